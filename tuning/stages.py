"""What the tuner knows about each native stage, one `Tunable` per stage.

A `Tunable` takes the stage's search space (values per tile parameter) and the
limits a candidate must meet before it is compiled (shared memory, registers,
the kernel's own shape rules) from the stage's card (mate/*/kernels/*_card.py),
and adds the problem shapes it is timed on (presets `quick` and `full`) and how
to build one workload: inputs on the GPU and two calls, the native entrypoint
and its reference. The tuner runs the
native call under each candidate's tiles (through the public API, so the
wrapper sees the tiles too) and compares it with the reference.

Adding a stage: its card, then one `Tunable(...)` entry in TUNABLES below.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

import mate
from mate._dispatch import Stage
from mate.nsa.kernels import selection_card
from mate.qsa.kernels import mqa_card, sparse_card
from mate.swa.kernels import gqa_card
from mate.testing import nsa_selection_workload


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

    @classmethod
    def of(cls, card: Stage, **kw) -> "Tunable":
        """The tuner's entry of a stage: space and limits from its card, the rest from `kw`."""
        return cls(stage=card.name, space=card.space, limits=card.limits, **kw)


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


# ---------------------------------------------------------------- MQA indexer: prefill / padded score logits

HEADS, DIM = mqa_card.HEADS, mqa_card.DIM


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


MQA_LOGITS = Tunable.of(
    mqa_card.LOGITS,
    shapes=dict(
        quick=[dict(rows=4096, keys=4096)],
        full=[dict(rows=8192, keys=8192), dict(rows=1024, keys=8192), dict(rows=8192, keys=2048)],
    ),
    workload=_logits_workload,
    tol=1e-4,
)


# ---------------------------------------------------------------- MQA indexer: paged decode


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


MQA_DECODE = Tunable.of(
    mqa_card.DECODE,
    # Batches whose keys (batch x keys x 256 B) exceed the 60 MB L2, so the timing is of HBM reads.
    shapes=dict(quick=[dict(batch=32, keys=8192)], full=[dict(batch=32, keys=8192), dict(batch=128, keys=8192), dict(batch=8, keys=65536)]),
    workload=_decode_workload,
    tol=1e-4,
)


# ---------------------------------------------------------------- NSA selection attention


NSA_SELECTION = Tunable.of(
    selection_card.STAGE,
    shapes=dict(quick=[dict(seq=8192, heads=128, kv_heads=8, selected=16)],
                full=[dict(seq=32768, heads=128, kv_heads=8, selected=16), dict(seq=32768, heads=64, kv_heads=4, selected=16)]),
    workload=nsa_selection_workload,
    tol=1e-2,
)


# ---------------------------------------------------------------- GQA attention, dense / sliding window


def _gqa_workload(spec, shape):
    S, H, Hkv, d = shape["seq"], shape["heads"], shape["kv_heads"], spec["dim"]
    window = {"none": None, "causal": (-1, 0), "local": tuple(shape.get("window", (4096, 0)))}[spec["window"]]
    dt = _dtype(spec)
    q = torch.randn(1, S, H, d, device="cuda").to(dt)
    k = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    v = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    return (lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True),
            lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference"))


GQA_FWD = Tunable.of(
    gqa_card.STAGE,
    shapes=dict(quick=[dict(seq=4096, heads=64, kv_heads=8)],
                full=[dict(seq=16384, heads=64, kv_heads=8), dict(seq=16384, heads=64, kv_heads=8, window=(512, 0))]),
    workload=_gqa_workload,
    tol=1e-2,
)


# ---------------------------------------------------------------- QSA sparse attention and its SplitKV merge

QSA_HQ, QSA_HKV, QSA_DIM = sparse_card.CANONICAL_GEOMETRY


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


QSA_ATTENTION = Tunable.of(
    sparse_card.ATTENTION,
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


QSA_MERGE = Tunable.of(
    sparse_card.MERGE,
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
