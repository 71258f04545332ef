"""GQA prefill under sustained load: the same call back to back for seconds, with the SM clock and board power.

A short benchmark (do_bench over ~100 ms) and a server that runs attention without pause do not see
the same GPU: an H200 at its 700 W limit lowers its SM clock within about half a second of
tensor-core work. This script times each call two ways and samples `nvidia-smi` beside it:

- isolated: one call after the GPU idled for half a second (median of 5), CUDA events;
- sustained: `--seconds` of back-to-back calls, timed in groups of 10 with CUDA events; the median
  of the groups in the second half of the window (after the clock has settled), with the median SM
  clock and power of the samples taken in that half.

Cases (B 1, H 64 / H_kv 8, D 128, BF16, Sq = Sk): dense causal 16k, windows (1024, 0) and (4096, 0)
at 16k, (4096, 0) at 64k (issue 17's). Implementations: `mate` (mate.gqa_attention), `cudnn`
(torch SDPA with the cuDNN backend; dense causal only), `fa3` (the fa3-fwd wheel's flash_attn_func,
importable as fa3_fwd_interface; dense causal only: the wheel has no local windows). The fa3-fwd
wheel (27 MB) cannot travel to the H200 beside TileLang's bundle (51 MB), so run it in its own call:

    python benchmarks/experiments/sustained.py --impls mate cudnn --out benchmarks/results/sustained-mate.json
    PYTHONPATH=<fa3-fwd wheel unpacked> python benchmarks/experiments/sustained.py --impls fa3 cudnn --out ...-fa3.json

Each implementation's output is checked first on the last 512 query rows against mate's reference
backend (relative error in the JSON). FLOPs = 4 * H * D * visible (query, key) pairs.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

from bench_gqa import cudnn_causal, visible_pairs  # noqa: E402
from common import RESULTS, environment, rel_err, write_json  # noqa: E402
import mate  # noqa: E402

H, HKV, D = 64, 8, 128
CASES = {"causal-16k": ((-1, 0), 16384), "w1024-16k": ((1024, 0), 16384), "w4096-16k": ((4096, 0), 16384),
         "w4096-64k": ((4096, 0), 65536)}
CHECK_ROWS = 512


def implementation(name: str, window):
    """fn(q, k, v) -> out [B, S, H, D] for `name`, or None where it does not run this window."""
    dense = window[0] < 0
    if name == "mate":
        return lambda q, k, v: mate.gqa_attention(q, k, v, sliding_window=window)
    if name == "cudnn" and dense:
        return lambda q, k, v: cudnn_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    if name == "fa3" and dense:
        from fa3_fwd_interface import flash_attn_func

        def fa3(q, k, v):
            o = flash_attn_func(q, k, v, causal=True)
            return o[0] if isinstance(o, tuple) else o
        return fa3
    return None


def events_ms(fn, calls: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


def smi_samples(path: Path) -> list[tuple[float, float, float]]:
    """(unix time, SM MHz, W) of each nvidia-smi line."""
    out = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            out.append((float(parts[0]) / 1e3, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            pass
    return out


def measure(fn, seconds: float, samples) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    isolated = []
    for _ in range(5):
        time.sleep(0.5)
        isolated.append(events_ms(fn, 1))
    start = time.time()
    groups = []
    while time.time() - start < seconds:
        groups.append((time.time(), events_ms(fn, 10)))
    end = time.time()
    time.sleep(0.3)  # let the sampler write the window's last lines
    half = start + (end - start) / 2
    settled = [ms for t, ms in groups if t >= half]
    smi = [s for s in samples() if half <= s[0] <= end]
    return dict(isolated_ms=statistics.median(isolated), isolated_runs=isolated, sustained_ms=statistics.median(settled),
                sustained_first_group_ms=groups[0][1], groups=len(groups),
                sm_mhz=statistics.median(s[1] for s in smi) if smi else None,
                power_w=statistics.median(s[2] for s in smi) if smi else None, smi_samples=len(smi))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", nargs="+", default=["mate", "cudnn"], choices=["mate", "cudnn", "fa3"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "gqa_sustained.json")
    a = ap.parse_args(argv)
    log = Path(tempfile.mkstemp(suffix=".csv")[1])
    # nvidia-smi's own timestamp is a local date string: the sampler puts unix milliseconds in front instead.
    sampler = subprocess.Popen(
        ["bash", "-c", "nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 | "
         "while read -r l; do echo \"$(date +%s%3N), $l\"; done"], stdout=log.open("w"), start_new_session=True)
    res = {**environment(), "seconds": a.seconds, "timing": "\n\n".join(__doc__.split("\n\n")[1:3]), "rows": []}
    try:
        for case in a.cases:
            window, s = CASES[case]
            q = torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16)
            ref = mate.gqa_attention(q[:, -CHECK_ROWS:], k, v, sliding_window=window, backend="reference")
            flops = 4.0 * H * D * visible_pairs(s, s, *window)
            for impl in a.impls:
                fn = implementation(impl, window)
                if fn is None:
                    continue
                err = rel_err(fn(q, k, v)[:, -CHECK_ROWS:], ref)
                row = dict(case=case, window=list(window), seq=s, impl=impl, err_vs_reference=err,
                           **measure(lambda: fn(q, k, v), a.seconds, lambda: smi_samples(log)))
                row["sustained_tflops"] = flops / row["sustained_ms"] / 1e9
                res["rows"].append(row)
                print(f"{case:>10} {impl:>6}: isolated {row['isolated_ms']:.3f} ms, sustained {row['sustained_ms']:.3f} ms "
                      f"({row['sustained_tflops']:.0f} TFLOP/s) at {row['sm_mhz']} MHz, {row['power_w']} W; err {err:.1e}", flush=True)
                write_json(a.out, res)
            del q, k, v
            torch.cuda.empty_cache()
    finally:
        os.killpg(sampler.pid, signal.SIGTERM)  # the shell and its nvidia-smi
    print(f"-> {write_json(a.out, res)}")
    return res


if __name__ == "__main__":
    main()
