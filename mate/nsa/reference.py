"""PyTorch oracle of the NSA selection forward: FP32 math, any device.

Inputs are assumed validated by the API layer; this module only computes.

A slot (b, m, g, t) is used iff t < block_counts[b, m, g] (when given), its
block index j is >= 0, and the block's first token is causally visible to the
query: j * block_size <= N - M + m. Inside a used block, key n is visible iff
n <= N - M + m (and n < N). A block selected twice counts twice (each slot
contributes once), which is the same as adding log(multiplicity) to its keys'
scores; that is how this oracle evaluates it, densely over the keys, one chunk
of queries at a time.
"""

from __future__ import annotations

import math

import torch

from mate._reference import visible_value_sum

NEG_INF = float("-inf")


def used_slots(block_indices, block_counts, n_keys, block_size):
    """[B, M, G, T] bool: which slots the kernel reads."""
    B, M, G, T = block_indices.shape
    pos = n_keys - M + torch.arange(M, device=block_indices.device)
    last = torch.where(pos >= 0, torch.div(pos, block_size, rounding_mode="floor"), torch.full_like(pos, -1))
    idx = block_indices.long()
    used = (idx >= 0) & (idx <= last.view(1, M, 1, 1))
    if block_counts is not None:
        used &= torch.arange(T, device=idx.device) < block_counts.long().unsqueeze(-1)
    return used


def selection_attention(q, k, v, block_indices, block_counts, block_size, scale, chunk_elems=1 << 24):
    """O [B, M, H, D] (FP32) and LSE [B, H, M] (FP32, natural log) of NSA selection attention."""
    B, M, H, D = q.shape
    N, G = k.shape[1], k.shape[2]
    hpg = H // G
    dev = q.device
    out = torch.zeros(B, M, H, D, dtype=torch.float32, device=dev)
    lse = torch.full((B, H, M), NEG_INF, dtype=torch.float32, device=dev)
    if B * M * H == 0 or N == 0 or block_indices.shape[-1] == 0:
        return out, lse
    n_blocks = math.ceil(N / block_size)
    used = used_slots(block_indices, block_counts, N, block_size)
    kf, vg = k.float(), v.float().permute(0, 2, 1, 3).unsqueeze(2)  # vg [B, G, 1, N, D]
    key_block = torch.arange(N, device=dev) // block_size
    chunk = max(1, chunk_elems // max(1, B * H * N))
    for m0 in range(0, M, chunk):
        m1 = min(M, m0 + chunk)
        mult = torch.zeros(B, m1 - m0, G, n_blocks, dtype=torch.float32, device=dev)
        idx = block_indices[:, m0:m1].long().clamp(0, n_blocks - 1)
        mult.scatter_add_(-1, idx, used[:, m0:m1].float())
        key_mult = mult[..., key_block]  # [B, mc, G, N]
        pos = N - M + torch.arange(m0, m1, device=dev)
        visible = torch.arange(N, device=dev) <= pos[:, None]  # [mc, N]
        ok = ((key_mult > 0) & visible[None, :, None, :]).permute(0, 2, 1, 3).unsqueeze(3)  # [B, G, mc, 1, N]
        qc = q[:, m0:m1].float().reshape(B, m1 - m0, G, hpg, D).permute(0, 2, 1, 3, 4)  # [B, G, mc, hpg, D]
        s = torch.einsum("bgmhd,bngd->bgmhn", qc, kf) * scale
        # where, not + bias: a NaN score of an unused key must not survive
        s = torch.where(ok, s + key_mult.log().permute(0, 2, 1, 3).unsqueeze(3), NEG_INF)
        row_lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
        live = torch.isfinite(row_lse)
        p = torch.exp(s - torch.where(live, row_lse, torch.zeros_like(row_lse)).unsqueeze(-1))
        o = visible_value_sum(p, ok, vg)  # [B, G, mc, hpg, D]
        row_lse = row_lse.permute(0, 2, 1, 3)  # [B, mc, G, hpg]
        out[:, m0:m1] = o.permute(0, 2, 1, 3, 4).reshape(B, m1 - m0, H, D)
        lse[:, :, m0:m1] = row_lse.reshape(B, m1 - m0, H).transpose(1, 2)
    return out, lse
