"""How the tuner runs and times a candidate: the dispatcher under other tiles (`using_tiles`), CUDA-event and
CUDA-graph medians (`median_ms`, `graph_ms`, `capture_graph`) and what a result needs to be reproduced
(`environment`). The benchmarks time with the same functions, so a tuned time and a benchmarked time are
one measurement. Importing this module loads no TileLang.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from mate import _dispatch

ROOT = Path(__file__).resolve().parents[2]


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median of triton.testing.do_bench (warm-up and repetitions in ms of GPU time)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture_graph(fn, calls: int = 1):
    """Warm `fn` up on a side stream, then capture `calls` back-to-back calls in a CUDA graph; (graph, last result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            result = fn()
    return graph, result


def graph_ms(fn, target_ms: float = 0.5, warmup: int = 25, rep: int = 100) -> float:
    """Per-call median of CUDA-graph replays of back-to-back calls: kernel time without the host launch cost.

    Enough calls go into one graph that a replay lasts about `target_ms`, so
    microsecond kernels are not timed against the event resolution.
    """
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    est = max(start.elapsed_time(stop), 1e-3)
    calls = max(1, min(200, math.ceil(target_ms / est)))
    graph, _ = capture_graph(fn, calls)
    # At least 7 replays however long one lasts: the median of fewer is not worth its name.
    return median_ms(graph.replay, warmup, max(rep, 7 * calls * est)) / calls


def commit() -> str:
    """The source commit: MATE_COMMIT (set it where the tree has no .git), else git's HEAD, '+dirty' if mate/ or configs/ differ."""
    if os.environ.get("MATE_COMMIT"):
        return os.environ["MATE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mate", "configs"], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return "unknown"
    return (sha + ("+dirty" if dirty.stdout.strip() else "")) if sha else "unknown"


def environment() -> dict:
    """What a result needs to be reproduced: GPU, commit, date, versions and the command line (tilelang None
    where it is not installed: a baseline's run on a GPU host without TileLang's bundle)."""
    try:
        import tilelang
    except ImportError:
        tilelang = None
    return dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        tilelang=tilelang and tilelang.__version__,
    )


@contextlib.contextmanager
def using_tiles(target: str, stage: str, key: str, tiles: dict, base: dict | None = None):
    """Run the dispatcher with `tiles` as the entry of (stage, key), through a patched copy of `base`
    (default: the target's config as the dispatcher reads it).

    The API wrappers read tile values too (grid sizes, limits), so the whole
    dispatch path, not only the kernel, must see the candidate.
    """
    cfg = {s: dict(e) for s, e in (base or _dispatch.load_config(target)).items()}
    cfg.setdefault(stage, {})[key] = dict(tiles)
    saved = os.environ.get("MATE_CONFIG_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / f"{target}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.environ["MATE_CONFIG_DIR"] = tmp
        _dispatch.clear_caches()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("MATE_CONFIG_DIR", None)
            else:
                os.environ["MATE_CONFIG_DIR"] = saved
            _dispatch.clear_caches()
