"""Backend choice, tile-config loading and its schema, and the shared checks."""

import pytest
import torch
import yaml

from mate import _checks as C
from mate import _dispatch


def test_backend_values():
    assert _dispatch.backend("tilelang") == "tilelang"
    assert _dispatch.backend("reference") == "reference"
    for bad in ("auto", "torch", ""):
        with pytest.raises(ValueError, match="backend"):
            _dispatch.backend(bad)
    with pytest.raises(TypeError, match="backend"):
        _dispatch.backend(None)


def test_keys_round_trip():
    spec = {"dtype": "bfloat16", "page_size": 16}
    assert _dispatch.spec_key(spec) == "dtype=bfloat16,page_size=16"
    assert _dispatch.parse_key("dtype=bfloat16,page_size=16") == spec
    with pytest.raises(ValueError, match="name=value"):
        _dispatch.parse_key("bfloat16")


def test_the_api_modules_use_the_listed_stages():
    """Every listed stage is one an API module (mate/<family>/*.py, or a public mate/*.py such as the merge) looks
    up, the listed card itself, and the API modules hold no other (found by scanning them, so a new stage needs no
    edit here)."""
    import importlib
    import pkgutil

    import mate
    from mate._stage import Stage

    used = []
    for info in pkgutil.walk_packages(mate.__path__, "mate."):
        # mate.<family>.<api> and mate.<api>, not the kernels packages, private modules or __main__
        if not info.ispkg and info.name.count(".") <= 2 and not info.name.rsplit(".", 1)[-1].startswith("_"):
            used += [v for v in vars(importlib.import_module(info.name)).values() if isinstance(v, Stage)]
    assert sorted({s.name for s in used}) == sorted(_dispatch.STAGES)
    assert all(_dispatch.STAGES[s.name] is s for s in used)


def test_shipped_config_is_valid_and_complete():
    config = _dispatch.load_config("sm90")
    assert set(config) == set(_dispatch.STAGES)  # every listed stage has entries
    for stage, entries in config.items():
        for key in entries:
            assert set(_dispatch.tiles(stage, _dispatch.parse_key(key), "sm90")) == set(_dispatch.STAGES[stage].params)


def _write(tmp_path, data):
    path = tmp_path / "sm90.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "data, match",
    [
        ({"no_such_stage": {"dtype=bfloat16": {}}}, "unknown stage 'no_such_stage'"),
        ({"mqa_decode": {"dtype=bfloat16,page_size=16": {"threads": 128}}}, r"mqa_decode\.dtype=bfloat16,page_size=16: missing tile parameter 'block_keys'"),
        ({"mqa_decode": {"dtype=bfloat16,page_size=16": {"threads": 128, "block_keys": -64}}}, r"\.block_keys: expected a positive integer"),
        ({"mqa_decode": {"dtype=bfloat16,page_size=16": {"threads": 128, "block_keys": "64"}}}, r"\.block_keys: expected a positive integer"),
        ({"mqa_decode": {"dtype=bfloat16,page_size=16": {"threads": 128, "block_keys": 64, "warps": 4}}}, "unknown tile parameter"),
        ({"mqa_decode": {"bfloat16": {"threads": 128, "block_keys": 64}}}, "name=value"),
        ({"mqa_decode": {"dtype=bfloat16,page=16": {"threads": 128, "block_keys": 64}}}, "mqa_decode keys are dtype, page_size, in that order"),
        ({"mqa_decode": {"page_size=16,dtype=bfloat16": {"threads": 128, "block_keys": 64}}}, "names page_size, dtype;"),
        ({"mqa_decode": []}, "non-empty mapping"),
        (["mqa_decode"], "mapping of stage names"),
    ],
)
def test_config_schema_errors_name_file_and_key(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(_dispatch.ConfigError, match=match) as e:
        _dispatch.validate_config(yaml.safe_load(path.read_text()), path)
    assert str(path) in str(e.value)


def test_config_dir_override_and_missing_key(tmp_path, monkeypatch):
    _write(tmp_path, {"mqa_decode": {"dtype=bfloat16,page_size=16": {"threads": 128, "block_keys": 64, "measured": "by hand"}}})
    monkeypatch.setenv("MATE_CONFIG_DIR", str(tmp_path))
    _dispatch.clear_caches()
    try:
        assert _dispatch.tiles("mqa_decode", {"dtype": "bfloat16", "page_size": 16}, "sm90") == {"block_keys": 64, "threads": 128}
        with pytest.raises(ValueError, match="no mqa_decode tile config for dtype=float16,page_size=16 on sm90.*supported: dtype=bfloat16,page_size=16"):
            _dispatch.tiles("mqa_decode", {"dtype": "float16", "page_size": 16}, "sm90")
    finally:
        monkeypatch.delenv("MATE_CONFIG_DIR")
        _dispatch.clear_caches()


def test_kernel_options_take_their_entrys_tiles_and_clear_with_the_cache(monkeypatch):
    """A variant with compile-time options (gqa_fwd's varlen/sinks/softcap) is cached beside the plain kernel, on the
    tiles of its specialization's entry, and clear_caches() forgets it too (a using_tiles run must not keep it)."""
    built = []
    monkeypatch.setattr(_dispatch, "compile_program", lambda stage, spec, target, values=None: built.append(values) or len(built))
    spec = {"dtype": "bfloat16", "dim": 128, "window": "causal"}
    _dispatch.clear_caches()
    try:
        plain = _dispatch.kernel("gqa_fwd", spec, "sm90")
        opt = _dispatch.kernel("gqa_fwd", spec, "sm90", varlen=True, sinks=False, softcap=True)
        assert _dispatch.kernel("gqa_fwd", spec, "sm90", varlen=True, sinks=False, softcap=True) == opt != plain
        assert built == [None, {**_dispatch.tiles("gqa_fwd", spec, "sm90"), "varlen": True, "sinks": False, "softcap": True}]
        _dispatch.clear_caches()
        _dispatch.kernel("gqa_fwd", spec, "sm90", varlen=True, sinks=False, softcap=True)
        assert len(built) == 3
    finally:
        _dispatch.clear_caches()


def test_target_of_rejects_cpu_naming_targets():
    with pytest.raises(ValueError, match=r"sm90 \(compute capability 9\.0\)"):
        _dispatch.target_of(torch.empty(1), "x")


# ---------------------------------------------------------------- shared checks


def test_out_buffer_checks():
    buf = torch.empty(4, 6)
    assert C.out_buffer("out", buf[:, :3], shape=(4, 3), dtype=torch.float32, device=buf.device) is not None
    with pytest.raises(ValueError, match="out must have shape"):
        C.out_buffer("out", buf, shape=(4, 3), dtype=torch.float32, device=buf.device)
    with pytest.raises(ValueError, match="out must have dtype"):
        C.out_buffer("out", buf.half(), shape=(4, 6), dtype=torch.float32, device=buf.device)
    with pytest.raises(ValueError, match="internal overlap"):
        C.out_buffer("out", torch.empty(8).as_strided((4, 3), (1, 1)), shape=(4, 3), dtype=torch.float32, device=buf.device)
    with pytest.raises(ValueError, match="positive strides"):
        C.out_buffer("out", torch.empty(1, 3).expand(4, 3), shape=(4, 3), dtype=torch.float32, device=buf.device)
    with pytest.raises(TypeError, match="out"):
        C.out_buffer("out", [1], shape=(1,), dtype=torch.float32, device=buf.device)


def test_no_overlap():
    base = torch.empty(10, 8)
    C.no_overlap({"out": base[5:]}, {"q": base[:5]})
    with pytest.raises(ValueError, match="out overlaps q"):
        C.no_overlap({"out": base[4:]}, {"q": base[:5]})
    with pytest.raises(ValueError, match="out overlaps lse"):
        C.no_overlap({"out": base[:2], "lse": base[1:3]}, {})
    C.no_overlap({"out": torch.empty(3)}, {"q": None})


def test_int32_and_scale_checks():
    with pytest.raises(TypeError, match="idx must be an int32 tensor, got torch.int64"):
        C.int32("idx", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"idx must have shape \(4,\)"):
        C.int32("idx", torch.zeros(3, dtype=torch.int32), shape=(4,))
    assert C.score_multiplier(None, None, 64) == 0.125
    assert C.score_multiplier(None, 8.0, 64) == 0.125
    assert C.score_multiplier(2.0, None, 64) == 2.0


def test_canonical_unit_strides_is_a_view():
    x = torch.empty(16, 4, 8)[3:4]
    y = C.canonical_unit_strides(x.as_strided((1, 4, 8), (5, 8, 1)))
    assert y.stride() == (32, 8, 1) and y.data_ptr() == x.data_ptr()


def test_lazy_module_reads_the_module_as_it_is_now(monkeypatch):
    """A kernel module patched or reloaded after the API's first read is what the API reads next."""
    import importlib

    from mate import _hopper

    lazy = _dispatch.lazy_module("mate._hopper")
    assert lazy.MAX_REGS == _hopper.MAX_REGS
    monkeypatch.setattr(_hopper, "MAX_REGS", -1)
    assert lazy.MAX_REGS == -1
    monkeypatch.undo()
    _hopper.MAX_REGS = -2
    importlib.reload(_hopper)  # back to the source's value
    assert lazy.MAX_REGS == _hopper.MAX_REGS != -2


def test_import_mate_loads_no_tilelang():
    """TileLang and TVM take about a second to load: they come with the first native call, not with `import mate`
    or the tuner's workloads and measurement, or a reference call (a fresh interpreter, since this one may have loaded them already)."""
    import subprocess
    import sys

    code = """
import sys, torch, mate, mate.tuning.measure, mate.tuning.workloads
from mate import _dispatch
loaded = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'tilelang', 'tvm', 'tvm_ffi'})
assert not loaded(), ('import mate', loaded())
from mate.tuning import stages  # the tuner's entries read the stage cards, which need no TileLang
assert not loaded(), ('the stage cards', loaded())
q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 1, 64)
mate.gqa_attention(q, k, k, backend='reference')
try:
    mate.gqa_attention(q.bfloat16(), k.bfloat16(), k.bfloat16())
except ValueError as e:
    assert 'needs CUDA tensors' in str(e), e
assert not loaded(), ('a reference call and a refused native one', loaded())
assert _dispatch.lazy_module('mate.qsa.kernels.sparse').HAS_GATE > 0
assert 'tilelang' in loaded(), loaded()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_program_variants_switch_the_program_and_keep_each_versions_kernels(tmp_path):
    """benchmarks/overrides.py's program_variants (the A/B benchmarks): the card builds from the chosen file, each version's
    compiled kernels come back when it is chosen again, and on exit the shipped card and kernels are back."""
    from overrides import program_variants

    src = tmp_path / "other_gqa.py"
    src.write_text("def gqa_fwd(**kw):\n    return ('other', kw)\n")
    shipped = _dispatch.STAGES["gqa_fwd"]
    key = ("gqa_fwd", (("dtype", "bfloat16"),), "sm90")
    elsewhere = ("nsa_selection", (), "sm90")
    _dispatch._kernels.update({key: "shipped kernel", elsewhere: "nsa kernel"})
    try:
        with program_variants("gqa_fwd", {"current": None, "other": src}) as use:
            assert key not in _dispatch._kernels and _dispatch._kernels[elsewhere] == "nsa kernel"
            use("other")
            assert _dispatch.STAGES["gqa_fwd"].build(a=1) == ("other", {"a": 1})
            assert _dispatch.STAGES["gqa_fwd"].pass_configs is None  # the shipped card names none
            _dispatch._kernels[key] = "other kernel"
            use("current")
            assert _dispatch.STAGES["gqa_fwd"] is shipped and key not in _dispatch._kernels
            _dispatch._kernels[key] = "current kernel"
            use("other")
            assert _dispatch._kernels[key] == "other kernel"
            use("current")
            assert _dispatch._kernels[key] == "current kernel"
        assert _dispatch.STAGES["gqa_fwd"] is shipped
        assert _dispatch._kernels[key] == "shipped kernel" and _dispatch._kernels[elsewhere] == "nsa kernel"
    finally:
        _dispatch.STAGES["gqa_fwd"] = shipped
        _dispatch._kernels.pop(key, None)
        _dispatch._kernels.pop(elsewhere, None)


def test_config_lookups_of_the_benchmark_overrides():
    from overrides import gqa_config_key, shipped_tiles

    assert gqa_config_key(torch.float16, 64, None) == "dtype=float16,dim=64,window=none"
    assert gqa_config_key(torch.bfloat16, 128, (-1, 0)) == "dtype=bfloat16,dim=128,window=causal"
    assert gqa_config_key(torch.bfloat16, 128, (512, 0)) == "dtype=bfloat16,dim=128,window=local"
    key = "dtype=bfloat16,dim=128,window=causal"
    assert shipped_tiles("sm90", "gqa_fwd", key) == _dispatch.STAGES["gqa_fwd"].entry_tiles(_dispatch.load_config("sm90")["gqa_fwd"][key])
