"""QSA indexer end to end on small random inputs: MQA block scores -> top-k blocks -> token indices.

Uses the native TileLang backend on a CUDA GPU with a mate tile config, the
PyTorch reference backend anywhere else, and says which.
"""

import torch

import mate
from mate import _dispatch


def pick_backend():
    if torch.cuda.is_available():
        try:
            target = _dispatch.target_of(torch.empty(0, device="cuda"), "probe")
            return "cuda", "tilelang", f"native TileLang kernels for {target} on {torch.cuda.get_device_name()}"
        except ValueError as e:
            return "cpu", "reference", f"PyTorch reference ({e})"
    return "cpu", "reference", "PyTorch reference (no CUDA GPU)"


def main():
    device, backend, why = pick_backend()
    print(f"backend: {backend} - {why}")
    torch.manual_seed(0)
    batch, rows, tokens, topk = 2, 64, 1024, 16
    blocks = tokens // 4  # one compressed key per 4-token block
    dtype = torch.bfloat16 if backend == "tilelang" else torch.float32
    q_idx = torch.randn(batch, rows, 4, 128, device=device, dtype=dtype)
    block_keys = torch.randn(batch, blocks, 128, device=device, dtype=dtype)
    # The rows are the last `rows` tokens of each request.
    positions = torch.arange(tokens - rows, tokens, device=device, dtype=torch.int32).expand(batch, rows).contiguous()

    scores = mate.qsa_indexer_mqa_score(q_idx, block_keys, query_positions=positions, backend=backend)
    top = scores.topk(topk, dim=-1)
    block_ids = torch.where(torch.isinf(top.values), -1, top.indices).to(torch.int32)
    # Expand each selected block j into tokens 4j..4j+3 (-1 stays -1).
    offsets = torch.arange(4, device=device, dtype=torch.int32)
    token_indices = torch.where(block_ids[..., None] >= 0, block_ids[..., None] * 4 + offsets, -1).flatten(-2)

    print(f"scores {tuple(scores.shape)} {scores.dtype}, visible blocks in row 0: {int(torch.isfinite(scores[0, 0]).sum())}")
    print(f"top-{topk} blocks of request 0, row 0: {block_ids[0, 0].tolist()}")
    print(f"token_indices {tuple(token_indices.shape)}, first 8: {token_indices[0, 0, :8].tolist()}")
    check = mate.qsa_indexer_mqa_score(q_idx, block_keys, query_positions=positions, backend="reference")
    err = (scores[torch.isfinite(check)] - check[torch.isfinite(check)]).abs().max().item()
    print(f"max |{backend} - reference| over visible scores: {err:.2e}")


if __name__ == "__main__":
    main()
