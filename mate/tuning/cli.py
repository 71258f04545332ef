"""mate-tune: search a stage's tile space on the GPU and write the winners into the tile config.

For every specialization key of the stage in the config (or those named by
--keys): enumerate the stage's declared space, prune what breaks the hardware
limits, compile the rest in parallel on the CPU (TileLang's disk cache keeps
them), then on the GPU run each candidate on the shape preset: every output is
compared with the reference first, from a call after the previous call's
outputs were poisoned and released (a wrong candidate is reported and never
chosen), then timed as the median of CUDA-graph replays. A key's score is the
geometric mean of its shapes' times; the current entry is measured in the same
run, and a candidate replaces it only when it is faster by more than --min-gain.

Every result goes to a JSON cache as soon as it is measured, keyed by GPU,
kernel source and shapes, so an interrupted run resumes where it stopped. A
candidate that runs past --candidate-timeout (a kernel that hangs: NSA's
one-stage ring did) is recorded as failed and the run exits with status 3;
the same command then goes on with the next candidate.

  mate-tune --stage mqa_decode [--keys dtype=bfloat16,page_size=16] [--shapes quick|full|FILE]
            [--target sm90] [--write configs/sm90.yaml] [--dry-run] [--compile-only]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.util
import json
import math
import os
import sys
import threading
from pathlib import Path

import yaml

from mate import _dispatch, precompile
from mate.tuning import configfile
from mate.tuning.stages import TUNABLES, candidates, rel_error


def tiles_str(tiles: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in tiles.items() if k != "measured")


def load_shapes(stage: str, name: str) -> list[dict]:
    """A preset of the stage, or the stage's list in a YAML/JSON file {stage: [shape, ...]}."""
    presets = TUNABLES[stage].shapes
    if name in presets:
        return presets[name]
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"--shapes: {name!r} is neither a preset ({', '.join(presets)}) nor a file")
    data = yaml.safe_load(path.read_text()) or {}
    if stage not in data:
        raise SystemExit(f"--shapes {path}: no shapes for stage {stage!r}")
    return data[stage]


class Cache:
    """Results by candidate, in a JSON file rewritten after each one (the resume point of an interrupted run)."""

    def __init__(self, path: Path, stage: str, shapes: list[dict]):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}
        # A compile result holds for the kernel source it was built from (the program's module and its
        # card's, which holds constants the program imports), a timing also for its shapes.
        card = _dispatch.STAGES[stage]
        source = hashlib.sha256()
        for module in (card.module, card.limits.__module__):
            source.update(Path(importlib.util.find_spec(module).origin).read_bytes())
        self.source = source.hexdigest()[:16]
        source.update(json.dumps(shapes, sort_keys=True).encode())
        self.timed = source.hexdigest()[:16]

    def _key(self, where: str, key: str, tiles: dict) -> str:
        return json.dumps([where, self.source if where == "compile" else self.timed, key, tiles], sort_keys=True)

    def get(self, where, key, tiles):
        return self.data.get(self._key(where, key, tiles))

    def put(self, where, key, tiles, result):
        self.data[self._key(where, key, tiles)] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=0))
        os.replace(tmp, self.path)


def compile_all(jobs: list[tuple[str, dict]], stage: str, target: str, cache: Cache, workers: int, progress) -> None:
    todo = [(stage, key, tiles, True) for key, tiles in jobs if cache.get("compile", key, tiles) is None]
    if not todo:
        return
    for (_, key, tiles, _), (_, error) in progress(precompile.build_all(todo, target, workers), total=len(todo),
                                                   desc=f"compile {stage}", unit="cand"):
        cache.put("compile", key, tiles, {"error": error})


def require_gpu(target: str) -> None:
    """Exit at once, before any compile, unless a GPU of `target` is here."""
    import torch

    want = _dispatch.TARGETS[target][0]
    if not torch.cuda.is_available():
        raise SystemExit(f"mate-tune: timing needs a CUDA GPU of target {target} (compute capability {want[0]}.{want[1]}) "
                         "and this machine has none; --dry-run and --compile-only run without one")
    have = torch.cuda.get_device_capability()
    if have != want:
        raise SystemExit(f"mate-tune: timing needs a GPU of target {target} (compute capability {want[0]}.{want[1]}), "
                         f"this one is {torch.cuda.get_device_name()} ({have[0]}.{have[1]}); --dry-run and --compile-only run without one")


def workloads(tunable, spec: dict, shapes: list[dict]) -> list[tuple]:
    """(native, reference, pick) per shape; `pick` is the identity where the stage's workload gives none."""
    loads = []
    for shape in shapes:
        native, reference, *pick = tunable.workload(spec, shape)
        loads.append((native, reference, pick[0] if pick else (lambda out: out)))
    return loads


def _tensors(out):
    if isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif hasattr(out, "fill_"):
        yield out


def native_after_poison(native):
    """`native()`'s outputs, from a second call after the first call's outputs were poisoned (NaN, or -1 for
    integers) and released. The caching allocator hands a call's fresh outputs the blocks a previous call
    freed, which may still hold a previous candidate's correct values: a candidate that leaves elements
    unwritten would pass. Released poisoned, those blocks are the ones the second call most likely gets."""
    for t in _tensors(native()):
        t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else -1)
    return native()


def measure(tunable, target, config, key, tiles, loads, refs) -> dict:
    """Check every shape against the reference (native_after_poison), then time it; {'us': geomean,
    'shapes_us': [...]} or {'error'/'wrong': ...}."""
    from mate.tuning.measure import graph_ms, using_tiles

    try:
        with using_tiles(target, tunable.stage, key, tiles, config):
            times = []
            for (native, _, pick), ref in zip(loads, refs):
                err = rel_error(pick(native_after_poison(native)), ref)
                if not err <= tunable.tol:
                    return {"wrong": f"relative error {err:.2e} > {tunable.tol:.0e}"}
                times.append(graph_ms(native) * 1e3)
    except Exception as e:  # a candidate that fails to run is reported, never chosen
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    return {"us": math.exp(sum(map(math.log, times)) / len(times)), "shapes_us": times}


@contextlib.contextmanager
def watchdog(seconds: float, on_expiry):
    """Call `on_expiry` and end the process (exit status 3) if the block still runs after `seconds`.

    A kernel that never finishes holds the host in a CUDA synchronize, where no
    exception reaches it, and leaves the GPU unusable to this process.
    """

    def expire():
        on_expiry()
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def decide(results: list[tuple[dict, dict]], current: dict | None, min_gain: float):
    """(winner, its us, the current entry's us): the fastest correct candidate, or the current entry
    unless the winner beats it by more than `min_gain` (inf where the current entry is wrong or failed)."""
    old_us = next((r["us"] for t, r in results if t == current and "us" in r), math.inf)
    ok = [(t, r["us"]) for t, r in results if "us" in r]
    best, best_us = min(ok, key=lambda x: x[1]) if ok else (current, math.inf)
    if best_us * (1 + min_gain) < old_us:
        return best, best_us, old_us
    return current, old_us, old_us


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mate-tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True, choices=sorted(TUNABLES))
    ap.add_argument("--keys", nargs="*", help="specialization keys to tune (default: every key of the stage in the config)")
    ap.add_argument("--shapes", default="quick", help="a preset (quick, full) or a YAML/JSON file {stage: [shape, ...]}")
    ap.add_argument("--target", default="sm90", choices=sorted(_dispatch.TARGETS))
    ap.add_argument("--write", type=Path, help="merge the winners into this config file (e.g. configs/sm90.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="print the space, the pruned candidates and stop")
    ap.add_argument("--compile-only", action="store_true", help="compile the candidates into TileLang's disk cache and stop (no GPU)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile processes")
    ap.add_argument("--min-gain", type=float, default=0.02, help="replace an entry only when faster by more than this fraction")
    ap.add_argument("--candidate-timeout", type=float, default=180,
                    help="seconds one candidate's check and timing may take; past it the candidate is recorded as failed and "
                         "the run ends with exit status 3 (rerun to resume)")
    ap.add_argument("--cache", type=Path, help="results cache (default ~/.cache/mate/tune-<target>.json)")
    return ap


def plan_keys(tunable, keys: list[str], entries: dict) -> dict:
    """key -> (candidates, pruned with the reason, the current entry's tiles or None)."""
    plan = {}
    for key in keys:
        spec = _dispatch.parse_key(key)
        legal, pruned = candidates(tunable, spec)
        current = _dispatch.STAGES[tunable.stage].entry_tiles(entries[key]) if key in entries else None
        # The current entry is always measured: it is the time to beat, in or out of the space.
        plan[key] = ([current] if current else []) + [t for t in legal if t != current], pruned, current
    return plan


def print_plan(args, shapes: list[dict], plan: dict) -> None:
    print(f"{args.stage} on {args.target}, shapes {args.shapes}: {json.dumps(shapes)}")
    for key, (cands, pruned, current) in plan.items():
        print(f"\n{key}: {len(cands)} candidates, {len(pruned)} pruned")
        for t in cands:
            print(f"  {'*' if t == current else ' '} {tiles_str(t)}")
        for t, why in pruned:
            print(f"  - {tiles_str(t)}: {why}")


def measure_key(args, tunable, config, cache: Cache, env: dict, key: str, cands: list[dict], shapes: list[dict], progress) -> list:
    """(tiles, result) of every candidate of one key: from the cache, a failed compile, or measured under the watchdog."""
    import torch

    loads = workloads(tunable, _dispatch.parse_key(key), shapes)
    refs = [ref() for _, ref, _ in loads]
    results = []
    for tiles in progress(cands, desc=key, unit="cand"):
        res = cache.get(env["gpu"], key, tiles)
        if res is None:
            compiled = cache.get("compile", key, tiles)
            if compiled and compiled["error"]:
                res = {"error": compiled["error"]}
            else:
                hung = {"error": f"did not finish within {args.candidate_timeout:g} s (a hung kernel?)"}

                def give_up():
                    cache.put(env["gpu"], key, tiles, hung)
                    print(f"\nmate-tune: {key} {tiles_str(tiles)}: {hung['error']}; recorded as failed in {cache.path}. "
                          "Run the same command again to go on from there.", file=sys.stderr, flush=True)

                with watchdog(args.candidate_timeout, give_up):
                    res = measure(tunable, args.target, config, key, tiles, loads, refs)
            cache.put(env["gpu"], key, tiles, res)
        results.append((tiles, res))
    del loads, refs
    torch.cuda.empty_cache()
    return results


def print_summary(args, env: dict, rows: list[dict]) -> None:
    print(f"\n{args.stage} on {env['gpu']}, shapes {args.shapes}, commit {env['commit']}; times: geomean over the shapes of CUDA-graph medians")
    print(f"{'key':<36} {'old tiles':<44} {'old us':>9} {'new tiles':<44} {'new us':>9} {'speedup':>7} {'wrong':>5} {'failed':>6}")
    for r in rows:
        print(f"{r['key']:<36} {tiles_str(r['old'] or {}):<44} {r['old_us']:>9.1f} {tiles_str(r['new'] or {}):<44} {r['new_us']:>9.1f} "
              f"{r['old_us'] / r['new_us']:>7.3f} {r['wrong']:>5} {r['failed']:>6}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    tunable = TUNABLES[args.stage]
    config_path = args.write or _dispatch.config_dir() / f"{args.target}.yaml"
    config = _dispatch.validate_config(yaml.safe_load(config_path.read_text()) or {}, config_path)
    entries = config.get(args.stage, {})
    shapes = load_shapes(args.stage, args.shapes)
    plan = plan_keys(tunable, args.keys or list(entries), entries)
    if args.dry_run:
        print_plan(args, shapes, plan)
        return 0
    if not args.compile_only:
        require_gpu(args.target)

    from tqdm import tqdm

    cache = Cache(args.cache or Path.home() / ".cache" / "mate" / f"tune-{args.target}.json", args.stage, shapes)
    compile_all([(k, t) for k, (c, _, _) in plan.items() for t in c], args.stage, args.target, cache, args.jobs, tqdm)
    if args.compile_only:
        errors = [(k, t, r["error"]) for k, (c, _, _) in plan.items() for t in c if (r := cache.get("compile", k, t))["error"]]
        for key, tiles, err in errors:
            print(f"  {key} {tiles_str(tiles)}: FAILED {err}")
        print(f"compiled {sum(len(c) for c, _, _ in plan.values()) - len(errors)} candidates, {len(errors)} failed")
        return 0

    from mate.tuning.measure import environment

    env = environment()
    rows, updates = [], {}
    for key, (cands, _, current) in plan.items():
        results = measure_key(args, tunable, config, cache, env, key, cands, shapes, tqdm)
        for tiles, res in results:
            if "us" not in res:
                print(f"  {key} {tiles_str(tiles)}: {'WRONG' if 'wrong' in res else 'FAILED'} {res.get('wrong') or res.get('error')}")
        new, new_us, old_us = decide(results, current, args.min_gain)
        rows.append(dict(key=key, old=current, old_us=old_us, new=new, new_us=new_us,
                         wrong=sum("wrong" in r for _, r in results), failed=sum("error" in r for _, r in results)))
        if new != current:
            was = f"{old_us:.1f} us" if math.isfinite(old_us) else "no working entry"
            updates[key] = dict(new, measured=f"mate-tune {datetime.date.today()} {env['gpu']}, shapes {args.shapes}: "
                                             f"{new_us:.1f} us geomean (was {was}: {tiles_str(current or {})})")
    print_summary(args, env, rows)
    if args.write and updates:
        configfile.write(args.write, args.stage, updates)
        print(f"wrote {len(updates)} entr{'y' if len(updates) == 1 else 'ies'} to {args.write}")
    elif args.write:
        print(f"{args.write} unchanged: no candidate beat the current entries by more than {args.min_gain:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
