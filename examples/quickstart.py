"""QSA indexer on small random inputs: MQA block scores -> top-k blocks -> token indices.

Runs the native TileLang kernels on a Hopper GPU and compares their scores with
the reference backend; elsewhere runs the PyTorch reference and compares it
with a naive computation. It prints which.

    python examples/quickstart.py
"""

import torch

import mate
from common import naive_relu_scores, report, where_to_run


def main():
    device, backend, what = where_to_run()
    print(f"quickstart: {what}")
    gen = torch.Generator().manual_seed(0)
    batch, rows, tokens, topk = 2, 64, 1024, 16
    blocks = tokens // 4  # one compressed key per 4-token block
    q_idx = torch.randn(batch, rows, 4, 128, generator=gen).to(device=device, dtype=torch.bfloat16)
    block_keys = torch.randn(batch, blocks, 128, generator=gen).to(device=device, dtype=torch.bfloat16)
    # The rows are the last `rows` tokens of each request: block j is visible to position p iff 4j + 3 <= p.
    positions = torch.arange(tokens - rows, tokens, device=device, dtype=torch.int32).expand(batch, rows).contiguous()

    scores = mate.qsa_indexer_mqa_score(q_idx, block_keys, query_positions=positions, backend=backend)
    top = scores.topk(topk, dim=-1)
    block_ids = torch.where(torch.isinf(top.values), -1, top.indices).to(torch.int32)
    # Expand each selected block j into tokens 4j..4j+3 (-1 stays -1).
    offsets = torch.arange(4, device=device, dtype=torch.int32)
    token_indices = torch.where(block_ids[..., None] >= 0, block_ids[..., None] * 4 + offsets, -1).flatten(-2)

    print(f"  scores {tuple(scores.shape)} {scores.dtype}, visible blocks in row 0: {int(torch.isfinite(scores[0, 0]).sum())}")
    print(f"  top-{topk} blocks of request 0, row 0: {block_ids[0, 0].tolist()}")
    print(f"  token_indices {tuple(token_indices.shape)}, first 8: {token_indices[0, 0, :8].tolist()}")
    if backend == "tilelang":
        ref = mate.qsa_indexer_mqa_score(q_idx, block_keys, query_positions=positions, backend="reference")
        report("scores", scores, ref, "backend='reference'", 1e-4)
    else:
        naive = torch.full(scores.shape, float("-inf"), dtype=torch.float64)
        for b in range(batch):
            for r in range(rows):
                visible = (int(positions[b, r]) + 1) // 4
                naive[b, r, :visible] = naive_relu_scores(q_idx[b, r], block_keys[b, :visible])
        report("scores", scores, naive, "a naive computation", 1e-5)


if __name__ == "__main__":
    main()
