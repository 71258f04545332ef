"""GQA forward attention, dense or sliding window: `gqa_attention` and the launcher `build_gqa_attn`.

Layout BSHD: q [B, Sq, H, D], k/v [B, Sk, H_kv, D], out [B, Sq, H, D], LSE [B, H, Sq]
(FP32, natural log). Query head h reads KV head h // (H // H_kv).

`sliding_window=(LEFT, RIGHT)`: query row i, at position p = i + Sk - Sq
(bottom-right aligned), sees the keys j with p - LEFT <= j <= p + RIGHT;
-1 leaves a side unbounded. None is full (non-causal) attention, (-1, 0)
causal; a Hugging Face window W is (W - 1, 0). A row that sees no key gets
output 0 and LSE -inf.

Native: BF16/FP16, D 64 or 128, any H divisible by H_kv, each tensor with a
unit feature stride and 16-byte aligned pointer and strides (TMA). One kernel
per (dtype, D, window class) serves every geometry, length and window of its
class: `none` (no window), `causal` (LEFT unbounded, RIGHT bounded) and
`local` (LEFT bounded).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _dispatch
from mate.swa import reference
from mate.swa.kernels.gqa_card import NATIVE_DIMS

LOG2E = 1.4426950408889634
# Stands for an unbounded window side in the kernel: larger than any distance
# between a query position and a key index (lengths are far below 2**30).
UNBOUNDED = 1 << 30

STAGE = _dispatch.STAGES["gqa_fwd"]


def parse_window(sliding_window) -> tuple[int, int]:
    """(LEFT, RIGHT) with -1 for an unbounded side; None -> (-1, -1)."""
    if sliding_window is None:
        return -1, -1
    if not isinstance(sliding_window, (tuple, list)) or any(isinstance(v, bool) or not isinstance(v, int) for v in sliding_window):
        raise TypeError(
            "sliding_window must be None or a (LEFT, RIGHT) pair of ints (-1 = unbounded; a Hugging Face "
            f"window W is (W - 1, 0)), got {sliding_window!r}"
        )
    if len(sliding_window) != 2:
        raise ValueError(f"sliding_window must be a (LEFT, RIGHT) pair, got {len(sliding_window)} values: {sliding_window!r}")
    left, right = sliding_window
    for name, v in (("LEFT", left), ("RIGHT", right)):
        if v < -1:
            raise ValueError(f"sliding_window {name} must be -1 (unbounded) or >= 0, got {v}")
    return left, right


def window_class(left: int, right: int) -> str:
    if left < 0:
        return "none" if right < 0 else "causal"
    return "local"


def _runtime(v: int) -> int:
    return UNBOUNDED if v < 0 else min(v, UNBOUNDED)


def _spec(dtype: torch.dtype, dim: int, left: int, right: int) -> dict:
    return {"dtype": str(dtype).removeprefix("torch."), "dim": dim, "window": window_class(left, right)}


def _native_dim(name: str, dim: int) -> None:
    if dim not in NATIVE_DIMS:
        raise ValueError(
            f"backend='tilelang' supports head dim {' or '.join(map(str, NATIVE_DIMS))} for {name}, got {dim}; "
            "use backend='reference' for other head dims"
        )


def _launch(q, k, v, o, lse, left, right, scale, target) -> None:
    """Run the native kernel on validated 4-D views; never reads device memory."""
    kern = _dispatch.kernel(STAGE.name, _spec(q.dtype, q.shape[-1], left, right), target)
    cu = C.canonical_unit_strides
    kern(cu(q), cu(k), cu(v), cu(o), lse, scale * LOG2E, _runtime(left), _runtime(right))


def _run_native(q, k, v, o, left, right, scale, target) -> torch.Tensor:
    """Shapes are validated; handles the empty cases on the host (from shapes only)."""
    B, Sq, H, _ = q.shape
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if B == 0 or Sq == 0:
        return lse
    if k.shape[1] == 0:  # no keys: every row sees nothing
        o.zero_()
        return lse.fill_(float("-inf"))
    _launch(q, k, v, o, lse, left, right, scale, target)
    return lse


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sliding_window=None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "tilelang",
):
    """GQA attention forward: out [B, Sq, H, D] (q's dtype), and LSE [B, H, Sq] FP32 if return_lse.

    q [B, Sq, H, D], k/v [B, Sk, H_kv, D] with H % H_kv == 0; Sq != Sk is
    bottom-right aligned. sliding_window: None (full), (-1, 0) causal or
    (LEFT, RIGHT) with -1 unbounded. scale multiplies q.k (default 1/sqrt(D)).
    out, when given, is written in place and returned.
    """
    p = _resolve(**locals())  # first statement: locals() is exactly the parameters
    if p.backend == "reference":
        o, lse = reference.gqa_attention(p.q, p.k, p.v, p.left, p.right, p.scale)
        out = o.to(p.q.dtype) if p.out is None else p.out.copy_(o)
    else:
        out = torch.empty_like(p.q, memory_format=torch.contiguous_format) if p.out is None else p.out
        lse = _run_native(p.q, p.k, p.v, out, p.left, p.right, p.scale, p.target)
    return (out, lse) if p.return_lse else out


class Problem(NamedTuple):
    """One gqa_attention call, resolved and checked (immutable, built once per call); the window
    as (left, right) with -1 unbounded; target for backend='tilelang' only."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    left: int
    right: int
    scale: float
    return_lse: bool
    out: torch.Tensor | None
    target: str | None


def _resolve(q, k, v, *, sliding_window, scale, out, return_lse, backend) -> Problem:
    """Every check of gqa_attention, in one order: inputs, devices, shapes, window, scalars, out,
    the native limits."""
    backend = _dispatch.backend(backend)
    for name, x in (("q", q), ("k", k), ("v", v)):
        C.tensor(name, x, ndim=4)
        C.floating(name, x)
    C.same_dtype(q=q, k=k, v=v)
    C.same_device(q=q, k=k, v=v)
    B, Sq, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B, Sk, H_kv, D] with B = {B} and D = {D} as in q, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's head count H = {H} must be a positive multiple of k's H_kv = {Hkv}")
    left, right = parse_window(sliding_window)
    mult = C.score_multiplier(scale, None, max(D, 1))
    return_lse = C.flag("return_lse", return_lse)
    if out is not None:
        C.out_buffer("out", out, shape=q.shape, dtype=q.dtype, device=q.device)
        C.no_overlap({"out": out}, {"q": q, "k": k, "v": v})
    target = None
    if backend == "tilelang":
        C.native_dtype("q", q)
        _native_dim("q", D)
        for name, x in (("q", q), ("k", k), ("v", v)):
            C.vector_layout(name, x)
        if out is not None:
            C.vector_layout("out", out)
        target = _dispatch.target_of(q, "q")
    return Problem(backend, q, k, v, left, right, mult, return_lse, out, target)


# ---------------------------------------------------------------- the seed's launcher


def _int(name: str, v, *, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _rows_view(name: str, x, batch: int, seq_len: int, heads: int, dim: int, stride1: int) -> torch.Tensor:
    """x as [batch, seq_len, heads, dim] whose sequence rows are stride1 elements apart.

    4-D x must already have that shape and stride(1) == stride1 (its own batch
    stride is kept). 2-D x [batch * seq_len, heads * dim] and 3-D x
    [batch * seq_len, heads, dim], with row stride stride1 and contiguous rows
    (a column slice of a packed QKV tensor, say), are viewed with batch stride
    seq_len * stride1.
    """
    C.tensor(name, x, ndim=(2, 3, 4))
    if x.dim() == 4:
        if tuple(x.shape) != (batch, seq_len, heads, dim):
            raise ValueError(f"{name} must be [{batch}, {seq_len}, {heads}, {dim}], got {tuple(x.shape)}")
        if seq_len > 1 and x.stride(1) != stride1:
            raise ValueError(f"{name}.stride(1) is {x.stride(1)} but the launch passed stride {stride1}")
        return x
    rows = batch * seq_len
    want = (rows, heads * dim) if x.dim() == 2 else (rows, heads, dim)
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must be {list(want)} (batch * seq_len rows), got {tuple(x.shape)}")
    inner = (1,) if x.dim() == 2 else (dim, 1)
    if (heads * dim > 1 and tuple(x.stride()[1:]) != inner) or (rows > 1 and x.stride(0) != stride1):
        raise ValueError(
            f"{name} must have row stride {stride1} and contiguous rows (strides ({stride1}, {', '.join(map(str, inner))})), "
            f"got {tuple(x.stride())}"
        )
    return x.as_strided((batch, seq_len, heads, dim), (seq_len * stride1, stride1, dim, 1), x.storage_offset())


def build_gqa_attn(ATTN_B: int, ATTN_H: int, ATTN_H_KV: int, ATTN_D: int, sliding_window=None):
    """The seed's launcher: specialized once per geometry and window, native only.

    Returns launch(Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1,
    seq_len_q, seq_len_kv) -> O, which writes O in place. Q/O hold ATTN_H
    heads and K/V ATTN_H_KV heads of ATTN_D features; sequence lengths and
    sequence (row) strides, in elements, are runtime values, so Q/K/V can be
    column slices of one packed QKV tensor. Each tensor is 4-D
    [ATTN_B, seq_len, heads, ATTN_D] with stride(1) equal to the passed
    stride, or 2-D [ATTN_B * seq_len, heads * ATTN_D] / 3-D
    [ATTN_B * seq_len, heads, ATTN_D] with that row stride, sequences packed
    batch-major. The kernel is compiled at the first launch of each dtype.
    """
    B = _int("ATTN_B", ATTN_B, minimum=1)
    H = _int("ATTN_H", ATTN_H, minimum=1)
    Hkv = _int("ATTN_H_KV", ATTN_H_KV, minimum=1)
    D = _int("ATTN_D", ATTN_D, minimum=1)
    if H % Hkv:
        raise ValueError(f"ATTN_H = {H} must be a multiple of ATTN_H_KV = {Hkv}")
    _native_dim("ATTN_D", D)
    left, right = parse_window(sliding_window)
    scale = 1.0 / math.sqrt(D)

    def launch(Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1, seq_len_q, seq_len_kv):
        sq = _int("seq_len_q", seq_len_q, minimum=0)
        sk = _int("seq_len_kv", seq_len_kv, minimum=0)
        strides = {}
        for name, s in (("Q_stride1", Q_stride1), ("K_stride1", K_stride1), ("V_stride1", V_stride1), ("O_stride1", O_stride1)):
            strides[name] = _int(name, s, minimum=1)
        q = _rows_view("Q", Q, B, sq, H, D, strides["Q_stride1"])
        k = _rows_view("K", K, B, sk, Hkv, D, strides["K_stride1"])
        v = _rows_view("V", V, B, sk, Hkv, D, strides["V_stride1"])
        o = _rows_view("O", O, B, sq, H, D, strides["O_stride1"])
        C.same_dtype(Q=q, K=k, V=v, O=o)
        C.same_device(Q=q, K=k, V=v, O=o)
        C.native_dtype("Q", q)
        C.no_overlap({"O": o}, {"Q": q, "K": k, "V": v})
        for name, x in (("Q", q), ("K", k), ("V", v), ("O", o)):
            C.vector_layout(name, x)
        target = _dispatch.target_of(q, "Q")
        _run_native(q, k, v, o, left, right, scale, target)
        return O

    return launch
