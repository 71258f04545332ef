"""The benchmark report: every stage's benchmark (or those named) with its baselines, one JSON and PNG plots.

  python benchmarks/run.py [--only mqa gqa_fwd] [--preset quick|full] [--out-dir benchmarks/results]

Runs each benchmark script that defines REPORT (benchmarks/common.py says what
that takes) with the preset's arguments, in this process, and writes
<out-dir>/<gpu>-<date>.json (the environment, and per stage its arguments and
its full result) and <out-dir>/<gpu>-<date>-<stage>.png. A stage that fails is
recorded with its error and the others still run. Needs matplotlib
(`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from common import RESULTS, environment, plot, write_json

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict:
    """stage -> module, for each bench_*.py that takes part in the report."""
    found = {}
    for path in sorted(HERE.glob("bench_*.py")):
        try:
            module = importlib.import_module(path.stem)
        except Exception as e:  # one broken script must not take the report down
            print(f"skipping {path.name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if hasattr(module, "REPORT"):
            found[module.REPORT["stage"]] = module
    return found


def table(figures: list[dict]) -> str:
    """A markdown table per figure: one row per x, one column per implementation."""
    out = []
    for f in figures:
        names = list(f["lines"])
        xs = sorted({x for pts in f["lines"].values() for x, _ in pts})
        out += [f"{f['title']} ({f['ylabel']})", "", f"| {f['xlabel']} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for x in xs:
            vals = [dict(f["lines"][n]).get(x) for n in names]
            out.append(f"| {x} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in vals) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    mods = benchmarks()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(mods), help="stages to run (default: all)")
    ap.add_argument("--preset", default="full", choices=["quick", "full"], help="quick: a few sizes per stage, minutes in all")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    env = environment()
    stem = f"{env['gpu'].replace(' ', '_')}-{datetime.date.today()}"
    report = dict(env, preset=args.preset, stages={})
    for stage in args.only or mods:
        module = mods[stage]
        stage_argv = module.REPORT[args.preset]
        print(f"\n=== {stage}: {module.__name__}.py {' '.join(stage_argv)}", flush=True)
        entry = report["stages"][stage] = dict(script=f"benchmarks/{module.__name__}.py", argv=stage_argv)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                entry["result"] = module.main([*stage_argv, "--out", f"{tmp}/{stage}.json"])
            figs = module.figures(entry["result"])
            entry["png"] = plot(figs, args.out_dir / f"{stem}-{stage}.png", f"{env['gpu']}, commit {env['commit']}").name
            print(f"\n{table(figs)}", flush=True)
        except (Exception, SystemExit) as e:  # one stage's failure (argparse exits too) must not lose the others' results
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache()
        write_json(args.out_dir / f"{stem}.json", report)
    print(f"wrote {args.out_dir / stem}.json")
    return 1 if any("error" in e for e in report["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
