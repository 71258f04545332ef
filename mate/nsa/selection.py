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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _debug, _dispatch
from mate.nsa import reference
from mate.nsa.kernels.selection_card import NATIVE_BLOCK_SIZES, NATIVE_DIMS
kernels = _dispatch.lazy_module("mate.nsa.kernels.selection")  # imported, with TileLang, at the first native call

STAGE = _dispatch.STAGES["nsa_selection"]


def nsa_selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    block_size: int = 64,
    block_counts: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: str = "tilelang",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA selection attention forward: returns (o [B, M, H, D], lse [B, H, M] FP32).

    q [B, M, H, D]; k, v [B, N, G, D] with H a multiple of G; block_indices
    int32 [B, M, G, T] (block j covers keys j*block_size .. (j+1)*block_size - 1);
    block_counts int32 [B, M, G], optional: only the first block_counts slots
    of a row are used. scale multiplies q . k (default 1/sqrt(D)). out and lse,
    when given, are written in place and returned as given.

    backend="tilelang" (native, CUDA on sm90): FP16/BF16, D 64 or 128,
    block_size 32 or 64, H/G from 1 to 16, T <= 128; q, k, v and out follow
    the vector-load layout rule (unit feature stride, 16-byte aligned rows).
    backend="reference": the FP32 PyTorch oracle, any device, dtype, D and
    block_size.
    """
    problem = _resolve(**locals())  # first statement: locals() is exactly the parameters
    return _native(problem) if problem.backend == "tilelang" else _reference(problem)


class Problem(NamedTuple):
    """One nsa_selection_attention call, resolved and checked (immutable, built once per call);
    spec and target are set for backend='tilelang' only."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_indices: torch.Tensor
    block_counts: torch.Tensor | None
    block_size: int
    scale: float
    group_heads: int
    out: torch.Tensor | None
    lse: torch.Tensor | None
    spec: dict | None
    target: str | None


def _resolve(q, k, v, block_indices, *, block_size, block_counts, scale, out, lse, backend) -> Problem:
    """Every check of nsa_selection_attention, in one order: inputs, indices, scalars, output
    buffers, devices and overlap, the debug value checks, the native limits."""
    backend = _dispatch.backend(backend)
    C.tensor("q", q, ndim=4)
    C.floating("q", q)
    C.tensor("k", k, ndim=4)
    C.floating("k", k)
    C.tensor("v", v, ndim=4)
    C.floating("v", v)
    C.same_dtype(q=q, k=k, v=v)
    B, M, H, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k must be [B, N, G, D] with B = {B} and D = {D} as in q, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    N, G = k.shape[1], k.shape[2]
    if G == 0 or H % G:
        raise ValueError(f"q's heads ({H}) must be a positive multiple of k's KV groups ({G})")
    group_heads = H // G
    C.int32("block_indices", block_indices, ndim=4)
    if tuple(block_indices.shape[:3]) != (B, M, G):
        raise ValueError(f"block_indices must be [B, M, G, T] = [{B}, {M}, {G}, T], got {tuple(block_indices.shape)}")
    n_slots = block_indices.shape[3]
    C.optional_int32("block_counts", block_counts, shape=(B, M, G))
    block_size = C.positive_int("block_size", block_size)
    mult = C.score_multiplier(scale, None, D)
    if out is not None:
        C.out_buffer("out", out, shape=(B, M, H, D), dtype=q.dtype, device=q.device)
    if lse is not None:
        C.out_buffer("lse", lse, shape=(B, H, M), dtype=torch.float32, device=q.device)
    C.same_device(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts, out=out, lse=lse)
    C.no_overlap({"out": out, "lse": lse}, {"q": q, "k": k, "v": v, "block_indices": block_indices, "block_counts": block_counts})
    if _debug.enabled():
        n_blocks = -(-N // block_size)
        _debug.in_range("block_indices", block_indices, -1, n_blocks, f" (k holds {n_blocks} blocks of {block_size})")
        _debug.lengths("block_counts", block_counts, n_slots, "slots a row holds")
    spec = target = None
    if backend == "tilelang":
        spec, target = _native_limits(q, k, v, out, n_slots, block_size, group_heads)
    return Problem(backend, q, k, v, block_indices, block_counts, block_size, mult, group_heads, out, lse, spec, target)


def _native_limits(q, k, v, out, n_slots: int, block_size: int, group_heads: int) -> tuple[dict, str]:
    """What the native kernel runs (raises ValueError for the rest); returns its specialization and target."""
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
        H, G = q.shape[2], k.shape[2]
        raise ValueError(
            f"backend='tilelang' supports up to {tiles['head_tile']} query heads per KV group, got H/G = {H}/{G} = {group_heads}; "
            "use backend='reference'"
        )
    return spec, target


def _reference(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    o_ref, lse_ref = reference.selection_attention(p.q, p.k, p.v, p.block_indices, p.block_counts, p.block_size, p.scale)
    out = o_ref.to(p.q.dtype) if p.out is None else p.out.copy_(o_ref)
    lse = lse_ref if p.lse is None else p.lse.copy_(lse_ref)
    return out, lse


def _native(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    q, block_counts = p.q, p.block_counts
    B, M, H, D = q.shape
    out = torch.empty(B, M, H, D, dtype=q.dtype, device=q.device) if p.out is None else p.out
    lse = torch.empty(B, H, M, dtype=torch.float32, device=q.device) if p.lse is None else p.lse
    if B * M * H == 0:
        return out, lse
    if p.k.shape[1] == 0 or p.block_indices.shape[3] == 0:  # nothing can be visible
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    kern = _dispatch.kernel(STAGE.name, p.spec, p.target)
    # Without block_counts the kernel never reads its counts argument; any int32 [B, M, G] view will do.
    counts = block_counts if block_counts is not None else p.block_indices[..., 0]
    kern(
        C.canonical_unit_strides(q),
        C.canonical_unit_strides(p.k),
        C.canonical_unit_strides(p.v),
        p.block_indices,
        counts,
        C.canonical_unit_strides(out),
        lse,
        p.scale,
        p.group_heads,
        int(block_counts is not None),
    )
    return out, lse
