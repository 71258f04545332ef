"""PyTorch oracles of the QSA stages: FP32 math, any device, every documented layout.

Inputs are assumed validated by the API layer; these functions only compute.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def relu_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """sum_h relu(q[..., h, :] . k[..., n, :]) * scale: q [..., H, D], k [..., N, D] -> [..., N] FP32."""
    dots = torch.einsum("...hd,...nd->...hn", q.float(), k.float())
    return dots.clamp_min(0).sum(-2) * scale


def interval_mask(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] bool: key j is visible to a row iff lo <= j < hi."""
    j = torch.arange(n, device=lo.device)
    return (j >= lo.unsqueeze(-1).long()) & (j < hi.unsqueeze(-1).long())


def causal_block_limit(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Number of leading blocks visible to a position: block j is visible iff block_size*j + block_size-1 <= p."""
    p = positions.long()
    return torch.where(p >= 0, torch.div(p + 1, block_size, rounding_mode="floor"), torch.zeros_like(p))


def gather_pages(cache: torch.Tensor, table: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical keys [B, width, D] from a paged cache [pages, page_size, D] and whether each one exists.

    A key exists iff its table entry is inside the table and names a page of the pool.
    """
    pages, page_size = cache.shape[0], cache.shape[1]
    j = torch.arange(width, device=table.device)
    col = j // page_size
    in_table = col < table.shape[1]
    page = table.long()[:, col.clamp_max(table.shape[1] - 1)]
    ok = in_table & (page >= 0) & (page < pages)
    safe = torch.where(ok, page, torch.zeros_like(page))
    keys = cache[safe, (j % page_size).expand_as(safe)]
    return keys, ok


def mqa_logits(q, k, lo, hi, scale):
    """Packed prefill: q [rows, H, D], k [keys, D], visible keys [lo, hi) per row -> [rows, keys]."""
    s = relu_scores(q, k, scale)
    return torch.where(interval_mask(lo, hi, k.shape[0]), s, NEG_INF)


def mqa_score(q, keys, key_exists, positions, row_valid, block_size, scale):
    """Per-row scores over per-row logical keys.

    q [R, H, D]; keys [R?, N, D] broadcastable per row; key_exists [R?, N] bool;
    positions [R] local positions; row_valid [R] bool (False: padded row, all -inf).
    """
    s = relu_scores(q, keys, scale)
    n = s.shape[-1]
    limit = torch.where(row_valid, causal_block_limit(positions, block_size), torch.zeros_like(positions, dtype=torch.long))
    visible = (torch.arange(n, device=q.device) < limit.unsqueeze(-1)) & key_exists
    return torch.where(visible, s, NEG_INF)


def mqa_decode(q, k_cache, page_table, context_lens, max_model_len, scale):
    """q [B, H, D], k_cache [pages, page_size, D] -> [B, max_model_len]: keys < context_lens in existing pages."""
    keys, exists = gather_pages(k_cache, page_table, max_model_len)
    s = relu_scores(q, keys, scale)
    visible = exists & (torch.arange(max_model_len, device=q.device) < context_lens.long().unsqueeze(-1))
    return torch.where(visible, s, NEG_INF)
