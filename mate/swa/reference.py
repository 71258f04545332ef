"""PyTorch oracle of GQA attention with (LEFT, RIGHT) sliding windows: FP32 math, any device.

Inputs are assumed validated by the API layer; these functions only compute, and
read no device memory on the host (no sync): every layout is gathered into
padded per-sequence tensors with lengths, computed masked, and scattered back.
"""

from __future__ import annotations

import torch

from mate._reference import visible_value_sum

NEG_INF = float("-inf")


def window_mask(sq: int, sk: int, left: int, right: int, device=None) -> torch.Tensor:
    """[sq, sk] bool: query i (at position p = i + sk - sq) sees key j iff p - left <= j <= p + right.

    -1 leaves that side unbounded; (-1, -1) is full attention.
    """
    return _visible(torch.tensor([sq], device=device), torch.tensor([sk], device=device), sq, sk, left, right)[0]


def _visible(len_q, len_k, sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """[B, sq, sk] bool over padded rows and keys: row i < len_q[b] at position i + len_k[b] - len_q[b]
    sees key j < len_k[b] inside the window."""
    i = torch.arange(sq, device=len_q.device).view(1, -1, 1)
    j = torch.arange(sk, device=len_q.device).view(1, 1, -1)
    lq, lk = len_q.view(-1, 1, 1).long(), len_k.view(-1, 1, 1).long()
    p = i + lk - lq
    visible = (i < lq) & (j < lk)
    if left >= 0:
        visible &= j >= p - left
    if right >= 0:
        visible &= j <= p + right
    return visible


def padded_rows(x, cu, max_len: int):
    """Varlen x [total, ...] with offsets cu [B + 1] -> (padded [B, max_len, ...], lengths [B], valid [B, max_len]).

    Rows past a sequence's length are gathered from row 0 and flagged invalid (callers select them away)."""
    lens = (cu[1:] - cu[:-1]).long()
    idx = cu[:-1].long().unsqueeze(1) + torch.arange(max_len, device=x.device)
    valid = torch.arange(max_len, device=x.device) < lens.unsqueeze(1)
    idx = torch.where(valid, idx, 0).clamp(0, max(x.shape[0] - 1, 0))
    return x[idx] if x.shape[0] else x.new_zeros(idx.shape + x.shape[1:]), lens, valid


def paged_keys(cache, block_table, seq_lens):
    """A paged cache [pages, page_size, Hkv, D] -> (keys [B, max_pages * page_size, Hkv, D], valid [B, keys]).

    A key is valid iff it lies before seq_lens[b] on a page id in [0, pages); -1 and out-of-range
    page ids gather page 0, flagged invalid."""
    pages, ps = cache.shape[:2]
    B, max_pages = block_table.shape
    pid = block_table.long()
    ok_page = (pid >= 0) & (pid < pages)
    pid = torch.where(ok_page, pid, 0)
    keys = cache[pid] if pages else cache.new_zeros(B, max_pages, ps, *cache.shape[2:])
    j = torch.arange(max_pages * ps, device=cache.device)
    valid = ok_page.repeat_interleave(ps, dim=1) & (j < seq_lens.long().unsqueeze(1))
    return keys.reshape(B, max_pages * ps, *cache.shape[2:]), valid


def attention(q, k, v, len_q, len_k, key_valid, left: int, right: int, scale: float, sinks=None, softcap=None,
              *, max_scores: int = 1 << 26):
    """The oracle on padded tensors: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], len_q/len_k [B] (int),
    key_valid [B, Sk] bool or None -> (out [B, Sq, H, D] FP32, lse [B, H, Sq] FP32 natural log).

    Row i < len_q[b] sits at position i + len_k[b] - len_q[b]; query head h reads KV head
    h // (H // Hkv). Scores are scale * q.k, then softcap * tanh(score / softcap) when softcap is
    set; masked keys are selected away (their values never enter a sum, NaN included). sinks [H]
    FP32 adds one logit per head to the normaliser and the LSE, with no value. A row with no
    visible key gets output 0 and LSE -inf (with sinks: the sink's logit).
    Query rows go in chunks whose score matrix holds at most `max_scores` elements.
    """
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    out = torch.zeros(B, Sq, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Sq), NEG_INF, dtype=torch.float32, device=q.device)
    if B == 0 or Sq == 0:
        return out, lse
    sink = None if sinks is None else sinks.float().view(1, Hkv, group, 1, 1)
    if Sk == 0:
        if sink is not None:
            lse[:] = sinks.float().view(1, H, 1)
        return out, lse
    mask = _visible(len_q, len_k, Sq, Sk, left, right)  # [B, Sq, Sk]
    if key_valid is not None:
        mask &= key_valid.unsqueeze(1)
    mask = mask.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, Sq, Sk]
    # [B, Hkv, group, S, D]: query head h = kv * group + g.
    qf = q.float().permute(0, 2, 1, 3).reshape(B, Hkv, group, Sq, D)
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Sk, D]
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    rows = max(1, max_scores // max(1, B * H * Sk))
    for r0 in range(0, Sq, rows):
        r1 = min(Sq, r0 + rows)
        seen = mask[..., r0:r1, :]
        s = torch.matmul(qf[:, :, :, r0:r1], kf.transpose(-1, -2)) * scale  # [B, Hkv, group, r, Sk]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = torch.where(seen, s, NEG_INF)
        m = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for empty rows
        if sink is not None:
            m = torch.logaddexp(m, sink.expand_as(m))
        p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        o = visible_value_sum(p, seen, vf)  # [B, Hkv, group, r, D]; empty rows: exp(-inf) = 0 everywhere
        out[:, r0:r1] = o.reshape(B, H, r1 - r0, D).permute(0, 2, 1, 3)
        lse[:, :, r0:r1] = m.reshape(B, H, r1 - r0)
    return out, lse


def gqa_attention(q, k, v, left: int, right: int, scale: float, *, max_scores: int = 1 << 26):
    """Padded q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D] FP32, lse [B, H, Sq] FP32)."""
    B, Sq = q.shape[:2]
    len_q = torch.full((B,), Sq, device=q.device)
    len_k = torch.full((B,), k.shape[1], device=q.device)
    return attention(q, k, v, len_q, len_k, None, left, right, scale, max_scores=max_scores)


def general(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seq_lens_k,
            left, right, scale, sinks, softcap):
    """Every layout of gqa_attention: q padded [B, Sq, H, D] or varlen [total_q, H, D] (cu_seqlens_q,
    max_seqlen_q); k/v padded [B, Sk, Hkv, D], varlen [total_k, Hkv, D] (cu_seqlens_k, max_seqlen_k) or
    paged [pages, page_size, Hkv, D] (block_table, seq_lens_k). Returns (out like q FP32, lse FP32:
    [B, H, Sq] padded, [H, total_q] varlen)."""
    key_valid = None
    if block_table is not None:
        kp, key_valid = paged_keys(k, block_table, seq_lens_k)
        vp, _ = paged_keys(v, block_table, seq_lens_k)
        len_k = seq_lens_k.long()
    elif cu_seqlens_k is not None:
        kp, len_k, key_valid = padded_rows(k, cu_seqlens_k, max_seqlen_k)
        vp, _, _ = padded_rows(v, cu_seqlens_k, max_seqlen_k)
    else:
        kp, vp = k, v
        len_k = torch.full((k.shape[0],), k.shape[1], device=q.device)
    if cu_seqlens_q is None:
        B, Sq = q.shape[:2]
        return attention(q, kp, vp, torch.full((B,), Sq, device=q.device), len_k, key_valid, left, right, scale, sinks, softcap)
    qp, len_q, row_valid = padded_rows(q, cu_seqlens_q, max_seqlen_q)
    o, l = attention(qp, kp, vp, len_q, len_k, key_valid, left, right, scale, sinks, softcap)
    # Back to the packed rows: padded row i of sequence b is row cu_seqlens_q[b] + i; padded rows past a
    # length go to a spare row `total`, dropped (a scatter, not boolean indexing, which would sync).
    total, H = q.shape[0], q.shape[1]
    idx = cu_seqlens_q[:-1].long().unsqueeze(1) + torch.arange(max_seqlen_q, device=q.device)
    idx = torch.where(row_valid, idx, total).flatten()
    out = torch.zeros(total + 1, *q.shape[1:], dtype=torch.float32, device=q.device)
    lse = torch.full((H, total + 1), NEG_INF, dtype=torch.float32, device=q.device)
    out[idx] = o.flatten(0, 1)
    lse[:, idx] = l.permute(1, 0, 2).flatten(1)
    return out[:total], lse[:, :total]
