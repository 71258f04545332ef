"""One QSA prefill chunk: packed indexer logits -> top-k blocks -> token ids with the `block_indices` hint.

Two requests prefill a chunk each, as flattened query rows (`cu_seqlens_q`):
request 0 its first 200 tokens, request 1 tokens 1000..1099 after a cached
prefix. The indexer scores each row against the compressed keys (one per
4-token block) packed for both requests, each row seeing its own request's
complete blocks up to its position (`qsa_mqa_prefill`'s [start, end) per row).
Top-k keeps 128 blocks a row; with the tokens of the row's incomplete block
the token list is 4 * 128 + 3 wide, the width the `block_indices` hint needs,
and the hint lets the kernel load whole 4-token blocks. Top-k puts the valid
blocks first and every one is causally visible, which is what
`assume_compact_blocks=True` promises.

On a Hopper GPU each stage runs natively and is compared with the reference
backend on the same inputs; elsewhere the reference runs and is compared with
a naive computation.

    python examples/prefill_step.py
"""

import math

import torch

import mate
from common import naive_relu_scores, naive_sparse_attention, report, where_to_run

HQ, HKV, DIM, PAGE, BLOCKS = 24, 2, 256, 64, 128


def expand(blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token ids [rows, 4 * BLOCKS + 3]: each selected block's 4 tokens, then the row's incomplete block up to its position."""
    offs = torch.arange(4, device=blocks.device, dtype=torch.int32)
    selected = torch.where(blocks[..., None] >= 0, blocks[..., None] * 4 + offs, -1).flatten(-2)
    tail = ((positions + 1) // 4 * 4)[:, None] + offs[:3]
    return torch.cat([selected, torch.where(tail <= positions[:, None], tail, -1)], -1)


def main():
    device, backend, what = where_to_run()
    print(f"prefill step: {what}")
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    starts, chunks = [0, 1000], [200, 100]  # tokens already cached, tokens prefilled now
    lens = [s + c for s, c in zip(starts, chunks)]
    max_pages = math.ceil(max(lens) / PAGE)
    table = torch.randperm(len(lens) * max_pages, generator=gen).to(torch.int32).view(len(lens), max_pages).to(device)
    key, value = rand(table.numel(), PAGE, HKV, DIM), rand(table.numel(), PAGE, HKV, DIM)
    rows = sum(chunks)
    cu = torch.tensor([0, chunks[0], rows], dtype=torch.int32, device=device)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(chunks)).to(device)
    positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, chunks)]).to(device=device, dtype=torch.int32)

    # The indexer: request b's compressed keys sit at [key_start[b], key_start[b] + lens[b] // 4) of the packed keys.
    key_start = torch.tensor([0, lens[0] // 4], device=device)
    idx_keys = rand(sum(n // 4 for n in lens), 128)
    q_idx = rand(rows, 4, 128)
    lo = key_start[req].to(torch.int32)
    hi = lo + (positions + 1) // 4  # complete blocks up to the row's position
    logits = mate.qsa_mqa_prefill(q_idx, idx_keys, lo, hi, backend=backend)
    top = logits.topk(BLOCKS, dim=-1)
    blocks = torch.where(torch.isinf(top.values), -1, top.indices.to(torch.int32) - lo[:, None])  # request-local block ids
    tokens = expand(blocks, positions)

    q, gate = rand(rows, HQ, DIM), rand(rows, HQ)
    # seq_lens_k places each request's rows at its last positions (bottom-right), i.e. at `positions`.
    lens_k = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = mate.qsa_sparse_attention(q, key, value, tokens, block_indices=blocks, assume_compact_blocks=True,
                                         cu_seqlens_q=cu, block_table=table, seq_lens_k=lens_k, gate=gate, return_lse=True, backend=backend)
    print(f"  {len(lens)} requests prefilling {chunks} rows after {starts} cached tokens; top-{BLOCKS} blocks, "
          f"token_indices {tuple(tokens.shape)}, block_indices {tuple(blocks.shape)}")

    if backend == "tilelang":
        report("indexer logits", logits, mate.qsa_mqa_prefill(q_idx, idx_keys, lo, hi, backend="reference"), "backend='reference'", 1e-4)
        ref_out, ref_lse = mate.qsa_sparse_attention(q, key, value, tokens, block_indices=blocks, assume_compact_blocks=True,
                                                     cu_seqlens_q=cu, block_table=table, seq_lens_k=lens_k, gate=gate, return_lse=True,
                                                     backend="reference")
        report("attention output", out, ref_out, "backend='reference'", 1e-2)
        report("attention LSE", lse, ref_lse, "backend='reference'", 1e-3)
        return

    print("  ran the step with backend='reference'; checked against a naive computation:")
    naive = torch.full(logits.shape, float("-inf"), dtype=torch.float64)
    for r in range(rows):
        naive[r, lo[r]:hi[r]] = naive_relu_scores(q_idx[r], idx_keys[lo[r]:hi[r]])
    report("indexer logits", logits, naive, "naive relu scores", 1e-5)
    naive_out = torch.stack([naive_sparse_attention(q[r], key, value, table[req[r]], tokens[r],
                                                    lambda t, p=int(positions[r]): t <= p, gate[r]) for r in range(rows)])
    report("attention output", out, naive_out, "naive causal softmax", 1e-2)


if __name__ == "__main__":
    main()
