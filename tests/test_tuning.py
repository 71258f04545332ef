"""The tuner on the CPU: search-space enumeration and pruning, the choice rule, the YAML merge, a dry run, and
the parallel compile phase (with nvcc). The GPU phase (check and timing) runs on the device only."""

import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mate import _dispatch
from mate.tuning import cli, configfile
from mate.tuning.stages import TUNABLES, Tunable, candidates, rel_error

CONFIG = _dispatch.config_dir() / "sm90.yaml"
ROOT = Path(__file__).resolve().parent.parent


def test_every_native_stage_is_tunable_from_its_card():
    """Each card names a workload of mate.tuning.workloads, its presets and a tolerance; the tuner takes them from there."""
    from mate.tuning import workloads

    assert list(TUNABLES) == list(_dispatch.STAGES)
    for name, card in _dispatch.STAGES.items():
        t = TUNABLES[name]
        assert (t.space, t.limits, t.shapes, t.tol) == (card.space, card.limits, card.shapes, card.tol), name
        assert t.workload is getattr(workloads, card.workload), name
        assert {"quick", "full"} <= set(t.shapes) and all(t.shapes.values()), name
        assert 0 < t.tol < 0.1, name


@pytest.mark.parametrize("stage", sorted(_dispatch.STAGES))
def test_card_names_the_program_and_its_arguments(stage):
    """A card's specialization keys and tile parameters are its program's arguments; the MQA programs take
    nothing else (their geometry is the card's constants, which they import) but their variants' options
    (mqa_decode's FP8 kv_dtype)."""
    import importlib
    import inspect

    card = _dispatch.STAGES[stage]
    params = inspect.signature(getattr(importlib.import_module(card.module), card.program)).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    assert required == [*card.keys, *card.params]
    if stage in ("mqa_logits", "mqa_decode"):
        from mate.qsa.kernels import mqa, mqa_card

        options = {n for spec in _dispatch.load_config("sm90")[stage] for v in card.variants(_dispatch.parse_key(spec)) for n in v}
        assert list(params) == required + sorted(options)
        assert (mqa.HEADS, mqa.DIM, mqa.HEADS_MMA, mqa.LOAD_ELEMS) == (mqa_card.HEADS, mqa_card.DIM, mqa_card.HEADS_MMA, mqa_card.LOAD_ELEMS)


def test_enumeration_is_the_product_split_into_legal_and_pruned():
    t = Tunable("x", dict(a=(1, 2, 3), b=(10, 20)), lambda spec, tiles: "odd" if tiles["a"] % 2 else None, {}, None, 0.0)
    legal, pruned = candidates(t, {})
    assert legal == [dict(a=2, b=10), dict(a=2, b=20)]
    assert [p for p, _ in pruned] == [dict(a=1, b=10), dict(a=1, b=20), dict(a=3, b=10), dict(a=3, b=20)]
    assert all(why == "odd" for _, why in pruned)


@pytest.mark.parametrize("stage, key", [(s, k) for s, e in _dispatch.load_config("sm90").items() for k in e])
def test_committed_entries_pass_their_stage_limits(stage, key):
    """The limits must not prune tiles that compile and run (every committed entry does, on the H200)."""
    entry = _dispatch.load_config("sm90")[stage][key]
    tiles = _dispatch.STAGES[stage].entry_tiles(entry)
    assert TUNABLES[stage].limits(_dispatch.parse_key(key), tiles) is None


@pytest.mark.parametrize(
    "stage, spec, tiles, reason",
    [
        ("mqa_decode", dict(dtype="bfloat16", page_size=128), dict(block_keys=64, threads=128), "multiple of page_size"),
        ("mqa_decode", dict(dtype="bfloat16", page_size=16), dict(block_keys=64, threads=256), "warpgroups"),
        ("mqa_logits", dict(dtype="bfloat16", even_keys=1), dict(block_rows=128, block_keys=256, threads=256, num_stages=2, min_blocks=1), "shared memory"),
        ("mqa_logits", dict(dtype="bfloat16", even_keys=1), dict(block_rows=64, block_keys=256, threads=128, num_stages=1, min_blocks=1), "registers"),
        ("mqa_logits", dict(dtype="bfloat16", even_keys=1), dict(block_rows=64, block_keys=128, threads=128, num_stages=2, min_blocks=2), "per multiprocessor"),
        ("nsa_selection", dict(dtype="bfloat16", dim=128, block_size=64), dict(head_tile=16, threads=128, num_stages=3, min_blocks=3), "fit in one SM"),
        ("nsa_selection", dict(dtype="bfloat16", dim=128, block_size=64), dict(head_tile=8, threads=128, num_stages=2, min_blocks=3), "H/G = 16"),
        # 57956 B a CTA as the generated CUDA lays it out (reduction scratch and mbarriers included): 4 do not fit
        ("nsa_selection", dict(dtype="bfloat16", dim=64, block_size=32), dict(head_tile=16, threads=128, num_stages=3, min_blocks=4), "fit in one SM"),
        ("gqa_fwd", dict(dtype="bfloat16", dim=128, window="causal"), dict(block_m=192, block_n=128, threads=384, num_stages=2, mma_depth=2), "registers"),
        ("gqa_fwd", dict(dtype="bfloat16", dim=128, window="causal"), dict(block_m=128, block_n=192, threads=256, num_stages=3, mma_depth=2), "shared memory"),
    ],
)
def test_limits_prune_with_the_reason(stage, spec, tiles, reason):
    why = TUNABLES[stage].limits(spec, tiles)
    assert why is not None and reason in why, why


def test_qsa_shared_memory_model_is_the_generated_layout():
    """215912 B: the dynamic buffer (210944 B, its last reduction workspace ends there) and the static
    buffers of the generated CUDA of the 3-stage bfloat16 entries (split=0; split=1 below) (token lists, valid flags, counts, a full and an empty mbarrier for K and for V per stage)."""
    from mate.qsa.kernels import sparse_card

    assert sparse_card.attention_smem(dict(dtype="bfloat16"), dict(head_tile=16, num_stages=3)) == 210944 + 4096 + 768 + 8 + 96
    # split: the 16 KB FP32 output staging joins the dynamic buffer (227328 B), 152 B under 227 KB in all
    split = sparse_card.attention_smem(dict(dtype="bfloat16", split=1), dict(head_tile=16, num_stages=3))
    assert split == 227328 + 4096 + 768 + 8 + 96 and split <= 227 * 1024


def test_decide_never_picks_a_wrong_or_slower_candidate():
    cur, fast, faster_wrong = dict(b=64), dict(b=128), dict(b=256)
    results = [(cur, {"us": 10.0}), (fast, {"us": 9.0}), (faster_wrong, {"wrong": "relative error 1e-1"}), (dict(b=32), {"error": "x"})]
    assert cli.decide(results, cur, 0.02) == (fast, 9.0, 10.0)
    # Within the noise margin the current entry stays.
    assert cli.decide(results, cur, 0.2) == (cur, 10.0, 10.0)
    # Nothing beats it: it stays.
    assert cli.decide([(cur, {"us": 8.0}), (fast, {"us": 9.0})], cur, 0.0) == (cur, 8.0, 8.0)
    # A current entry that fails is replaced by any working one.
    assert cli.decide([(cur, {"wrong": "x"}), (fast, {"us": 9.0})], cur, 0.02) == (fast, 9.0, math.inf)


def test_rel_error_flags_nan_and_infinity_patterns():
    import torch

    ref = torch.tensor([1.0, float("-inf"), 2.0])
    assert rel_error(ref.clone(), ref) == 0.0
    assert rel_error(torch.tensor([1.0, 0.0, 2.0]), ref) == math.inf
    assert rel_error(torch.tensor([1.0, float("-inf"), float("nan")]), ref) == math.inf
    assert 0 < rel_error((ref + torch.tensor([0.0, 0.0, 1e-3]), ref), (ref, ref)) < 1e-3


# ---------------------------------------------------------------- YAML merge

TEXT = CONFIG.read_text()


def _entry(stage, key):
    return dict(yaml.safe_load(TEXT)[stage][key])


def test_merge_of_unchanged_entries_round_trips():
    data = yaml.safe_load(TEXT)
    for stage, entries in data.items():
        out = configfile.merge(TEXT, stage, entries)
        assert yaml.safe_load(out) == data
        # Comments and order survive a rewrite of every entry.
        assert [l for l in out.splitlines() if l.startswith("#") or l.endswith(":")] == [
            l for l in TEXT.splitlines() if l.startswith("#") or l.endswith(":")
        ]


def test_merge_replaces_in_place_adds_keys_and_stages():
    key = "dtype=bfloat16,dim=128,block_size=64"  # a multi-line entry in the committed file
    new = dict(_entry("nsa_selection", key), num_stages=3, min_blocks=1, measured='H200 2026-11-30: 28.6 ms "quoted", a: colon')
    out = configfile.merge(TEXT, "nsa_selection", {key: new, "dtype=bfloat16,dim=256,block_size=64": dict(new, measured="")})
    data = yaml.safe_load(out)
    assert data["nsa_selection"][key] == new
    assert list(data["nsa_selection"])[-1] == "dtype=bfloat16,dim=256,block_size=64"
    assert "measured" not in data["nsa_selection"]["dtype=bfloat16,dim=256,block_size=64"]
    assert list(data) == list(yaml.safe_load(TEXT))
    # The entry's lines became one line in place, the new key follows the stage's last entry, nothing else moved.
    old_lines = TEXT.splitlines()
    i = next(n for n, l in enumerate(old_lines) if l.startswith(f"  {key}:"))
    j = next(n for n in range(i + 1, len(old_lines)) if not old_lines[n].startswith("    "))
    expected = old_lines[:i] + [f"  {key}: {configfile.render('nsa_selection', new)}"] + old_lines[j:]
    last = max(n for n, l in enumerate(expected) if l.startswith("  dtype=") and n < expected.index("gqa_fwd:"))
    expected.insert(last + 1, "  dtype=bfloat16,dim=256,block_size=64: " + configfile.render("nsa_selection", dict(new, measured="")))
    assert out.splitlines() == expected
    _dispatch.validate_config(data, "merged")


def test_merge_adds_a_missing_stage_at_the_end():
    text = "# header\nmqa_logits:\n  dtype=bfloat16,even_keys=1: {block_rows: 64, block_keys: 128, threads: 128, num_stages: 2}\n"
    out = configfile.merge(text, "mqa_decode", {"dtype=bfloat16,page_size=16": dict(block_keys=64, threads=128)})
    assert out.startswith(text)
    assert yaml.safe_load(out)["mqa_decode"] == {"dtype=bfloat16,page_size=16": dict(block_keys=64, threads=128)}


def test_write_validates_and_records_measured(tmp_path):
    path = tmp_path / "sm90.yaml"
    path.write_text(TEXT)
    key = "dtype=bfloat16,page_size=16"
    configfile.write(path, "mqa_decode", {key: dict(block_keys=128, threads=256, measured="mate-tune 2026-11-30 NVIDIA H200")})
    assert yaml.safe_load(path.read_text())["mqa_decode"][key] == dict(block_keys=128, threads=256, measured="mate-tune 2026-11-30 NVIDIA H200")
    with pytest.raises(_dispatch.ConfigError):
        configfile.write(path, "mqa_decode", {key: dict(block_keys=128, threads=0)})
    assert yaml.safe_load(path.read_text())["mqa_decode"][key]["threads"] == 256  # a refused write leaves the file


def test_merge_refuses_a_layout_it_cannot_edit():
    text = "mqa_decode:\n  dtype=bfloat16,page_size=16:\n    block_keys: 64\n    threads: 128\n"
    with pytest.raises(ValueError, match="layout"):
        configfile.merge(text, "mqa_decode", {"dtype=bfloat16,page_size=16": dict(block_keys=128, threads=128)})


# ---------------------------------------------------------------- the command


def test_dry_run_prints_the_space_without_compiling(capsys, monkeypatch):
    monkeypatch.setattr(cli, "compile_all", lambda *a, **k: pytest.fail("a dry run compiled"))
    assert cli.main(["--stage", "mqa_decode", "--keys", "dtype=bfloat16,page_size=16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dtype=bfloat16,page_size=16: 5 candidates, 1 pruned" in out
    current = _dispatch.tiles("mqa_decode", {"dtype": "bfloat16", "page_size": 16}, "sm90")
    assert f"* block_keys={current['block_keys']} threads={current['threads']}" in out  # the current entry, measured first
    assert "- block_keys=64 threads=256: block_keys 64 does not give each of 2 warpgroups" in out


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_compile_only_compiles_in_parallel_and_records_failures(tmp_path, monkeypatch, capsys):
    # Two candidates: one compiles; one passes the limits but the kernel refuses it (threads do not split the loads).
    # The current config entry is one of them, so no third candidate is compiled for it.
    t = TUNABLES["mqa_decode"]
    cur = _dispatch.tiles("mqa_decode", {"dtype": "bfloat16", "page_size": 16}, "sm90")
    space = dict(block_keys=(cur["block_keys"],), threads=(cur["threads"], 384))
    monkeypatch.setitem(TUNABLES, "mqa_decode", Tunable(t.stage, space, lambda s, x: None, t.shapes, t.workload, t.tol))
    cache = tmp_path / "cache.json"
    args = ["--stage", "mqa_decode", "--keys", "dtype=bfloat16,page_size=16", "--compile-only", "--jobs", "2", "--cache", str(cache)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "compiled 1 candidates, 1 failed" in out and "threads=384: FAILED" in out
    # Resumed from the cache: nothing is compiled again.
    monkeypatch.setattr(cli.precompile, "build_all", lambda *a, **k: pytest.fail("recompiled a cached candidate"))
    assert cli.main(args) == 0


def test_tuning_loop_checks_times_chooses_writes_and_resumes(tmp_path, monkeypatch, capsys):
    """The GPU phase with its GPU parts replaced: the workload runs on the CPU and reports the tiles the dispatcher
    hands it (so the candidate really went through the config), the timing is a function of those tiles.
    block_keys=256 is the fastest but wrong; 128 beats the current 64."""
    import torch

    from mate.tuning import measure

    key = "dtype=bfloat16,page_size=16"
    in_effect = lambda: _dispatch.tiles("mqa_decode", _dispatch.parse_key(key), "sm90")["block_keys"]  # noqa: E731
    t = TUNABLES["mqa_decode"]

    def workload(spec, shape):
        return (lambda: torch.tensor([2.0 if in_effect() == 256 else 1.0]), lambda: torch.tensor([1.0]))

    monkeypatch.setitem(TUNABLES, "mqa_decode", Tunable(t.stage, dict(block_keys=(64, 128, 256), threads=(128,)), t.limits,
                                                        t.shapes, workload, t.tol))
    monkeypatch.setattr(cli, "compile_all", lambda *a, **k: None)
    monkeypatch.setattr(cli, "require_gpu", lambda target: None)
    monkeypatch.setattr(measure, "environment", lambda: dict(gpu="Fake GPU", commit="abc"))
    timed = []
    monkeypatch.setattr(measure, "graph_ms", lambda fn: timed.append(in_effect()) or {64: 3.0, 128: 2.0, 256: 1.0}[in_effect()])

    # The scenario starts from block_keys 64 / threads 128, whatever the shipped config holds.
    text = configfile.merge(TEXT, "mqa_decode", {key: {"block_keys": 64, "threads": 128}})
    config = tmp_path / "sm90.yaml"
    config.write_text(text)
    args = ["--stage", "mqa_decode", "--keys", key, "--write", str(config), "--cache", str(tmp_path / "cache.json")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "WRONG relative error" in out and "block_keys=256" in out
    assert timed == [64, 128]  # the wrong candidate is never timed
    entry = yaml.safe_load(config.read_text())["mqa_decode"][key]
    assert (entry["block_keys"], entry["threads"]) == (128, 128)
    assert "Fake GPU" in entry["measured"] and "2000.0 us" in entry["measured"] and "was 3000.0 us" in entry["measured"]
    assert config.read_text().replace(f"  {key}: {configfile.render('mqa_decode', entry)}", "") == text.replace(
        f"  {key}: {{block_keys: 64, threads: 128}}", "")

    # Resumed: every candidate comes from the cache, and the new entry (now current) stays.
    monkeypatch.setattr(cli, "measure", lambda *a: pytest.fail("measured a cached candidate"))
    assert cli.main(args) == 0
    assert "unchanged" in capsys.readouterr().out
    assert yaml.safe_load(config.read_text())["mqa_decode"][key] == entry


def test_a_workload_pick_checks_only_the_slice_the_reference_computes(monkeypatch):
    """NSA's reference checks the last rows of the timed shape: the tuner compares the picked slice, and a
    wrong value inside it still disqualifies the candidate."""
    import torch

    from mate.tuning import measure

    monkeypatch.setattr(measure, "graph_ms", lambda fn: 0.002)
    t = TUNABLES["mqa_decode"]
    key = "dtype=bfloat16,page_size=16"
    tiles = {"block_keys": 128, "threads": 256}

    def run(native_out):
        tun = Tunable(t.stage, t.space, t.limits, t.shapes,
                      lambda spec, shape: (lambda: native_out.clone(), lambda: torch.tensor([1.0, 2.0]), lambda out: out[1:]), t.tol)
        loads = cli.workloads(tun, _dispatch.parse_key(key), [{}])
        refs = [ref() for _, ref, _ in loads]
        return cli.measure(tun, "sm90", _dispatch.load_config("sm90"), key, tiles, loads, refs)

    assert run(torch.tensor([-7.0, 1.0, 2.0])) == {"us": pytest.approx(2.0), "shapes_us": [pytest.approx(2.0)]}
    assert "wrong" in run(torch.tensor([1.0, 1.0, 3.0]))
    # A workload without a pick compares the whole output.
    loads = cli.workloads(Tunable(t.stage, t.space, t.limits, t.shapes, lambda s, x: (1, 2), t.tol), {}, [{}])
    assert loads[0][:2] == (1, 2) and loads[0][2]("out") == "out"


def test_a_candidate_that_leaves_reused_memory_unwritten_is_caught(monkeypatch):
    """A call's fresh output may get the block a previous candidate's output was freed from, still holding
    correct values. A stand-in native that reuses one buffer (the allocator's part) and writes only its first
    element passes while the buffer holds the reference's values, unless the tuner poisons before it checks."""
    import torch

    from mate.tuning import measure

    monkeypatch.setattr(measure, "graph_ms", lambda fn: 0.002)
    t = TUNABLES["mqa_decode"]
    key = "dtype=bfloat16,page_size=16"
    ref = torch.tensor([1.0, 2.0, 3.0])
    block = ref.clone()  # what the previous candidate left in the block

    def native(writes):
        block[:writes] = ref[:writes]
        return block

    def run(writes):
        tun = Tunable(t.stage, t.space, t.limits, t.shapes, lambda spec, shape: (lambda: native(writes), lambda: ref), t.tol)
        loads = cli.workloads(tun, _dispatch.parse_key(key), [{}])
        return cli.measure(tun, "sm90", _dispatch.load_config("sm90"), key, {"block_keys": 128, "threads": 256}, loads, [ref])

    assert "us" in run(3)
    assert run(1)["wrong"].startswith("relative error")
    block.copy_(ref)
    assert cli.native_after_poison(lambda: (native(1), [torch.arange(2)]))[0].isnan().sum() == 2


@pytest.mark.parametrize("stage", ["nsa_selection_bwd_dq", "nsa_selection_bwd_dkv"])
def test_nsa_backward_workloads_check_their_step_against_the_reference_gradients(stage, monkeypatch):
    """The NSA backward's workloads on the CPU, each native step played by the reference's gradients (the real
    steps need CUDA): the tuner accepts a step that writes them, and catches one that leaves a dq row
    unwritten (poisoned NaN before each launch) or one key block's dk and dv (zeroed before each launch)."""
    import torch

    from mate.tuning import measure, workloads

    monkeypatch.setattr(measure, "graph_ms", lambda fn: 0.001)
    key, shape = "dtype=bfloat16,dim=64,block_size=32", dict(seq=256, heads=16, kv_heads=1, selected=4)
    spec = _dispatch.parse_key(key)
    skip = [None]  # what the stand-in step leaves unwritten: a dq row or a key block

    def parts(q, k, v, idx, do, *, block_size):
        assert block_size == spec["block_size"] and q.shape == (1, 256, 16, 64) and k.shape == v.shape == (1, 256, 1, 64)
        want = workloads.nsa_reference_grads(q, k, v, idx, do, block_size=block_size)
        grads = tuple(torch.zeros_like(g) for g in want)

        def write(i, rows):
            grads[i][:, rows].copy_(want[i][:, rows])

        return workloads.NsaBackwardParts(grads, lambda: None, lambda: write(0, slice(0, skip[0])),
                                        lambda: [write(i, slice(skip[0], None)) for i in (1, 2)])

    monkeypatch.setattr(workloads, "nsa_backward_parts", parts)
    t = TUNABLES[stage]
    t = Tunable(t.stage, t.space, t.limits, t.shapes, lambda spec, shape: TUNABLES[stage].workload(spec, shape, device="cpu"), t.tol)
    loads = cli.workloads(t, spec, [shape])
    refs = [ref() for _, ref, _ in loads]
    tiles = _dispatch.tiles(stage, spec, "sm90")
    measure = lambda: cli.measure(t, "sm90", _dispatch.load_config("sm90"), key, tiles, loads, refs)  # noqa: E731
    assert "us" in measure(), measure()
    skip[0] = -1 if stage.endswith("dq") else 32  # the last query row's dq; the first key block of 32
    assert measure()["wrong"].startswith("relative error " + ("inf" if stage.endswith("dq") else ""))


def test_watchdog_records_a_hung_candidate_and_ends_the_process(tmp_path):
    # A hung kernel is a host thread blocked in CUDA; a sleep stands in for it.
    mark = tmp_path / "mark"
    code = ("import time\nfrom mate.tuning.cli import watchdog\n"
            f"with watchdog(60, lambda: None):\n    pass\n"  # a block that ends in time leaves no trace
            f"with watchdog(0.5, lambda: open({str(mark)!r}, 'w').write('hung')):\n    time.sleep(60)\n"
            "print('not reached')\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=50)
    assert proc.returncode == 3 and mark.read_text() == "hung" and "not reached" not in proc.stdout
    assert time.monotonic() - start < 30


def test_without_a_supported_gpu_the_tuner_says_so_before_compiling(monkeypatch):
    import torch

    monkeypatch.setattr(cli, "compile_all", lambda *a, **k: pytest.fail("compiled before checking for a GPU"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU of target sm90.*has none; --dry-run and --compile-only"):
        cli.main(["--stage", "mqa_decode"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake A100")
    with pytest.raises(SystemExit, match=r"compute capability 9.0\), this one is Fake A100 \(8.0\)"):
        cli.main(["--stage", "mqa_decode"])
