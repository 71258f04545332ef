"""The MQA indexer kernels against another version of their source, in one process on the same data.

    git show b8777bc:mate/qsa/kernels/mqa.py > /tmp/old_mqa.py
    python benchmarks/experiments/mqa_ab.py --against /tmp/old_mqa.py [--out FILE] [--compile-only] [--workers N]
                                [--batches 1 64] [--full-contexts] [--page-size 16]

Issue 16's shapes (bench_mqa's cases): prefill, 8192 rows at positions 24576..32767 of a request
against its 8192 compressed keys (row_ends = (pos + 1) // 4); paged decode, page 16, 8192 keys,
batches 1 and 64 (`--batches`), each request's context a random length in [4096, 8192] (request 0:
8192), or with `--full-contexts` all 8192 keys, as bench_mqa and issue 16 take them; `--page-size` picks
the decode cache's page size (and the config entry the decode variants stand in for). Each version of VARIANTS (program: the current source or the other; tiles) is
compiled first in parallel processes (TileLang's disk cache; --compile-only stops there, for a CPU
host with nvcc), then handed to the dispatcher (overrides.using_kernel), so the public API runs it.

Per variant: the relative error against the reference backend on fresh random inputs, with the
output's memory poisoned (NaN) first; LAUNCHES back-to-back launches, whose last result must equal
the first bit for bit; then in three interleaved rounds (the middle one reported) the time of one
call per CUDA-graph replay with L2 flushed before each (do_bench; the issue's method: "cold") and
of back-to-back calls in one graph ("warm", common.graph_ms).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

from common import RESULTS, cold_graph_us, rel_err, write_json  # noqa: E402

import mate  # noqa: E402

LAUNCHES = 1000
LOGITS_KEY = dict(dtype="bfloat16", even_keys=1)
DECODE_KEY = dict(dtype="bfloat16", page_size=16)
KEYS = {"mqa_logits": LOGITS_KEY, "mqa_decode": DECODE_KEY}  # the specialization each stage's variants take
# (name, stage, program: "current" or "other", tiles)
VARIANTS = [
    ("logits other 64x128 s2", "mqa_logits", "other", dict(block_rows=64, block_keys=128, threads=128, num_stages=2, min_blocks=1)),
    ("logits 64x128 s2", "mqa_logits", "current", dict(block_rows=64, block_keys=128, threads=128, num_stages=2, min_blocks=1)),
    ("logits 64x128 s1 2/SM", "mqa_logits", "current", dict(block_rows=64, block_keys=128, threads=128, num_stages=1, min_blocks=2)),
    ("logits 64x64 s2 2/SM", "mqa_logits", "current", dict(block_rows=64, block_keys=64, threads=128, num_stages=2, min_blocks=2)),
    ("logits 64x64 s3", "mqa_logits", "current", dict(block_rows=64, block_keys=64, threads=128, num_stages=3, min_blocks=1)),
    ("decode other 128/256", "mqa_decode", "other", dict(block_keys=128, threads=256)),
    ("decode 128/256", "mqa_decode", "current", dict(block_keys=128, threads=256)),
    ("decode other 64/128", "mqa_decode", "other", dict(block_keys=64, threads=128)),
    ("decode 64/128", "mqa_decode", "current", dict(block_keys=64, threads=128)),
    ("decode 128/128", "mqa_decode", "current", dict(block_keys=128, threads=128)),
    ("decode 256/256", "mqa_decode", "current", dict(block_keys=256, threads=256)),
]


def jobs(against: Path, keys: dict) -> list[tuple]:
    # b8777bc's logits program (the version this was written against) has no min_blocks: one CTA per multiprocessor.
    drop = () if "min_blocks" in against.read_text() else ("min_blocks",)
    return [(stage, keys[stage], tiles if prog == "current" else {p: v for p, v in tiles.items() if p not in drop},
             None if prog == "current" else str(against)) for _, stage, prog, tiles in VARIANTS]


def poisoned(shape) -> int:
    """Leave a NaN block of this size in the caching allocator (the next torch.empty of the size gets it); its address."""
    return torch.full(shape, float("nan"), device="cuda").data_ptr()


def prefill_case(gen):
    rows, keys = 8192, 8192
    pos = torch.arange(32768 - rows, 32768, device="cuda")
    q = torch.randn(rows, 4, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(keys, 128, device="cuda", generator=gen).bfloat16()
    lo = torch.zeros(rows, device="cuda", dtype=torch.int32)
    hi = ((pos + 1) // 4).to(torch.int32)
    return "prefill 8192 x 8192", (rows, keys), lambda backend="tilelang": mate.qsa_mqa_prefill(q, k, lo, hi, backend=backend)


def decode_case(gen, batch, full, keys=8192, ps=16):
    pages = batch * keys // ps
    cache = torch.randn(pages, ps, 1, 128, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    q = torch.randn(batch, 4, 128, device="cuda", generator=gen).bfloat16()
    ctx = torch.randint(keys // 2, keys + 1, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    ctx[0] = keys
    if full:
        ctx.fill_(keys)
    return (f"decode b={batch} x {keys}, page {ps}{', full contexts' if full else ''}", (batch, keys),
            lambda backend="tilelang": mate.qsa_mqa_decode(q, cache, table, ctx, keys, backend=backend))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other version of mate/qsa/kernels/mqa.py")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="decode batches")
    ap.add_argument("--full-contexts", action="store_true", help="every request's 8192 keys (bench_mqa's decode inputs)")
    ap.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64], help="decode's page size")
    a = ap.parse_args(argv)
    from common import environment, graph_ms
    from overrides import cache_variants, compile_variant, using_kernel

    keys = dict(KEYS, mqa_decode=dict(DECODE_KEY, page_size=a.page_size))
    todo = jobs(a.against, keys)
    errors = cache_variants(todo, a.workers)
    for (name, *_), error in zip(VARIANTS, errors):
        print(f"compiled {name}: {error or 'ok'}", flush=True)
    if a.compile_only:
        return {}
    kernels = [compile_variant(*job) if error is None else None for job, error in zip(todo, errors)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {"mqa_logits": [prefill_case(gen)], "mqa_decode": [decode_case(gen, b, a.full_contexts, ps=a.page_size) for b in a.batches]}
    res = {**environment(), "against": str(a.against), "launches": LAUNCHES,
           "timing": "us per call; cold: one call per CUDA-graph replay, L2 flushed before each (do_bench median); "
                     "warm: back-to-back calls in one graph (graph_ms); 3 interleaved rounds, the middle", "rows": []}
    for stage, stage_cases in cases.items():
        mine = [(v, k) for v, k in zip(VARIANTS, kernels) if v[1] == stage and k is not None]
        for case, shape, call in stage_cases:
            ref = call("reference")
            rows = {}
            for (name, _, prog, tiles), kern in mine:
                with using_kernel(stage, keys[stage], kern, tiles):
                    ptr = poisoned(shape)
                    out = call()
                    assert out.data_ptr() == ptr, "the output did not land in the poisoned block"
                    torch.cuda.synchronize()
                    first = out.clone()
                    for i in range(LAUNCHES):
                        out = call()
                    torch.cuda.synchronize()
                    try:
                        err = rel_err(first, ref)
                    except AssertionError as e:  # a wrong -inf pattern (NaN: an unwritten output) is reported, not timed
                        err = repr(e)
                    rows[name] = dict(program=prog, tiles=tiles, rel_err=err, nan=bool(first.isnan().any()),
                                      stable=bool(torch.equal(first, out)), cold=[], warm=[])
            for _ in range(3):
                for (name, *_), kern in mine:
                    tiles = rows[name]["tiles"]
                    with using_kernel(stage, keys[stage], kern, tiles):
                        rows[name]["cold"].append(cold_graph_us(call, warmup=10, rep=60))
                        rows[name]["warm"].append(graph_ms(call, target_ms=2, warmup=10, rep=50) * 1e3)
            for name, r in rows.items():
                r["cold_us"], r["warm_us"] = sorted(r["cold"])[1], sorted(r["warm"])[1]
                err = f"{r['rel_err']:.1e}" if isinstance(r["rel_err"], float) else r["rel_err"]
                print(f"{case:<28} {name:<26} cold {r['cold_us']:8.2f} us  warm {r['warm_us']:8.2f} us  err {err}"
                      f"{'  NaN!' if r['nan'] else ''}{'' if r['stable'] else '  CHANGED over launches!'}", flush=True)
            res["rows"].append(dict(case=case, variants=rows))
            write_json(a.out or RESULTS / "mqa_ab.json", res)
    return res


if __name__ == "__main__":
    main()
