"""Run every native kernel of tests/cases.py (and EXTRA_CASES below) under compute-sanitizer (memcheck and racecheck).

    python tests/sanitize.py [--tools memcheck,racecheck] [--cases mqa_decode,...]

For each tool and case this starts
`compute-sanitizer --tool <tool> python tests/sanitize.py --run --cases <case>`,
which calls the case natively three times (its edge-case inputs, then twice
with refreshed metadata) and checks the outputs against the reference. Each
log is printed whole when its process ends. It exits non-zero if a tool
reports any error, a case fails, a process outlasts --timeout, or the
sanitizer does not run. Needs a Hopper GPU and compute-sanitizer (on the
PATH, or under /usr/local/cuda*/bin, or --sanitizer).

One process at a time by default: on the H200 the racecheck run of mqa_score
finished in about 40 s alone, but never (320 s, 520 s) beside other sanitized
processes or the GPU test suite, and NSA's once; why is not known. --jobs N
runs N at once, which is faster when it works.

PyTorch's caching allocator is off in the checked process
(PYTORCH_NO_CUDA_MEMORY_CACHING=1): each tensor is its own allocation, so a
read or write past a tensor leaves an allocation, which memcheck reports
(the cases cut their views from the end of their base tensors for the same
reason). Kernels compile before the sanitized runs (TileLang's disk cache
keeps them), so the sanitizer sees kernel launches, not nvcc.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))  # common: issue 16's QSA inputs (qsa_serving_selection)
TOOLS = ("memcheck", "racecheck")


def nsa_backward(device, gen):
    """NSA selection's backward (its dq and dk/dv kernels; tests/cases.py's cases run forward calls): padded
    inputs at storage offsets, 3 heads a group (the dk/dv kernel's TMA box of 16 reaches into the next group's
    heads, which it zeroes), D 128 in blocks of 32, -1 pads, duplicates, block_counts, rows that see nothing."""
    import torch

    import mate
    from cases import I32, Problem
    from inputs import nsa_indices, randint, randn, tail_view

    B, M, N, G, hpg, D, T, bs = 2, 37, 150, 2, 3, 128, 6, 32
    q = tail_view(gen, (B, M, G * hpg, D), device=device, pad_cols=8)
    kv = tail_view(gen, (B, N, 2, G, D), device=device)
    k, v = kv[:, :, 0], kv[:, :, 1]
    idx = torch.zeros(B, M, G, T, dtype=I32, device=device)
    counts = torch.zeros(B, M, G, dtype=I32, device=device)
    do = torch.zeros(B, M, G * hpg, D, dtype=q.dtype, device=device)

    def refresh():
        idx.copy_(nsa_indices(gen, B, M, G, T, N, bs, device))
        counts.copy_(randint(gen, -1, T + 2, (B, M, G), device))
        do.copy_(randn(gen, *do.shape, device=device))

    def call(backend):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o, _ = mate.nsa_selection_attention(*leaves, idx, block_size=bs, block_counts=counts, backend=backend)
        return torch.autograd.grad(o, leaves, do)

    refresh()
    return Problem(call, refresh)


def _qsa_paged_rows(device, gen, rows, width, hinted, splits=1):
    """QSA over many tiles (the split=0 kernel unless `splits`, as num_splits, says otherwise): `rows` rows of
    one paged request, each selecting the last `width` slots of a 2051-token selection, with the block hint
    (then width must be 2051) if `hinted`."""
    import torch

    import mate
    from cases import I32, Problem
    from common import qsa_serving_selection
    from inputs import tail_view

    hq, hkv, D, ps, pages = 24, 2, 256, 64, 40
    query = tail_view(gen, (rows, hq, D), device=device)
    key = tail_view(gen, (pages, ps, hkv, D), device=device)
    value = tail_view(gen, (pages, ps, hkv, D), device=device)
    table = torch.zeros(1, pages, dtype=I32, device=device)
    pos = torch.arange(pages * ps - rows, pages * ps, dtype=I32)
    tokens = torch.zeros(rows, width, dtype=I32, device=device)
    blocks = torch.zeros(rows, 512, dtype=I32, device=device)
    cu = torch.tensor([0, rows], dtype=I32, device=device)

    def refresh():
        table.copy_(torch.randperm(pages, generator=gen).view(1, pages).to(I32))
        ti, bi = qsa_serving_selection(gen, pos)
        tokens.copy_(ti[:, ti.shape[1] - width:])
        blocks.copy_(bi)

    def call(backend):
        kw = dict(cu_seqlens_q=cu, block_table=table, return_lse=True, num_splits=splits, backend=backend)
        out = mate.qsa_sparse_attention(query, key, value, tokens, **kw)
        if not hinted:
            return out
        extra = {} if backend == "reference" else dict(block_indices=blocks)
        return (*out, *mate.qsa_sparse_attention(query, key, value, tokens, **kw, **extra))

    refresh()
    return Problem(call, refresh)


def qsa_prefill_chunks(device, gen):
    """QSA's split=0 kernel (one CTA an SM's deep ring) over 2051-token selections (33 tiles, 5 chunks) of 3
    rows, without and with the block hint; tests/cases.py's QSA cases hold one tile a row."""
    return _qsa_paged_rows(device, gen, 3, 4 * 512 + 3, True)


def _qsa_row_an_sm(device, gen, splits):
    """A row an SM (two KV heads), 259-slot selections (5 tiles), at num_splits=`splits`."""
    import torch

    rows = torch.cuda.get_device_properties(device).multi_processor_count if torch.cuda.is_available() else 132
    return _qsa_paged_rows(device, gen, rows, 259, False, splits)


def qsa_wide(device, gen):
    """QSA's split=0 kernel for grids of two CTAs an SM (the `wide` entries: a one-stage K and V ring, which
    qsa_prefill_chunks' three rows do not reach)."""
    return _qsa_row_an_sm(device, gen, 1)


def qsa_wide_split(device, gen):
    """QSA's split kernel on a grid past one wave (the split=1, wide=1 entries: a one-stage ring, two CTAs an
    SM, then the merge launch): qsa_wide's rows at the split count num_splits=None picks there (2)."""
    return _qsa_row_an_sm(device, gen, None)


# Cases of this script alone, beside tests/cases.py's.
EXTRA_CASES = {"nsa_backward": nsa_backward, "qsa_prefill_chunks": qsa_prefill_chunks, "qsa_wide": qsa_wide,
               "qsa_wide_split": qsa_wide_split}


def all_cases() -> dict:
    sys.path.insert(0, str(HERE))
    from cases import CASES

    return {**CASES, **EXTRA_CASES}


def run_cases(names: list[str], check: bool = True) -> int:
    """The sanitized process: each case natively, three times, checked against the reference (unless check=False)."""
    import time

    import pytest
    import torch

    sys.path.insert(0, str(HERE))
    from cases import NOT_YET, assert_matches

    cases = all_cases()
    failed = 0
    for name in names:
        p = cases[name]("cuda", torch.Generator().manual_seed(2))
        start = time.perf_counter()
        try:
            for i in range(3):
                if i:
                    p.refresh()
                try:
                    outs = tuple(o.clone() for o in p.call("tilelang"))
                except ValueError as e:
                    if NOT_YET.search(str(e)):
                        print(f"[sanitize] {name}: skipped, {e}", flush=True)
                        break
                    raise
                torch.cuda.synchronize()
                if check:
                    assert_matches(outs, p.call("reference"), p.tol)
            else:
                what = "matches the reference" if check else "not checked"
                print(f"[sanitize] {name}: ran 3 times, {what} ({time.perf_counter() - start:.1f} s)", flush=True)
        except (AssertionError, RuntimeError, ValueError, pytest.skip.Exception) as e:
            failed += 1
            print(f"[sanitize] {name}: FAILED {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


def find_sanitizer(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for path in sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")) + sorted(glob.glob("/opt/nvidia/*/compute-sanitizer*/compute-sanitizer")):
        if os.access(path, os.X_OK):
            return path
    return None


@functools.cache
def has_padding(sanitizer: str) -> bool:
    return "--padding" in subprocess.run([sanitizer, "--help"], capture_output=True, text=True).stdout


def sanitize(tool: str, sanitizer: str, name: str, timeout: float = 600) -> tuple[bool, str]:
    """One case under one tool, in its own process: (ok, verdict line); its log is printed when it ends."""
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20"]
    if tool == "memcheck":
        cmd += ["--leak-check", "no"]
        if has_padding(sanitizer):
            cmd += ["--padding", "1024"]  # a gap after each allocation: over-reads land outside any
    cmd += [sys.executable, str(Path(__file__).resolve()), "--run", "--cases", name]
    if tool == "racecheck":
        # Racecheck instruments every shared-memory access of every kernel and is slow; correctness was
        # checked in the warm-up and under memcheck, so skip the reference's many kernels here.
        cmd.append("--no-check")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    # Its own session, so that a run past the limit is killed with the Python process the sanitizer started.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = (proc.communicate()[0] or "") + f"[sanitize] killed after {timeout:g} s\n"
    print(f"[sanitize] $ {' '.join(cmd)}\n{log}", end="" if log.endswith("\n") else "\n", flush=True)
    if proc.returncode == -signal.SIGKILL:
        return False, f"{tool} {name}: did not finish within {timeout:g} s -> FAILED"
    # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
    summary = re.findall(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warning", log)
    errors = sum(int(a or b or 0) for a, b, _ in summary)
    warnings = sum(int(w or 0) for _, _, w in summary)
    ok = proc.returncode == 0 and bool(summary) and errors == 0
    verdict = (f"{tool} {name}: exit {proc.returncode}, {errors} errors, {warnings} racecheck warnings"
               f"{'' if summary else ', no summary line'} -> {'OK' if ok else 'FAILED'}")
    return ok, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the cases in this process (what the sanitizer checks)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--no-check", action="store_true", help="with --run: skip the comparison with the reference")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--sanitizer", default=None, help="path of compute-sanitizer")
    ap.add_argument("--jobs", type=int, default=1, help="sanitized processes at a time (see the docstring before raising it)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one sanitized process may take before it is killed and failed")
    args = ap.parse_args()
    cases = all_cases()
    names = [n for n in args.cases.split(",") if n] or list(cases)
    unknown = set(names) - set(cases)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(cases)}")
    if args.run:
        return run_cases(names, check=not args.no_check)

    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("[sanitize] compute-sanitizer not found (PATH, /usr/local/cuda*/bin); pass --sanitizer", flush=True)
        return 2
    print("[sanitize] warm-up (compiles the kernels outside the sanitizer)", flush=True)
    if run_cases(names):
        return 1
    jobs = [(tool, name) for tool in args.tools.split(",") for name in names]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        verdicts = list(pool.map(lambda job: sanitize(job[0], sanitizer, job[1], args.timeout), jobs))
    for _, verdict in verdicts:
        print("[sanitize]", verdict, flush=True)
    return 0 if all(ok for ok, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
