"""SplitKV merge: combine per-split partial attention outputs and their LSEs.

Split s of a row holds the attention output o_s over its share of the keys and the
natural-log LSE l_s of its scaled scores. The merged row is

    lse = log(sum_s exp(l_s)),   out = sum_s exp(l_s - lse) * o_s,

computed in FP32. A split with l_s = -inf (no visible key) contributes nothing and
its o_s is never read into the sum (it may hold anything, NaN included); a row
whose splits are all -inf gives output 0 and lse -inf. An optional gate multiplies
the merged output by sigmoid(gate) in FP32; the lse is not gated.

Both SplitKV attentions end here: QSA's sparse attention (mate.qsa.attention, through launch) and GQA's
split-KV decode (mate.swa.attention, through merge_attention_states). The kernel is still the `merge`
program of mate/qsa/kernels/sparse.py, with its card (stage qsa_merge) in sparse_card.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _dispatch
from mate._reference import apply_gate

kernels = _dispatch.lazy_module("mate.qsa.kernels.sparse")  # imported, with TileLang, at the first native call

STAGE = _dispatch.STAGES["qsa_merge"]
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEG_INF = float("-inf")


def gate_rows(gate: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A gate as the kernels read it: `shape` [rows, heads, D] (a per-head gate expanded, not copied), in `dtype`
    (the output's) when it has that dtype, else an FP32 copy."""
    g = gate if gate.dtype == dtype else gate.float()
    return g if g.dim() == 3 else g.unsqueeze(-1).expand(shape)


def gate_buffers(gate: torch.Tensor | None, dtype: torch.dtype, stand_in, flags: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernels' two gate buffers (G: FP32, GH: `dtype`) and flags, for a gate_rows() result or None: the gate
    in one, a placeholder (of the call's _dispatch.Placeholders `stand_in`) in the other."""
    if gate is None:
        return stand_in(torch.float32, 3), stand_in(dtype, 3), flags
    if gate.dtype == dtype:
        return stand_in(torch.float32, 3), gate, flags | kernels.HAS_GATE | kernels.GATE_NATIVE
    return gate, stand_in(dtype, 3), flags | kernels.HAS_GATE


def launch(partial_out, partial_lse, gate, out, lse, flags, target, stand_in):
    """The merge kernel on [splits, rows, heads, D] partials; gate is a gate_rows() result or None (flags gain
    its bits here), lse may be None when flags lacks WRITE_LSE; stand_in: the call's _dispatch.Placeholders.
    Also the last step of SplitKV sparse attention."""
    spec = {"pdtype": str(partial_out.dtype).removeprefix("torch."), "odtype": str(out.dtype).removeprefix("torch.")}
    g, gh, flags = gate_buffers(gate, out.dtype, stand_in, flags)
    _dispatch.kernel(STAGE.name, spec, target)(
        partial_out, partial_lse, g, gh, out, stand_in(torch.float32, 2) if lse is None else lse, flags,
    )


def merge_attention_states(
    partial_out: torch.Tensor, partial_lse: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "tilelang",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge SplitKV partials: partial_out [splits, rows, heads, D], partial_lse FP32 [splits, rows, heads].

    Returns (out [rows, heads, D], lse FP32 [rows, heads]); they are exactly `out` and
    `lse` when those buffers are given (written in place, storage around them
    untouched). The output dtype is out's, else out_dtype, else partial_out's.
    gate: floating, [rows, heads] (per head) or [rows, heads, D] (per element).
    Outputs must not overlap each other or any input. splits may be 0 (every row empty).

    backend="reference" runs the FP32 PyTorch oracle on any device.
    backend="tilelang" (default) runs the native merge kernel for float32/bfloat16/float16
    partials and outputs; splits = 0 gives 0 and -inf there too.
    """
    problem = _resolve(**locals())  # first statement: locals() is exactly the parameters
    return _native(problem) if problem.backend == "tilelang" else _reference(problem)


class MergeProblem(NamedTuple):
    """One merge_attention_states call, resolved and checked (immutable, built once per call).

    dtype: the output's; row_shape [rows, heads] and out_shape [rows, heads, D]; target set for
    backend='tilelang' only."""

    backend: str
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    gate: torch.Tensor | None
    out: torch.Tensor | None
    lse: torch.Tensor | None
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    target: str | None


def _resolve(partial_out, partial_lse, *, gate, out, lse, out_dtype, backend) -> MergeProblem:
    """Every check of merge_attention_states, in one order: partials, gate, out_dtype, the output
    buffers, devices and overlap, the target and the native dtypes."""
    backend = _dispatch.backend(backend)
    C.tensor("partial_out", partial_out, ndim=4)
    C.floating("partial_out", partial_out)
    C.tensor("partial_lse", partial_lse, ndim=3)
    if partial_lse.dtype != torch.float32:
        raise ValueError(f"partial_lse must be float32, got {partial_lse.dtype}")
    if tuple(partial_lse.shape) != tuple(partial_out.shape[:-1]):
        raise ValueError(
            f"partial_lse must have shape {tuple(partial_out.shape[:-1])} (partial_out's [splits, rows, heads]), "
            f"got {tuple(partial_lse.shape)}"
        )
    row_shape = tuple(partial_out.shape[1:-1])
    out_shape = tuple(partial_out.shape[1:])
    if gate is not None:
        C.tensor("gate", gate)
        C.floating("gate", gate)
        if tuple(gate.shape) not in (row_shape, out_shape):
            raise ValueError(f"gate must have shape {row_shape} (per head) or {out_shape} (per element), got {tuple(gate.shape)}")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
        if not out_dtype.is_floating_point:
            raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    if out is not None:
        C.tensor("out", out)
        C.floating("out", out)
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        C.out_buffer("out", out, shape=out_shape, dtype=out.dtype, device=partial_out.device)
    if lse is not None:
        C.out_buffer("lse", lse, shape=row_shape, dtype=torch.float32, device=partial_out.device)
    C.same_device(partial_out=partial_out, partial_lse=partial_lse, gate=gate, out=out, lse=lse)
    C.no_overlap({"out": out, "lse": lse}, {"partial_out": partial_out, "partial_lse": partial_lse, "gate": gate})

    dtype = out.dtype if out is not None else (out_dtype or partial_out.dtype)
    target = None
    if backend == "tilelang":
        target = _dispatch.target_of(partial_out, "partial_out")
        for name, dt in (("partial_out", partial_out.dtype), ("output", dtype)):
            if dt not in NATIVE_DTYPES:
                raise ValueError(f"backend='tilelang' merges float32/bfloat16/float16 {name}, got {dt}; use backend='reference'")
    return MergeProblem(backend, partial_out, partial_lse, gate, out, lse, dtype, row_shape, out_shape, target)


def _native(p: MergeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    dev = p.partial_out.device
    out = torch.empty(p.out_shape, dtype=p.dtype, device=dev) if p.out is None else p.out
    lse = torch.empty(p.row_shape, dtype=torch.float32, device=dev) if p.lse is None else p.lse
    if out.numel():
        g = None if p.gate is None else gate_rows(p.gate, p.dtype, p.out_shape)
        launch(p.partial_out, p.partial_lse, g, out, lse, kernels.WRITE_LSE, p.target, _dispatch.Placeholders(dev))
    elif lse.numel():
        lse.fill_(float("-inf"))
    return out, lse


def _reference(p: MergeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    res, res_lse = merge_states(p.partial_out, p.partial_lse)
    res = apply_gate(res, p.gate)
    out = res.to(p.dtype) if p.out is None else p.out.copy_(res)
    lse = res_lse if p.lse is None else p.lse.copy_(res_lse)
    return out, lse


def merge_states(partial_out: torch.Tensor, partial_lse: torch.Tensor):
    """Combine split partials [S, ..., D] with their lse [S, ...] into FP32 (out [..., D], lse [...]).

    A split with lse -inf contributes nothing (its partial output is never read into the
    sum, so it may hold anything); a row whose splits are all -inf gives 0 and -inf.
    """
    lse = partial_lse.float()
    if lse.shape[0] == 0:
        return (partial_out.new_zeros(partial_out.shape[1:], dtype=torch.float32),
                lse.new_full(lse.shape[1:], NEG_INF))
    m = lse.amax(dim=0)
    live = lse > NEG_INF
    w = torch.where(live, torch.exp(lse - torch.where(m > NEG_INF, m, 0.0)), 0.0)
    total = w.sum(dim=0)
    acc = torch.where(live.unsqueeze(-1), w.unsqueeze(-1) * partial_out.float(), 0.0).sum(dim=0)
    some = total > 0
    out = torch.where(some.unsqueeze(-1), acc / torch.where(some, total, 1.0).unsqueeze(-1), 0.0)
    merged = torch.where(some, m + torch.log(torch.where(some, total, 1.0)), NEG_INF)
    return out, merged
