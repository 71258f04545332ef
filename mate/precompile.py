"""mate-precompile: compile the tile config's kernels into TileLang's disk cache, in parallel.

Without it, the first native call of each specialization compiles its kernel
in that process (seconds each; `configs/sm90.yaml` has about 50). Run it on
the GPU host before serving, or on a CPU machine with nvcc and ship the cache
folder (`TILELANG_CACHE_DIR`, default `~/.tilelang/cache`): kernels compiled
there load on the GPU host from the same folder.

  mate-precompile [--target sm90] [--stages gqa_fwd ...] [--dtypes bfloat16 ...] [--options] [--jobs N]

--options also compiles the compile-time variants of the selected entries, on each entry's tiles, which
a call otherwise compiles at its first use: gqa_fwd's varlen, sinks and softcap (every combination),
qsa_attention's split kernel as a cluster launch of 2 to 16 CTAs.

The same enumeration of config entries and the same worker pool serve the CI
compile check (tests/test_compile.py) and mate-tune's compile phase.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time

from mate import _dispatch


MODEL_DTYPES = ("float16", "bfloat16", "float32")


def entries(target: str = "sm90", stages=None, dtypes=None) -> list[tuple[str, str]]:
    """(stage, key) of every entry of the target's config, or of the named stages / dtypes only.

    An entry is of the dtype its key's `dtype=` names; a merge entry (no `dtype=`) is of its output
    dtype `odtype=`, the model's: SplitKV attention merges FP32 partials into it. An entry of no model
    dtype (the selection's: top-k of FP32 scores, int32 block ids) is taken under every dtype filter,
    since a model of any dtype calls it.
    """
    config = _dispatch.load_config(target)
    for name in stages or ():
        if name not in config:
            raise ValueError(f"unknown stage {name!r} for {target}; its config has: {', '.join(config)}")
    out = []
    for stage, keys in config.items():
        if stages and stage not in stages:
            continue
        for key in keys:
            spec = _dispatch.parse_key(key)
            dtype = spec.get("dtype", spec.get("odtype"))
            if not dtypes or dtype in dtypes or dtype not in MODEL_DTYPES:
                out.append((stage, key))
    return out


def variant_jobs(todo, target: str) -> list[tuple]:
    """build_all jobs (stage, key, tiles, True) of the compile-time variants of the entries in todo (the
    stage card's `variants`: gqa_fwd's options, qsa_attention's cluster sizes), each on its entry's tiles."""
    jobs = []
    for stage, key in todo:
        spec = _dispatch.parse_key(key)
        for options in _dispatch.STAGES[stage].variants(spec):
            jobs.append((stage, key, {**_dispatch.tiles(stage, spec, target), **options}, True))
    return jobs


def build(stage: str, key: str, target: str, tiles: dict | None = None, full: bool = True) -> tuple[str | None, str | None]:
    """Compile one entry (or only lower it: `full=False`, no nvcc, nothing cached): (CUDA source, None) or (None, error).

    `tiles` replaces the config's tile values (mate-tune's candidates). The error is its
    exception's type and last line: a candidate that does not compile is reported, never raised.
    """
    try:
        spec = _dispatch.parse_key(key)
        if full:
            return _dispatch.compile_program(stage, spec, target, tiles).get_kernel_source(), None
        return _dispatch.lower_program(stage, spec, target, tiles), None
    except Exception as e:
        return None, error_line(e)


def error_line(e: Exception) -> str:
    """A compile error as its type and last line (TileLang's and nvcc's messages end with the cause)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}"


def build_all(jobs: list[tuple], target: str, workers: int):
    """Run `build` on each job (stage, key, tiles, full) in `workers` processes; yield (job, (source, error)) as each ends."""
    if workers <= 1:
        for job in jobs:
            yield job, build(job[0], job[1], target, job[2], job[3])
        return
    # spawn: TileLang and torch hold threads that a forked child would inherit broken.
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(build, stage, key, target, tiles, full): (stage, key, tiles, full) for stage, key, tiles, full in jobs}
        for f in cf.as_completed(futures):
            yield futures[f], f.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mate-precompile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="sm90", choices=sorted(_dispatch.TARGETS))
    ap.add_argument("--stages", nargs="*", help="only these stages (default: every stage of the config)")
    ap.add_argument("--dtypes", nargs="*", help="only entries of these dtypes, e.g. bfloat16 float16")
    ap.add_argument("--options", action="store_true", help="also the compile-time variants (gqa_fwd: varlen, sinks, softcap; qsa_attention: cluster sizes)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile processes (default: one per core)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    try:
        todo = entries(args.target, args.stages, args.dtypes)
    except ValueError as e:
        raise SystemExit(f"mate-precompile: {e}") from None
    if not todo:
        raise SystemExit("mate-precompile: no config entry matches --stages / --dtypes")
    jobs = [(s, k, None, True) for s, k in todo] + (variant_jobs(todo, args.target) if args.options else [])
    start, failed = time.monotonic(), []
    bar = tqdm(build_all(jobs, args.target, args.jobs), total=len(jobs), desc=f"compile {args.target}", unit="kernel")
    for (stage, key, tiles, _), (_, error) in bar:
        if error:
            base = _dispatch.tiles(stage, _dispatch.parse_key(key), args.target) if tiles else {}
            opts = "".join(f" +{n}={v}" for n, v in (tiles or {}).items() if n not in base)
            failed.append(f"{stage}[{key}]{opts}: {error}")
            bar.write(f"FAILED {failed[-1]}")
    cache = os.environ.get("TILELANG_CACHE_DIR", "~/.tilelang/cache")
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} kernels for {args.target} in {time.monotonic() - start:.0f} s "
          f"with {args.jobs} processes into {cache}" + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
