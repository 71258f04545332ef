"""The benchmark report on the CPU: discovery of the stages, figures from each script's result rows, plots, tables.
The benchmarks themselves need a GPU (benchmarks/run.py on the device)."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import run  # noqa: E402
from common import plot  # noqa: E402

# One result of each script in the shape its main() returns, two sizes each.
RESULTS = {
    "mqa": dict(rows=[
        dict(kind=k, size=n, flops=1e12 * n, bytes=1e9 * n, roofline_us=1.0 * n, us={"mate": 2.0 * n, "torch": 9.0 * n})
        for k in ("prefill", "decode") for n in (1, 64)
    ]),
    "nsa_selection": dict(copy_TBps=4.3, rows=[
        dict(H=128, G=8, L=n, ms=n / 1e3, gathered_GBps=9e3, dense_ms={"cudnn": n / 1e2, "flash": None}) for n in (8192, 16384)
    ]),
    "gqa_fwd": dict(rows=[
        dict(dim=128, window=w, seq=n, mate_ms=1.0, mate_tflops=500.0, flex_tflops=400.0, **({"cudnn_tflops": 520.0} if w == [-1, 0] else {}))
        for w in ([4096, 0], [-1, 0]) for n in (4096, 16384)
    ] + [dict(dim=128, window=[512, 0], seq=4096, error="RuntimeError: x")]),
}


def test_every_stage_benchmark_takes_part_with_both_presets():
    mods = run.benchmarks()
    assert {"mqa", "nsa_selection", "gqa_fwd"} <= set(mods)
    for m in mods.values():
        assert {"quick", "full"} <= set(m.REPORT) and callable(m.main) and callable(m.figures)


def test_every_preset_parses(monkeypatch):
    """Each stage's preset arguments parse with its script's own parser (stopping right after, before any GPU work)."""

    class Parsed(Exception):
        pass

    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)  # a preset its parser refuses exits here, failing the test
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for stage, module in run.benchmarks().items():
        for preset in ("quick", "full"):
            with pytest.raises(Parsed):
                module.main(list(module.REPORT[preset]))


def test_figures_plots_and_tables(tmp_path):
    mods = run.benchmarks()
    for stage, result in RESULTS.items():
        figs = mods[stage].figures(result)
        assert figs and all(f["lines"] for f in figs), stage
        for f in figs:
            for name, pts in f["lines"].items():
                assert len(pts) == 2, (stage, f["title"], name)  # one point per size, failed rows left out
        png = plot(figs, tmp_path / f"{stage}.png", "test")
        assert png.read_bytes()[:4] == b"\x89PNG"
        md = run.table(figs)
        assert sum(line.startswith("|---") for line in md.splitlines()) == len(figs)
    mqa = run.table(mods["mqa"].figures(RESULTS["mqa"])).splitlines()
    # 64 query rows: 64e12 FLOPs in 128 us (mate), 576 us (torch), 64 us (roofline).
    assert "| query rows | mate | torch | roofline |" in mqa and "| 64 | 5e+05 | 1.111e+05 | 1e+06 |" in mqa


def test_benchmarks_reach_mate_through_the_public_api_and_the_tuner_only():
    """Issue 15: a benchmark (an experiment too) imports `mate` (its public names) and the tuner's measurement and
    workloads (mate.tuning.measure, mate.tuning.workloads), nothing else of mate, so a refactor of the internals
    cannot break one unseen. The one exception is benchmarks/overrides.py, the dispatcher switches of the A/B
    scripts, which tests/test_dispatch.py and the GPU tests exercise."""
    import ast

    import mate

    allowed = ("mate", "mate.tuning.measure", "mate.tuning.workloads")
    scripts = sorted(p for p in Path(run.__file__).parent.rglob("*.py") if p.name != "overrides.py")
    assert any(p.parent.name == "experiments" for p in scripts)
    for path in scripts:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for m in modules:
                assert m.split(".")[0] not in ("mate", "tuning") or m in allowed, f"{path.name}:{node.lineno} imports {m}"
            if isinstance(node, ast.ImportFrom) and node.module == "mate":
                names = {a.name for a in node.names}
                assert names <= set(mate.__all__), f"{path.name}:{node.lineno} imports {sorted(names)} from mate"
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "mate"}
        assert used <= set(mate.__all__), f"{path.name} uses mate.{sorted(used - set(mate.__all__))}"
