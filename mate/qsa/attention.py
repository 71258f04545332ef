"""QSA sparse core attention: each query row attends to its own list of selected tokens.

All query heads of a row share the row's token list; query head h reads K/V head
h // (Hq // Hkv). out = softmax(scale * q . k) . v over the row's visible tokens,
computed in FP32, each occurrence of a duplicated token counting once;
lse = log-sum-exp (natural log, FP32) of the same scaled scores. A row with no
visible token gets output 0 and lse -inf. With `gate`, out *= sigmoid(gate) in FP32.

Two ways to name the tokens:

- logical, `token_indices`: request-local token ids (int32, -1 pads, any width),
  shape query.shape[:-2] + (W,). Token t of request b is used iff t >= 0, it lies in
  the request's cache, t < seq_lens_k[b] (where given), its page exists (paged
  K/V), and t <= the row's causal position; padded rows (index >= seq_lens_q[b])
  give 0 and -inf.
- physical, `selected_kv_indices`: int32 [rows, W] ids into flattened K/V [N, Hkv, D];
  an id is used iff 0 <= id < N. No causal filtering, no request or page metadata.

Query layouts: padded [B, Q, Hq, D]; flattened [total_q, Hq, D] with cu_seqlens_q
(int32 [B + 1]) or token_to_req (int32 [total_q]) and num_requests. K/V layouts
(key and value alike): padded [B, S, Hkv, D]; paged [pages, page_size, Hkv, D] with
block_table (int32 [B, max_pages], -1 or ids past the pool are missing pages);
flattened varlen [total_k, Hkv, D] with cu_seqlens_k (int32 [B + 1]; reference only).

Causal position of a row: query_positions (int32, query.shape[:-2]) where given,
else bottom-right: row i of a request with Sq rows and Sk keys sits at Sk - Sq + i,
where Sq = seq_lens_q[b] if given else the request's row count, and Sk =
seq_lens_k[b] if given else the request's cache capacity (S, its varlen length, or
max_pages * page_size).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _debug, _dispatch, _hopper, _reference, merge
from mate.qsa import reference
from mate.qsa.kernels import sparse_card
from mate.qsa.kernels.sparse_card import CANONICAL_GEOMETRY, MAX_GROUP
kernels = _dispatch.lazy_module("mate.qsa.kernels.sparse")  # imported, with TileLang, at the first native call

NATIVE_DIM = sparse_card.DIM
MAX_HINT_BLOCKS = 512
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _attention_input(name: str, x) -> torch.Tensor:
    C.tensor(name, x, ndim=(3, 4))
    C.floating(name, x)
    return x


def _compute_dtype(v, inputs: torch.dtype) -> None:
    """One rule: None means the inputs' dtype; an explicit compute_dtype must be that dtype.

    The MMAs run in the dtype of Q/K/V (FP32 accumulation); nothing converts the inputs,
    so a compute_dtype that differs from them cannot be honoured and is an error."""
    if v is None:
        return
    if not isinstance(v, torch.dtype):
        raise TypeError(f"compute_dtype must be None or a torch.dtype, got {type(v).__name__}")
    if _is_fp8(v):
        raise ValueError(f"compute_dtype {v} is not supported: FP8 compute is not enabled; use torch.bfloat16")
    if v not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, got {v}")
    if v != inputs:
        raise ValueError(
            f"compute_dtype={v} differs from the query/key/value dtype {inputs}: the matmuls run in the inputs' dtype; "
            "pass compute_dtype=None (or the inputs' dtype), or convert the inputs"
        )


def _softmax_scale(scale, softmax_scale, dim: int) -> float:
    if scale is not None and softmax_scale is not None:
        raise ValueError("softmax_scale is an alias of scale; pass one of scale or softmax_scale, not both")
    if softmax_scale is not None:
        return C.positive_float("softmax_scale", softmax_scale)
    if scale is not None:
        return C.positive_float("scale", scale)
    return dim**-0.5


def qsa_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_indices: torch.Tensor | None = None,
    *,
    block_indices: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    token_to_req: torch.Tensor | None = None,
    num_requests: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seq_lens_q: torch.Tensor | None = None,
    seq_lens_k: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    page_size: int | None = None,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    backend: str = "tilelang",
    warp_specialized: bool = False,
    assume_compact_blocks: bool = False,
    out: torch.Tensor | None = None,
    selected_kv_indices: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    k_scale: float | torch.Tensor | None = 1.0,
    v_scale: float | torch.Tensor | None = 1.0,
    compute_dtype: torch.dtype | None = None,
    lse: torch.Tensor | None = None,
):
    """QSA core attention over a per-row token set (see the module docstring for the semantics).

    Returns the query-shaped output (exactly `out` when given), or (output, lse) with
    return_lse=True; lse is FP32 of shape query.shape[:-1].

    - block_indices: optional int32 hint, the 4-token blocks behind token_indices,
      shape token_indices.shape[:-1] + (nb,) with 1 <= nb <= 512 and
      token_indices.shape[-1] == 4 * nb + 3. Result-neutral when it matches token_indices
      (block b stands for tokens 4b .. 4b+3, -1 for four -1): the native path trusts it
      without reading it back, so a hint that disagrees changes the native result (the
      reference ignores the hint); MATE_DEBUG_CHECKS=1 / mate.debug_checks() catches it.
      assume_compact_blocks=True (needs block_indices) is the producer's promise that
      valid block ids form a prefix of each row and are causally visible (trusted the
      same way; the debug checks test the prefix).
    - An empty pool (0 pages) or a block_table with 0 columns: nothing is visible, the
      output is 0 and the LSE -inf.
    - scale / softmax_scale (aliases, not both): positive multiplier, default 1/sqrt(D).
    - gate: floating, shape query.shape[:-1] (per head) or query.shape (per element).
    - num_splits (None or positive; 1 disables SplitKV) and warp_specialized choose
      the native schedule; they do not change the result.
    - FP8 K/V: key and value torch.float8_e4m3fn or torch.float8_e5m2 (the same one), every
      layout; the query stays BF16/FP16. k_scale / v_scale are the per-tensor dequant
      multipliers (real value = stored value x scale): a positive finite float, or a
      one-element FP32 tensor on the cache's device that the kernel reads on the GPU (so a
      captured graph replays with new scales, no host sync). The native path gathers the FP8
      rows (half the bytes), upcasts them exactly into the query's dtype for the matmuls and
      applies the scales to the scores and the output; the reference dequantizes (FP32 value
      x scale). BF16/FP16 K/V take no scale (None or 1.0). Errors: an FP8 query, FP8 K with
      non-FP8 or other-FP8 V, a scale <= 0, NaN or inf (a tensor's value: with
      mate.debug_checks() and on the reference), a tensor scale of another shape, dtype or device.
    - compute_dtype: None (default) is the query's dtype; an explicit bfloat16 or float16 must be
      that dtype, else ValueError (the seed's default, torch.bfloat16, ran fp16 inputs in
      fp16 without a word); FP8 compute is not enabled; float32 inputs (reference only) take None.
    - selected_kv_indices: int32 [rows, W] physical ids into flattened key/value
      [N, Hkv, D] with flattened query [rows, Hq, D]. Excludes token_indices,
      block_indices, request/page/causal metadata and gate. `lse` (FP32 [rows, Hq])
      is its output buffer, written even when return_lse=False.
    - out: writable non-overlapping positive-stride view of query's shape, dtype and
      device; storage around it is untouched. Overlap of out or lse with any input
      (gate included) is rejected.

    backend="reference" runs the FP32 PyTorch oracle on any device and layout.
    backend="tilelang" (default) runs the native sm90 kernels (mate/qsa/kernels/sparse.py) for
    BF16/FP16, D = 256, Hq / Hkv <= 16: padded query with padded K/V (num_splits 1), padded or
    flattened query with paged K/V, and BF16 physical ids; SplitKV partials are merged (with the
    gate) in the attention launch, a thread-block cluster per (row, KV head), where every cluster fits
    on the GPU at once, else by the native merge (see cluster_splits). num_splits=None picks the split
    count from the row count (see choose_splits and cluster_splits). Every native kernel is
    warp-specialized already (a cp.async producer warpgroup and an MMA consumer warpgroup):
    warp_specialized=True is accepted for the canonical 24/2/256 geometry and runs that same
    kernel. Padded query axes (and those of indices, positions, gate and out) must collapse to
    zero-copy row views; K/V need a unit feature stride and 16-byte aligned base and outer strides.
    No host synchronization: the native path can be captured in a CUDA graph and replayed with new
    metadata values.
    """
    problem = resolve(**locals())  # first statement: locals() is exactly the parameters
    return native(problem) if problem.backend == "tilelang" else reference_run(problem)


class Problem(NamedTuple):
    """One qsa_sparse_attention call, resolved and checked: all that reference_run() and native() read.

    `indices` is token_indices (logical) or selected_kv_indices (physical); kv_layout is "padded",
    "paged", "varlen" (reference only) or "physical"; n_req is None for physical ids. For
    backend='tilelang' the rest holds the target and the row views the kernels take (query,
    indices, hint, positions, out, lse and gate with their batch/query axes as one row axis,
    the gate per element (merge.gate_rows), out and lse allocated where the caller passed none).

    Immutable and built once per call; a NamedTuple because a frozen dataclass costs about
    2 us more to build, which launch-bound decode calls would feel.
    """

    backend: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    indices: torch.Tensor
    kv_layout: str
    n_req: int | None
    scale: float
    block_indices: torch.Tensor | None
    compact: bool
    cu_seqlens_q: torch.Tensor | None
    token_to_req: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    seq_lens_q: torch.Tensor | None
    seq_lens_k: torch.Tensor | None
    query_positions: torch.Tensor | None
    block_table: torch.Tensor | None
    gate: torch.Tensor | None
    num_splits: int | None
    return_lse: bool
    out: torch.Tensor | None
    lse: torch.Tensor | None
    kv: C.KVScales
    rows: NativeRows | None = None


class NativeRows(NamedTuple):
    """The native call's target, its results (query-shaped out, lse or None) and their row views."""

    target: str
    out: torch.Tensor
    lse: torch.Tensor | None
    q: torch.Tensor
    indices: torch.Tensor
    block_indices: torch.Tensor | None
    query_positions: torch.Tensor | None
    o: torch.Tensor
    lse_rows: torch.Tensor  # the placeholder when no lse is wanted
    gate: torch.Tensor | None  # [rows, Hq, D] in the query's dtype or FP32 (merge.gate_rows)
    stand_in: _dispatch.Placeholders  # the call's placeholders


def resolve(query, key, value, token_indices, *, block_indices, cu_seqlens_q, token_to_req, num_requests, cu_seqlens_k,
            seq_lens_q, seq_lens_k, query_positions, block_table, page_size, scale, gate, num_splits, return_lse, backend,
            warp_specialized, assume_compact_blocks, out, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, lse) -> Problem:
    """Every check of qsa_sparse_attention, in one order: flags, Q/K/V, the physical or logical
    arguments, output buffers, devices and overlap, the debug value checks, the native limits."""
    backend = _dispatch.backend(backend)
    return_lse = C.flag("return_lse", return_lse)
    warp_specialized = C.flag("warp_specialized", warp_specialized)
    assume_compact_blocks = C.flag("assume_compact_blocks", assume_compact_blocks)
    num_splits = C.positive_int("num_splits", num_splits, allow_none=True)
    _attention_input("query", query)
    _attention_input("key", key)
    _attention_input("value", value)
    kv = C.kv_scales(key, value, k_scale, v_scale, query, names=("key", "value", "query"))
    _compute_dtype(compute_dtype, query.dtype)
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    hq, dim = query.shape[-2], query.shape[-1]
    hkv = key.shape[-2]
    if key.shape[-1] != dim:
        raise ValueError(f"key has feature dim {key.shape[-1]} but query has {dim}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"query heads must be a positive multiple of key heads, got Hq = {hq} and Hkv = {hkv}")
    mult = _softmax_scale(scale, softmax_scale, dim)

    if selected_kv_indices is not None:
        logical = dict(token_indices=token_indices, block_indices=block_indices, cu_seqlens_q=cu_seqlens_q,
                       token_to_req=token_to_req, num_requests=num_requests, cu_seqlens_k=cu_seqlens_k,
                       seq_lens_q=seq_lens_q, seq_lens_k=seq_lens_k, query_positions=query_positions,
                       block_table=block_table, page_size=page_size, gate=gate)
        _physical(query, key, selected_kv_indices, logical, assume_compact_blocks)
        indices, kv_layout, n_req = selected_kv_indices, "physical", None
    else:
        if lse is not None:
            raise ValueError("lse= is the output buffer of selected_kv_indices (physical ids); logical calls use return_lse=True")
        if token_indices is None:
            raise ValueError("pass token_indices (request-local token ids) or selected_kv_indices (physical ids); got neither")
        n_req = C.requests("query", query, "Hq", cu_seqlens_q, token_to_req, num_requests)
        _block_hint(query, token_indices, block_indices, assume_compact_blocks)
        kv_layout = _kv_layout(key, n_req, block_table, page_size, cu_seqlens_k)
        _row_metadata(query, n_req, seq_lens_q, seq_lens_k, query_positions, gate)
        indices = token_indices

    if out is not None:
        C.out_buffer("out", out, shape=query.shape, dtype=query.dtype, device=query.device)
    if lse is not None:
        C.out_buffer("lse", lse, shape=query.shape[:-1], dtype=torch.float32, device=query.device)
    inputs = dict(query=query, key=key, value=value, token_indices=token_indices, selected_kv_indices=selected_kv_indices,
                  block_indices=block_indices, cu_seqlens_q=cu_seqlens_q, token_to_req=token_to_req,
                  cu_seqlens_k=cu_seqlens_k, seq_lens_q=seq_lens_q, seq_lens_k=seq_lens_k,
                  query_positions=query_positions, block_table=block_table, gate=gate)
    C.same_device(**inputs, out=out, lse=lse)
    C.no_overlap({"out": out, "lse": lse}, inputs)
    if _debug.enabled():
        _debug_values(query, key, indices, kv_layout, n_req, block_indices, assume_compact_blocks, cu_seqlens_q,
                      token_to_req, cu_seqlens_k, seq_lens_q, seq_lens_k, block_table)
    if _debug.enabled() or backend == "reference":
        _debug.scales(kv)
    rows = None
    if backend == "tilelang":
        _native_limits(query, key, value, kv_layout, warp_specialized, num_splits, kv.fp8)
        rows = _native_rows(query, indices, block_indices, query_positions, gate, out, lse, return_lse)
    return Problem(backend, query, key, value, indices, kv_layout, n_req, mult, block_indices, assume_compact_blocks,
                   cu_seqlens_q, token_to_req, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions, block_table, gate,
                   num_splits, return_lse, out, lse, kv, rows)


def _physical(query, key, selected_kv_indices, logical: dict, assume_compact_blocks: bool) -> None:
    for name, v in logical.items():
        if v is not None:
            raise ValueError(
                f"{name} cannot be combined with selected_kv_indices: physical ids take no token_indices, "
                "block hint, request, page or causal metadata, and no gate"
            )
    if assume_compact_blocks:
        raise ValueError("assume_compact_blocks describes block_indices and cannot be combined with selected_kv_indices")
    if query.dim() == 4:
        raise ValueError(f"selected_kv_indices needs flattened query [rows, Hq, D], got shape {tuple(query.shape)}")
    if key.dim() != 3:
        raise ValueError(
            f"selected_kv_indices needs flattened key/value [N, Hkv, D], got key shape {tuple(key.shape)} "
            "(a paged pool [pages, page_size, Hkv, D] flattens to key.flatten(0, 1), ids page * page_size + slot)"
        )
    C.int32("selected_kv_indices", selected_kv_indices, ndim=2)
    rows = query.shape[0]
    if selected_kv_indices.shape[0] != rows:
        raise ValueError(f"selected_kv_indices must have {rows} rows (one per query row), got shape {tuple(selected_kv_indices.shape)}")


def _block_hint(query, token_indices, block_indices, assume_compact_blocks: bool) -> None:
    row_shape = tuple(query.shape[:-2])
    C.int32("token_indices", token_indices, ndim=len(row_shape) + 1)
    if tuple(token_indices.shape[:-1]) != row_shape:
        raise ValueError(f"token_indices must have shape {row_shape} + (width,), got {tuple(token_indices.shape)}")
    width = token_indices.shape[-1]
    if block_indices is None:
        if assume_compact_blocks:
            raise ValueError("assume_compact_blocks=True is a promise about block_indices; pass block_indices with it")
        return
    C.int32("block_indices", block_indices, ndim=len(row_shape) + 1)
    nb = block_indices.shape[-1]
    if tuple(block_indices.shape[:-1]) != row_shape:
        raise ValueError(f"block_indices must have shape {row_shape} + (blocks,), got {tuple(block_indices.shape)}")
    if not 1 <= nb <= MAX_HINT_BLOCKS:
        raise ValueError(
            f"block_indices must hold 1 to {MAX_HINT_BLOCKS} blocks per row, got {nb}; "
            "wider selections use token_indices alone"
        )
    if width != 4 * nb + 3:
        raise ValueError(
            f"token_indices width must be 4 * block_indices width + 3 = {4 * nb + 3} with the block hint, got {width}; "
            "omit block_indices for other widths"
        )


def _kv_layout(key, n_req: int, block_table, page_size, cu_seqlens_k) -> str:
    """'paged', 'varlen' or 'padded', with the metadata that layout needs checked."""
    if block_table is not None and cu_seqlens_k is not None:
        raise ValueError("pass block_table (paged K/V) or cu_seqlens_k (flattened varlen K/V), not both")
    if block_table is not None:
        if key.dim() != 4:
            raise ValueError(f"paged key must be [pages, page_size, Hkv, D], got shape {tuple(key.shape)}")
        C.block_table_rows(block_table, n_req)
        if page_size is not None and C.positive_int("page_size", page_size) != key.shape[1]:
            raise ValueError(f"page_size is {page_size} but key pages hold {key.shape[1]} tokens")
        if key.shape[1] == 0:
            raise ValueError("paged key must have a positive page size, got key.shape[1] = 0")
        return "paged"
    if page_size is not None:
        raise ValueError("page_size applies to paged key/value and needs block_table")
    if cu_seqlens_k is not None:
        if key.dim() != 3:
            raise ValueError(f"with cu_seqlens_k, key must be flattened [total_k, Hkv, D], got shape {tuple(key.shape)}")
        C.int32("cu_seqlens_k", cu_seqlens_k, shape=(n_req + 1,))
        return "varlen"
    if key.dim() != 4 or key.shape[0] != n_req:
        raise ValueError(
            f"key must be padded [B, S, Hkv, D] with B = {n_req} requests (or paged with block_table, "
            f"or flattened with cu_seqlens_k), got shape {tuple(key.shape)}"
        )
    return "padded"


def _row_metadata(query, n_req: int, seq_lens_q, seq_lens_k, query_positions, gate) -> None:
    C.optional_int32("seq_lens_q", seq_lens_q, shape=(n_req,))
    C.optional_int32("seq_lens_k", seq_lens_k, shape=(n_req,))
    C.optional_int32("query_positions", query_positions, shape=tuple(query.shape[:-2]))
    if gate is not None:
        C.tensor("gate", gate)
        C.floating("gate", gate)
        if tuple(gate.shape) not in (tuple(query.shape[:-1]), tuple(query.shape)):
            raise ValueError(
                f"gate must have shape {tuple(query.shape[:-1])} (per head) or {tuple(query.shape)} (per element), "
                f"got {tuple(gate.shape)}"
            )


def _native_limits(query, key, value, kv_layout, warp_specialized, num_splits, fp8):
    """The native path's limits (from the seed); raises ValueError for everything it cannot run."""
    hq, dim, hkv = query.shape[-2], query.shape[-1], key.shape[-2]
    if kv_layout == "varlen":
        raise ValueError("flattened varlen key/value with cu_seqlens_k require backend='reference'; native K/V is padded or paged")
    C.native_dtype("query", query)
    if dim != NATIVE_DIM:
        raise ValueError(f"backend='tilelang' supports head dim {NATIVE_DIM} for query, got {dim}; use backend='reference'")
    if hq // hkv > MAX_GROUP:
        raise ValueError(
            f"backend='tilelang' supports query/key head groups up to {MAX_GROUP}, got Hq / Hkv = {hq} / {hkv} = {hq // hkv}; "
            "use backend='reference'"
        )
    if kv_layout == "padded":
        if query.dim() != 4:
            raise ValueError("backend='tilelang' with padded key/value needs padded query [B, Q, Hq, D]; flattened queries need paged K/V")
        if num_splits not in (None, 1):
            raise ValueError(f"num_splits={num_splits}: SplitKV needs paged key/value; padded K/V runs with num_splits=1")
    if warp_specialized and (hq, hkv, dim) != CANONICAL_GEOMETRY:
        raise ValueError(
            f"warp_specialized needs the canonical geometry Hq, Hkv, D = {CANONICAL_GEOMETRY}, got {(hq, hkv, dim)}"
        )
    if kv_layout == "physical" and query.dtype != torch.bfloat16:
        raise ValueError(
            f"selected_kv_indices runs natively on bfloat16 query/key/value, got {query.dtype}; use backend='reference'"
        )
    C.vector_layout("key", key)
    C.vector_layout("value", value)
    if fp8 and not warp_offsets_fit(key, value):
        raise ValueError(
            "backend='tilelang' reads FP8 key/value whose views span under 32 GiB (the small-CTA program's int32 row "
            f"offsets); key spans {_span_bytes(key)} bytes, value {_span_bytes(value)}: split the pool or use backend='reference'"
        )


def _debug_values(query, key, indices, kv_layout, n_req, block_indices, compact, cu_seqlens_q, token_to_req,
                  cu_seqlens_k, seq_lens_q, seq_lens_k, block_table):
    """MATE_DEBUG_CHECKS: the metadata values the native path trusts or masks (see mate/_debug.py)."""
    if kv_layout == "physical":
        _debug.in_range("selected_kv_indices", indices, -1, key.shape[0], f" (key holds {key.shape[0]} rows)")
        return
    rows = query.shape[0] if query.dim() == 3 else query.shape[1]
    if query.dim() == 3:
        _debug.request_rows(rows, n_req, cu_seqlens_q, token_to_req)
    if kv_layout == "paged":
        cap = block_table.shape[1] * key.shape[1]
        _debug.in_range("block_table", block_table, -1, key.shape[0], f" (the pool holds {key.shape[0]} pages)")
    elif kv_layout == "varlen":
        _debug.offsets("cu_seqlens_k", cu_seqlens_k.long(), key.shape[0], exact=True)
        cap = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if n_req else 0
    else:
        cap = key.shape[1]
    _debug.in_range("token_indices", indices, -1, cap, f" (the cache holds {cap} tokens a request)")
    _debug.lengths("seq_lens_k", seq_lens_k, cap, "tokens a request's cache holds")
    _debug.lengths("seq_lens_q", seq_lens_q, rows, "rows")
    if block_indices is not None:
        _debug.block_hint(indices, block_indices, compact)


def reference_run(p: Problem):
    k, v, dequant = p.key, p.value, None
    if p.kv.fp8:
        kd, ks, vs = p.kv.kv_dtype, p.kv.k_value(p.key), p.kv.v_value(p.value)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        dequant = lambda ki, vi: (C.dequantized(ki.view(kd), ks), C.dequantized(vi.view(kd), vs))  # noqa: E731
    res, res_lse = reference.sparse_attention(
        p.query, k, v, p.indices, physical=p.kv_layout == "physical", n_req=p.n_req,
        cu_seqlens_q=p.cu_seqlens_q, token_to_req=p.token_to_req, cu_seqlens_k=p.cu_seqlens_k,
        seq_lens_q=p.seq_lens_q, seq_lens_k=p.seq_lens_k, query_positions=p.query_positions,
        block_table=p.block_table, scale=p.scale, dequant=dequant,
    )
    res = _reference.apply_gate(res, p.gate)
    out = res.to(p.query.dtype) if p.out is None else p.out.copy_(res)
    res_lse = res_lse if p.lse is None else p.lse.copy_(res_lse)
    return (out, res_lse) if p.return_lse else out


# ---------------------------------------------------------------- native path

ATTENTION = _dispatch.STAGES["qsa_attention"]
WARP_ATTENTION = _dispatch.STAGES["qsa_attention_warp"]
MAX_SPLITS = 64


def _rows(name: str, x: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    """x with its `lead` leading (batch/query) axes as one row axis, without copying."""
    if x is None or lead == 1:
        return x
    try:
        return x.view(math.prod(x.shape[:lead]), *x.shape[lead:])  # not -1: ambiguous when x is empty
    except RuntimeError:
        raise ValueError(
            f"{name}'s batch and query axes must collapse to a zero-copy row view (strides {tuple(x.stride())} for shape "
            f"{tuple(x.shape)}); pass flattened tensors instead"
        ) from None


def choose_splits(rows_x_heads: int, tiles: int, sms: int) -> int:
    """SplitKV count for `num_splits=None`, at least 2 tiles a split: up to one CTA an SM, as many splits as
    fill that wave; past it (up to 8 row-heads an SM), 2 splits; past that (prefill), none.

    Measured on the H200 (benchmarks/results/qsa_attention_h200.json, 2051 tokens = 33 tiles a row,
    times in us for splits 1/2/4/8/16): batch 1 (2 row-heads) 82/60/43/35/34; batch 8 (16)
    82/61/45/39/59; batch 64 (128) 95/126/167/229/338. With a merge fused into the attention launch
    (since dropped: two launches were faster; benchmarks/results/NVIDIA_H200-2026-12-01-qsa-issue16-decode.md,
    cold graph, splits as run): batch 1 11/17/33: 31.0/34.0/40.3; batch 8 7/11/17/33: 37.6/51.2/50.8/66.1.
    Past one wave, since the split kernel waits on separate K and V barriers (2026-12-03; cold graph,
    splits 1/2/3/4; batches >= 256 share a 512-page pool): batch 64 96.4/98.1/106.1/100.5, 96
    157.7/139.3/151.8/137.7, 128 176.0/159.3/165.7/169.6, 160 262.7/208.4/205.0/207.0, 192
    263.9/234.1/251.6/248.6, 256 227.1/221.4/232.2/241.9, 384 335.5/325.6/341.6/353.1, 512
    440.4/421.3/443.0/457.0 (benchmarks/results/NVIDIA_H200-2026-12-03-qsa-kv-split.md): two one-stage
    CTAs an SM with half the tiles each beat whole-row CTAs that one wave cannot hold. At 12 / 1 heads (one
    tensor-parallel rank; same file) the rule's count was the fastest timed at rows 64 / 128 / 256 / 512.
    """
    if rows_x_heads > sms:
        return max(1, min(tiles // 2, 2 if rows_x_heads <= 8 * sms else 1))
    return max(1, min(tiles // 2, MAX_SPLITS, sms // max(1, rows_x_heads)))


def split_tiles(tiles: int, num_splits: int) -> tuple[int, int]:
    """(tiles a split, splits) for at most num_splits splits of `tiles` key tiles: no split without a tile."""
    per_split = -(-tiles // max(1, min(num_splits, tiles)))
    return per_split, -(-tiles // per_split)


def cluster_splits(rows_x_heads: int, tiles: int, splits: int, chosen: bool, whole_sm_clusters) -> int:
    """The split count of a cluster launch (the splits of a (row, KV head) as one thread-block cluster that
    merges its partials in the launch, mate.qsa.kernels.sparse), or 0 for the two launches (attention, merge).

    A cluster launch is taken only where every cluster runs at once (`whole_sm_clusters(c)`: how many clusters
    of c whole-SM CTAs the GPU holds): a second wave would cost a whole CTA's time. For a count the caller
    chose (`chosen` False) that is all; choose_splits' count may instead drop to the most splits whose
    clusters fit, if that costs each split at most one more tile: the in-launch merge saved more than a tile
    (H200, cold graph: rows 8, 7 splits of 5 tiles 26.6 us in two launches, 6 splits of 6 tiles 24.8 us as a
    cluster; clusters of 7 do not all fit there, 38.1 us. Rows 1, 11 splits: 16.1 against 15.8 us;
    benchmarks/results/NVIDIA_H200-2026-12-02-qsa-cluster.md)."""
    per_split = -(-tiles // splits)
    for c in range(min(splits, _hopper.MAX_CLUSTER), 1, -1):
        if rows_x_heads <= whole_sm_clusters(c):
            per, c = split_tiles(tiles, c)
            return c if c > 1 and (c == splits or chosen and per <= per_split + 1) else 0
        if not chosen:
            break
    return 0




def _native_rows(query, indices, block_indices, query_positions, gate, out, lse, return_lse) -> NativeRows:
    """The target and the row views the kernels take; allocates out and lse where the caller passed none."""
    target = _dispatch.target_of(query, "query")
    dev = query.device
    lead = query.dim() - 2
    q = _rows("query", query, lead)
    ti = _rows("token_indices", indices, lead)
    bi = _rows("block_indices", block_indices, lead)
    qp = None if query_positions is None else _rows("query_positions", query_positions.unsqueeze(-1), lead).squeeze(-1)
    if out is None:
        out = torch.empty_like(query)
    o = _rows("out", out, lead)
    want_lse = return_lse or lse is not None
    if want_lse and lse is None:
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=dev)
    stand_in = _dispatch.Placeholders(dev)
    lse_rows = _rows("lse", lse, lead) if want_lse else stand_in(torch.float32, 2)
    g = None if gate is None else merge.gate_rows(_rows("gate", gate, lead), query.dtype, (q.shape[0], *query.shape[-2:]))
    return NativeRows(target, out, lse, q, ti, bi, qp, o, lse_rows, g, stand_in)


# The small-CTA family's splits hold MIN_SPLIT_TILES tiles or more (the last one fewer). H100, issue 37's inputs on
# e4m3 / e5m2 caches, rows 1 (2 row-heads, 129 tiles), cold graph: 129 splits of one tile 30.7 / 30.4 us, 33 of
# four 25.1 / 24.9, 16 33.2 / 32.7; rows 8: 41 splits 32.4, 33 32.3 (NVIDIA_H100-2026-12-05-qsa-fp8-fp16-mma.md).
MIN_SPLIT_TILES = 4
# Past one wave, two splits run about 10% longer a wave than one (their partials written and merged): they must
# end at least that much sooner (warp_splits).
TWO_SPLIT_GAIN = 0.9


def warp_splits(rows_x_heads: int, tiles: int, sms: int, resident: int) -> int:
    """SplitKV count of the small-CTA family for `num_splits=None`: the most splits whose grid still fits one
    wave of `resident` CTAs an SM (a second, partial wave costs a whole CTA's time), no split of fewer than
    MIN_SPLIT_TILES tiles but the last;
    past one wave, 2 splits only where they end at least 10% sooner than 1 (TWO_SPLIT_GAIN; in waves of one
    split's CTA time).

    Cold graph, us, issue 37's inputs, per-element gate (1 / 2 splits; the count this picks first): H200
    2026-12-04, rows 64 (128 row-heads, 5 fit a wave) 186.5 / 104.4, 5 splits 99.4; rows 256 (512 row-heads)
    281.9 / 306.8; prefill (8192 row-heads: 13 waves in one split, 12.5 in two) 2410 / 2460
    (benchmarks/results/NVIDIA_H200-2026-12-04-qsa-small-cta.md). H100 2026-12-07, the gate's fast division
    (mate._tl.times_sigmoid): prefill 2371 / 2518 (benchmarks/results/NVIDIA_H100-2026-12-07-qsa-gate.md)."""
    wave = resident * sms
    if rows_x_heads <= wave:
        return max(1, min(-(-tiles // MIN_SPLIT_TILES), wave // max(1, rows_x_heads)))
    waves = lambda s: -(-rows_x_heads * s // wave) / s  # noqa: E731
    return 2 if tiles >= 2 and waves(2) <= TWO_SPLIT_GAIN * waves(1) else 1


def family(rows_x_heads: int, sms: int) -> str:
    """Which program runs a call: 'warp' (mate.qsa.kernels.sparse_warp, small CTAs) or 'wgmma'
    (mate.qsa.kernels.sparse, warp-specialized, with cluster launches for decode).

    H200, issue 37's inputs, cold graph, us (wgmma / warp at the count warp_splits picks): rows 1 16.2 / 29.6,
    rows 8 25.2 / 33.0 (the warp program of 2026-12-04 noon); rows 64 (128 row-heads) 101.8 / 99.2, rows 256
    302.4 / 285.2, prefill 3370 / 2452 (its evening version, one run).
    So small CTAs from half a wave of row-heads on (between 16 and 128 row-heads nothing was measured)."""
    return "warp" if rows_x_heads > sms // 2 else "wgmma"


def _span_bytes(t: torch.Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()


def warp_offsets_fit(*caches: torch.Tensor) -> bool:
    """Whether the small-CTA program can address every row of these K/V views: it keeps row offsets as int32
    counts of 16 bytes (their ring in shared memory at half the bytes is what fits a fifth CTA an SM), so a
    BF16 view reaching 32 GiB or past runs on the wgmma family instead (an FP8 one is refused)."""
    return all(_span_bytes(t) // 16 < 2**31 for t in caches)


def native(p: Problem):
    r = p.rows
    dev = p.query.device
    hq, dim = p.query.shape[-2:]
    hkv = p.key.shape[-2]
    rows = r.q.shape[0]
    want_lse = r.lse is not None
    k4, v4 = (p.key.unsqueeze(0), p.value.unsqueeze(0)) if p.kv_layout == "physical" else (p.key, p.value)
    flags = (
        (kernels.HAS_SEQ_LENS_Q if p.seq_lens_q is not None else 0)
        | (kernels.HAS_SEQ_LENS_K if p.seq_lens_k is not None else 0)
        | (kernels.HAS_POSITIONS if r.query_positions is not None else 0)
        | (kernels.PAGED if p.kv_layout == "paged" else 0)
        | (kernels.HAS_BLOCKS if r.block_indices is not None else 0)
        | (kernels.COMPACT_BLOCKS if p.compact else 0)
        | (kernels.WRITE_LSE if want_lse else 0)
    )
    if p.kv_layout == "physical":
        row_mode, rowmap = kernels.ROW_PHYSICAL, None
    elif p.query.dim() == 4:
        row_mode, rowmap = kernels.ROW_PADDED, None
    elif p.cu_seqlens_q is not None:
        row_mode, rowmap = kernels.ROW_CU, p.cu_seqlens_q
    else:
        row_mode, rowmap = kernels.ROW_TOKEN_TO_REQ, p.token_to_req
    q_len = p.query.shape[1] if p.query.dim() == 4 else 1
    width = r.indices.shape[-1]
    sms = _dispatch.sm_count(dev)
    result = (r.out, r.lse) if p.return_lse else r.out
    if rows == 0:
        return result
    if width == 0:  # nothing selected anywhere
        r.o.zero_()
        if want_lse:
            r.lse_rows.fill_(float("-inf"))
        return result
    dtype = str(p.query.dtype).removeprefix("torch.")
    cluster = 0
    # FP8 caches run on the small-CTA family alone (its compile-time kv_dtype option)
    kv_dtype = str(p.kv.kv_dtype).removeprefix("torch.") if p.kv.fp8 else None
    warp = p.kv.fp8 or family(rows * hkv, sms) == "warp" and warp_offsets_fit(k4, v4)
    if warp:
        # the split entry's tiles size the splits; a call left with one split runs the unsplit entry
        wt = _dispatch.tiles(WARP_ATTENTION.name, {"dtype": dtype, "split": 1}, r.target)
        num_splits = p.num_splits
        if num_splits is None:
            smem = sparse_card.warp_attention_smem({"dtype": dtype}, wt, kv_dtype)
            resident = _hopper.SMEM_PER_SM // (smem + _hopper.SMEM_RESERVED_PER_CTA)
            num_splits = 1 if p.kv_layout == "padded" else warp_splits(rows * hkv, -(-width // wt["block_n"]), sms, resident)
        tile = wt["block_n"]
        per_split, splits = split_tiles(-(-width // tile), num_splits)
        spec = {"dtype": dtype, "split": int(splits > 1)}
        if splits == 1:
            tile = _dispatch.tiles(WARP_ATTENTION.name, spec, r.target)["block_n"]
            per_split = -(-width // tile)
        attend = _dispatch.kernel(WARP_ATTENTION.name, spec, r.target, **({"kv_dtype": kv_dtype} if kv_dtype else {}))
        q = r.q if not C.layout_problems(r.q) else r.q.contiguous()  # its rows load as 16-byte vectors
    else:
        tile = kernels.TILE
        tiles = -(-width // tile)
        num_splits = p.num_splits
        if num_splits is None:
            num_splits = 1 if p.kv_layout == "padded" else choose_splits(rows * hkv, tiles, sms)
        per_split, splits = split_tiles(tiles, num_splits)
        fits = functools.partial(_hopper.whole_sm_clusters, dev.index)
        cluster = cluster_splits(rows * hkv, tiles, splits, p.num_splits is None, fits)
        if cluster:
            per_split, splits = split_tiles(tiles, cluster)
        # A grid of two CTAs or more per SM runs best with a shallow K/V ring, so that two CTAs fit an SM;
        # a smaller one with the deep ring (configs/sm90.yaml has the measurements).
        wide = rows * hkv * splits >= 2 * sms
        spec = {"dtype": dtype, "split": int(splits > 1), "wide": int(wide)}
        attend = _dispatch.kernel(ATTENTION.name, spec, r.target, **({"cluster": cluster} if cluster else {}))
        q = r.q
    chunk = per_split * tile

    opt = lambda x, ndim: r.stand_in(torch.int32, ndim) if x is None else x  # noqa: E731
    g, gh, flags = merge.gate_buffers(r.gate, p.query.dtype, r.stand_in, flags)
    meta = (r.indices, opt(r.block_indices, 2), opt(p.block_table, 2), opt(rowmap, 1), opt(p.seq_lens_q, 1),
            opt(p.seq_lens_k, 1), opt(r.query_positions, 1), g, gh)
    if warp:
        # the dequant scales: floats fold into the scores' factor and the output's, tensors the kernel reads
        ks, vs = (r.stand_in(torch.float32, 1) if t is None else t for t in (p.kv.k_tensor, p.kv.v_tensor))
        flags |= (kernels.K_SCALE_DEV if p.kv.k_tensor is not None else 0) | (kernels.V_SCALE_DEV if p.kv.v_tensor is not None else 0)
        args = (p.scale * p.kv.k, row_mode, flags, p.n_req or 1, q_len, chunk, ks, vs, p.kv.v)
    else:
        args = (p.scale, row_mode, flags, p.n_req or 1, q_len, chunk)
    if splits == 1 or cluster:
        attend(q, k4, v4, *meta, r.o, r.lse_rows, *args)
    else:
        part_o = torch.empty((splits, rows, hq, dim), dtype=torch.float32, device=dev)
        part_lse = torch.empty((splits, rows, hq), dtype=torch.float32, device=dev)
        attend(q, k4, v4, *meta, part_o, part_lse, *args)
        merge.launch(part_o, part_lse, r.gate, r.o, r.lse_rows, flags, r.target, r.stand_in)
    return result
