"""NSA selection attention forward (the selection branch of DeepSeek's Native Sparse Attention).

Each query attends only to the key blocks its KV group selected:

    O[b, m, h]   = softmax over the used keys of (scale * q . k) applied to V
    LSE[b, h, m] = natural-log log-sum-exp of those scaled scores (FP32)

with heads g*H/G .. (g+1)*H/G - 1 sharing group g's K, V and block_indices.
A slot t of block_indices[b, m, g] is used iff t < block_counts[b, m, g] (when
given) and its block j satisfies 0 <= j and j * block_size <= N - M + m: the
query sits at position N - M + m (causal, bottom-right aligned), so -1 pads,
out-of-range and wholly future blocks are skipped, never read. Inside a used
block, keys past the query's position are masked. Duplicate slots count once
each. A query with nothing visible gets output 0 and LSE -inf.

Packed sequences (cu_seqlens): token rows of several sequences back to back,
each a problem of its own with M = N (so a token's position is its index in
its sequence) and block ids local to it.

Training: on inputs that require grad the call is differentiable in q, k and
v (torch.autograd; lse, block_indices and block_counts are not). The native
backward recomputes the probabilities from the saved LSE:
delta = rowsum(dO * O), then dq per query (one CTA per query and KV group,
walking its selected blocks), then dk and dv per selected key block (one CTA
per key block and KV group, walking the queries that selected it, which a
stable sort of the used slots lists). Every dk/dv row is written by one CTA,
in a fixed order: no atomics, and the gradients are bitwise deterministic.
The forward's config entry may name `queries` = W > 1 (none shipped does yet): then one CTA takes W
consecutive query rows and gathers the union of their selected blocks once
(mate/nsa/kernels/selection_shared.py, T <= 16 and block_size 64; other calls take the one-query program).
Atomics are not offered: one kernel adding each query's dk/dv tiles into an FP32 workspace measured
2.3-4.8x slower than this on the H200 (benchmarks/results/NVIDIA_H200-2026-12-01-nsa-bwd-atomics.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _debug, _dispatch
from mate.nsa import reference
from mate.nsa.kernels.selection_card import NATIVE_BLOCK_SIZES, NATIVE_DIMS, SHARED_SLOTS, TILE_KEYS
kernels = _dispatch.lazy_module("mate.nsa.kernels.selection")  # imported, with TileLang, at the first native call

STAGE = _dispatch.STAGES["nsa_selection"]
BWD_DQ = _dispatch.STAGES["nsa_selection_bwd_dq"]
BWD_DKV = _dispatch.STAGES["nsa_selection_bwd_dkv"]


def nsa_selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    block_size: int = 64,
    block_counts: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: str = "tilelang",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA selection attention: returns (o [B, M, H, D], lse [B, H, M] FP32).

    q [B, M, H, D]; k, v [B, N, G, D] with H a multiple of G; block_indices
    int32 [B, M, G, T] (block j covers keys j*block_size .. (j+1)*block_size - 1);
    block_counts int32 [B, M, G], optional: only the first block_counts slots
    of a row are used. scale multiplies q . k (default 1/sqrt(D)). out and lse,
    when given, are written in place and returned as given.

    Packed sequences: with cu_seqlens (int32 [S + 1], offsets from 0 to the
    token count, nondecreasing; the values are checked under mate.debug_checks
    only) q is [T_total, H, D], k and v [T_total, G, D], block_indices
    [T_total, G, T] with block ids local to each sequence, block_counts
    [T_total, G]; o is [T_total, H, D] and lse [H, T_total]. A token at index i
    of its sequence sees the keys 0..i of that sequence.

    Differentiable in q, k and v when one of them requires grad (then out and
    lse buffers are refused); lse is returned non-differentiable.

    backend="tilelang" (native, CUDA on sm90): FP16/BF16, D 64 or 128,
    block_size 32 or 64, H/G from 1 to 16, T <= 128, forward and backward;
    q, k, v and out follow the vector-load layout rule (unit feature stride,
    16-byte aligned rows).
    backend="reference": the FP32 PyTorch oracle, any device, dtype, D and
    block_size, forward and backward.
    """
    p = _resolve(**locals())  # first statement: locals() is exactly the parameters
    if p.grad:
        o4, lse4 = _Function.apply(p.q, p.k, p.v, p)
    else:
        o4, lse4 = _forward(p)
    if p.cu_seqlens is None:
        return o4, lse4
    return (o4[0] if out is None else out), (lse4[0] if lse is None else lse)


class Problem(NamedTuple):
    """One nsa_selection_attention call, resolved and checked (immutable, built once per call).

    Tensors are in the padded form: packed sequences (cu_seqlens) are one batch row
    ([1, T_total, ...] views, lse [1, H, T_total]). spec and target are set for
    backend='tilelang' only; grad: autograd records the call."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_indices: torch.Tensor
    block_counts: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    block_size: int
    scale: float
    group_heads: int
    out: torch.Tensor | None
    lse: torch.Tensor | None
    spec: dict | None
    target: str | None
    grad: bool


def _resolve(q, k, v, block_indices, *, block_size, block_counts, cu_seqlens, scale, out, lse, backend) -> Problem:
    """Every check of nsa_selection_attention, in one order: inputs, indices, scalars, output
    buffers, devices and overlap, the debug value checks, the native limits."""
    backend = _dispatch.backend(backend)
    packed = cu_seqlens is not None
    if packed:
        C.int32("cu_seqlens", cu_seqlens, ndim=1)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must hold S + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    rank = 3 if packed else 4
    C.tensor("q", q, ndim=rank)
    C.floating("q", q)
    C.tensor("k", k, ndim=rank)
    C.floating("k", k)
    C.tensor("v", v, ndim=rank)
    C.floating("v", v)
    C.same_dtype(q=q, k=k, v=v)
    if packed:
        if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
            raise ValueError(f"k must be [T_total, G, D] with T_total = {q.shape[0]} and D = {q.shape[-1]} as in q, got {tuple(k.shape)}")
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    else:
        q4, k4, v4 = q, k, v
    B, M, H, D = q4.shape
    if not packed and (k.shape[0] != B or k.shape[-1] != D):
        raise ValueError(f"k must be [B, N, G, D] with B = {B} and D = {D} as in q, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    N, G = k4.shape[1], k4.shape[2]
    if G == 0 or H % G:
        raise ValueError(f"q's heads ({H}) must be a positive multiple of k's KV groups ({G})")
    group_heads = H // G
    rows = (M,) if packed else (B, M)
    C.int32("block_indices", block_indices, ndim=rank)
    if tuple(block_indices.shape[:-1]) != (*rows, G):
        want = f"[T_total, G, T] = [{M}, {G}, T]" if packed else f"[B, M, G, T] = [{B}, {M}, {G}, T]"
        raise ValueError(f"block_indices must be {want}, got {tuple(block_indices.shape)}")
    n_slots = block_indices.shape[-1]
    C.optional_int32("block_counts", block_counts, shape=(*rows, G))
    block_size = C.positive_int("block_size", block_size)
    mult = C.score_multiplier(scale, None, D)
    if out is not None:
        C.out_buffer("out", out, shape=q.shape, dtype=q.dtype, device=q.device)
    if lse is not None:
        C.out_buffer("lse", lse, shape=(H, M) if packed else (B, H, M), dtype=torch.float32, device=q.device)
    C.same_device(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts, cu_seqlens=cu_seqlens, out=out, lse=lse)
    C.no_overlap({"out": out, "lse": lse},
                 {"q": q, "k": k, "v": v, "block_indices": block_indices, "block_counts": block_counts, "cu_seqlens": cu_seqlens})
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad and (out is not None or lse is not None):
        raise ValueError("out and lse buffers are not supported when q, k or v require grad (the call is recorded for autograd); "
                         "leave them None, or call under torch.no_grad()")
    if _debug.enabled():
        if packed:
            _debug.offsets("cu_seqlens", cu_seqlens, M, exact=True)
        n_blocks = -(-N // block_size)
        _debug.in_range("block_indices", block_indices, -1, n_blocks, f" (k holds {n_blocks} blocks of {block_size})")
        _debug.lengths("block_counts", block_counts, n_slots, "slots a row holds")
    spec = target = None
    if backend == "tilelang":
        spec, target = _native_limits(q, k, v, out, n_slots, block_size, group_heads, grad)
    unsq = (lambda x: None if x is None else x.unsqueeze(0)) if packed else (lambda x: x)  # noqa: E731
    return Problem(backend, q4, k4, v4, unsq(block_indices), unsq(block_counts), cu_seqlens, block_size, mult, group_heads,
                   unsq(out), unsq(lse), spec, target, grad)


def _native_limits(q, k, v, out, n_slots: int, block_size: int, group_heads: int, grad: bool) -> tuple[dict, str]:
    """What the native kernels run (raises ValueError for the rest); returns their specialization and target."""
    D = q.shape[-1]
    C.native_dtype("q", q)
    if D not in NATIVE_DIMS:
        raise ValueError(
            f"backend='tilelang' supports head dim {' or '.join(map(str, NATIVE_DIMS))}, got q with D = {D}; use backend='reference'"
        )
    if block_size not in NATIVE_BLOCK_SIZES:
        raise ValueError(
            f"backend='tilelang' supports block_size {' or '.join(map(str, NATIVE_BLOCK_SIZES))}, got {block_size}; "
            "use backend='reference'"
        )
    if n_slots > kernels.MAX_SLOTS:
        raise ValueError(
            f"backend='tilelang' supports at most {kernels.MAX_SLOTS} selected blocks per row, got block_indices with "
            f"T = {n_slots}; use backend='reference'"
        )
    C.vector_layout("q", q)
    C.vector_layout("k", k)
    C.vector_layout("v", v)
    if out is not None:
        C.vector_layout("out", out)
    target = _dispatch.target_of(q, "q")
    spec = {"dtype": str(q.dtype).removeprefix("torch."), "dim": D, "block_size": block_size}
    tiles = _dispatch.tiles(STAGE.name, spec, target)
    if group_heads > tiles["head_tile"]:
        H, G = q.shape[-2], k.shape[-2]
        raise ValueError(
            f"backend='tilelang' supports up to {tiles['head_tile']} query heads per KV group, got H/G = {H}/{G} = {group_heads}; "
            "use backend='reference'"
        )
    for stage in (BWD_DQ, BWD_DKV) if grad else ():
        _dispatch.tiles(stage.name, spec, target)  # the backward's entries exist (raises naming the supported set)
    return spec, target


def _forward(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    return _native(p) if p.backend == "tilelang" else _reference(p)


def _reference(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    if p.cu_seqlens is None:
        o_ref, lse_ref = reference.selection_attention(p.q, p.k, p.v, p.block_indices, p.block_counts, p.block_size, p.scale)
    else:
        counts = None if p.block_counts is None else p.block_counts[0]
        o_ref, lse_ref = reference.varlen_selection_attention(p.q[0], p.k[0], p.v[0], p.block_indices[0], counts, p.cu_seqlens,
                                                              p.block_size, p.scale)
        o_ref, lse_ref = o_ref[None], lse_ref[None]
    out = o_ref.to(p.q.dtype) if p.out is None else p.out.copy_(o_ref)
    lse = lse_ref if p.lse is None else p.lse.copy_(lse_ref)
    return out, lse


def _sequence_starts(cu_seqlens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token row: the index of its sequence (int64) and the row where that sequence starts (int32);
    device work only (graph-capturable)."""
    token = torch.arange(rows, device=cu_seqlens.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens[1:], token, right=True).clamp_max_(cu_seqlens.shape[0] - 1)
    return seq, cu_seqlens[seq]


def _any_visible(p: Problem) -> bool:
    """False when no key can be visible to any row (no keys, or no slots): then no kernel runs."""
    return p.k.shape[1] > 0 and p.block_indices.shape[3] > 0


def _forward_options(p: Problem) -> dict:
    """{} (the entry's program), or queries=1 where the entry asks for the shared program (queries > 1: a CTA of
    W queries gathers the union of their blocks once) and the call exceeds it: more than SHARED_SLOTS slots a
    row, or a block size other than 64. The shipped entries leave queries at 1."""
    if _dispatch.tiles(STAGE.name, p.spec, p.target)["queries"] == 1:
        return {}
    if p.block_indices.shape[3] > SHARED_SLOTS or p.block_size != TILE_KEYS:
        return {"queries": 1}
    return {}


def _native(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    q, block_counts = p.q, p.block_counts
    B, M, H, D = q.shape
    out = torch.empty(B, M, H, D, dtype=q.dtype, device=q.device) if p.out is None else p.out
    lse = torch.empty(B, H, M, dtype=torch.float32, device=q.device) if p.lse is None else p.lse
    if B * M * H == 0:
        return out, lse
    if not _any_visible(p):
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    kern = _dispatch.kernel(STAGE.name, p.spec, p.target, **_forward_options(p))
    # Without block_counts the kernel never reads its counts argument; any int32 [B, M, G] view will do;
    # likewise the sequence starts without cu_seqlens.
    counts = block_counts if block_counts is not None else p.block_indices[..., 0]
    starts = _sequence_starts(p.cu_seqlens, M)[1] if p.cu_seqlens is not None else _dispatch.Placeholders(q.device)(torch.int32, 1)
    kern(
        C.canonical_unit_strides(q),
        C.canonical_unit_strides(p.k),
        C.canonical_unit_strides(p.v),
        p.block_indices,
        counts,
        C.canonical_unit_strides(out),
        lse,
        starts,
        p.scale,
        p.group_heads,
        int(block_counts is not None),
        int(p.cu_seqlens is not None),
    )
    return out, lse


# ---------------------------------------------------------------- backward


class _Function(torch.autograd.Function):
    """The forward as run without grad, saving what the backward needs (o and the LSE); lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, p: Problem):
        o, lse = _forward(p)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, o, lse, p.block_indices, p.block_counts, p.cu_seqlens)
        ctx.problem = p._replace(q=None, k=None, v=None, block_indices=None, block_counts=None, cu_seqlens=None)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward itself is not differentiable (no double backward)
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, block_indices, block_counts, cu_seqlens = ctx.saved_tensors
        p = ctx.problem._replace(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts, cu_seqlens=cu_seqlens)
        return (*backward(p, o, lse, do), None)


def backward(p: Problem, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (in q's dtype, the padded form of p) from the forward's o and LSE and the output's gradient do."""
    if p.backend == "tilelang":
        return _native_backward(p, o, lse, do)
    if p.cu_seqlens is None:
        grads = reference.selection_attention_backward(p.q, p.k, p.v, o, lse, do, p.block_indices, p.block_counts, p.block_size,
                                                       p.scale)
    else:
        counts = None if p.block_counts is None else p.block_counts[0]
        grads = reference.varlen_selection_attention_backward(p.q[0], p.k[0], p.v[0], o[0], lse[0], do[0], p.block_indices[0], counts,
                                                              p.cu_seqlens, p.block_size, p.scale)
        grads = tuple(g[None] for g in grads)
    return tuple(g.to(p.q.dtype) for g in grads)


def _native_backward(p: Problem, o, lse, do):
    dq, dk, dv = _backward_buffers(p)
    if dq.numel() and _any_visible(p):
        a = _backward_args(p, o, lse, do, dq, dk, dv)
        launch_dq(p, a)
        launch_dkv(p, a)
    return dq, dk, dv


def _backward_buffers(p: Problem):
    """dq (every element written by the dq kernel), dk and dv (zeros: rows of blocks no query uses are not written)."""
    dq = torch.empty(p.q.shape, dtype=p.q.dtype, device=p.q.device)
    if not _any_visible(p):
        dq.zero_()
    dk = torch.zeros(p.k.shape, dtype=p.k.dtype, device=p.k.device)
    dv = torch.zeros(p.k.shape, dtype=p.k.dtype, device=p.k.device)
    return dq, dk, dv


def _backward_args(p: Problem, o, lse, do, dq, dk, dv) -> dict:
    """The two kernels' arguments on flat token rows, and the sorted per-block lists of selecting queries
    (device work only: no host sync)."""
    q, k, v = p.q, p.k, p.v
    B, M, H, D = q.shape
    N, G, n_slots = k.shape[1], k.shape[2], p.block_indices.shape[3]
    dev, bs = q.device, p.block_size
    TQ, TK = B * M, B * N
    flat = lambda x, heads: x.reshape(x.shape[0] * x.shape[1], heads, D)  # noqa: E731  views where the strides allow
    idx = p.block_indices.reshape(TQ, G, n_slots)
    counts = p.block_counts.reshape(TQ, G) if p.block_counts is not None else idx[..., 0]
    token = torch.arange(TQ, device=dev, dtype=torch.int32)
    # Per query row: its sequence, the flat key row where that sequence's keys start, its position there,
    # and the end of those keys.
    if p.cu_seqlens is None:
        seq = torch.div(token, M, rounding_mode="floor")
        key_base = (seq * N).int()
        pos = (N - M + token - seq * M).int()
        key_end = key_base + N
        n_seq = B
    else:
        seq, key_base = _sequence_starts(p.cu_seqlens, TQ)
        pos = token - key_base
        key_end = p.cu_seqlens[(seq + 1).clamp_max_(p.cu_seqlens.shape[0] - 1)]
        n_seq = p.cu_seqlens.shape[0] - 1
    # The queries of each used (key block, group), in a fixed order: a stable sort of the used slots by
    # (group, segment), where segment = block start // block_size + sequence index is one-to-one over a
    # group's blocks and below TK // block_size + n_seq.
    blk = idx.long()
    used = (blk >= 0) & (blk <= torch.where(pos >= 0, torch.div(pos, bs, rounding_mode="floor"), -1).view(TQ, 1, 1))
    if p.block_counts is not None:
        used &= torch.arange(n_slots, device=dev) < counts.unsqueeze(-1)
    start = torch.where(used, key_base.view(TQ, 1, 1).long() + blk * bs, 0)
    n_seg = TK // bs + n_seq
    seg = torch.arange(G, device=dev).view(1, G, 1) * n_seg + torch.div(start, bs, rounding_mode="floor") + seq.view(TQ, 1, 1)
    # int32 keys (G * n_seg is far below 2**31): half the radix sort's passes of int64 ones.
    order = torch.sort(torch.where(used, seg, G * n_seg).flatten().int(), stable=True)
    bounds = torch.searchsorted(order.values, torch.arange(G * n_seg + 1, device=dev, dtype=torch.int32)).int()
    return dict(
        q=flat(q, H), o=flat(o, H), do=flat(do.contiguous(), H), k=flat(k, G), v=flat(v, G), idx=idx.unsqueeze(0),
        counts=counts.unsqueeze(0), lse=lse.transpose(0, 1).reshape(H, TQ), key_base=key_base, pos=pos,
        dq=dq.view(TQ, H, D), delta=torch.empty(H, TQ, dtype=torch.float32, device=dev),
        lo=bounds[:-1].view(G, n_seg), hi=bounds[1:].view(G, n_seg),
        entry_query=torch.div(order.indices, G * n_slots, rounding_mode="floor").int(), entry_start=start.flatten()[order.indices].int(),
        last_row=key_base + pos, key_end=key_end, dk=dk.view(TK, G, D), dv=dv.view(TK, G, D),
    )


def launch_dq(p: Problem, a: dict) -> None:
    """delta = rowsum(dO * O) and dq (the dk/dv kernel reads delta)."""
    _dispatch.kernel(BWD_DQ.name, p.spec, p.target)(
        a["q"], a["o"], a["do"], a["k"].unsqueeze(0), a["v"].unsqueeze(0), a["idx"], a["counts"], a["lse"], a["key_base"], a["pos"], a["dq"], a["delta"],
        p.scale, p.group_heads, int(p.block_counts is not None))


def launch_dkv(p: Problem, a: dict) -> None:
    _dispatch.kernel(BWD_DKV.name, p.spec, p.target)(
        a["q"], a["do"], a["k"], a["v"], a["lse"], a["delta"], a["lo"], a["hi"], a["entry_query"], a["entry_start"], a["last_row"],
        a["key_end"], a["dk"], a["dv"], p.scale, p.group_heads)


# ---------------------------------------------------------------- the pieces torch.compile's ops run


def training_forward(q, k, v, block_indices, block_size, block_counts, cu_seqlens, scale, backend):
    """(o, lse) as nsa_selection_attention returns them, recorded for no autograd (the op registers its own)."""
    with torch.no_grad():
        p = _resolve(q, k, v, block_indices, block_size=block_size, block_counts=block_counts, cu_seqlens=cu_seqlens, scale=scale,
                     out=None, lse=None, backend=backend)
        o, lse = _forward(p)
    return (o, lse) if cu_seqlens is None else (o[0], lse[0])


def training_backward(do, q, k, v, o, lse, block_indices, block_size, block_counts, cu_seqlens, scale, backend):
    """dq, dk, dv of training_forward's call, in the shapes of q, k and v."""
    with torch.no_grad():
        p = _resolve(q, k, v, block_indices, block_size=block_size, block_counts=block_counts, cu_seqlens=cu_seqlens, scale=scale,
                     out=None, lse=None, backend=backend)
        if cu_seqlens is not None:
            do, o, lse = do.unsqueeze(0), o.unsqueeze(0), lse.unsqueeze(0)
        grads = backward(p, o, lse, do)
    return grads if cu_seqlens is None else tuple(g[0] for g in grads)
