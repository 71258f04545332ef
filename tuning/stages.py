"""What the tuner knows about each native stage, one `Tunable` per stage.

A `Tunable` declares the stage's search space (values per tile parameter), the
hardware limits a candidate must meet before it is compiled (shared memory,
registers, the kernel's own shape rules), the problem shapes it is timed on
(presets `quick` and `full`), and how to build one workload: inputs on the GPU
and two calls, the native entrypoint and its reference. The tuner runs the
native call under each candidate's tiles (through the public API, so the
wrapper sees the tiles too) and compares it with the reference.

Adding a stage: one `Tunable(...)` entry in TUNABLES below.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

import mate

# Hopper (sm_90a) limits.
SMEM_PER_CTA = 227 * 1024  # the opt-in maximum of one block's shared memory
SMEM_PER_SM = 228 * 1024  # one multiprocessor's, of which 1 KB per resident block is reserved
REGS_PER_SM = 65536
MAX_REGS = 255
WARPGROUP = 128  # wgmma is issued by warpgroups of 128 threads, each owning 64 rows of M


@dataclass(frozen=True)
class Tunable:
    stage: str
    space: dict[str, tuple[int, ...]]
    # (spec, tiles) -> why the candidate cannot run or would spill, or None when legal.
    limits: Callable[[dict, dict], str | None]
    # preset -> problem shapes; each shape is a dict that `workload` understands.
    shapes: dict[str, list[dict]]
    # (spec, shape) -> (native call, reference call[, pick]); the calls return a tensor or a tuple of
    # tensors. `pick`, where given, maps the native outputs to the part the reference computes (a
    # reference too slow for the whole timed shape checks a slice of it).
    workload: Callable[[dict, dict], tuple]
    # Largest accepted relative error (L2 norm over finite values) of each output against the reference.
    tol: float


def candidates(t: Tunable, spec: dict) -> tuple[list[dict], list[tuple[dict, str]]]:
    """The legal tile candidates of the space, and the pruned ones with the reason."""
    legal, pruned = [], []
    for values in itertools.product(*t.space.values()):
        tiles = dict(zip(t.space, values))
        why = t.limits(spec, tiles)
        (pruned.append((tiles, why)) if why else legal.append(tiles))
    return legal, pruned


def _dtype(spec: dict) -> torch.dtype:
    return getattr(torch, spec["dtype"])


def _bytes(spec: dict) -> int:
    return _dtype(spec).itemsize


def _warpgroups(threads: int, rows: int, what: str) -> str | None:
    if threads % WARPGROUP:
        return f"threads {threads} is not whole warpgroups (wgmma)"
    if rows % (64 * (threads // WARPGROUP)):
        return f"{what} {rows} does not give each of {threads // WARPGROUP} warpgroups whole 64-row wgmma tiles"
    return None


# ---------------------------------------------------------------- MQA indexer: prefill / padded score logits

HEADS, DIM = 4, 128  # the indexer's geometry (mate.qsa.kernels.mqa)


def _logits_limits(spec, t):
    if why := _warpgroups(t["threads"], t["block_rows"], "block_rows"):
        return why
    smem = _bytes(spec) * (HEADS * t["block_rows"] * DIM + t["num_stages"] * t["block_keys"] * DIM) + 2 * t["block_rows"] * 4
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    regs = 2 * t["block_rows"] * t["block_keys"] // t["threads"]  # S and acc, FP32
    if regs + 64 > MAX_REGS:
        return f"{regs} accumulator registers per thread leave too few of {MAX_REGS}"
    return None


def _logits_workload(spec, shape):
    rows, keys = shape["rows"], shape["keys"]
    keys += keys % 2 != (spec["even_keys"] == 0)  # the key count's parity picks the specialization: make it match
    dt = _dtype(spec)
    q = torch.randn(rows, HEADS, DIM, device="cuda").to(dt)
    k = torch.randn(keys, DIM, device="cuda").to(dt)
    # The last `rows` token positions of a request of 4 * keys tokens, each seeing its complete blocks.
    pos = torch.arange(4 * keys - rows, 4 * keys, device="cuda")
    lo = torch.zeros(rows, device="cuda", dtype=torch.int32)
    hi = ((pos + 1) // 4).to(torch.int32)
    return (lambda: mate.qsa_mqa_prefill(q, k, lo, hi), lambda: mate.qsa_mqa_prefill(q, k, lo, hi, backend="reference"))


MQA_LOGITS = Tunable(
    stage="mqa_logits",
    space=dict(block_rows=(64, 128), block_keys=(64, 128, 256), threads=(128, 256), num_stages=(1, 2, 3)),
    limits=_logits_limits,
    shapes=dict(
        quick=[dict(rows=4096, keys=4096)],
        full=[dict(rows=8192, keys=8192), dict(rows=1024, keys=8192), dict(rows=8192, keys=2048)],
    ),
    workload=_logits_workload,
    tol=1e-4,
)


# ---------------------------------------------------------------- MQA indexer: paged decode


def _decode_limits(spec, t):
    if t["block_keys"] % spec["page_size"]:
        return f"block_keys {t['block_keys']} is not a multiple of page_size {spec['page_size']}"
    if (t["block_keys"] * DIM // 8) % t["threads"]:
        return "threads do not split the tile's 16-byte loads evenly"
    if why := _warpgroups(t["threads"], t["block_keys"], "block_keys"):
        return why
    smem = _bytes(spec) * (8 + t["block_keys"]) * DIM
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    # The gathered keys sit in registers before the shared-memory store, plus S (block_keys x 8 heads, FP32).
    regs = t["block_keys"] * DIM * _bytes(spec) // 4 // t["threads"] + t["block_keys"] * 8 // t["threads"]
    if regs + 64 > MAX_REGS:
        return f"{regs} registers per thread for the gather and S leave too few of {MAX_REGS}"
    return None


def _decode_workload(spec, shape):
    batch, keys, page = shape["batch"], shape["keys"], spec["page_size"]
    pages = keys // page
    dt = _dtype(spec)
    cache = torch.randn(batch * pages, page, 1, DIM, device="cuda").to(dt)
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    q = torch.randn(batch, HEADS, DIM, device="cuda").to(dt)
    ctx = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    return (lambda: mate.qsa_mqa_decode(q, cache, table, ctx, keys),
            lambda: mate.qsa_mqa_decode(q, cache, table, ctx, keys, backend="reference"))


MQA_DECODE = Tunable(
    stage="mqa_decode",
    space=dict(block_keys=(64, 128, 256), threads=(128, 256)),
    limits=_decode_limits,
    # Batches whose keys (batch x keys x 256 B) exceed the 60 MB L2, so the timing is of HBM reads.
    shapes=dict(quick=[dict(batch=32, keys=8192)], full=[dict(batch=32, keys=8192), dict(batch=128, keys=8192), dict(batch=8, keys=65536)]),
    workload=_decode_workload,
    tol=1e-4,
)


# ---------------------------------------------------------------- NSA selection attention


def _nsa_limits(spec, t):
    if t["threads"] != WARPGROUP:
        return "the kernel's MMA tiles are sized for one consumer warpgroup (threads=128)"
    if t["head_tile"] != 16:
        return "head_tile below 16 would refuse the supported H/G = 16; above 16 wastes MMA columns"
    d, ht = spec["dim"], t["head_tile"]
    # As the kernel's generated CUDA lays it out: Q, the K and V rings (O goes through the first K
    # stage), P, and the max and sum reductions' scratch (threads x head_tile/4 floats each, never
    # merged, see the kernel's PASS_CONFIGS); static: the compacted block list, its count and the
    # four mbarriers per stage.
    smem = _bytes(spec) * (ht * d + t["num_stages"] * 2 * 64 * d + 64 * ht) + 2 * t["threads"] * (ht // 4) * 4
    smem += 128 * 4 + 4 + 4 * t["num_stages"] * 8
    if t["min_blocks"] * (smem + 1024) > SMEM_PER_SM:
        return f"{t['min_blocks']} CTAs of {smem} B shared memory do not fit in one SM"
    # A producer warpgroup runs beside the consumer: 2 x threads per CTA share the SM's registers.
    cap = min(MAX_REGS, REGS_PER_SM // (2 * t["threads"] * t["min_blocks"]))
    regs = (d * ht + 64 * ht * 2) // t["threads"] + 64 * ht // 2 // t["threads"]  # acc, S, row sums (FP32), P (16-bit)
    if regs + 24 > cap:
        return f"{t['min_blocks']} CTAs per SM cap registers at {cap} per thread, below {regs} + 24"
    return None


def draw_block_indices(B, M, N, G, T, bs, hot=False, chunk=4096):
    """T distinct random causally visible blocks per (query, group), sorted, -1 where fewer exist (bottom-right aligned).

    `hot` draws from the first T blocks only, so every query reads the same blocks (a benchmark probe).
    """
    n_blocks = -(-N // bs)
    idx = torch.empty(B, M, G, T, dtype=torch.int32, device="cuda")
    blocks = torch.arange(n_blocks, device="cuda")
    for m0 in range(0, M, chunk):
        m1 = min(M, m0 + chunk)
        pos = N - M + torch.arange(m0, m1, device="cuda")
        visible = blocks.view(1, -1) <= (pos // bs).view(-1, 1)
        if hot:
            visible &= blocks.view(1, -1) < T
        r = torch.rand(B, m1 - m0, G, n_blocks, device="cuda")
        r = torch.where(visible.view(1, m1 - m0, 1, n_blocks), r, -1.0)
        val, sel = r.topk(min(T, n_blocks), dim=-1)
        sel = torch.where(val >= 0, sel, n_blocks + 1).sort(-1).values
        sel = torch.where(sel > n_blocks, -1, sel)
        if T > n_blocks:
            sel = torch.cat([sel, sel.new_full((*sel.shape[:-1], T - n_blocks), -1)], -1)
        idx[:, m0:m1] = sel.to(torch.int32)
    return idx


def _nsa_workload(spec, shape):
    L, H, G, T, d, bs = shape["seq"], shape["heads"], shape["kv_heads"], shape["selected"], spec["dim"], spec["block_size"]
    dt = _dtype(spec)
    q = torch.randn(1, L, H, d, device="cuda").to(dt)
    k = torch.randn(1, L, G, d, device="cuda").to(dt)
    v = torch.randn(1, L, G, d, device="cuda").to(dt)
    idx = draw_block_indices(1, L, L, G, T, bs)
    # The reference is dense over the keys (M x N x H scores in FP32), too slow for the whole timed
    # shape: it checks the last rows, which keep their positions (bottom-right aligned) and select
    # the most blocks.
    tail = min(L, 128)
    return (lambda: mate.nsa_selection_attention(q, k, v, idx, block_size=bs),
            lambda: mate.nsa_selection_attention(q[:, -tail:], k, v, idx[:, -tail:], block_size=bs, backend="reference"),
            lambda out: (out[0][:, -tail:], out[1][:, :, -tail:]))


NSA_SELECTION = Tunable(
    stage="nsa_selection",
    space=dict(head_tile=(16,), threads=(128,), num_stages=(1, 2, 3, 4), min_blocks=(1, 2, 3, 4)),
    limits=_nsa_limits,
    shapes=dict(quick=[dict(seq=8192, heads=128, kv_heads=8, selected=16)],
                full=[dict(seq=32768, heads=128, kv_heads=8, selected=16), dict(seq=32768, heads=64, kv_heads=4, selected=16)]),
    workload=_nsa_workload,
    tol=1e-2,
)


# ---------------------------------------------------------------- GQA attention, dense / sliding window


def _gqa_limits(spec, t):
    wgs = t["threads"] // WARPGROUP
    if why := _warpgroups(t["threads"], t["block_m"], "block_m"):
        return why
    if wgs > 3:
        return "more than 3 consumer warpgroups (plus the producer) exceed 512 threads"
    if t["block_n"] % 16 or t["block_n"] > 256:
        return f"block_n {t['block_n']} is not a wgmma N (multiple of 16, at most 256)"
    d = spec["dim"]
    smem = _bytes(spec) * (t["block_m"] * d + t["num_stages"] * 2 * t["block_n"] * d)  # Q (O reuses it), K and V rings
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    cap = 240 if wgs <= 2 else 160  # setmaxnreg of the consumers, as the kernel sets it
    regs = (t["block_m"] * t["block_n"] * 3 // 2 + t["block_m"] * d) // t["threads"]  # S, O (FP32) and P (16-bit)
    if regs + 32 > cap:
        return f"{regs} accumulator registers per consumer thread + 32 > {cap}"
    return None


def _gqa_workload(spec, shape):
    S, H, Hkv, d = shape["seq"], shape["heads"], shape["kv_heads"], spec["dim"]
    window = {"none": None, "causal": (-1, 0), "local": tuple(shape.get("window", (4096, 0)))}[spec["window"]]
    dt = _dtype(spec)
    q = torch.randn(1, S, H, d, device="cuda").to(dt)
    k = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    v = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    return (lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True),
            lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference"))


GQA_FWD = Tunable(
    stage="gqa_fwd",
    space=dict(block_m=(64, 128, 192), block_n=(64, 128, 192), threads=(128, 256, 384), num_stages=(1, 2, 3), mma_depth=(1, 2)),
    limits=_gqa_limits,
    shapes=dict(quick=[dict(seq=4096, heads=64, kv_heads=8)],
                full=[dict(seq=16384, heads=64, kv_heads=8), dict(seq=16384, heads=64, kv_heads=8, window=(512, 0))]),
    workload=_gqa_workload,
    tol=1e-2,
)


# ---------------------------------------------------------------- QSA sparse attention and its SplitKV merge

QSA_HQ, QSA_HKV, QSA_DIM, QSA_TILE = 24, 2, 256, 64  # canonical geometry (mate.qsa.kernels.sparse)


def _qsa_limits(spec, t):
    if t["head_tile"] < 16 or t["head_tile"] % 8:
        return f"head_tile {t['head_tile']} must be a multiple of 8 (wgmma N) holding a group of up to 16 heads"
    # Q and P tiles, the K/V ring, reduction workspaces; token lists, flags and barriers are static (about 5 KB).
    smem = _bytes(spec) * (t["head_tile"] * QSA_DIM + 2 * t["num_stages"] * QSA_TILE * QSA_DIM + QSA_TILE * t["head_tile"])
    smem += 4096 + 5 * 1024
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    return None


def _qsa_workload(spec, shape):
    """Paged decode rows: `batch` requests of `context` tokens, each with `width` random tokens of its own pages.

    The key's `wide` picks the grid size (two CTAs per SM or more, or fewer): the batch is scaled to match.
    """
    splits = 4 if spec["split"] else 1
    batch = shape["batch"] if spec["wide"] else max(1, shape["batch"] // 16)
    context, width, page = shape["context"], shape["width"], 64
    dt = _dtype(spec)
    pages = context // page
    k = torch.randn(batch * pages, page, QSA_HKV, QSA_DIM, device="cuda").to(dt)
    v = torch.randn_like(k)
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    q = torch.randn(batch, QSA_HQ, QSA_DIM, device="cuda").to(dt)
    tokens = torch.randint(0, context, (batch, width), device="cuda", dtype=torch.int32)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    kw = dict(block_table=table, cu_seqlens_q=cu, num_splits=splits, return_lse=True)
    return (lambda: mate.qsa_sparse_attention(q, k, v, tokens, **kw),
            lambda: mate.qsa_sparse_attention(q, k, v, tokens, **kw, backend="reference"))


QSA_ATTENTION = Tunable(
    stage="qsa_attention",
    space=dict(head_tile=(16,), num_stages=(1, 2, 3)),
    limits=_qsa_limits,
    # batch 256: 512 CTAs (wide); the narrow keys run batch 16 (32 CTAs, 128 with 4 splits)
    shapes=dict(quick=[dict(batch=256, context=32768, width=2051)],
                full=[dict(batch=256, context=32768, width=2051), dict(batch=128, context=16384, width=2051)]),
    workload=_qsa_workload,
    tol=1e-2,
)


def _merge_workload(spec, shape):
    splits, rows = shape["splits"], shape["rows"]
    po = torch.randn(splits, rows, QSA_HQ, QSA_DIM, device="cuda").to(getattr(torch, spec["pdtype"]))
    pl = torch.randn(splits, rows, QSA_HQ, device="cuda")
    odt = getattr(torch, spec["odtype"])
    return (lambda: mate.merge_attention_states(po, pl, out_dtype=odt),
            lambda: mate.merge_attention_states(po, pl, out_dtype=odt, backend="reference"))


QSA_MERGE = Tunable(
    stage="qsa_merge",
    space=dict(threads=(64, 128, 256)),
    limits=lambda spec, t: None,
    shapes=dict(quick=[dict(splits=8, rows=64)], full=[dict(splits=8, rows=64), dict(splits=16, rows=8)]),
    workload=_merge_workload,
    tol=1e-2,
)


TUNABLES = {t.stage: t for t in (MQA_LOGITS, MQA_DECODE, NSA_SELECTION, GQA_FWD, QSA_ATTENTION, QSA_MERGE)}


def rel_error(out, ref) -> float:
    """Largest relative L2 error over the outputs; inf when NaN appears or the infinities differ."""
    if isinstance(out, torch.Tensor):
        out, ref = (out,), (ref,)
    worst = 0.0
    for o, r in zip(out, ref):
        o, r = o.double(), r.double().to(o.device)
        if torch.isnan(o).any() or not torch.equal(torch.isinf(o), torch.isinf(r)) or not torch.equal(o[torch.isinf(o)], r[torch.isinf(r)]):
            return math.inf
        fin = torch.isfinite(r)
        worst = max(worst, float((o[fin] - r[fin]).norm() / r[fin].norm().clamp_min(1e-30)))
    return worst
