"""QSA MQA indexer: block scores for the caller's top-k.

score = scale * sum over the 4 indexer heads of ReLU(q . k), in FP32; a key the
row cannot see scores -inf. Three entrypoints:

- `qsa_indexer_mqa_score`: padded queries [B, Q, 4, 128] against per-request
  compressed keys [B, N_B, 128] (native), or varlen / paged forms (reference).
  A compressed key j stands for tokens 4j..4j+3 and is visible to position p
  iff 4j + 3 <= p; row i of a request sits at position i unless
  `query_positions` says otherwise.
- `qsa_mqa_prefill` (= `qsa_mqa`): packed rows [rows, 4, 128] against shared keys,
  each row seeing the keys [row_starts, row_ends).
- `qsa_mqa_decode`: one row per request against a paged compressed-key cache.
"""

from __future__ import annotations

import functools

import torch

from mate import _checks as C
from mate import _debug, _dispatch
from mate.qsa import reference
from mate.qsa.kernels.mqa_card import DIM, HEADS
from mate.qsa.kernels.mqa_card import PAGE_SIZES as DECODE_PAGE_SIZES

LOGITS = _dispatch.STAGES["mqa_logits"]
DECODE = _dispatch.STAGES["mqa_decode"]


def _native_geometry(name: str, x: torch.Tensor) -> None:
    C.native_dtype(name, x)
    if tuple(x.shape[-2:]) != (HEADS, DIM):
        raise ValueError(
            f"backend='tilelang' supports {name} with {HEADS} heads of dim {DIM}, got heads, dim = {tuple(x.shape[-2:])}; "
            "use backend='reference' for other geometries"
        )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _logits(q, k, lo, hi, scale, target):
    """Native interval scores: q [B, R, 4, 128], k [B, N, 128], lo/hi [B, R] -> [B, R, N] FP32."""
    B, R, N = q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty(B, R, N, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    spec = {"dtype": str(q.dtype).removeprefix("torch."), "even_keys": int(N % 2 == 0)}
    kern = _dispatch.kernel(LOGITS.name, spec, target)
    tiles = _dispatch.tiles(LOGITS.name, spec, target)
    # Split the key axis while that still fits the grid in one wave of the multiprocessors.
    ctas = -(-R // tiles["block_rows"]) * B
    key_tiles = -(-N // tiles["block_keys"])
    splits = max(1, min(key_tiles, _sm_count(q.device.index) // ctas))
    kern(C.canonical_unit_strides(q), C.canonical_unit_strides(k), lo, hi, out, scale, splits)
    return out


# ---------------------------------------------------------------- score


def qsa_indexer_mqa_score(
    q_idx: torch.Tensor,
    block_keys: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    page_size: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    token_to_req: torch.Tensor | None = None,
    num_requests: int | None = None,
    query_positions: torch.Tensor | None = None,
    seq_lens_q: torch.Tensor | None = None,
    block_size: int = 4,
    scale: float | None = None,
    score_scale: float | None = None,
    backend: str = "tilelang",
) -> torch.Tensor:
    """QSA MQA block scores, FP32 [B, Q, N_B] (padded q_idx) or [total_q, N_B] (varlen q_idx).

    Padded q_idx [B, Q, H, D] with block_keys [B, N_B, D] runs natively
    (H = 4, D = 128, BF16/FP16). Varlen q_idx [total_q, H, D] (with
    cu_seqlens_q, or token_to_req and num_requests) and paged block_keys
    [pages, page_size, (1,) D] with block_table [B, max_pages] need
    backend="reference"; native packed rows use qsa_mqa_prefill and native
    paged scoring qsa_mqa_decode. With block_table, N_B = max_pages * page_size
    and keys in missing pages (-1 or past the pool) score -inf; an empty pool
    scores -inf everywhere, a 0-column block_table gives N_B = 0. cu_seqlens_q
    must be nondecreasing offsets within [0, total_q] (ValueError otherwise);
    rows past its last offset belong to no request and score -inf.

    query_positions (int32, q_idx.shape[:-2]) are request-local positions,
    by default the row's index within its request. seq_lens_q (int32 [B])
    masks rows at or past each request's length. scale multiplies scores,
    score_scale divides them (not both); the default is 1/sqrt(D). Block j
    is visible to position p iff block_size*j + block_size - 1 <= p.
    """
    backend = _dispatch.backend(backend)
    C.tensor("q_idx", q_idx, ndim=(3, 4))
    C.floating("q_idx", q_idx)
    C.tensor("block_keys", block_keys, ndim=(3, 4))
    C.floating("block_keys", block_keys)
    C.same_dtype(q_idx=q_idx, block_keys=block_keys)
    dim = q_idx.shape[-1]
    mult = C.score_multiplier(scale, score_scale, dim)
    block_size = C.positive_int("block_size", block_size)
    varlen = q_idx.dim() == 3

    if varlen:
        rows = q_idx.shape[0]
        n_req = C.flattened_requests("q_idx [total_q, H, D]", rows, cu_seqlens_q, token_to_req, num_requests)
        pos_shape = (rows,)
    else:
        if cu_seqlens_q is not None or token_to_req is not None:
            raise ValueError("cu_seqlens_q and token_to_req apply to flattened q_idx [total_q, H, D], not padded [B, Q, H, D]")
        n_req = q_idx.shape[0]
        if num_requests is not None and C.positive_int("num_requests", num_requests) != n_req:
            raise ValueError(f"num_requests is {num_requests} but padded q_idx holds {n_req} requests")
        pos_shape = tuple(q_idx.shape[:2])

    paged = block_table is not None
    if paged:
        C.int32("block_table", block_table, ndim=2)
        if block_table.shape[0] != n_req:
            raise ValueError(f"block_table must have one row per request ({n_req}), got shape {tuple(block_table.shape)}")
        if block_keys.dim() == 4 and block_keys.shape[2] != 1:
            raise ValueError(f"paged block_keys must be [pages, page_size, 1, D] or [pages, page_size, D], got {tuple(block_keys.shape)}")
        if page_size is not None and C.positive_int("page_size", page_size) != block_keys.shape[1]:
            raise ValueError(f"page_size is {page_size} but block_keys pages hold {block_keys.shape[1]} keys")
        if block_keys.shape[1] == 0:
            raise ValueError("paged block_keys must have a positive page size")
        cache = block_keys.reshape(block_keys.shape[0], block_keys.shape[1], block_keys.shape[-1])
        n_keys = block_table.shape[1] * block_keys.shape[1]
    else:
        if page_size is not None:
            raise ValueError("page_size applies to paged block_keys and needs block_table")
        if block_keys.dim() != 3 or block_keys.shape[0] != n_req:
            raise ValueError(f"block_keys must be [B, N_B, D] with B = {n_req} requests, got {tuple(block_keys.shape)}")
        n_keys = block_keys.shape[1]
    if block_keys.shape[-1] != dim:
        raise ValueError(f"block_keys has feature dim {block_keys.shape[-1]} but q_idx has {dim}")
    C.optional_int32("query_positions", query_positions, shape=pos_shape)
    C.optional_int32("seq_lens_q", seq_lens_q, shape=(n_req,))
    C.same_device(q_idx=q_idx, block_keys=block_keys, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                  token_to_req=token_to_req, query_positions=query_positions, seq_lens_q=seq_lens_q)
    if _debug.enabled():
        rows = q_idx.shape[0] if varlen else q_idx.shape[1]
        if varlen:
            _debug.request_rows(rows, n_req, cu_seqlens_q, token_to_req)
        if paged:
            _debug.in_range("block_table", block_table, -1, cache.shape[0], f" (the pool holds {cache.shape[0]} pages)")
        _debug.lengths("seq_lens_q", seq_lens_q, rows, "rows")

    if backend == "reference":
        return _score_reference(q_idx, block_keys if not paged else cache, block_table, cu_seqlens_q, token_to_req,
                                n_req, query_positions, seq_lens_q, block_size, mult, n_keys)

    if varlen:
        raise ValueError(
            "varlen q_idx [total_q, 4, 128] requires backend='reference'; use qsa_mqa_prefill for native packed rows"
        )
    if paged:
        raise ValueError("paged block_keys require backend='reference' here; native paged scoring uses qsa_mqa_decode")
    _native_geometry("q_idx", q_idx)
    C.vector_layout("q_idx", q_idx)
    C.vector_layout("block_keys", block_keys)
    target = _dispatch.target_of(q_idx, "q_idx")
    B, Q = pos_shape
    if query_positions is None:
        query_positions = torch.arange(Q, device=q_idx.device, dtype=torch.int32).expand(B, Q)
    hi = reference.causal_block_limit(query_positions, block_size)
    if seq_lens_q is not None:
        rows = torch.arange(Q, device=q_idx.device)
        hi = torch.where(rows < seq_lens_q.unsqueeze(-1), hi, 0)
    hi = hi.clamp_max(n_keys).to(torch.int32)
    lo = torch.zeros_like(hi)
    return _logits(q_idx, block_keys, lo, hi, mult, target)


def _score_reference(q, keys, table, cu, t2r, n_req, positions, seq_lens, block_size, scale, n_keys):
    """Scores of every layout, one request at a time."""
    out = q.new_full((*q.shape[:-2], n_keys), float("-inf"), dtype=torch.float32)
    if table is not None:
        keys, exists = reference.gather_pages(keys, table, n_keys)
    else:
        exists = torch.ones(keys.shape[:2], dtype=torch.bool, device=q.device)
    for b in range(n_req):
        if q.dim() == 4:
            rows = slice(None)
            q_b, out_b = q[b], out[b]
            local = torch.arange(q.shape[1], device=q.device)
        else:
            if cu is not None:
                if b == 0:
                    _debug.offsets("cu_seqlens_q", cu, q.shape[0])
                rows = torch.arange(int(cu[b]), int(cu[b + 1]), device=q.device)
            else:
                rows = torch.nonzero(t2r == b).flatten()
            q_b, out_b = q[rows], None
            local = torch.arange(rows.numel(), device=q.device)
        pos = local if positions is None else (positions[b] if q.dim() == 4 else positions[rows]).long()
        valid = local < int(seq_lens[b]) if seq_lens is not None else torch.ones_like(local, dtype=torch.bool)
        s = reference.mqa_score(q_b, keys[b], exists[b], pos, valid, block_size, scale)
        if out_b is not None:
            out_b.copy_(s)
        else:
            out[rows] = s
    return out


# ---------------------------------------------------------------- packed prefill


def qsa_mqa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    score_scale: float | None = None,
    *,
    scale: float | None = None,
    backend: str = "tilelang",
) -> torch.Tensor:
    """Packed-prefill MQA logits: FP32 [rows, keys], -inf outside [row_starts, row_ends) of each row.

    q [rows, heads, dim]; k [keys, dim] or [keys, 1, dim], shared by all rows;
    row_starts / row_ends int32 [rows]. score_scale divides scores, scale
    multiplies them (not both); the default is 1/sqrt(dim). Native: BF16/FP16,
    heads 4, dim 128, the vector-load layout rule on q and k.
    """
    backend = _dispatch.backend(backend)
    C.tensor("q", q, ndim=3)
    C.floating("q", q)
    C.tensor("k", k, ndim=(2, 3))
    C.floating("k", k)
    C.same_dtype(q=q, k=k)
    if k.dim() == 3 and k.shape[1] != 1:
        raise ValueError(f"k must be [keys, dim] or [keys, 1, dim], got {tuple(k.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has feature dim {k.shape[-1]} but q has {q.shape[-1]}")
    rows = q.shape[0]
    C.int32("row_starts", row_starts, shape=(rows,))
    C.int32("row_ends", row_ends, shape=(rows,))
    C.same_device(q=q, k=k, row_starts=row_starts, row_ends=row_ends)
    if _debug.enabled():
        for name, x in (("row_starts", row_starts), ("row_ends", row_ends)):
            _debug.in_range(name, x, 0, k.shape[0] + 1, f" (k holds {k.shape[0]} keys)")
    mult = C.score_multiplier(scale, score_scale, q.shape[-1])
    k2 = k.reshape(k.shape[0], k.shape[-1]) if k.dim() == 3 else k

    if backend == "reference":
        return reference.mqa_logits(q, k2, row_starts, row_ends, mult)
    _native_geometry("q", q)
    C.vector_layout("q", q)
    C.vector_layout("k", k)
    target = _dispatch.target_of(q, "q")
    out = _logits(q.unsqueeze(0), k2.unsqueeze(0), row_starts.unsqueeze(0), row_ends.unsqueeze(0), mult, target)
    return out[0]


qsa_mqa = qsa_mqa_prefill


# ---------------------------------------------------------------- paged decode


def qsa_mqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    max_model_len: int,
    score_scale: float | None = None,
    *,
    scale: float | None = None,
    backend: str = "tilelang",
) -> torch.Tensor:
    """Paged-decode MQA logits: FP32 [B, max_model_len].

    q [B, heads, dim] or [B, 1, heads, dim]; k_cache [pages, page_size, 1, dim]
    or [pages, page_size, dim]; page_table int32 [B, max_pages] of page ids
    (-1 for unused); context_lens int32 [B], visible compressed keys per request.
    Key n scores -inf unless n < context_lens[b] and its page exists (in the
    table, inside the pool): an empty pool or a 0-column page_table gives -inf
    everywhere. Native: BF16/FP16, heads 4, dim 128, page sizes
    8/16/32/64; q goes through plain loads, so broadcast (stride-0) q is fine.
    """
    backend = _dispatch.backend(backend)
    C.tensor("q", q, ndim=(3, 4))
    C.floating("q", q)
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q must be [B, heads, dim] or [B, 1, heads, dim], got {tuple(q.shape)}")
    C.tensor("k_cache", k_cache, ndim=(3, 4))
    C.floating("k_cache", k_cache)
    C.same_dtype(q=q, k_cache=k_cache)
    if k_cache.dim() == 4 and k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must be [pages, page_size, 1, dim] or [pages, page_size, dim], got {tuple(k_cache.shape)}")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_cache has feature dim {k_cache.shape[-1]} but q has {q.shape[-1]}")
    if k_cache.shape[1] == 0:
        raise ValueError("k_cache must have a positive page size")
    batch = q.shape[0]
    C.int32("page_table", page_table, ndim=2)
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table must have {batch} rows (one per request), got shape {tuple(page_table.shape)}")
    C.int32("context_lens", context_lens, shape=(batch,))
    max_model_len = C.positive_int("max_model_len", max_model_len)
    C.same_device(q=q, k_cache=k_cache, page_table=page_table, context_lens=context_lens)
    if _debug.enabled():
        pages = k_cache.shape[0]
        _debug.in_range("page_table", page_table, -1, pages, f" (k_cache holds {pages} pages)")
        _debug.lengths("context_lens", context_lens, page_table.shape[1] * k_cache.shape[1], "keys the page table holds")
    mult = C.score_multiplier(scale, score_scale, q.shape[-1])
    q3 = q.reshape(batch, q.shape[-2], q.shape[-1]) if q.dim() == 4 else q
    cache = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1]) if k_cache.dim() == 4 else k_cache

    if backend == "reference":
        return reference.mqa_decode(q3, cache, page_table, context_lens, max_model_len, mult)
    _native_geometry("q", q)
    page_size = cache.shape[1]
    if page_size not in DECODE_PAGE_SIZES:
        raise ValueError(
            f"backend='tilelang' supports page sizes {', '.join(map(str, DECODE_PAGE_SIZES))} for k_cache, got {page_size}; "
            "use backend='reference'"
        )
    C.unit_feature_stride("q", q)
    C.vector_layout("k_cache", k_cache)
    target = _dispatch.target_of(q, "q")
    out = torch.empty(batch, max_model_len, dtype=torch.float32, device=q.device)
    if batch == 0 or cache.shape[0] == 0:
        return out.fill_(float("-inf"))
    spec = {"dtype": str(q.dtype).removeprefix("torch."), "page_size": page_size}
    kern = _dispatch.kernel(DECODE.name, spec, target)
    kern(q3, C.canonical_unit_strides(cache), page_table, context_lens, out, mult)
    return out
