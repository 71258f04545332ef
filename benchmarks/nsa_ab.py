"""The NSA selection kernel against another version of its source, in one process on the same data.

    git show REV:mate/nsa/kernels/selection.py > /tmp/old_selection.py
    python benchmarks/nsa_ab.py --against /tmp/old_selection.py [--tiles 2/3 2/2] [--out FILE]

For a kernel change, side by side: per case (specialization key, num_stages /
CTAs per SM, shape), both programs are compiled with the same tiles and run on
one workload (the tuner's), each checked against the reference on its last
rows, then timed in three interleaved rounds of do_bench medians; the middle
round is reported. Cases: the four bfloat16 keys on the tuner's quick shape
(L = 8192, H = 128, G = 8, T = 16), and the seed shape of issue 5 (L = 65536,
D = 128, block 64). The other source must define `nsa_selection_fwd` with the
same signature; its PASS_CONFIGS are used if it has them. Both run through the public API
(mate.testing.program_variants switches the program; the workload is the tuner's,
mate.testing.nsa_selection_workload).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import RESULTS, environment, median_ms, write_json  # noqa: E402
from mate.testing import nsa_selection_workload, program_variants, using_tiles  # noqa: E402

QUICK = dict(seq=8192, heads=128, kv_heads=8, selected=16)
SEED = dict(seq=65536, heads=128, kv_heads=8, selected=16)
SPECS = [dict(dtype="bfloat16", dim=d, block_size=b) for d in (64, 128) for b in (32, 64)]


def key_of(spec: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.items())


def run_case(sources: dict, spec: dict, stages: int, min_blocks: int, shape: dict) -> dict:
    tiles = dict(head_tile=16, threads=128, num_stages=stages, min_blocks=min_blocks)
    key = key_of(spec)
    with using_tiles("sm90", "nsa_selection", key, tiles), program_variants("nsa_selection", sources) as use:
        native, ref, pick = nsa_selection_workload(spec, shape)
        want = ref()
        err = {}
        for name in sources:
            use(name)
            got = pick(native())
            err[name] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        rounds = {name: [] for name in sources}
        for _ in range(3):
            for name in sources:
                use(name)
                rounds[name].append(median_ms(native, warmup=50, rep=600 if shape["seq"] > 8192 else 200))
    ms = {name: sorted(r)[1] for name, r in rounds.items()}
    return dict(key=key, num_stages=stages, min_blocks=min_blocks, shape=shape, max_abs_err=err, ms=ms, rounds=rounds,
                ratio=ms["current"] / ms["other"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, required=True, help="the other version of mate/nsa/kernels/selection.py")
    ap.add_argument("--tiles", nargs="*", default=["2/3", "2/2"], help="num_stages/min_blocks pairs")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    sources = {"current": None, "other": a.against}
    torch.manual_seed(0)
    res = dict(environment(), against=str(a.against), rows=[])
    pairs = [tuple(map(int, t.split("/"))) for t in a.tiles]
    cases = [(k, s, b, QUICK) for k in SPECS for s, b in pairs] + [(SPECS[3], s, b, SEED) for s, b in pairs]
    print(f"{'key':<38} {'tiles':>5} {'L':>6} {'current ms':>10} {'other ms':>9} {'ratio':>6} {'err cur/oth':>16}")
    for spec, s, b, shape in cases:
        r = run_case(sources, spec, s, b, shape)
        res["rows"].append(r)
        print(f"{r['key']:<38} {s}/{b:<3} {shape['seq']:>6} {r['ms']['current']:>10.3f} {r['ms']['other']:>9.3f} {r['ratio']:>6.3f} "
              f"{r['max_abs_err']['current']:>8.1e}/{r['max_abs_err']['other']:.1e}", flush=True)
    out = write_json(a.out or RESULTS / f"nsa_ab_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"GPU {res['gpu']} commit {res['commit']} -> {out}")
    return res


if __name__ == "__main__":
    main()
