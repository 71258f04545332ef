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


def selection_attention_backward(q, k, v, o, lse, do, block_indices, block_counts, block_size, scale, chunk_elems=1 << 24):
    """dq [B, M, H, D], dk, dv [B, N, G, D] (FP32) of selection_attention, from its output o and LSE.

    The flash form: P = mult * exp(scale * q.k - LSE) on the used keys (mult counts a block's
    occurrences in the row), delta = rowsum(dO * O), dS = P * (dO.v - delta),
    dq = scale * dS.k, dk = scale * dS^T.q, dv = P^T.dO. Unused keys have P = dS = 0 by
    selection (never 0 * x), so NaN in keys or values no row uses reaches no gradient.
    """
    B, M, H, D = q.shape
    N, G = k.shape[1], k.shape[2]
    hpg = H // G
    dev = q.device
    dq = torch.zeros(B, M, H, D, dtype=torch.float32, device=dev)
    dk = torch.zeros(B, N, G, D, dtype=torch.float32, device=dev)
    dv = torch.zeros(B, N, G, D, dtype=torch.float32, device=dev)
    if B * M * H == 0 or N == 0 or block_indices.shape[-1] == 0:
        return dq, dk, dv
    n_blocks = math.ceil(N / block_size)
    used = used_slots(block_indices, block_counts, N, block_size)
    kf, vf = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)  # [B, G, N, D]
    key_block = torch.arange(N, device=dev) // block_size
    chunk = max(1, chunk_elems // max(1, B * H * N))
    for m0 in range(0, M, chunk):
        m1 = min(M, m0 + chunk)
        mc = m1 - m0
        mult = torch.zeros(B, mc, G, n_blocks, dtype=torch.float32, device=dev)
        mult.scatter_add_(-1, block_indices[:, m0:m1].long().clamp(0, n_blocks - 1), used[:, m0:m1].float())
        key_mult = mult[..., key_block].permute(0, 2, 1, 3).unsqueeze(3)  # [B, G, mc, 1, N]
        pos = N - M + torch.arange(m0, m1, device=dev)
        ok = (key_mult > 0) & (torch.arange(N, device=dev) <= pos[:, None])[None, None, :, None, :]
        grouped = lambda x: x[:, m0:m1].float().reshape(B, mc, G, hpg, D).permute(0, 2, 1, 3, 4)  # noqa: E731  [B, G, mc, hpg, D]
        qc, oc, doc = grouped(q), grouped(o), grouped(do)
        row_lse = lse[:, :, m0:m1].reshape(B, G, hpg, mc).permute(0, 1, 3, 2).unsqueeze(-1)  # [B, G, mc, hpg, 1]
        s = torch.einsum("bgmhd,bgnd->bgmhn", qc, kf) * scale
        p = torch.where(ok, key_mult * torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, 0.0)), 0.0)
        dp = torch.einsum("bgmhd,bgnd->bgmhn", doc, vf)
        delta = (doc * oc).sum(-1, keepdim=True)
        ds = torch.where(ok, p * (dp - delta), 0.0)
        dq[:, m0:m1] = (visible_value_sum(ds, ok, kf.unsqueeze(2)) * scale).permute(0, 2, 1, 3, 4).reshape(B, mc, H, D)
        dk += torch.einsum("bgmhn,bgmhd->bngd", ds, qc) * scale
        dv += torch.einsum("bgmhn,bgmhd->bngd", p, doc)
    return dq, dk, dv


def sequences(cu_seqlens):
    """(start, end) of each packed sequence (reads cu_seqlens on the host: the reference may)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def varlen_selection_attention(q, k, v, block_indices, block_counts, cu_seqlens, block_size, scale):
    """O [T, H, D] and LSE [H, T] of packed sequences: each one is a padded problem of its own (M = N)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, dtype=torch.float32, device=q.device)
    for a, b in sequences(cu_seqlens):
        counts = None if block_counts is None else block_counts[None, a:b]
        o1, l1 = selection_attention(q[None, a:b], k[None, a:b], v[None, a:b], block_indices[None, a:b], counts, block_size, scale)
        out[a:b], lse[:, a:b] = o1[0], l1[0]
    return out, lse


def varlen_selection_attention_backward(q, k, v, o, lse, do, block_indices, block_counts, cu_seqlens, block_size, scale):
    """dq [T, H, D], dk, dv [T, G, D] (FP32) of varlen_selection_attention."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    for a, b in sequences(cu_seqlens):
        counts = None if block_counts is None else block_counts[None, a:b]
        g = selection_attention_backward(q[None, a:b], k[None, a:b], v[None, a:b], o[None, a:b], lse[None, :, a:b], do[None, a:b],
                                         block_indices[None, a:b], counts, block_size, scale)
        dq[a:b], dk[a:b], dv[a:b] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
