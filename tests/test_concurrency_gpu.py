"""A server's first calls on the GPU (run with `pytest -m gpu`): threads on their own streams against a cold kernel
cache, a call on a side stream while the default stream is busy, and the first call of every stage and path inside a
CUDA graph capture and inside torch.compile(mode="reduce-overhead"). Each runs in a fresh interpreter where a first
call must be a first call. The CPU half (the lazy imports from many threads, no tensor kept past a call, processes
sharing a cache) is tests/test_concurrency.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases import CASES, assert_matches
from helpers import poison_allocator

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
# One problem of each native stage, on the paths of a server's step: QSA sparse attention over a paged cache
# (the default split count), GQA with a sliding window and GQA's padded decode path (split keys and the merge),
# NSA selection, the MQA indexer's decode.
STAGES = ["qsa_paged", "gqa_local", "gqa_decode_padded_split", "nsa_selection", "mqa_decode"]
# Under torch.compile: those, the SplitKV paths (QSA's cluster launch, GQA's paged decode) and the merge alone.
COMPILED = [*STAGES, "qsa_split", "gqa_paged_decode_split", "merge_states"]


def run(code: str, *args: str, env: dict | None = None) -> str:
    """`code` in a fresh interpreter (tests/ importable); its stdout, after asserting it exited 0."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


SERVE = """
import sys
import torch
from cases import CASES, assert_matches
from helpers import at_once
names, CALLS = sys.argv[1].split(","), 10

def serve(i):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        problems = {n: CASES[n]("cuda", torch.Generator().manual_seed(i)) for n in names}
        want = {n: p.call("reference") for n, p in problems.items()}
    stream.synchronize()
    for _ in range(CALLS):
        for n in names[i % len(names):] + names[:i % len(names)]:  # the threads start on different stages
            with torch.cuda.stream(stream):
                got = problems[n].call("tilelang")
            stream.synchronize()
            assert_matches(got, want[n], problems[n].tol)
            with torch.cuda.stream(stream):
                for o in got:  # a caller's out buffer must be written again by the next call
                    o.fill_(float("nan"))

failures = at_once(serve, 6)
print(f"{6 - len(failures)} of 6 threads, each on its own stream, matched the reference in {CALLS} calls of each of {names}")
sys.exit(failures[0] if failures else 0)
"""


def test_threads_on_their_own_streams_from_a_cold_cache(tmp_path):
    """6 threads, each on its own stream, make their first native calls of every stage at the same moment in a fresh
    process with an empty TILELANG_CACHE_DIR (so the imports, the compiles and the first launches overlap), then
    call each stage 10 times; every result matches the reference (outputs poisoned between calls)."""
    out = run(SERVE, ",".join(STAGES), env={"TILELANG_CACHE_DIR": str(tmp_path / "cache")})
    assert "6 of 6 threads" in out


def test_a_call_runs_on_the_callers_stream():
    """With the default stream busy (a second of torch.cuda._sleep), every stage called on a side stream has its
    results complete once the side stream is synchronised, and the default stream is still busy then: the kernels
    ran on the side stream, with no wait on the default one."""
    problems = {n: CASES[n]("cuda", torch.Generator().manual_seed(4)) for n in STAGES}
    for p in problems.values():
        for o in p.call("tilelang"):  # compiles and loads; its out buffers poisoned, so stale results cannot pass
            o.fill_(float("nan"))
    want = {n: p.call("reference") for n, p in problems.items()}
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second at the H200's clock
    with torch.cuda.stream(side):
        poison_allocator("cuda")  # the side stream's blocks of the caching allocator
        got = {n: tuple(o.cpu() for o in p.call("tilelang")) for n, p in problems.items()}  # copies on the side stream
    busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    assert busy, "the default stream finished first: the side-stream calls waited for it (or the sleep was too short)"
    for n, p in problems.items():
        assert_matches(got[n], want[n], p.tol)


GRAPH_FIRST = """
import sys, traceback, torch
from cases import CASES, assert_matches
names, failed = sys.argv[1].split(","), []
for name in names:
    try:
        p = CASES[name]("cuda", torch.Generator().manual_seed(6))
        want = p.call("reference")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = p.call("tilelang")  # the first native call of its kernels in this process (compile, load, launch)
        assert_matches(p.call("tilelang"), want, p.tol)  # eager, before the first replay
        p.refresh()
        want = p.call("reference")
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(tuple(o.clone() for o in outs), want, p.tol)
        assert_matches(p.call("tilelang"), want, p.tol)  # eager, after a replay
    except Exception:
        failed.append(name)
        print(f"{name}: FAILED", traceback.format_exc(limit=-4))
print(f"{len(names) - len(failed)} of {len(names)} cases: first call inside torch.cuda.graph, eager before and after a replay, the replay: all match")
sys.exit(1 if failed else 0)
"""


def test_first_call_inside_a_cuda_graph_capture():
    """Every case of tests/cases.py makes the process's first native call of its kernels inside torch.cuda.graph (the
    compile, the module load and the cluster probe happen during the capture); an eager call before the first replay,
    the replay with new metadata and an eager call after it all match the reference."""
    assert f"{len(CASES)} of {len(CASES)} cases" in run(GRAPH_FIRST, ",".join(CASES))


COMPILED_FIRST = """
import sys, traceback, torch
from torch._dynamo.utils import counters
from cases import CASES, assert_matches
names, graphs, failed = sys.argv[1].split(","), [], []
for name in names:
    try:
        torch._dynamo.reset()  # a fresh compile each case (the lambda's code is the same)
        p = CASES[name]("cuda", torch.Generator().manual_seed(8))
        step = torch.compile(lambda: p.call("tilelang"), mode="reduce-overhead", fullgraph=True)
        skips = counters["inductor"]["cudagraph_skips"]
        for run in ("warm-up", "record", "replay"):  # torch's cudagraph trees: the first is the first native call
            want = p.call("reference")
            torch.compiler.cudagraph_mark_step_begin()
            got = tuple(o.clone() for o in step())
            assert_matches(got, want, p.tol)
            assert_matches(p.call("tilelang"), want, p.tol)  # eager, between the compiled calls
            p.refresh()
        if counters["inductor"]["cudagraph_skips"] == skips:
            graphs.append(name)
    except Exception:
        failed.append(name)
        print(f"{name}: FAILED", traceback.format_exc(limit=-4))
print("in CUDA graphs:", ",".join(graphs))
print("cudagraphs skipped (a caller's out buffer is a mutated input):", ",".join(n for n in names if n not in graphs + failed))
print(f"{len(names) - len(failed)} of {len(names)} cases matched in every run")
sys.exit(1 if failed else 0)
"""


def test_first_call_inside_torch_compile_reduce_overhead():
    """Each case's first native call is the warm-up run of torch.compile(mode="reduce-overhead", fullgraph=True), with
    the graph's memory pool active; the recording and the replay follow, each checked against the reference, with an
    eager call after each. The paths that failed before the fix ("tensors in the cudagraph pool not tracked as
    outputs": QSA's SplitKV, GQA's decode) run as CUDA graphs; a case that writes a caller's out buffer runs without
    (torch skips cudagraphs for a mutated input)."""
    out = run(COMPILED_FIRST, ",".join(COMPILED))
    in_graphs = out.split("in CUDA graphs:")[1].split("\n")[0].strip().split(",")
    assert {"qsa_paged", "qsa_split", "gqa_decode_padded_split", "mqa_decode", "merge_states"} <= set(in_graphs), out
