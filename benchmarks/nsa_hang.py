"""Which NSA selection ring depths survive many back-to-back launches, and why the one-stage ring does not.

    python benchmarks/nsa_hang.py [--key dtype=bfloat16,dim=64,block_size=32] [--tiles 2/3 1/1 1/3 3/3 2/1]
                                  [--launches 3000] [--limit 20] [--warp0-only] [--compile-only] [--out FILE]

Each stages/CTAs-per-SM pair runs in its own child process on the tuner's
quick workload (8192 tokens, 128 heads, 16 selected blocks): one call, then
LAUNCHES calls with a synchronize every 100, killed LIMIT seconds after the
first call returned. "hung" means the child was still inside a synchronize
then (a kernel that never finished; the GPU stays at 100%). The one-stage
ring, which the kernel refuses, is built from a copy of the kernel's source
without that assertion. --compile-only builds the kernels and stops (no GPU
needed), to fill TileLang's cache ahead of a GPU run.

The suspected cause, which --warp0-only tests. TileLang 0.1.15's
warp-specialized producer is a whole warpgroup: all four warps wait on every
"empty" mbarrier, and one lane of warp 0 issues the TMA loads. Warps 1-3 gate
nothing, so nothing keeps them in step. An mbarrier wait tests one parity bit:
a warp that reaches a wait after the barrier has completed the awaited phase
and the next one (a lag of one iteration with one stage, of about num_stages
iterations with more) takes the phase for not yet done, and at the end of the
loop waits for a phase that never comes; the CTA never exits. --warp0-only
patches the generated CUDA (a post-processing hook, in this script's children
only, with TileLang's kernel cache off) so that only warp 0 runs the producer
loop: if the one-stage ring then finishes, the idle warps were the cause.
Patched kernels go to their own TileLang cache folder ($TILELANG_CACHE_DIR or
~/.tilelang/cache, plus /nsa-warp0-only): TileLang's cache key does not see
the patch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "mate" / "nsa" / "kernels" / "selection.py"
PRODUCER_LOOP = re.compile(r"\n(\s*)for \(int it = 0; ")  # the first pipelined loop TileLang emits is the producer's


def warp0_only(source: str, target=None) -> str:
    patched, n = PRODUCER_LOOP.subn(r"\n\1if (((int)threadIdx.x) < 32) for (int it = 0; ", source, count=1)
    assert n == 1, "the producer loop was not found in the generated CUDA"
    return patched


def child(key: str, stages: int, min_blocks: int, launches: int, patch: bool, compile_only: bool) -> None:
    import dataclasses
    import importlib.util
    import tempfile

    from mate import _dispatch
    from tuning import configfile

    if stages < 2:
        # TileLang's parser reads the program from its file: build from a copy without the guard.
        tmp = Path(tempfile.mkdtemp()) / "selection_any_stages.py"
        tmp.write_text("\n".join(line for line in KERNEL.read_text().splitlines() if "assert num_stages >= 2" not in line))
        spec = importlib.util.spec_from_file_location("selection_any_stages", tmp)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _dispatch.STAGES["nsa_selection"] = dataclasses.replace(_dispatch.STAGES["nsa_selection"], build=module.nsa_selection_fwd)
    if patch:
        from tilelang.engine.callback import register_cuda_postproc

        register_cuda_postproc(warp0_only)
    tiles = dict(head_tile=16, threads=128, num_stages=stages, min_blocks=min_blocks)
    if compile_only:
        _dispatch.compile_program("nsa_selection", _dispatch.parse_key(key), "sm90", tiles)
        print("compiled", flush=True)
        return

    import torch

    from tuning.stages import NSA_SELECTION

    with configfile.using_tiles("sm90", "nsa_selection", key, tiles):
        native = NSA_SELECTION.workload(_dispatch.parse_key(key), NSA_SELECTION.shapes["quick"][0])[0]
        native()
        torch.cuda.synchronize()
        print("ready", flush=True)
        start = time.perf_counter()
        for i in range(launches):
            native()
            if i % 100 == 99:
                torch.cuda.synchronize()
                print(f"launched {i + 1} {time.perf_counter() - start:.2f}", flush=True)
        torch.cuda.synchronize()
        print(f"finished {launches} {time.perf_counter() - start:.2f}", flush=True)


def child_env(patch: bool) -> dict:
    env = dict(os.environ)
    if patch:
        base = Path(env.get("TILELANG_CACHE_DIR") or Path.home() / ".tilelang" / "cache")
        env["TILELANG_CACHE_DIR"] = str(base / "nsa-warp0-only")
    return env


def probe(key: str, stages: int, min_blocks: int, launches: int, limit: float, patch: bool, compile_only: bool) -> dict:
    """Run one child; the launch phase (after its first call) gets `limit` seconds, compiling and loading 600."""
    cmd = [sys.executable, __file__, "--child", "--key", key, "--tiles", f"{stages}/{min_blocks}", "--launches", str(launches)]
    cmd += (["--warp0-only"] if patch else []) + (["--compile-only"] if compile_only else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(patch), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, ready = [], []
    errors = []
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()

    def read():
        for line in proc.stdout:
            lines.append(line.split())
            if line.startswith("ready"):
                ready.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start, status = time.monotonic(), None
    while proc.poll() is None:
        if time.monotonic() - (ready[0] if ready else start) > (limit if ready else 600):
            proc.kill()
            status = "hung" if ready else "did not start within 600 s"
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(5)
    if status is None:
        status = "finished" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {''.join(errors).strip()[-300:]}"
    done = [w[1:] for w in lines if w and w[0] in ("launched", "finished")]
    return dict(stages=stages, min_blocks=min_blocks, warp0_only=patch, launches=launches, status=status,
                completed=int(done[-1][0]) if done else 0, seconds=float(done[-1][1]) if done else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--key", default="dtype=bfloat16,dim=64,block_size=32")
    ap.add_argument("--tiles", nargs="*", default=["2/3", "1/1", "1/3", "3/3", "2/1"], help="num_stages/min_blocks pairs")
    ap.add_argument("--launches", type=int, default=3000)
    ap.add_argument("--limit", type=float, default=20, help="seconds for a child's launches, from its first call's return")
    ap.add_argument("--warp0-only", action="store_true", help="patch the producer loop to warp 0 (the hypothesis test)")
    ap.add_argument("--compile-only", action="store_true", help="build the kernels into TileLang's cache and stop (no GPU)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    pairs = [tuple(int(v) for v in t.split("/")) for t in args.tiles]
    if args.child:
        child(args.key, *pairs[0], args.launches, args.warp0_only, args.compile_only)
        return 0

    from tuning.measure import environment

    rows = []
    print(f"{args.key}, {args.launches} launches, {args.limit:g} s per child, warp0-only={args.warp0_only}")
    print("| stages / CTAs per SM | result | launches completed | seconds |\n|---|---|---|---|")
    for stages, min_blocks in pairs:
        r = probe(args.key, stages, min_blocks, args.launches, args.limit, args.warp0_only, args.compile_only)
        rows.append(r)
        print(f"| {stages} / {min_blocks} | {r['status']} | {r['completed']} | {r['seconds'] if r['seconds'] is not None else '-'} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(env=environment(), key=args.key, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
