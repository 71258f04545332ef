"""benchmarks/experiments/sustained.py on the CPU: its nvidia-smi log parsing and which implementation runs which window.
The timing itself needs a GPU (see the script)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "experiments"))

import sustained  # noqa: E402


def test_smi_samples_parse_the_samplers_lines_and_skip_the_rest(tmp_path):
    log = tmp_path / "smi.csv"
    log.write_text("1764770000123, 1515, 692.20\nnot a sample\n1764770000173, [N/A], 690.1\n1764770000223, 1980, 85.05\n")
    assert sustained.smi_samples(log) == [(1764770000.123, 1515.0, 692.2), (1764770000.223, 1980.0, 85.05)]


def test_baselines_run_only_the_windows_they_support():
    for window in ((1024, 0), (4096, 0)):
        assert sustained.implementation("fa3", window) is None
        assert sustained.implementation("cudnn", window) is None
        assert callable(sustained.implementation("mate", window))
    assert callable(sustained.implementation("cudnn", (-1, 0)))
    assert set(sustained.CASES) == {"causal-16k", "w1024-16k", "w4096-16k", "w4096-64k"}
