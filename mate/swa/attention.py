"""GQA forward attention, dense or sliding window: `gqa_attention` and the launcher `build_gqa_attn`.

Layout BSHD: q [B, Sq, H, D], k/v [B, Sk, H_kv, D], out [B, Sq, H, D], LSE [B, H, Sq]
(FP32, natural log). Query head h reads KV head h // (H // H_kv).

`sliding_window=(LEFT, RIGHT)`: query row i, at position p = i + Sk - Sq
(bottom-right aligned), sees the keys j with p - LEFT <= j <= p + RIGHT;
-1 leaves a side unbounded. None is full (non-causal) attention, (-1, 0)
causal; a Hugging Face window W is (W - 1, 0). A row that sees no key gets
output 0 and LSE -inf.

Also packed varlen sequences, paged caches, attention sinks and softcap (issue 17; see
gqa_attention's docstring).

Native: BF16/FP16, D 64 or 128, any H divisible by H_kv, each tensor with a
unit feature stride and 16-byte aligned pointer and strides (TMA). One kernel
per (dtype, D, window class) serves every geometry, length and window of its
class: `none` (no window), `causal` (LEFT unbounded, RIGHT bounded) and
`local` (LEFT bounded). Varlen, sinks and softcap are compile-time variants of
that kernel with its class's tiles, compiled at first use (or by `mate-precompile --options`);
with none of them the call takes the plain kernel, unchanged.

Paged caches, and padded calls with at most DECODE_MAX_ROWS query rows per sequence
(decode; k then counts as one page per sequence), run the split-KV kernel
(mate/swa/kernels/gqa_decode.py: the query heads of a KV group packed into the tile's
rows, each sequence's keys split across CTAs where the grid is small; one split writes the
output itself, several go through the merge stage of mate.merge), with sinks and softcap
as runtime arguments: any page size natively, -1 and out-of-range page ids masked and never read.
FP8 K/V (issue 38), in every layout, run the split-KV kernel's FP8 variant (varlen k as one page with
per-sequence key offsets); see gqa_attention's docstring.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _debug, _dispatch
from mate.merge import merge_attention_states
from mate.swa import reference
from mate.swa.kernels.gqa_card import NATIVE_DIMS
from mate.swa.kernels.gqa_decode_card import resident_ctas

LOG2E = 1.4426950408889634
# Stands for an unbounded window side in the kernel: larger than any distance
# between a query position and a key index (lengths are far below 2**30).
UNBOUNDED = 1 << 30

STAGE = _dispatch.STAGES["gqa_fwd"]
DECODE = _dispatch.STAGES["gqa_decode"]
decode_kernel = _dispatch.lazy_module("mate.swa.kernels.gqa_decode")  # imported, with TileLang, at the first native call
# Padded calls with at most this many query rows per sequence take the split-KV kernel (decode).
DECODE_MAX_ROWS = 16
# Split-KV: at most this many CTAs per multiprocessor (more waves even out the sequences' lengths), with at
# least MIN_SPLIT_TILES key tiles per split; within that, the split count whose grid fills the resident CTA slots
# best (_num_splits), if that beats one split by SPLIT_GAIN (a split pays the partials and the merge).
CTAS_PER_SM = 8
MIN_SPLIT_TILES = 4
SPLIT_GAIN = 0.2
INT32_MAX = (1 << 31) - 1


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
    """Run the dense kernel on validated 4-D views; never reads device memory."""
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


def _run_native_ext(p, o) -> torch.Tensor:
    """Varlen, sinks or softcap on the native kernel; shapes are validated, nothing is read back."""
    q, k, v = p.q, p.k, p.v
    varlen = p.cu_seqlens_q is not None
    H = q.shape[-2]
    lse = torch.empty((H, q.shape[0]) if varlen else (q.shape[0], H, q.shape[1]), dtype=torch.float32, device=q.device)
    rows = q.shape[0] if varlen else q.shape[0] * q.shape[1]
    if rows == 0:
        return lse
    if (k.shape[0] if varlen else k.shape[1]) == 0:  # no keys: every row sees nothing but the sink
        o.zero_()
        if p.sinks is None:
            return lse.fill_(float("-inf"))
        return lse.copy_(p.sinks.view(H, 1) if varlen else p.sinks.view(1, H, 1))
    # The options are compile-time flags of the program, on the tiles of its (dtype, dim, window) entry.
    kern = _dispatch.kernel(STAGE.name, _spec(q.dtype, q.shape[-1], p.left, p.right), p.target, varlen=varlen,
                            sinks=p.sinks is not None, softcap=p.softcap is not None)
    four = (lambda x: x.unsqueeze(0)) if varlen else (lambda x: x)
    cu = C.canonical_unit_strides
    stand_in = _dispatch.Placeholders(q.device)
    hold = None if varlen else stand_in(torch.int32, 1)
    # The kernel reads offsets as dense vectors: a strided view goes in as a copy (captured with the call).
    kern(cu(four(q)), cu(four(k)), cu(four(v)), cu(four(o)), four(lse),
         p.cu_seqlens_q.contiguous() if varlen else hold, p.cu_seqlens_k.contiguous() if varlen else hold,
         _sinks_arg(p, stand_in), *_softmax_args(p), p.max_seqlen_q if varlen else 0)
    return lse


def _sinks_arg(p, stand_in) -> torch.Tensor:
    """The sinks as both kernels read them: a dense vector (a strided view goes in as a copy), or a placeholder."""
    return p.sinks.contiguous() if p.sinks is not None else stand_in(torch.float32, 1)


def _softmax_args(p) -> tuple:
    """Both kernels' softmax arguments: scale * log2(e), the window as runtime bounds, softcap and scale / softcap.
    With softcap the kernel applies the scale itself, before the tanh: the softmax gets scores in natural units.
    An FP8 cache's float k_scale (1 otherwise) is a factor of the scale."""
    scale = p.scale * p.kv.k
    return (LOG2E if p.softcap else scale * LOG2E, _runtime(p.left), _runtime(p.right), p.softcap or 0.0,
            scale / p.softcap if p.softcap else 0.0)


def _padded_rows(device, batch: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded q as the split-KV kernel's metadata: the row offsets b * rows, and 0 .. batch (whose first `batch` are
    padded k's page table). Built per call, so that a graph captures them with the call (a cache kept across calls
    and made inside a capture would be read before its first replay filled it, or after the graph freed it)."""
    ids = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return (ids if rows == 1 else ids * rows), ids




def _num_splits(p, rows_max: int, group: int, capacity: int, spec: dict, tiles: dict) -> int:
    """Key splits per (row tile, KV head, sequence) from a wave model: c CTAs unsplit, s splits each 1/s of the
    work, slots resident CTAs (resident_ctas x multiprocessors) take ceil(s c / slots) / s of one unsplit CTA's
    time (equal work a CTA). The smallest s of the least time, if that is SPLIT_GAIN below one split's, else
    one split (which writes the output itself, no merge). H200, B x 8192 keys, H 64 / 8, D 128 (2 slots an SM):
    B 16 / 24 / 32 / 40 / 48 / 56 / 64 were fastest at 2 / 4 / 1 / 2-4 / 2 / 1-2 / 1 splits, as the model says
    (56: s 7 by 14%, below SPLIT_GAIN); the 8-row merges cost most
    (benchmarks/results/NVIDIA_H200-2026-12-02-decode-splits.md)."""
    keys = capacity if p.left < 0 else min(capacity, p.left + -(-rows_max // group) + max(p.right, 0))
    ctas = p.batch * p.k.shape[-2] * -(-rows_max // tiles["block_m"])
    sms = _dispatch.sm_count(p.q.device)
    slots = resident_ctas(spec, tiles) * sms
    most = max(1, min(-(-keys // (tiles["block_n"] * MIN_SPLIT_TILES)), -(-CTAS_PER_SM * sms // max(ctas, 1))))

    def waves(s: int) -> float:
        return -(-s * ctas // slots) / s

    best = min(range(1, most + 1), key=lambda s: (waves(s), s))
    return best if waves(best) <= (1 - SPLIT_GAIN) * waves(1) else 1


def _run_split_kv(p, o) -> torch.Tensor:
    """Paged caches, padded calls with few query rows (decode) and every FP8 call on the split-KV kernel (and the
    merge stage when it splits the keys)."""
    q, k, v = p.q, p.k, p.v
    varlen = p.cu_seqlens_q is not None
    H, D = q.shape[-2], q.shape[-1]
    stand_in = _dispatch.Placeholders(q.device)
    flags, base = 0, stand_in(torch.int32, 1)
    if varlen:
        cu_q, q_rows, rows_max = p.cu_seqlens_q.contiguous(), q, p.max_seqlen_q
    else:
        cu_q, ids = _padded_rows(q.device, p.batch, q.shape[1])
        q_rows, rows_max = q.reshape(-1, H, D), q.shape[1]
    if p.block_table is not None:
        table, seq_lens = p.block_table.contiguous(), p.seq_lens_k.contiguous()
        capacity = table.shape[1] * k.shape[1]
    elif p.cu_seqlens_k is not None:  # varlen k (FP8): one page of every key, sequence b's from cu_seqlens_k[b] on
        cu_k = p.cu_seqlens_k.contiguous()
        k, v = k.unsqueeze(0), v.unsqueeze(0)
        table = torch.zeros(p.batch, 1, dtype=torch.int32, device=q.device)
        seq_lens, base, flags = cu_k[1:] - cu_k[:-1], cu_k, decode_kernel.KEY_BASE
        capacity = p.max_seqlen_k
    else:  # padded k: sequence b's keys are page b, of Sk slots, and a key count the kernel clamps to the page
        table, seq_lens = ids[:-1].view(p.batch, 1), torch.full((p.batch,), INT32_MAX, dtype=torch.int32, device=q.device)
        capacity = k.shape[1]
    R = q_rows.shape[0]
    lse_rows = torch.empty(R, H, dtype=torch.float32, device=q.device)
    if R and (k.shape[0] == 0 or k.shape[1] == 0 or table.shape[1] == 0):  # no keys: every row sees nothing but the sink
        o.zero_()
        lse_rows.copy_(p.sinks.view(1, H).expand(R, H) if p.sinks is not None else torch.full_like(lse_rows, float("-inf")))
    elif R:
        group = H // k.shape[-2]
        spec = _spec(q.dtype, D, p.left, p.right)
        splits = _num_splits(p, rows_max * group, group, capacity, spec, _dispatch.tiles(DECODE.name, spec, p.target))
        try:
            o_rows = o.view(R, H, D)
        except RuntimeError:  # a caller's out whose rows do not flatten: written beside it, then copied
            o_rows = None
        dst = o_rows if o_rows is not None else torch.empty(R, H, D, dtype=o.dtype, device=q.device)
        # One split: the kernel writes dst and the LSE itself (direct); else FP32 partials (and the sink's slot) to merge.
        slots = 0 if splits == 1 else splits + (p.sinks is not None)
        shape = (slots, R, H) if slots else (1, 1, 1)  # direct: placeholders, never written
        part_o = torch.empty(*shape, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        cu = C.canonical_unit_strides
        kv = p.kv
        options = {"kv_dtype": str(kv.kv_dtype).removeprefix("torch.")} if kv.fp8 else {}
        flags |= (decode_kernel.K_SCALE_DEV if kv.k_tensor is not None else 0) | (decode_kernel.V_SCALE_DEV if kv.v_tensor is not None else 0)
        ks, vs = (stand_in(torch.float32, 1) if t is None else t for t in (kv.k_tensor, kv.v_tensor))
        _dispatch.kernel(DECODE.name, spec, p.target, **options)(
            cu(q_rows), cu(k), cu(v), table, seq_lens, cu_q, base, _sinks_arg(p, stand_in), part_o, part_lse, cu(dst), lse_rows,
            *_softmax_args(p), splits, rows_max * group, int(p.sinks is not None), int(slots == 0), flags, ks, vs, kv.v)
        if slots:
            merge_attention_states(part_o, part_lse, out=dst, lse=lse_rows)
        if o_rows is None:
            o.copy_(dst.view(o.shape))
    if varlen:
        return lse_rows.t().contiguous() if p.return_lse else lse_rows.t()
    lse = lse_rows.view(p.batch, q.shape[1], H).permute(0, 2, 1)
    return lse.contiguous() if p.return_lse else lse


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    block_table: torch.Tensor | None = None,
    seq_lens_k: torch.Tensor | None = None,
    sliding_window=None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    k_scale: float | torch.Tensor | None = 1.0,
    v_scale: float | torch.Tensor | None = 1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "tilelang",
):
    """GQA attention forward: out (q's shape and dtype), and the FP32 LSE if return_lse.

    Layouts (query head h reads KV head h // (H // H_kv)):
    - padded: q [B, Sq, H, D], k/v [B, Sk, H_kv, D]; LSE [B, H, Sq].
    - varlen (FlashAttention's convention): q [total_q, H, D] with cu_seqlens_q int32 [B + 1]
      (offsets from 0 to total_q) and max_seqlen_q; k/v [total_k, H_kv, D] with cu_seqlens_k
      int32 [B + 1] (offsets within [0, total_k]) and max_seqlen_k; LSE [H, total_q].
      max_seqlen_* are host ints at least every sequence's length (nothing is read back).
    - paged: k/v caches [pages, page_size, H_kv, D] with block_table int32 [B, max_pages] and
      seq_lens_k int32 [B]; q padded or varlen. Key j of sequence b sits on page
      block_table[b, j // page_size] at slot j % page_size; -1 and out-of-range pages are masked.
    Each sequence is bottom-right aligned: its row i sits at position i + Sk - Sq.
    sliding_window: None (full), (-1, 0) causal or (LEFT, RIGHT) with -1 unbounded.
    scale multiplies q.k (default 1/sqrt(D)); softcap (None or 0: off) makes a score
    softcap * tanh(score / softcap) before masking; sinks, FP32 [H], adds one logit per head to
    the softmax normaliser and the LSE (no value). A row with no visible key gets output 0 and
    LSE -inf (with sinks, the sink's logit). out, when given, is written in place and returned.

    FP8 K/V: k and v both torch.float8_e4m3fn or both torch.float8_e5m2 (any layout), q BF16/FP16;
    k_scale / v_scale are the per-tensor dequant multipliers (real = stored value x scale): a
    positive finite float, or a one-element FP32 tensor on k's device that the kernel reads on the
    GPU (a server may change it between CUDA-graph replays). BF16/FP16 K/V take no scale (1.0 or
    None). The native path upcasts each K/V tile exactly to FP16 and runs FP16 MMAs (a BF16 q is
    scaled by a power of two into FP16's range, exact down to 2^-24 of a tile's largest |q|); the
    reference dequantizes (FP32 value x scale). Errors: an FP8 q, FP8 k with non-FP8 v or two FP8
    kinds, a scale <= 0, NaN or inf, != 1 without FP8, a tensor scale of another shape, dtype or device.

    backend='tilelang' (sm90): BF16/FP16, D 64 or 128, every layout and option above; paged
    caches (any page size), padded calls of at most DECODE_MAX_ROWS rows and every FP8 call take
    the split-KV kernel and the SplitKV merge, which read nothing of unused pages or slots.
    """
    p = _resolve(**locals())  # first statement: locals() is exactly the parameters
    if p.backend == "reference":
        k, v = p.k, p.v
        if p.kv.fp8:
            k, v = C.dequantized(k, p.kv.k_value(k)), C.dequantized(v, p.kv.v_value(v))
        o, lse = reference.general(
            p.q, k, v, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
            max_seqlen_k=p.max_seqlen_k, block_table=p.block_table, seq_lens_k=p.seq_lens_k, left=p.left, right=p.right,
            scale=p.scale, sinks=p.sinks, softcap=p.softcap)
        out = o.to(p.q.dtype) if p.out is None else p.out.copy_(o)
    else:
        out = torch.empty_like(p.q, memory_format=torch.contiguous_format) if p.out is None else p.out
        if p.split_kv:
            lse = _run_split_kv(p, out)
        elif p.plain:
            lse = _run_native(p.q, p.k, p.v, out, p.left, p.right, p.scale, p.target)
        else:
            lse = _run_native_ext(p, out)
    return (out, lse) if p.return_lse else out


class Problem(NamedTuple):
    """One gqa_attention call, resolved and checked (immutable, built once per call); the window
    as (left, right) with -1 unbounded; softcap None when off; plain: padded, no sinks, no softcap
    (the kernel as it was before those options); split_kv: the split-KV kernel runs it (a paged cache, an FP8
    cache, or padded q and k with at most DECODE_MAX_ROWS rows per sequence); target for backend='tilelang' only;
    kv: the cache's dtype and dequant scales."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    block_table: torch.Tensor | None
    seq_lens_k: torch.Tensor | None
    batch: int
    left: int
    right: int
    sinks: torch.Tensor | None
    softcap: float | None
    scale: float
    return_lse: bool
    out: torch.Tensor | None
    plain: bool
    split_kv: bool
    target: str | None
    kv: C.KVScales


def _max_seqlen(name: str, v, with_: str) -> int:
    if v is None:
        raise ValueError(f"{name} is required with {with_} (a host int, at least every sequence's length)")
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _offsets(name: str, cu, batch: int | None) -> int:
    """cu_seqlens int32 [B + 1] (B >= 1); returns B, which must equal batch when given."""
    C.int32(name, cu, ndim=1)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must hold B + 1 >= 2 offsets, got shape {tuple(cu.shape)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} must have shape ({batch + 1},) (B + 1 offsets, B = {batch} from cu_seqlens_q), got {tuple(cu.shape)}")
    return cu.shape[0] - 1


def _softcap(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"softcap must be None or a float, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"softcap must be None, 0 (both disable it) or a positive finite number, got {v}")
    return v or None


def _layout(varlen_q, varlen_k, paged, max_seqlen_q, max_seqlen_k, seq_lens_k) -> None:
    """Which metadata go together: varlen q with varlen k or a paged cache, padded q with padded k or a paged cache."""
    if varlen_k and not varlen_q:
        raise ValueError("cu_seqlens_k needs varlen q (cu_seqlens_q, q [total_q, H, D]); padded q takes padded k")
    if varlen_k and paged:
        raise ValueError("pass either cu_seqlens_k (varlen k) or block_table (a paged cache), not both")
    if varlen_q and not varlen_k and not paged:
        raise ValueError("varlen q (cu_seqlens_q) needs varlen k (cu_seqlens_k, max_seqlen_k) or a paged cache (block_table, seq_lens_k)")
    if max_seqlen_q is not None and not varlen_q:
        raise ValueError("max_seqlen_q applies to varlen q (with cu_seqlens_q), not padded q [B, Sq, H, D]")
    if max_seqlen_k is not None and not varlen_k:
        raise ValueError("max_seqlen_k applies to varlen k (with cu_seqlens_k); a paged cache's lengths are seq_lens_k")
    if paged and seq_lens_k is None:
        raise ValueError("block_table needs seq_lens_k (int32 [B], each sequence's key count)")
    if seq_lens_k is not None and not paged:
        raise ValueError("seq_lens_k applies to a paged cache (with block_table); varlen k takes cu_seqlens_k")


def _resolve(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seq_lens_k,
             sliding_window, sinks, softcap, scale, k_scale, v_scale, out, return_lse, backend) -> Problem:
    """Every check of gqa_attention, in one order: inputs and their layout (padded, varlen, paged),
    devices, shapes, metadata, window, sinks and scalars, out, the debug value checks, the native limits."""
    backend = _dispatch.backend(backend)
    varlen_q, paged, varlen_k = cu_seqlens_q is not None, block_table is not None, cu_seqlens_k is not None
    _layout(varlen_q, varlen_k, paged, max_seqlen_q, max_seqlen_k, seq_lens_k)
    q_shape = "[total_q, H, D]" if varlen_q else "[B, Sq, H, D]"
    kv_shape = "[pages, page_size, H_kv, D]" if paged else "[total_k, H_kv, D]" if varlen_k else "[B, Sk, H_kv, D]"
    for name, x, shape in (("q", q, q_shape), ("k", k, kv_shape), ("v", v, kv_shape)):
        C.tensor(name, x)
        if x.dim() != shape.count(",") + 1:
            raise ValueError(f"{name} must be {shape} (rank {shape.count(',') + 1}) here, got shape {tuple(x.shape)}")
        C.floating(name, x)
    C.same_device(q=q, k=k, v=v)
    kv = C.kv_scales(k, v, k_scale, v_scale, q)
    H, D = q.shape[-2], q.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"k must be {kv_shape} with D = {D} as in q, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    Hkv = k.shape[-2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's head count H = {H} must be a positive multiple of k's H_kv = {Hkv}")
    # The metadata: the batch comes from q (padded) or cu_seqlens_q, and everything else must agree.
    if varlen_q:
        batch = _offsets("cu_seqlens_q", cu_seqlens_q, None)
        max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, "cu_seqlens_q")
        if max_seqlen_q == 0 and q.shape[0]:  # offsets run from 0 to total_q > 0: some sequence is longer
            raise ValueError(f"max_seqlen_q is 0 but q holds {q.shape[0]} rows; it must be at least every sequence's length")
    else:
        batch = q.shape[0]
    if varlen_k:
        _offsets("cu_seqlens_k", cu_seqlens_k, batch)
        max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, "cu_seqlens_k")
    if paged:
        C.block_table_rows(block_table, batch)
        C.int32("seq_lens_k", seq_lens_k, shape=(batch,))
    elif not varlen_q and k.shape[0] != batch:
        raise ValueError(f"k must be [B, Sk, H_kv, D] with B = {batch} as in q, got {tuple(k.shape)}")
    C.same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table, seq_lens_k=seq_lens_k)
    left, right = parse_window(sliding_window)
    if sinks is not None:
        C.tensor("sinks", sinks, ndim=1)
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be a float32 tensor (one logit per query head), got {sinks.dtype}")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"sinks must have shape ({H},) (one logit per query head), got {tuple(sinks.shape)}")
        C.same_device(q=q, sinks=sinks)
    softcap = _softcap(softcap)
    mult = C.score_multiplier(scale, None, max(D, 1))
    return_lse = C.flag("return_lse", return_lse)
    if out is not None:
        C.out_buffer("out", out, shape=q.shape, dtype=q.dtype, device=q.device)
        C.no_overlap({"out": out}, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                                    "block_table": block_table, "seq_lens_k": seq_lens_k, "sinks": sinks})
    if _debug.enabled():
        _debug_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seq_lens_k)
    if _debug.enabled() or backend == "reference":
        _debug.scales(kv)
    plain = not varlen_q and not paged and sinks is None and softcap is None
    target = None
    if backend == "tilelang":
        C.native_dtype("q", q)
        _native_dim("q", D)
        for name, x in (("q", q), ("k", k), ("v", v)):
            C.vector_layout(name, x)
        if out is not None:
            C.vector_layout("out", out)
        target = _dispatch.target_of(q, "q")
    split_kv = paged or kv.fp8 or (not varlen_q and not varlen_k and q.shape[1] <= DECODE_MAX_ROWS)
    return Problem(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seq_lens_k,
                   batch, left, right, sinks, softcap, mult, return_lse, out, plain, split_kv, target, kv)


def _debug_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seq_lens_k) -> None:
    """The values the call trusts (MATE_DEBUG_CHECKS): offsets, lengths within max_seqlen_*, page ids."""
    for name, cu, total, exact, cap in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], True, max_seqlen_q),
                                        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], False, max_seqlen_k)):
        if cu is not None:
            _debug.offsets(name, cu.long(), total, exact=exact)
            _debug.lengths(f"{name}[b + 1] - {name}[b]", cu[1:] - cu[:-1], cap, f"max_seqlen_{name[-1]} = {cap}")
    if block_table is not None:
        pages, ps = k.shape[:2]
        _debug.in_range("block_table", block_table, -1, pages, f" (the cache holds {pages} pages)")
        _debug.lengths("seq_lens_k", seq_lens_k, block_table.shape[1] * ps, "keys a block_table row holds")


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


class Geometry(NamedTuple):
    """build_gqa_attn's arguments, resolved and checked once: the launcher's fixed geometry and window
    ((left, right), -1 unbounded) and the default scale 1/sqrt(D)."""

    batch: int
    heads: int
    kv_heads: int
    dim: int
    left: int
    right: int
    scale: float


class Launch(NamedTuple):
    """One launch of build_gqa_attn's launcher, resolved and checked: the 4-D views of Q, K, V and O, the target."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    target: str


def _resolve_geometry(ATTN_B, ATTN_H, ATTN_H_KV, ATTN_D, sliding_window) -> Geometry:
    B = _int("ATTN_B", ATTN_B, minimum=1)
    H = _int("ATTN_H", ATTN_H, minimum=1)
    Hkv = _int("ATTN_H_KV", ATTN_H_KV, minimum=1)
    D = _int("ATTN_D", ATTN_D, minimum=1)
    if H % Hkv:
        raise ValueError(f"ATTN_H = {H} must be a multiple of ATTN_H_KV = {Hkv}")
    _native_dim("ATTN_D", D)
    left, right = parse_window(sliding_window)
    return Geometry(B, H, Hkv, D, left, right, 1.0 / math.sqrt(D))


def _resolve_launch(g: Geometry, Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1, seq_len_q, seq_len_kv) -> Launch:
    """Every check of one launch, in one order: lengths, strides, the four views, dtypes, devices, overlap, layout, target."""
    sq = _int("seq_len_q", seq_len_q, minimum=0)
    sk = _int("seq_len_kv", seq_len_kv, minimum=0)
    strides = {}
    for name, s in (("Q_stride1", Q_stride1), ("K_stride1", K_stride1), ("V_stride1", V_stride1), ("O_stride1", O_stride1)):
        strides[name] = _int(name, s, minimum=1)
    q = _rows_view("Q", Q, g.batch, sq, g.heads, g.dim, strides["Q_stride1"])
    k = _rows_view("K", K, g.batch, sk, g.kv_heads, g.dim, strides["K_stride1"])
    v = _rows_view("V", V, g.batch, sk, g.kv_heads, g.dim, strides["V_stride1"])
    o = _rows_view("O", O, g.batch, sq, g.heads, g.dim, strides["O_stride1"])
    C.same_dtype(Q=q, K=k, V=v, O=o)
    C.same_device(Q=q, K=k, V=v, O=o)
    C.native_dtype("Q", q)
    C.no_overlap({"O": o}, {"Q": q, "K": k, "V": v})
    for name, x in (("Q", q), ("K", k), ("V", v), ("O", o)):
        C.vector_layout(name, x)
    return Launch(q, k, v, o, _dispatch.target_of(q, "Q"))


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
    g = _resolve_geometry(ATTN_B, ATTN_H, ATTN_H_KV, ATTN_D, sliding_window)

    def launch(Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1, seq_len_q, seq_len_kv):
        p = _resolve_launch(g, Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1, seq_len_q, seq_len_kv)
        _run_native(p.q, p.k, p.v, p.o, g.left, g.right, g.scale, p.target)
        return O

    return launch
