"""benchmarks/experiments/qsa_latency_probe.py on the CPU: its probe program is rewritten from the shipped small-CTA
source at fixed anchors, so an edit of mate/qsa/kernels/sparse_warp.py that moves one fails here, not on a GPU."""

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "experiments"))

import qsa_latency_probe  # noqa: E402


def test_every_probe_point_lands_once_in_the_shipped_program():
    src = qsa_latency_probe.probe_source()
    ast.parse(src)
    for point in range(len(qsa_latency_probe.POINTS)):
        assert src.count(f"tx, {point}, R, HKV)") == 1, point
