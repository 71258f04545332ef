"""NSA selection attention (DeepSeek Native Sparse Attention's selection branch) over a prefill.

Each query token attends only to the key blocks chosen for its KV group: here
the T = 4 blocks (of 64 keys) whose mean key scores highest against the
group's queries, with the token's own block always among them (as NSA's
selection forces it). Future blocks are not selectable, and keys past the
token inside its own block are masked by the kernel (causal, bottom-right).
16 query heads share each of the 2 KV groups' indices (H / G = 16).

On a Hopper GPU the native kernel runs and is compared with the reference
backend on the same inputs; elsewhere the reference runs and is compared with
a naive computation.

    python examples/nsa_selection.py
"""

import torch

import mate
from common import report, where_to_run

B, N, H, G, D, BS, T = 1, 512, 32, 2, 128, 64, 4  # T blocks of BS keys per token and group


def select_blocks(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """block_indices [B, N, G, T]: per token and group, the best-scoring visible blocks, its own block first."""
    pooled = k.float().unflatten(1, (N // BS, BS)).mean(2)  # [B, blocks, G, D]
    score = torch.einsum("bmgrd,bjgd->bmgj", q.float().unflatten(2, (G, H // G)), pooled)
    pos = torch.arange(N, device=q.device)
    block = torch.arange(N // BS, device=q.device)
    score = score.masked_fill((block * BS > pos[:, None])[None, :, None], float("-inf"))  # future blocks
    score = score.masked_fill((block == pos[:, None] // BS)[None, :, None], float("inf"))  # the token's own block
    top = score.topk(T, dim=-1)
    return torch.where(torch.isinf(top.values) & (top.values < 0), -1, top.indices).to(torch.int32)


def naive(q, k, v, idx):
    """Dense attention in float64 under a mask: key j is visible to token m of group g iff its block is selected and j <= m."""
    blocks = torch.arange(N) // BS
    chosen = (idx.long()[..., None] == blocks).any(-2)  # [B, N, G, keys]: the key's block is among the token's
    mask = chosen & (torch.arange(N)[None, :] <= torch.arange(N)[:, None])[None, :, None]
    s = torch.einsum("bmhd,bjhd->bhmj", q.double(), k.double().repeat_interleave(H // G, 2)) / D**0.5
    s = s.masked_fill(~mask.repeat_interleave(H // G, 2).permute(0, 2, 1, 3), float("-inf"))
    out = torch.einsum("bhmj,bjhd->bmhd", torch.softmax(s, -1), v.double().repeat_interleave(H // G, 2))
    return out, torch.logsumexp(s, -1)


def main():
    device, backend, what = where_to_run()
    print(f"NSA selection: {what}")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, N, h, D, generator=gen).to(device=device, dtype=torch.bfloat16) for h in (H, G, G))
    idx = select_blocks(q, k)
    out, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=BS, backend=backend)
    print(f"  q {tuple(q.shape)}, k/v {tuple(k.shape)}, block_indices {tuple(idx.shape)} (blocks of {BS}) -> "
          f"out {tuple(out.shape)}, lse {tuple(lse.shape)}")
    if backend == "tilelang":
        ref_out, ref_lse = mate.nsa_selection_attention(q, k, v, idx, block_size=BS, backend="reference")
        report("output", out, ref_out, "backend='reference'", 1e-2)
        report("LSE", lse, ref_lse, "backend='reference'", 1e-3)
    else:
        print("  ran backend='reference'; checked against a naive computation:")
        naive_out, naive_lse = naive(q, k, v, idx)
        report("output", out, naive_out, "a dense masked softmax", 1e-2)
        report("LSE", lse, naive_lse, "a dense masked softmax", 1e-3)


if __name__ == "__main__":
    main()
