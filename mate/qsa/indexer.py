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

from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _debug, _dispatch
from mate.qsa import reference, selection
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




def _logits(q, k, lo, hi, scale, target):
    """Native interval scores: q [B, R, 4, 128], k [B, N, 128], lo/hi [B, R] -> [B, R, N] FP32."""
    B, R, N = q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty(B, R, N, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    spec = {"dtype": str(q.dtype).removeprefix("torch."), "even_keys": int(N % 2 == 0)}
    kern = _dispatch.kernel(LOGITS.name, spec, target)
    tiles = _dispatch.tiles(LOGITS.name, spec, target)
    # Split the key axis while that still fits the grid in one wave of the multiprocessors (min_blocks CTAs
    # each; more splits, a second wave, measured slower at issue 16's prefill shape: each CTA loads its Q again).
    ctas = -(-R // tiles["block_rows"]) * B
    key_tiles = -(-N // tiles["block_keys"])
    splits = max(1, min(key_tiles, tiles["min_blocks"] * _dispatch.sm_count(q.device) // ctas))
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
    problem = _resolve_score(**locals())  # first statement: locals() is exactly the parameters
    return _score_native(problem) if problem.backend == "tilelang" else _score_reference(problem)


class ScoreProblem(NamedTuple):
    """One qsa_indexer_mqa_score call, resolved and checked (immutable, built once per call).

    keys: block_keys, paged ones as [pages, page_size, D]; n_keys: N_B; target: set for
    backend='tilelang' only."""

    backend: str
    q_idx: torch.Tensor
    keys: torch.Tensor
    block_table: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    token_to_req: torch.Tensor | None
    n_req: int
    query_positions: torch.Tensor | None
    seq_lens_q: torch.Tensor | None
    block_size: int
    scale: float
    n_keys: int
    target: str | None


def _resolve_score(q_idx, block_keys, *, block_table, page_size, cu_seqlens_q, token_to_req, num_requests,
                   query_positions, seq_lens_q, block_size, scale, score_scale, backend) -> ScoreProblem:
    """Every check of qsa_indexer_mqa_score, in one order: inputs, requests, key layout, metadata,
    devices, the debug value checks, the native limits, the offsets the reference slices by."""
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
    n_req = C.requests("q_idx", q_idx, "H", cu_seqlens_q, token_to_req, num_requests)

    paged = block_table is not None
    if paged:
        C.block_table_rows(block_table, n_req)
        if block_keys.dim() == 4 and block_keys.shape[2] != 1:
            raise ValueError(f"paged block_keys must be [pages, page_size, 1, D] or [pages, page_size, D], got {tuple(block_keys.shape)}")
        if page_size is not None and C.positive_int("page_size", page_size) != block_keys.shape[1]:
            raise ValueError(f"page_size is {page_size} but block_keys pages hold {block_keys.shape[1]} keys")
        if block_keys.shape[1] == 0:
            raise ValueError("paged block_keys must have a positive page size")
        keys = block_keys.reshape(block_keys.shape[0], block_keys.shape[1], block_keys.shape[-1])
        n_keys = block_table.shape[1] * block_keys.shape[1]
    else:
        if page_size is not None:
            raise ValueError("page_size applies to paged block_keys and needs block_table")
        if block_keys.dim() != 3 or block_keys.shape[0] != n_req:
            raise ValueError(f"block_keys must be [B, N_B, D] with B = {n_req} requests, got {tuple(block_keys.shape)}")
        keys, n_keys = block_keys, block_keys.shape[1]
    if block_keys.shape[-1] != dim:
        raise ValueError(f"block_keys has feature dim {block_keys.shape[-1]} but q_idx has {dim}")
    C.optional_int32("query_positions", query_positions, shape=tuple(q_idx.shape[:-2]))
    C.optional_int32("seq_lens_q", seq_lens_q, shape=(n_req,))
    C.same_device(q_idx=q_idx, block_keys=block_keys, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                  token_to_req=token_to_req, query_positions=query_positions, seq_lens_q=seq_lens_q)
    if _debug.enabled():
        rows = q_idx.shape[0] if varlen else q_idx.shape[1]
        if varlen:
            _debug.request_rows(rows, n_req, cu_seqlens_q, token_to_req)
        if paged:
            _debug.in_range("block_table", block_table, -1, keys.shape[0], f" (the pool holds {keys.shape[0]} pages)")
        _debug.lengths("seq_lens_q", seq_lens_q, rows, "rows")

    target = select_spec = None
    if backend == "tilelang":
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
    if varlen and cu_seqlens_q is not None and n_req:
        # The reference slices rows by these offsets (the native path took no varlen rows above), so
        # their values are checked with or without the debug checks.
        _debug.offsets("cu_seqlens_q", cu_seqlens_q, q_idx.shape[0])
    return ScoreProblem(backend, q_idx, keys, block_table, cu_seqlens_q, token_to_req, n_req, query_positions,
                        seq_lens_q, block_size, mult, n_keys, target)


def _score_native(p: ScoreProblem) -> torch.Tensor:
    B, Q = p.q_idx.shape[:2]
    query_positions = p.query_positions
    if query_positions is None:
        query_positions = torch.arange(Q, device=p.q_idx.device, dtype=torch.int32).expand(B, Q)
    hi = reference.causal_block_limit(query_positions, p.block_size)
    if p.seq_lens_q is not None:
        rows = torch.arange(Q, device=p.q_idx.device)
        hi = torch.where(rows < p.seq_lens_q.unsqueeze(-1), hi, 0)
    hi = hi.clamp_max(p.n_keys).to(torch.int32)
    lo = torch.zeros_like(hi)
    return _logits(p.q_idx, p.keys, lo, hi, p.scale, p.target)


def _score_reference(p: ScoreProblem) -> torch.Tensor:
    """Scores of every layout, one request at a time."""
    q, keys, table, cu, t2r, positions, seq_lens = (p.q_idx, p.keys, p.block_table, p.cu_seqlens_q, p.token_to_req,
                                                    p.query_positions, p.seq_lens_q)
    n_req, block_size, scale, n_keys = p.n_req, p.block_size, p.scale, p.n_keys
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


def _check_topk(topk, keys: int, rows: int, query_positions, block_size, what: str) -> int:
    """The selection's checks (topk=, query_positions, block_size) of the prefill and decode calls; the block size."""
    if topk is not None:
        return selection.check_selection(topk, keys, rows, query_positions, block_size, True, name="topk", what=what)
    if query_positions is not None:
        raise ValueError("query_positions is the selection's (topk=...): without topk the call returns the scores")
    return block_size


def _reference_selection(scores: torch.Tensor, p):
    """The reference's answer of a prefill or decode call: its scores, or with topk their selection."""
    if p.topk is None:
        return scores
    blocks = reference.topk_blocks(scores, p.topk)
    return blocks, reference.expand_blocks(blocks, p.query_positions, p.block_size)


def _native_selection(scores: torch.Tensor, p):
    """The native answer of a prefill or decode call: its scores, or with topk the top-k kernel's selection of them.
    Two kernels, the scores through global memory: a one-kernel decode (a cluster of CTAs a request, the leader
    selecting from the peers' scores in shared memory) was slower on the H100 (docs/performance.md, QSA selection)."""
    if p.topk is None:
        return scores
    return selection.tokens_native(scores, p.topk, p.query_positions, p.block_size, p.select_spec, p.target)


# ---------------------------------------------------------------- packed prefill


def qsa_mqa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    score_scale: float | None = None,
    *,
    scale: float | None = None,
    topk: int | None = None,
    query_positions: torch.Tensor | None = None,
    block_size: int = 4,
    backend: str = "tilelang",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed-prefill MQA logits: FP32 [rows, keys], -inf outside [row_starts, row_ends) of each row; with
    `topk`, the selection made from them instead.

    q [rows, heads, dim]; k [keys, dim] or [keys, 1, dim], shared by all rows;
    row_starts / row_ends int32 [rows]. score_scale divides scores, scale
    multiplies them (not both); the default is 1/sqrt(dim). Native: BF16/FP16,
    heads 4, dim 128, the vector-load layout rule on q and k.

    Selection: `topk=k` (1 <= k <= min(keys, 2048)) with `query_positions` (int32 [rows], each row's position:
    its incomplete tail block's last token) returns (block_indices int32 [rows, k], token_indices int32
    [rows, block_size * k + block_size - 1]), exactly `qsa_topk_tokens(qsa_mqa_prefill(...), k, query_positions,
    block_size=block_size)`: the ids are columns of k (with several requests packed into k, a row's ids count
    from the first key of k, not of its request), -1 past a row's [row_starts, row_ends). Natively that is
    today the indexer's kernel and the top-k's (the scores go through a temporary FP32 [rows, keys] in global
    memory): the native limits of both hold (keys up to 49152).
    """
    p = _resolve_prefill(**locals())  # first statement: locals() is exactly the parameters
    if p.backend == "reference":
        return _reference_selection(reference.mqa_logits(p.q, p.k, p.row_starts, p.row_ends, p.scale), p)
    return _native_selection(_prefill_native(p), p)


class PrefillProblem(NamedTuple):
    """One qsa_mqa_prefill call, resolved and checked; k as [keys, dim], target for backend='tilelang' only."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    row_starts: torch.Tensor
    row_ends: torch.Tensor
    scale: float
    target: str | None
    topk: int | None
    query_positions: torch.Tensor | None
    block_size: int
    select_spec: dict | None  # the top-k's specialization, with topk for backend='tilelang'


def _resolve_prefill(q, k, row_starts, row_ends, score_scale, *, scale, topk, query_positions, block_size, backend) -> PrefillProblem:
    """Every check of qsa_mqa_prefill, in one order: inputs, row bounds, the selection, devices, the debug value
    checks, the scale, the native limits."""
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
    block_size = _check_topk(topk, k.shape[0], rows, query_positions, block_size, "keys")
    C.same_device(q=q, k=k, row_starts=row_starts, row_ends=row_ends, query_positions=query_positions)
    if _debug.enabled():
        for name, x in (("row_starts", row_starts), ("row_ends", row_ends)):
            _debug.in_range(name, x, 0, k.shape[0] + 1, f" (k holds {k.shape[0]} keys)")
    mult = C.score_multiplier(scale, score_scale, q.shape[-1])
    k2 = k.reshape(k.shape[0], k.shape[-1]) if k.dim() == 3 else k
    target = select_spec = None
    if backend == "tilelang":
        _native_geometry("q", q)
        C.vector_layout("q", q)
        C.vector_layout("k", k)
        target = _dispatch.target_of(q, "q")
        if topk is not None:
            select_spec = selection.topk_spec(rows, k.shape[0], q.device)  # its native limit, before the indexer runs
    return PrefillProblem(backend, q, k2, row_starts, row_ends, mult, target, topk, query_positions, block_size, select_spec)


def _prefill_native(p: PrefillProblem) -> torch.Tensor:
    out = _logits(p.q.unsqueeze(0), p.k.unsqueeze(0), p.row_starts.unsqueeze(0), p.row_ends.unsqueeze(0), p.scale, p.target)
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
    k_scale: float | torch.Tensor | None = None,
    topk: int | None = None,
    query_positions: torch.Tensor | None = None,
    block_size: int = 4,
    backend: str = "tilelang",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged-decode MQA logits: FP32 [B, max_model_len]; with `topk`, the selection made from them instead.

    q [B, heads, dim] or [B, 1, heads, dim]; k_cache [pages, page_size, 1, dim]
    or [pages, page_size, dim]; page_table int32 [B, max_pages] of page ids
    (-1 for unused); context_lens int32 [B], visible compressed keys per request.
    Key n scores -inf unless n < context_lens[b] and its page exists (in the
    table, inside the pool): an empty pool or a 0-column page_table gives -inf
    everywhere. Native: q BF16/FP16 with a k_cache of q's dtype or FP8, heads 4,
    dim 128, page sizes 8/16/32/64; q goes through plain loads, so broadcast
    (stride-0) q is fine.

    FP8 cache: k_cache torch.float8_e4m3fn or torch.float8_e5m2 (q stays BF16/FP16: an FP8 q raises),
    k_scale its per-tensor dequant multiplier (real key = stored value x k_scale): a positive finite
    float, or a one-element (shape () or (1,)) float32 tensor on the cache's device, which the kernel
    reads on the GPU, so it may change between CUDA-graph replays with no host sync (a float is fixed
    when a graph is captured). None means 1; a BF16/FP16 cache takes none (or 1.0). The native kernel
    gathers the FP8 keys, upcasts them exactly into q's dtype and multiplies the scores by k_scale; the
    reference scores the dequantized keys (FP32 value x k_scale). A tensor's value is checked (> 0,
    finite) by the reference and under mate.debug_checks(); natively it is trusted. The native layout
    rule counts bytes: an FP8 cache's outer strides are multiples of 16 elements. Errors: ValueError for
    an FP8 q, a k_scale <= 0, NaN, inf or != 1 on a BF16/FP16 cache, a tensor k_scale on a BF16/FP16
    cache or of more than one element or on another device; TypeError for a k_scale that is neither a
    number nor a tensor, or a tensor that is not float32.

    Selection: `topk=k` (1 <= k <= min(max_model_len, 2048)) with `query_positions` (int32 [B], each
    request's position: its incomplete tail block's last token) returns (block_indices int32 [B, k],
    token_indices int32 [B, block_size * k + block_size - 1]), exactly
    `qsa_topk_tokens(qsa_mqa_decode(...), k, query_positions, block_size=block_size)` (the ids of each row's k
    largest scores in descending order, ties to the lower id, -1 past the visible keys; then their token
    expansion): qsa_sparse_attention's token_indices and block_indices. Natively that is today the indexer's
    kernel and the top-k's (the scores go through a temporary FP32 [B, max_model_len] in global memory): the
    native limits of both hold (max_model_len up to 49152).
    """
    p = _resolve_decode(**locals())  # first statement: locals() is exactly the parameters
    if p.backend == "reference":
        cache = C.dequantized(p.cache, p.kv.k_value(p.cache)) if p.kv.fp8 else p.cache
        return _reference_selection(reference.mqa_decode(p.q, cache, p.page_table, p.context_lens, p.max_model_len, p.scale), p)
    return _native_selection(_decode_native(p), p)


class DecodeProblem(NamedTuple):
    """One qsa_mqa_decode call, resolved and checked: q as [B, heads, dim], the cache as
    [pages, page_size, dim]; target for backend='tilelang' only."""

    backend: str
    q: torch.Tensor
    cache: torch.Tensor
    page_table: torch.Tensor
    context_lens: torch.Tensor
    max_model_len: int
    scale: float
    kv: C.KVScales
    target: str | None
    topk: int | None
    query_positions: torch.Tensor | None
    block_size: int
    select_spec: dict | None  # the top-k's specialization, with topk for backend='tilelang'


def _resolve_decode(q, k_cache, page_table, context_lens, max_model_len, score_scale, *, scale, k_scale, topk, query_positions,
                    block_size, backend) -> DecodeProblem:
    """Every check of qsa_mqa_decode, in one order: inputs, page table and lengths, the selection, devices, the
    debug value checks, the scale, the native limits."""
    backend = _dispatch.backend(backend)
    C.tensor("q", q, ndim=(3, 4))
    C.floating("q", q)
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q must be [B, heads, dim] or [B, 1, heads, dim], got {tuple(q.shape)}")
    C.tensor("k_cache", k_cache, ndim=(3, 4))
    C.floating("k_cache", k_cache)
    kv = C.kv_scales(k_cache, None, k_scale, None, q, names=("k_cache", None, "q"))
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
    block_size = _check_topk(topk, max_model_len, batch, query_positions, block_size, "max_model_len")
    C.same_device(q=q, k_cache=k_cache, page_table=page_table, context_lens=context_lens, query_positions=query_positions)
    if _debug.enabled():
        pages = k_cache.shape[0]
        _debug.in_range("page_table", page_table, -1, pages, f" (k_cache holds {pages} pages)")
        _debug.lengths("context_lens", context_lens, page_table.shape[1] * k_cache.shape[1], "keys the page table holds")
    if _debug.enabled() or backend == "reference":
        _debug.scales(kv)
    mult = C.score_multiplier(scale, score_scale, q.shape[-1])
    q3 = q.reshape(batch, q.shape[-2], q.shape[-1]) if q.dim() == 4 else q
    cache = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1]) if k_cache.dim() == 4 else k_cache
    target = select_spec = None
    if backend == "tilelang":
        _native_geometry("q", q)
        if cache.shape[1] not in DECODE_PAGE_SIZES:
            raise ValueError(
                f"backend='tilelang' supports page sizes {', '.join(map(str, DECODE_PAGE_SIZES))} for k_cache, "
                f"got {cache.shape[1]}; use backend='reference'"
            )
        C.unit_feature_stride("q", q)
        C.vector_layout("k_cache", k_cache)
        target = _dispatch.target_of(q, "q")
        if topk is not None:
            select_spec = selection.topk_spec(batch, max_model_len, q.device)  # its native limit, before the indexer runs
    return DecodeProblem(backend, q3, cache, page_table, context_lens, max_model_len, mult, kv, target, topk, query_positions, block_size,
                         select_spec)


def _decode_native(p: DecodeProblem) -> torch.Tensor:
    batch = p.q.shape[0]
    out = torch.empty(batch, p.max_model_len, dtype=torch.float32, device=p.q.device)
    if batch == 0 or p.cache.shape[0] == 0:
        return out.fill_(float("-inf"))
    spec = {"dtype": str(p.q.dtype).removeprefix("torch."), "page_size": p.cache.shape[1]}
    cache = C.canonical_unit_strides(p.cache)
    if not p.kv.fp8:
        _dispatch.kernel(DECODE.name, spec, p.target)(p.q, cache, p.page_table, p.context_lens, out, p.scale)
        return out
    # FP8: a float k_scale folds into the scores' factor here (k.k == 1.0 with a tensor); a tensor one the kernel
    # reads on the GPU (flag 1), a stand-in it never reads otherwise.
    kern = _dispatch.kernel(DECODE.name, spec, p.target, kv_dtype=str(p.kv.kv_dtype).removeprefix("torch."))
    dev = p.kv.k_tensor is not None
    ks = p.kv.k_tensor if dev else _dispatch.Placeholders(p.q.device)(torch.float32, 1)
    kern(p.q, cache, p.page_table, p.context_lens, out, p.scale * p.kv.k, ks, int(dev))
    return out
