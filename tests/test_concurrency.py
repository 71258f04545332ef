"""A server's first calls, on the CPU: the lazy import of TileLang and of the kernel modules from many threads at
once, and no device tensor kept past a call (a capture at the first call would own it). The GPU half (threads x
streams x a cold kernel cache, streams, processes sharing a cache, capture at the first call) is
tests/test_concurrency_gpu.py; test_two_processes_compile_one_kernel_a_third_loads_it is here (nvcc, no GPU needed)."""

import gc
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from cases import CASES
from launch_record import recording

ROOT = Path(__file__).resolve().parent.parent

# Threads released together: each reads a kernel module through the API's lazy module (the first read imports it
# and TileLang), or has a stage card import it, as the first native calls of a server's threads do.
THREADS = """
import sys
from mate import _dispatch
from helpers import at_once
reads = [("mate.qsa.kernels.sparse", "HAS_SEQ_LENS_K"), ("mate.nsa.kernels.selection", "PASS_CONFIGS"),
         ("mate.swa.kernels.gqa", "gqa_fwd"), ("mate.qsa.kernels.mqa", "mqa_decode"),
         ("mate.nsa.kernels.selection_bwd", "nsa_selection_bwd_dq"), ("mate.swa.kernels.gqa_decode", "gqa_decode")]
cards = {"gqa_decode": "gqa_decode", "selection": "nsa_selection", "sparse": "qsa_attention"}

def first_calls(i):
    for j in range(len(reads)):  # every module, from the thread's own: some are being imported by others then
        name, attr = reads[(i + j) % len(reads)]
        if (i + j) % 3 == 2 and name.split(".")[-1] in cards:
            _dispatch.STAGES[cards[name.split(".")[-1]]].pass_config_dict()
        else:
            getattr(_dispatch.lazy_module(name), attr)

failures = at_once(first_calls, 24)
print(f"{len(failures)} of 24 threads failed")
sys.exit(failures[0] if failures else 0)
"""


def test_first_native_imports_from_many_threads():
    """24 threads read kernel modules at the same moment in a fresh interpreter: each waits for the module's one
    import (with TileLang's) and none sees a half-initialised module (before the fix: AttributeError 'partially
    initialized module', or ModuleNotFoundError 'tvm' from a submodule of a TileLang still being imported)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-500:] + proc.stderr[-3000:]
    assert "0 of 24 threads failed" in proc.stdout


@pytest.mark.parametrize("name", CASES)
def test_a_native_call_keeps_no_tensor_it_made(name):
    """Every tensor a native call hands its kernels (placeholders, padded decode metadata, partials, views) is freed
    once the call's inputs and results are: none is cached. A cached one made inside a CUDA graph capture (or
    torch.compile's cudagraph warm-up) would be the graph's memory: read unfilled by an eager call before the first
    replay, freed under a graph that still reads it, and refused by torch.compile ("tensors in the cudagraph pool not
    tracked as outputs"). On the CPU, with the kernels replaced by a recorder (tests/launch_record.py)."""
    launched = []
    problem = CASES[name]("cpu", torch.Generator().manual_seed(3))
    with recording(launched, [], describe=lambda x, inputs: weakref.ref(x) if isinstance(x, torch.Tensor) else x):
        problem.call("tilelang")
    del problem
    gc.collect()
    tensors = [a for launch in launched for a in launch["args"] if isinstance(a, weakref.ref)]
    assert tensors, "no kernel launched"
    alive = [(launch["stage"], i) for launch in launched for i, a in enumerate(launch["args"]) if isinstance(a, weakref.ref) and a() is not None]
    assert not alive, f"kernel arguments (stage, position) still alive after the call: {alive}"


# A process that compiles one kernel once the start file appears (TileLang already imported, so that both begin
# at the same moment); TileLang's save of a compiled kernel is counted, so the test knows both really compiled.
COMPILE = """
import pathlib, sys, time
from tilelang.cache.kernel_cache import KernelCache
from mate import _dispatch
save = KernelCache._save_kernel_to_disk
KernelCache._save_kernel_to_disk = lambda self, *a, **k: (print("compiled and saved"), save(self, *a, **k))
ready, start = map(pathlib.Path, sys.argv[1:])
ready.touch()
while not start.exists():
    time.sleep(0.01)
_dispatch.compile_program("qsa_merge", {"pdtype": "float32", "odtype": "bfloat16"}, "sm90")
"""

# The third process: the kernel must come from the disk cache (a compile would call the save), and on a GPU it must
# merge as the reference does.
LOAD = """
import torch
from tilelang.cache.kernel_cache import KernelCache
import mate
from mate import _dispatch
def compiled(self, *a, **k):
    raise SystemExit("the cached kernel did not load: it was compiled again")
KernelCache._save_kernel_to_disk = compiled
kernel = _dispatch.kernel("qsa_merge", {"pdtype": "float32", "odtype": "bfloat16"}, "sm90")
print("loaded", kernel._tilelang_cache_path)
if torch.cuda.is_available():
    po, pl = torch.randn(3, 70, 4, 128, device="cuda"), torch.randn(3, 70, 4, device="cuda")
    out = torch.full((70, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    mate.merge_attention_states(po, pl, out=out)
    ref = mate.merge_attention_states(po, pl, out_dtype=torch.bfloat16, backend="reference")[0]
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-2, err
    print(f"merged on the GPU, relative error {err:.1e}")
"""


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_two_processes_compile_one_kernel_a_third_loads_it(tmp_path):
    """Two processes compile the same kernel into one empty TILELANG_CACHE_DIR at the same moment; the cache then holds
    one complete entry per layer (TileLang stages each writer's files and renames the entry into place, the first
    rename winning) and no staging left behind, and a third process loads that entry (and on a GPU runs it)."""
    cache, start = tmp_path / "cache", tmp_path / "start"
    env = dict(os.environ, TILELANG_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, str(r), str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for r in ready]
    try:
        deadline = time.time() + 240
        while not all(r.exists() for r in ready) and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        start.touch()
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "compiled and saved" in out, "a process found the kernel cached: the two did not compile at once"
    namespace = cache / "0.1.15"
    entries = {layer: sorted(p.name for p in (namespace / layer).iterdir()) for layer in ("linux-x86_64/kernels", "cuda-binaries")}
    assert all(len(names) == 1 for names in entries.values()), entries
    staged = [p for p in namespace.rglob("*") if ".staging" in p.parts and not p.is_dir()]
    assert not staged, staged
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert entries["linux-x86_64/kernels"][0] in proc.stdout
