"""Argument checks shared by every entrypoint.

None of these read device memory: they look at shapes, dtypes, strides and
pointers only, so native wrappers stay free of host syncs and can be captured
in CUDA Graphs. TypeError means a wrong Python type or a metadata dtype;
ValueError means a wrong shape, layout or value. Messages name the argument,
what was expected and what was given.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

NATIVE_DTYPES = (torch.bfloat16, torch.float16)

LAYOUT_ERROR = "vector loads require unit feature stride and 16-byte alignment"


def tensor(name: str, x, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else ndim
        if x.dim() not in ranks:
            want = " or ".join(str(r) for r in ranks)
            raise ValueError(f"{name} must have rank {want}, got shape {tuple(x.shape)}")
    return x


def floating(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def int32(name: str, x, *, ndim: int | None = None, shape: tuple | None = None) -> torch.Tensor:
    """Metadata (indices, positions, lengths, page tables) is int32, never converted."""
    tensor(name, x, ndim=ndim)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x


def optional_int32(name: str, x, **kw) -> torch.Tensor | None:
    return None if x is None else int32(name, x, **kw)


def flattened_requests(what: str, rows: int, cu_seqlens_q, token_to_req, num_requests) -> int:
    """Number of requests behind flattened rows: cu_seqlens_q (int32 [n + 1]) or token_to_req (int32 [rows]) with num_requests."""
    if (cu_seqlens_q is None) == (token_to_req is None):
        raise ValueError(f"flattened {what} needs exactly one of cu_seqlens_q or token_to_req")
    if cu_seqlens_q is not None:
        int32("cu_seqlens_q", cu_seqlens_q, ndim=1)
        if cu_seqlens_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must hold num_requests + 1 >= 2 offsets, got shape {tuple(cu_seqlens_q.shape)}")
        n_req = cu_seqlens_q.shape[0] - 1
        if num_requests is not None and positive_int("num_requests", num_requests) != n_req:
            raise ValueError(f"num_requests is {num_requests} but cu_seqlens_q holds {n_req} requests")
        return n_req
    int32("token_to_req", token_to_req, shape=(rows,))
    if num_requests is None:
        raise ValueError("token_to_req needs num_requests")
    return positive_int("num_requests", num_requests)


def requests(name: str, x: torch.Tensor, heads: str, cu_seqlens_q, token_to_req, num_requests) -> int:
    """Number of requests behind x's rows: padded [B, Q, heads, D] holds B, flattened [total_q, heads, D]
    names them with cu_seqlens_q or token_to_req (see flattened_requests)."""
    if x.dim() == 3:
        return flattened_requests(f"{name} [total_q, {heads}, D]", x.shape[0], cu_seqlens_q, token_to_req, num_requests)
    if cu_seqlens_q is not None or token_to_req is not None:
        raise ValueError(
            f"cu_seqlens_q and token_to_req apply to flattened {name} [total_q, {heads}, D], not padded [B, Q, {heads}, D]"
        )
    n_req = x.shape[0]
    if num_requests is not None and positive_int("num_requests", num_requests) != n_req:
        raise ValueError(f"num_requests is {num_requests} but padded {name} holds {n_req} requests")
    return n_req


def block_table_rows(block_table, n_req: int) -> None:
    int32("block_table", block_table, ndim=2)
    if block_table.shape[0] != n_req:
        raise ValueError(f"block_table must have one row per request ({n_req}), got shape {tuple(block_table.shape)}")


def same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}; all tensors must share one device")


def same_dtype(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for n, t in rest:
        if t.dtype != first.dtype:
            raise ValueError(f"{n} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")


def native_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in NATIVE_DTYPES:
        raise ValueError(
            f"backend='tilelang' supports bfloat16 and float16 {name}, got {x.dtype}; use backend='reference' for other dtypes"
        )


def vector_layout(name: str, x: torch.Tensor) -> None:
    """The layout rule of native vector (and TMA) loads.

    Feature stride 1, data_ptr 16-byte aligned, and every outer axis with more
    than one element has a positive stride spanning a multiple of 16 bytes.
    """
    problems = layout_problems(x)
    if problems:
        raise ValueError(
            f"{name}: {LAYOUT_ERROR} ({'; '.join(problems)}); pass a contiguous copy or adjust the slice offsets instead"
        )


def layout_problems(x: torch.Tensor) -> list[str]:
    """What breaks vector_layout's rule for x (empty: none)."""
    es = x.element_size()
    problems = []
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        problems.append(f"stride(-1) is {x.stride(-1)}, expected 1")
    if x.data_ptr() % 16:
        problems.append(f"data_ptr() is {x.data_ptr() % 16} bytes past a 16-byte boundary")
    for axis in range(x.dim() - 1):
        s = x.stride(axis)
        if x.shape[axis] > 1 and (s <= 0 or (s * es) % 16):
            problems.append(f"stride({axis}) is {s} elements ({s * es} bytes), expected a positive multiple of {16 // es}")
    return problems


def unit_feature_stride(name: str, x: torch.Tensor) -> None:
    """Looser rule for loads that go through plain (LSU) loads: broadcast outer axes are fine."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit feature stride (stride(-1) == 1), got {x.stride(-1)}")


def canonical_unit_strides(x: torch.Tensor) -> torch.Tensor:
    """A zero-copy view whose size-1 axes carry a TMA-legal stride.

    Size-1 axes are exempt from the layout rule, so their stride can be any
    value; a tensor-map descriptor still encodes it, so give them the stride
    a contiguous tensor would have there.
    """
    strides = list(x.stride())
    for axis in range(x.dim() - 1, -1, -1):
        if x.shape[axis] == 1:
            inner = [(x.shape[a], strides[a]) for a in range(axis + 1, x.dim())]
            strides[axis] = max([n * s for n, s in inner], default=1)
    if strides == list(x.stride()):
        return x
    return x.as_strided(x.shape, strides)


def positive_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v}")
    return v


def flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def positive_int(name: str, v, *, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    return v


def score_multiplier(scale, score_scale, dim: int) -> float:
    """`scale` multiplies scores, `score_scale` divides them; at most one of the two."""
    if scale is not None and score_scale is not None:
        raise ValueError("pass either scale (a multiplier) or score_scale (a denominator), not both")
    if score_scale is not None:
        return 1.0 / positive_float("score_scale", score_scale)
    if scale is not None:
        return positive_float("scale", scale)
    return 1.0 / math.sqrt(dim)


def _span(x: torch.Tensor) -> tuple[int, int]:
    """Byte interval [lo, hi) a tensor's elements can touch."""
    if x.numel() == 0:
        return (0, 0)
    lo = hi = x.data_ptr()
    for n, s in zip(x.shape, x.stride()):
        reach = (n - 1) * s * x.element_size()
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + x.element_size()


def no_overlap(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Reject outputs whose memory span meets an input's or another output's.

    The test is on byte spans, so it is conservative: two interleaved views
    that never touch the same element are rejected too.
    """
    outs = [(n, t, _span(t)) for n, t in outputs.items() if t is not None]
    if not outs:  # the common case on launch-bound decode calls: nothing to compare
        return
    others = outs + [(n, t, _span(t)) for n, t in inputs.items() if t is not None]
    for i, (on, ot, (olo, ohi)) in enumerate(outs):
        for n, t, (lo, hi) in others[i + 1 :]:
            if t.device == ot.device and olo < hi and lo < ohi:
                raise ValueError(f"{on} overlaps {n} in memory; outputs must not share memory with inputs or other outputs")


def _self_overlaps(x: torch.Tensor) -> bool:
    """Whether two elements may share memory (sufficient test: each stride clears the inner extent)."""
    extent = 0
    for s, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if s <= extent:
            return True
        extent += (n - 1) * s
    return False


def out_buffer(name: str, out, *, shape, dtype, device) -> torch.Tensor:
    """A caller-provided output: exact shape, dtype and device, positive strides, no self-overlap, and not
    recorded by autograd (both backends write it in place, where autograd would see no operation or refuse one)."""
    tensor(name, out)
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but an output buffer is written in place outside autograd; pass one that "
                         f"does not require grad (e.g. {name}.detach()), or call under torch.no_grad()")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{name} must be on {device}, got {out.device}")
    if any(s <= 0 for n, s in zip(out.shape, out.stride()) if n > 1):
        raise ValueError(f"{name} must have positive strides, got {tuple(out.stride())}")
    if _self_overlaps(out):
        raise ValueError(f"{name} has internal overlap (some elements share memory); pass a non-overlapping view")
    return out


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVScales(NamedTuple):
    """What kv_scales resolved: the cache dtype, and per scale the host multiplier and the device tensor.

    fp8: the caches are FP8 (else they are the query's dtype and both scales are 1).
    k / v: the float multiplier (1.0 where the scale is a tensor); k_tensor / v_tensor: the one-element
    FP32 device tensor the kernel reads instead (None where the scale is a float)."""

    kv_dtype: torch.dtype
    fp8: bool
    k: float
    v: float
    k_tensor: torch.Tensor | None
    v_tensor: torch.Tensor | None

    def k_value(self, like: torch.Tensor) -> torch.Tensor | float:
        """k_scale as the reference applies it: the float, or the tensor on like's device (FP32)."""
        return self.k if self.k_tensor is None else self.k_tensor.to(like.device)

    def v_value(self, like: torch.Tensor) -> torch.Tensor | float:
        return self.v if self.v_tensor is None else self.v_tensor.to(like.device)


def _kv_scale(name: str, s, fp8: bool, device) -> tuple[float, torch.Tensor | None]:
    if s is None:
        return 1.0, None
    if isinstance(s, torch.Tensor):
        if not fp8:
            raise ValueError(f"{name} as a tensor applies to FP8 K/V only; BF16/FP16 K/V take no scale (None or 1.0)")
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {s.dtype}")
        if s.numel() != 1 or s.dim() > 1:
            raise ValueError(f"{name} must be a one-element tensor of shape () or (1,), got shape {tuple(s.shape)}")
        if s.device != device:
            raise ValueError(f"{name} is on {s.device} but the K/V cache is on {device}; a tensor scale must be on the cache's device")
        return 1.0, canonical_unit_strides(s.reshape(1))  # a one-element view of any stride: the kernels' (1,) buffer
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"{name} must be a float or a one-element float32 tensor, got {type(s).__name__}")
    s = float(s)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {s}")
    if not fp8 and s != 1.0:
        raise ValueError(f"{name} must be 1.0 for non-FP8 K/V (nothing to dequantize), got {s}")
    return s, None


def kv_scales(k: torch.Tensor, v: torch.Tensor | None, k_scale, v_scale, query: torch.Tensor, *,
              names: tuple[str, str, str] = ("k", "v", "q")) -> KVScales:
    """The one check of a KV cache's dtype and its dequant scales (real value = stored value x scale).

    k, v: the caches (v None for a key-only cache, the MQA indexer's; then v_scale must be None);
    query: the query, whose dtype the matmuls run in; names: the entrypoint's names of k, v and query,
    for the messages. Raises, never reading device memory:
    - ValueError for an FP8 query (FP8 compute is not supported), for FP8 K with non-FP8 V or two FP8
      kinds, and for non-FP8 K/V whose dtype is not the query's;
    - for a float scale: TypeError if not a number, ValueError if <= 0, NaN or inf, or != 1 on
      non-FP8 K/V;
    - for a tensor scale: ValueError on non-FP8 K/V, TypeError unless float32, ValueError unless it
      has one element (shape () or (1,)) and lives on k's device. Its value is the kernel's to read
      (on the GPU, so it may change between CUDA-graph replays); mate.debug_checks() checks it is
      positive and finite (one host sync), and so does the reference, which reads it anyway.
    None means 1. FP8 is torch.float8_e4m3fn or torch.float8_e5m2, K and V of the same one; the query
    stays BF16/FP16 (native) and the kernels upcast exactly (both FP8 kinds are exact in BF16 and FP16).
    Returns KVScales: the cache dtype, whether it is FP8, and per scale the float multiplier and the
    tensor (the kernels take the float folded into their scales, and read the tensor when there is one).
    """
    kn, vn, qn = names
    if query.dtype in FP8_DTYPES:
        raise ValueError(f"{qn} has dtype {query.dtype}: FP8 queries are not supported (FP8 compute is not "
                         f"enabled); pass a bfloat16 or float16 {qn} (FP8 applies to the K/V cache only)")
    fp8 = k.dtype in FP8_DTYPES
    if v is not None and (fp8 or v.dtype in FP8_DTYPES) and v.dtype != k.dtype:
        raise ValueError(f"{kn} has dtype {k.dtype} but {vn} has {v.dtype}: an FP8 cache needs {kn} and {vn} of one FP8 "
                         "dtype (float8_e4m3fn or float8_e5m2)")
    if not fp8:
        same_dtype(**{qn: query, kn: k}, **({} if v is None else {vn: v}))
    if v is None and v_scale is not None:
        raise ValueError(f"v_scale applies to a value cache; this call has keys only ({kn})")
    kf, kt = _kv_scale("k_scale", k_scale, fp8, k.device)
    vf, vt = _kv_scale("v_scale", v_scale, fp8, k.device)
    return KVScales(k.dtype, fp8, kf, vf, kt, vt)


def dequantized(x: torch.Tensor, scale) -> torch.Tensor:
    """An FP8 cache as FP32 real values (exact: value x scale, a float or a one-element tensor)."""
    return x.float() * scale
