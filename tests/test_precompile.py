"""mate-precompile on the CPU: which entries it takes, and how it reports (the compiles themselves: test_compile.py)."""

import os
import shutil
import subprocess
import sys

import pytest

from mate import _dispatch, precompile
from mate.swa.kernels import gqa_card

ENTRIES = precompile.entries("sm90")


def test_entries_filter_by_stage_and_dtype():
    assert {s for s, _ in precompile.entries("sm90", ["gqa_fwd", "qsa_merge"])} == {"gqa_fwd", "qsa_merge"}
    half = precompile.entries("sm90", None, ["float16"])
    selection = {"qsa_topk", "qsa_expand"}  # of no model dtype: taken under every dtype filter
    assert half and all(k.startswith("dtype=float16") or k.endswith("odtype=float16") for s, k in half if s not in selection)
    assert {s for s, _ in half} == {s for s, _ in ENTRIES}
    # A merge entry is of its output dtype: float32 selects the three merges into FP32 and nothing else,
    # bfloat16 takes SplitKV's merge of FP32 partials into BF16 but no merge into another dtype.
    merges = {p: {k for _, k in precompile.entries("sm90", ["qsa_merge"], [p])} for p in ("float32", "bfloat16")}
    assert merges["float32"] == {f"pdtype={d},odtype=float32" for d in ("float32", "bfloat16", "float16")}
    assert {s for s, _ in precompile.entries("sm90", None, ["float32"])} == {"qsa_merge"} | selection
    assert "pdtype=float32,odtype=bfloat16" in merges["bfloat16"] and all(k.endswith("odtype=bfloat16") for k in merges["bfloat16"])
    assert precompile.entries("sm90", None, ["float16", "bfloat16", "float32"]) == ENTRIES
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        precompile.entries("sm90", ["nope"])


def test_command_compiles_the_selection_and_reports_failures(monkeypatch, capsys):
    seen = []

    def fake_build_all(jobs, target, workers):
        seen.append((jobs, target, workers))
        for i, job in enumerate(jobs):
            yield job, (None, "RuntimeError: nvcc said no") if i == 0 else ("src", None)

    monkeypatch.setattr(precompile, "build_all", fake_build_all)
    assert precompile.main(["--stages", "mqa_decode", "--dtypes", "bfloat16", "--jobs", "3"]) == 1
    jobs, target, workers = seen[0]
    want = [(s, k, None, True) for s, k in ENTRIES if s == "mqa_decode" and "dtype=bfloat16" in k]
    assert jobs == want and target == "sm90" and workers == 3
    out = capsys.readouterr()
    assert f"compiled {len(want) - 1} of {len(want)} kernels" in out.out and "1 failed" in out.out
    assert "FAILED mqa_decode" in out.out + out.err and "nvcc said no" in out.out + out.err
    with pytest.raises(SystemExit, match="no config entry matches"):
        precompile.main(["--stages", "mqa_decode", "--dtypes", "float64"])
    with pytest.raises(SystemExit, match="unknown stage"):
        precompile.main(["--stages", "nope"])


def test_options_add_every_variant_on_the_entry_tiles(monkeypatch):
    """--options: gqa_fwd's 7 combinations of varlen/sinks/softcap per selected entry, each on its entry's tiles,
    which are the values a call's _dispatch.kernel(..., **options) compiles (so the disk cache serves it)."""
    from mate import _dispatch

    seen = []

    def fake_build_all(jobs, target, workers):
        seen.extend(jobs)
        for job in jobs:
            yield job, ("src", None)

    monkeypatch.setattr(precompile, "build_all", fake_build_all)
    assert precompile.main(["--stages", "gqa_fwd", "qsa_merge", "--dtypes", "bfloat16", "--options"]) == 0
    plain = [(s, k) for s, k in ENTRIES if s in ("gqa_fwd", "qsa_merge") and k.startswith("dtype=bfloat16") or k.endswith("odtype=bfloat16")]
    variants = [j for j in seen if j[2] is not None]
    gqa = [k for s, k in precompile.entries("sm90", ["gqa_fwd"], ["bfloat16"])]
    assert len(variants) == 7 * len(gqa) and all(s == "gqa_fwd" for s, *_ in variants)
    for stage, key, tiles, full in variants:
        opts = {n: tiles.pop(n) for n in gqa_card.OPTIONS}
        assert any(opts.values()) and full and tiles == _dispatch.tiles(stage, _dispatch.parse_key(key), "sm90")
    assert {(j[0], j[1]) for j in seen if j[2] is None} >= {(s, k) for s, k in plain if s == "gqa_fwd"}
    assert _dispatch.STAGES["qsa_merge"].variants({"pdtype": "float32", "odtype": "bfloat16"}) == []


def test_qsa_attention_variants_are_the_narrow_split_kernels_cluster_sizes(monkeypatch):
    seen = []
    monkeypatch.setattr(precompile, "build_all", lambda jobs, target, workers: (seen.extend(jobs), [])[1])
    assert precompile.main(["--stages", "qsa_attention", "--options"]) == 0
    sizes = {}
    for stage, key, tiles, _ in seen:
        if tiles is not None:  # a variant: the entry's tiles and a cluster size
            sizes.setdefault(key, []).append(tiles.pop("cluster"))
            assert tiles == _dispatch.tiles(stage, _dispatch.parse_key(key), "sm90")
    assert set(sizes) == {k for s, k in ENTRIES if s == "qsa_attention" and "split=1,wide=0" in k}
    assert all(v == list(range(2, 17)) for v in sizes.values())


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_command_fills_the_cache_folder(tmp_path):
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "mate.precompile", "--stages", "qsa_merge", "--dtypes", "float32", "--jobs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = len(precompile.entries("sm90", ["qsa_merge"], ["float32"]))  # the merges into FP32: 3 small kernels
    assert f"compiled {n} of {n} kernels for sm90" in proc.stdout
    assert any(p.is_file() for p in tmp_path.rglob("*")), "nothing written to TILELANG_CACHE_DIR"
