"""The NSA selection kernel against other versions of its source, in one process on the same data.

    git show REV:mate/nsa/kernels/selection.py > /tmp/old_selection.py
    python benchmarks/experiments/nsa_ab.py --against /tmp/old_selection.py [--tiles 2/3 2/2] [--out FILE]
    python benchmarks/experiments/nsa_ab.py --against old=/tmp/old.py try=/tmp/try.py --seed-only --heads 128:8 64:8 --jobs 16

For a kernel change, side by side: per case (specialization key, num_stages /
CTAs per SM, shape), every program (the shipped one, "current", and each
--against NAME=FILE, a plain FILE being "other") is compiled with the same
tiles and run on one workload (the tuner's), checked against the reference on
its last rows (and every output compared bitwise with the current one's), then timed in three interleaved rounds of do_bench medians; the
middle round is reported, with each version's ratio to the current one. Cases:
the four bfloat16 keys on the tuner's quick shape (L = 8192, H = 128, G = 8,
T = 16), and the seed shape of issue 5 (L = 65536, D = 128, block 64) at each
--heads H:G; --seed-only keeps the seed shape's cases. --jobs N compiles every
case's programs first in N processes (TileLang's disk cache keys a kernel by
its program, so the timed process loads them). The other sources must define
`nsa_selection_fwd` with the same signature; their PASS_CONFIGS are used if
they have them. All run through the public API (overrides.program_variants
switches the program; the workload is the tuner's, mate.tuning.workloads.nsa_selection_workload).
A version that is not the same function (a timing probe that leaves a step
out) shows its error and is timed all the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

from common import RESULTS, environment, median_ms, write_json  # noqa: E402
from mate.tuning.measure import using_tiles  # noqa: E402
from mate.tuning.workloads import nsa_selection_workload  # noqa: E402
from overrides import cache_variants, program_variants  # noqa: E402

QUICK = dict(seq=8192, heads=128, kv_heads=8, selected=16)
SPECS = [dict(dtype="bfloat16", dim=d, block_size=b) for d in (64, 128) for b in (32, 64)]
STAGE = "nsa_selection"


def key_of(spec: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.items())


def tiles_of(stages: int, min_blocks: int) -> dict:
    return dict(head_tile=16, threads=128, num_stages=stages, min_blocks=min_blocks)


def precompile(sources: dict, cases, jobs: int) -> None:
    todo = sorted({(name, None if src is None else str(src), key_of(spec), s, b)
                   for name, src in sources.items() for spec, s, b, _ in cases})
    work = [(name, src, dict(spec), tiles_of(s, b)) for name, src, key, s, b in todo
            for spec in [next(x for x in SPECS if key_of(x) == key)]]
    # a failure is reported, and the timed run then fails on that case
    for (name, _, spec, _), err in zip(work, cache_variants([(STAGE, spec, tiles, src) for name, src, spec, tiles in work], jobs)):
        if err:
            print(f"compile failed: {name} {key_of(spec)}: {err}", flush=True)


def run_case(sources: dict, spec: dict, stages: int, min_blocks: int, shape: dict) -> dict:
    key = key_of(spec)
    with using_tiles("sm90", STAGE, key, tiles_of(stages, min_blocks)), program_variants(STAGE, sources) as use:
        native, ref, pick = nsa_selection_workload(spec, shape)
        want = ref()
        err, same, first = {}, {}, None
        for name in sources:
            use(name)
            out = native()
            full = [x.clone() for x in out]
            for x in out:  # freed as NaN: the next version's outputs likely reuse this memory, poisoned
                x.fill_(float("nan"))
            del out
            first = first or full
            same[name] = all(torch.equal(a, b) for a, b in zip(full, first))
            err[name] = max((g.float() - w.float()).abs().max().item() for g, w in zip(pick(full), want))
        del full, first
        rounds = {name: [] for name in sources}
        for _ in range(3):
            for name in sources:
                use(name)
                rounds[name].append(median_ms(native, warmup=50, rep=600 if shape["seq"] > 8192 else 200))
    ms = {name: sorted(r)[1] for name, r in rounds.items()}
    return dict(key=key, num_stages=stages, min_blocks=min_blocks, shape=shape, max_abs_err=err, bitwise_equal_current=same, ms=ms, rounds=rounds,
                ratio={name: ms[name] / ms["current"] for name in sources})


def parse_sources(items) -> dict:
    sources = {"current": None}
    for item in items:
        name, _, path = item.rpartition("=")
        sources[name or "other"] = Path(path)
    return sources


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", nargs="+", required=True, help="other versions of mate/nsa/kernels/selection.py: [NAME=]FILE")
    ap.add_argument("--tiles", nargs="*", default=["2/3", "2/2"], help="num_stages/min_blocks pairs")
    ap.add_argument("--heads", nargs="*", default=["128:8"], help="H:G of the seed shape's cases")
    ap.add_argument("--seed-only", action="store_true", help="only the seed shape (L = 65536, D = 128, block 64)")
    ap.add_argument("--jobs", type=int, default=0, help="compile every case's programs first in this many processes")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    sources = parse_sources(a.against)
    torch.manual_seed(0)
    res = dict(environment(), against={k: str(v) for k, v in sources.items() if v is not None}, rows=[])
    pairs = [tuple(map(int, t.split("/"))) for t in a.tiles]
    seeds = [dict(seq=65536, heads=h, kv_heads=g, selected=16) for h, g in (map(int, x.split(":")) for x in a.heads)]
    cases = [] if a.seed_only else [(k, s, b, QUICK) for k in SPECS for s, b in pairs]
    cases += [(SPECS[3], s, b, shape) for shape in seeds for s, b in pairs]
    if a.jobs:
        precompile(sources, cases, a.jobs)
    others = [n for n in sources if n != "current"]
    print(f"{'key':<38} {'tiles':>5} {'L':>6} {'H:G':>6} {'current ms':>10} " + " ".join(f"{n + ' ms (x)':>20}" for n in others), flush=True)
    for spec, s, b, shape in cases:
        r = run_case(sources, spec, s, b, shape)
        res["rows"].append(r)
        cols = " ".join(f"{r['ms'][n]:>10.3f} ({r['ratio'][n]:.3f})  " for n in others)
        print(f"{r['key']:<38} {s}/{b:<3} {shape['seq']:>6} {shape['heads']:>3}:{shape['kv_heads']:<2} {r['ms']['current']:>10.3f} {cols}"
              f" err {' '.join(f'{n}={e:.1e}' for n, e in r['max_abs_err'].items())}"
              f" bitwise={''.join('=' if r['bitwise_equal_current'][n] else 'x' for n in others)}", flush=True)
    out = write_json(a.out or RESULTS / f"nsa_ab_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"GPU {res['gpu']} commit {res['commit']} -> {out}")
    return res


if __name__ == "__main__":
    main()
