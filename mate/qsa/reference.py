"""PyTorch oracles of the QSA stages: FP32 math, any device, every documented layout.

Inputs are assumed validated by the API layer; these functions only compute.
"""

from __future__ import annotations

import torch

from mate._debug import offsets  # the oracle may read values: it always checks offsets

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
    if pages == 0 or table.shape[1] == 0:  # an empty pool or table: no key exists (and nothing can be indexed)
        ok = torch.zeros(table.shape[0], width, dtype=torch.bool, device=table.device)
        return cache.new_zeros(table.shape[0], width, *cache.shape[2:]), ok
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


# ---------------------------------------------------------------- sparse core attention

# Bound on the gathered K/V elements held at once (rows x tokens x kv heads x dim).
_GATHER_BUDGET = 1 << 25


def gather_attention(q, k_sel, v_sel, visible, scale):
    """Softmax attention of each row over its own gathered keys.

    q [R, Hq, D]; k_sel, v_sel [R, T, Hkv, D] (query head h reads kv head h // (Hq // Hkv));
    visible [R, T] bool. Returns FP32 out [R, Hq, D] and natural-log lse [R, Hq]; a row
    with nothing visible gets 0 and -inf. Each visible slot counts once per occurrence.
    """
    R, Hq, D = q.shape
    Hkv = k_sel.shape[2]
    qg = q.float().reshape(R, Hkv, Hq // Hkv, D)
    s = torch.einsum("rkgd,rtkd->rkgt", qg, k_sel.float()) * scale
    vis = visible[:, None, None, :]
    s = s.masked_fill(~vis, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(vis, torch.exp(s - lse.unsqueeze(-1)), 0.0)  # all-masked rows: -inf - -inf is NaN, dropped here
    # Invisible slots were gathered from a placeholder that may hold NaN: 0 * NaN must not enter.
    v_vis = torch.where(visible[:, :, None, None], v_sel.float(), 0.0)
    out = torch.einsum("rkgt,rtkd->rkgd", p, v_vis)
    return out.reshape(R, Hq, D), lse.reshape(R, Hq)


def _request_rows(rows, n_req, padded_q, cu_seqlens_q, token_to_req, device):
    """Per flattened query row: request id (-1: the row belongs to no request), index within its request,
    and the row count of each request."""
    if padded_q is not None:
        B, Q = padded_q
        req = torch.arange(B, device=device).repeat_interleave(Q)
        local = torch.arange(Q, device=device).repeat(B)
        return req, local, torch.full((B,), Q, device=device, dtype=torch.long)
    r = torch.arange(rows, device=device)
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.long()
        offsets("cu_seqlens_q", cu, rows)
        req = torch.searchsorted(cu[1:], r, right=True)
        inside = (r >= cu[0]) & (r < cu[-1])
        req = torch.where(inside, req, -1)
        local = r - cu[req.clamp(0, n_req - 1)]
        return req, local, cu[1:] - cu[:-1]
    req = token_to_req.long()
    req = torch.where((req >= 0) & (req < n_req), req, -1)
    # a row's index within its request is the number of earlier rows of that request
    sorted_req, order = torch.sort(req, stable=True)
    first = torch.searchsorted(sorted_req, sorted_req)
    local = torch.empty_like(r)
    local[order] = r - first
    counts = torch.bincount(req[req >= 0], minlength=n_req)[:n_req]
    return req, local, counts


def _physical_slots(key, value, idx):
    """Physical ids into flattened key/value: (visible [R, T], gather(rows, ok) -> the rows' K and V slots)."""
    pool = key.shape[0]
    visible = (idx >= 0) & (idx < pool)

    def gather(rows, ok):
        i = torch.where(ok, idx[rows], 0)
        return key[i], value[i]

    return visible, gather


def _logical_slots(query, key, value, idx, *, n_req, cu_seqlens_q, token_to_req, cu_seqlens_k, seq_lens_q, seq_lens_k,
                   query_positions, block_table):
    """Request-local token ids: (visible [R, T], gather(rows, ok) -> the rows' K and V slots), by the rules
    sparse_attention states, from the key's layout (padded, varlen or paged)."""
    dev = query.device
    R = idx.shape[0]
    padded_q = tuple(query.shape[:2]) if query.dim() == 4 else None
    req, local, nrows = _request_rows(R, n_req, padded_q, cu_seqlens_q, token_to_req, dev)
    live = req >= 0
    b = req.clamp_min(0)
    if block_table is not None:
        pages, page_size = key.shape[0], key.shape[1]
        cap = torch.full((n_req,), block_table.shape[1] * page_size, device=dev, dtype=torch.long)
    elif cu_seqlens_k is not None:
        cu_k = cu_seqlens_k.long()
        offsets("cu_seqlens_k", cu_k, key.shape[0])
        cap = cu_k[1:] - cu_k[:-1]
    else:
        cap = torch.full((n_req,), key.shape[1], device=dev, dtype=torch.long)
    sq = seq_lens_q.long() if seq_lens_q is not None else nrows
    sk = seq_lens_k.long() if seq_lens_k is not None else cap
    if seq_lens_q is not None:
        live = live & (local < sq[b])
    if query_positions is not None:
        pos = query_positions.reshape(R).long()
    else:
        pos = sk[b] - sq[b] + local
    limit = torch.minimum(cap, sk)[b]  # tokens [0, limit) of the row's request exist
    visible = live[:, None] & (idx >= 0) & (idx < limit[:, None]) & (idx <= pos[:, None])
    if block_table is not None:
        col = torch.div(idx, page_size, rounding_mode="floor").clamp(0, max(block_table.shape[1] - 1, 0))
        page = block_table.long()[b[:, None], col] if block_table.shape[1] else torch.full_like(idx, -1)
        visible &= (page >= 0) & (page < pages)

        def gather(rows, ok):
            p = torch.where(ok, page[rows], 0)
            slot = torch.where(ok, idx[rows] % page_size, 0)
            return key[p, slot], value[p, slot]

    elif cu_seqlens_k is not None:

        def gather(rows, ok):
            i = torch.where(ok, cu_k[b[rows], None] + idx[rows], 0)
            return key[i], value[i]

    else:

        def gather(rows, ok):
            t = torch.where(ok, idx[rows], 0)
            return key[b[rows, None].expand_as(t), t], value[b[rows, None].expand_as(t), t]

    return visible, gather


def sparse_attention(
    query,
    key,
    value,
    indices,
    *,
    physical,
    n_req,
    cu_seqlens_q,
    token_to_req,
    cu_seqlens_k,
    seq_lens_q,
    seq_lens_k,
    query_positions,
    block_table,
    scale,
    dequant=None,
):
    """QSA core attention over per-row token lists, every layout. Returns FP32 (out, lse) of query's shape.

    dequant: for an FP8 cache passed as its uint8 view (index ops take bytes), the gathered K and V slots ->
    their FP32 real values (value x scale); gathering before dequantizing keeps the FP32 copy to the slots read.

    physical: `indices` [rows, T] are ids into flattened key/value [N, Hkv, D]; an id is
    used iff 0 <= id < N, with no causal or request logic. Otherwise `indices` are
    request-local token ids (shape query.shape[:-2] + (T,)); token t of request b is
    used iff t >= 0, t is inside the request's cache (padded key [B, S]: t < S; varlen
    key with cu_seqlens_k: t < its length; paged key with block_table: its page is in
    the table and the pool), t < seq_lens_k[b] (where given), t <= the row's position,
    and the row is a real row of a request (index < seq_lens_q[b] where given).
    A row's position is query_positions where given, else bottom-right Sk - Sq + i.
    """
    dev = query.device
    Hq, D = query.shape[-2:]
    q = query.reshape(-1, Hq, D)
    R = q.shape[0]
    idx = indices.reshape(R, indices.shape[-1]).long()
    T = idx.shape[1]
    Hkv = key.shape[-2]
    if physical:
        visible, gather = _physical_slots(key, value, idx)
    else:
        visible, gather = _logical_slots(query, key, value, idx, n_req=n_req, cu_seqlens_q=cu_seqlens_q, token_to_req=token_to_req,
                                         cu_seqlens_k=cu_seqlens_k, seq_lens_q=seq_lens_q, seq_lens_k=seq_lens_k,
                                         query_positions=query_positions, block_table=block_table)

    out = torch.zeros(R, Hq, D, dtype=torch.float32, device=dev)
    lse = torch.full((R, Hq), NEG_INF, dtype=torch.float32, device=dev)
    step = max(1, _GATHER_BUDGET // max(1, T * Hkv * D))
    for start in range(0, R, step):
        rows = torch.arange(start, min(R, start + step), device=dev)
        ok = visible[rows]
        if not bool(ok.any()):
            continue  # also covers an empty pool, which cannot be indexed
        k_sel, v_sel = gather(rows, ok)
        if dequant is not None:
            k_sel, v_sel = dequant(k_sel, v_sel)
        out[rows], lse[rows] = gather_attention(q[rows], k_sel, v_sel, ok, scale)
    return out.reshape(query.shape), lse.reshape(query.shape[:-1])


def topk_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [rows, k]: the ids of each row's k largest scores, by score descending then id ascending; NaN and
    -inf are never selected (-1 fills the slots past a row's selectable scores); -0 ties with +0."""
    selectable = ~torch.isnan(scores) & (scores != NEG_INF)
    # A stable sort keeps equal scores in id order; the unselectable ones, as -inf, sort after every other.
    order = torch.sort(torch.where(selectable, scores, NEG_INF), dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(selectable.gather(-1, order), order, -1).to(torch.int32)


def expand_blocks(block_indices: torch.Tensor, query_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [rows, block_size * k + block_size - 1]: block j's tokens block_size*j .. block_size*j + block_size - 1
    (-1 for a negative id), then the tokens of the row's incomplete block up to its position (-1 where absent).
    int32 arithmetic, as the kernels do it."""
    t = torch.arange(block_size, dtype=torch.int32, device=block_indices.device)
    b = block_indices.unsqueeze(-1)
    blocks = torch.where(b >= 0, b * block_size + t, -1).flatten(-2)
    pos = query_positions.unsqueeze(-1)
    tail = (pos + 1).clamp_min(0) // block_size * block_size + t[: block_size - 1]
    return torch.cat([blocks, torch.where(tail <= pos, tail, -1)], -1).to(torch.int32)
