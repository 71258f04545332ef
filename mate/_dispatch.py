"""Backend choice, GPU target detection, tile configs and the compiled-kernel cache.

The route of every native call: `backend(...)` → `target_of(device)` → `kernel(stage, spec, target)`,
which looks up the stage's tile parameters for `spec` in `configs/<target>.yaml`,
builds the TileLang program and compiles it once per process (TileLang's disk
cache, `TILELANG_CACHE_DIR`, carries compiled kernels across processes).

Safe from many threads: every lazily built global here is built once, the other threads waiting for it
(TileLang and the kernel modules are imported under _stage.import_native's lock; a kernel is compiled by
its first caller while the other callers of that kernel wait, and different kernels compile at once). A
native call launches on the caller's current stream (TVM-FFI takes torch's current stream of the first
CUDA tensor argument's device), and keeps no device tensor past the call (see `Placeholders`).
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch
import yaml

from mate._stage import Stage, import_native
from mate.nsa.kernels import selection_bwd_card, selection_card
from mate.qsa.kernels import mqa_card, sparse_card, topk_card
from mate.swa.kernels import gqa_card, gqa_decode_card

BACKENDS = ("tilelang", "reference")

# mate target -> (CUDA compute capability, TileLang target).
TARGETS = {
    "sm90": ((9, 0), {"kind": "cuda", "arch": "sm_90a"}),
}


def backend(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"backend must be a str, got {type(value).__name__}")
    if value not in BACKENDS:
        raise ValueError(
            f"backend must be 'tilelang' or 'reference', got {value!r}; "
            "mate has no automatic backend and never falls back to the reference silently"
        )
    return value


# ---------------------------------------------------------------- tile configs


# Every native stage, in one place: each card lives beside its program (mate/<family>/kernels/<kernel>_card.py)
# and names it by module path, so this list loads no TileLang. The API modules look theirs up here.
STAGES: dict[str, Stage] = {s.name: s for s in (
    mqa_card.LOGITS, mqa_card.DECODE, selection_card.STAGE, selection_bwd_card.DQ, selection_bwd_card.DKV, gqa_card.STAGE, gqa_decode_card.STAGE, sparse_card.ATTENTION, sparse_card.WARP_ATTENTION, sparse_card.MERGE,
    topk_card.TOPK, topk_card.EXPAND,
)}


class _LazyModule:
    """A module imported at its first attribute access (once, whichever thread comes first: import_native).
    Every read goes to the module as it is now, so a patched or reloaded kernel module is what the API sees."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(import_native(self._name), attr)


def lazy_module(name: str) -> _LazyModule:
    """The kernel module `name`, imported (with TileLang) when the API first reads a flag or constant of it.

    The API modules read them only on their native path, so `import mate` and the
    reference backend never load TileLang.
    """
    return _LazyModule(name)


class ConfigError(ValueError):
    pass


def config_dir() -> Path:
    """configs/ from the environment, the installed wheel (mate/configs) or the source tree."""
    if os.environ.get("MATE_CONFIG_DIR"):
        return Path(os.environ["MATE_CONFIG_DIR"])
    here = Path(__file__).resolve().parent
    return here / "configs" if (here / "configs").is_dir() else here.parent / "configs"


def spec_key(spec: dict) -> str:
    """The config key of a specialization: `dtype=bfloat16,page_size=16`."""
    return ",".join(f"{k}={v}" for k, v in spec.items())


def parse_key(key: str) -> dict:
    spec = {}
    for part in key.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"bad specialization key {key!r}: expected name=value pairs separated by commas")
        value = value.strip()
        spec[name.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return spec


def validate_config(data, path) -> dict:
    """Schema: {stage: {key: {param: positive int, ..., [measured: str]}}}; the names of each key and
    the tile parameters of each entry are the stage card's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of stage names, got {type(data).__name__}")
    for stage_name, entries in data.items():
        if stage_name not in STAGES:
            raise ConfigError(f"{path}: unknown stage {stage_name!r}; known stages: {', '.join(sorted(STAGES))}")
        params = STAGES[stage_name].params
        if not isinstance(entries, dict) or not entries:
            raise ConfigError(f"{path}: {stage_name}: expected a non-empty mapping of specialization keys")
        for key, entry in entries.items():
            where = f"{path}: {stage_name}.{key}"
            try:
                names = tuple(parse_key(str(key)))
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
            if names != STAGES[stage_name].keys:
                # The wrappers look entries up by these names in this order: another key is never found.
                raise ConfigError(
                    f"{where}: specialization names {', '.join(names)}; {stage_name} keys are {', '.join(STAGES[stage_name].keys)}, in that order"
                )
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: expected a mapping of tile parameters, got {entry!r}")
            for p in params:
                if p not in entry and p in STAGES[stage_name].defaults:
                    continue
                if p not in entry:
                    raise ConfigError(f"{where}: missing tile parameter {p!r} (expected {', '.join(params)})")
                v = entry[p]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"{where}.{p}: expected a positive integer, got {v!r}")
            extra = set(entry) - set(params) - {"measured"}
            if extra:
                raise ConfigError(f"{where}: unknown tile parameter(s) {', '.join(sorted(extra))} (expected {', '.join(params)})")
            if "measured" in entry and not isinstance(entry["measured"], str):
                raise ConfigError(f"{where}.measured: expected a string, got {entry['measured']!r}")
    return data


# The functools.cache functions below are pure: two first calls at once both compute the same value and one is kept.
@functools.cache
def load_config(target: str) -> dict:
    path = config_dir() / f"{target}.yaml"
    if not path.is_file():
        raise ConfigError(f"no tile config for target {target!r} at {path}")
    with open(path) as f:
        return validate_config(yaml.safe_load(f) or {}, path)


@functools.cache
def supported_targets() -> tuple[str, ...]:
    return tuple(t for t in TARGETS if (config_dir() / f"{t}.yaml").is_file())


def tiles(stage: str, spec: dict, target: str) -> dict:
    return dict(_tiles(stage, tuple(spec.items()), target))


@functools.cache
def _tiles(stage: str, spec_items: tuple, target: str) -> tuple:
    entries = load_config(target).get(stage, {})
    key = spec_key(dict(spec_items))
    if key not in entries:
        have = "; ".join(entries) or "none"
        raise ValueError(
            f"no {stage} tile config for {key} on {target} ({config_dir() / (target + '.yaml')}); supported: {have}"
        )
    return tuple(STAGES[stage].entry_tiles(entries[key]).items())


# ---------------------------------------------------------------- targets


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the GPU holding tensors on `device` (the current one for a bare "cuda")."""
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _listed() -> str:
    return ", ".join(f"{t} (compute capability {TARGETS[t][0][0]}.{TARGETS[t][0][1]})" for t in supported_targets())


def target_of(x: torch.Tensor, name: str) -> str:
    """The mate target of the GPU holding `x`; raises before any compilation if there is none."""
    if x.device.type != "cuda":
        raise ValueError(
            f"backend='tilelang' needs CUDA tensors, but {name} is on {x.device}; "
            f"supported targets: {_listed()}; use backend='reference' elsewhere"
        )
    cap = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    for t in supported_targets():
        if TARGETS[t][0] == cap:
            return t
    raise ValueError(
        f"backend='tilelang' has no tile config for this GPU (compute capability {cap[0]}.{cap[1]}); "
        f"supported targets: {_listed()}; use backend='reference' elsewhere"
    )


# ---------------------------------------------------------------- kernels

_kernels: dict = {}
_compiling: dict = {}  # kernel key -> the lock its first caller compiles it under (its other callers wait on it)
_lock = threading.Lock()  # guards _compiling
# TileLang compiles programs from several threads at once (its own par_compile does), but builds them one at a
# time (the programs' Python is run under TVM's IR builder).
_build_lock = threading.Lock()


def _program(stage: str, spec: dict, target: str, tile_values: dict | None, card=None):
    values = tiles(stage, spec, target) if tile_values is None else tile_values
    with _build_lock:
        return (card or STAGES[stage]).build(**spec, **values)


def compile_program(stage: str, spec: dict, target: str, tile_values: dict | None = None, card=None):
    """Build and compile one specialization (used by dispatch, mate-precompile, the CI compile check and tuning);
    `card`: another version of the stage's card in its place (benchmarks/overrides.py's compile_variant).

    TileLang's disk cache is safe for processes compiling the same kernel at once: each writes its entry into a
    staging directory of its own (every file through a temporary name, fsynced, with a manifest of sizes and
    SHA-256 hashes) and renames it into place in one step, the first rename winning; a load checks the
    manifest and recompiles an entry that fails it. So mate adds no file lock."""
    tilelang = import_native("tilelang")
    card = card or STAGES[stage]
    program = _program(stage, spec, target, tile_values, card)
    return tilelang.compile(program, target=TARGETS[target][1], pass_configs=card.pass_config_dict())


def lower_program(stage: str, spec: dict, target: str, tile_values: dict | None = None) -> str:
    """The CUDA source TileLang generates for one specialization, without nvcc (about 60% of a compile's time)."""
    tilelang, tvm = import_native("tilelang"), import_native("tvm")
    program = _program(stage, spec, target, tile_values)
    # The pass options tilelang.compile would use: the program's own, overridden by the stage's.
    config = dict(program.attrs["tilelang_pass_configs"]) if program.attrs and "tilelang_pass_configs" in program.attrs else {}
    config.update(STAGES[stage].pass_config_dict() or {})
    tvm_target = tvm.target.Target(TARGETS[target][1])
    with tvm.transform.PassContext(opt_level=3, config=config), tvm_target:
        return tilelang.lower(program, target=tvm_target).kernel_source


def kernel(stage: str, spec: dict, target: str, **options):
    """The compiled kernel for (stage, specialization, target) with the config's tiles, compiled on first use.

    `options` are compile-time arguments of the program that are not config keys (gqa_fwd's varlen,
    sinks, softcap): such a variant takes the tiles of its specialization's entry.
    Config files are read once per process; `clear_caches()` makes the next call read them again.
    A call launches it on the current stream of the device of its first CUDA tensor argument.
    """
    key = (stage, tuple(spec.items()), target, tuple(options.items()))
    k = _kernels.get(key)
    if k is None:
        with _lock:
            pending = _compiling.setdefault(key, threading.Lock())
        with pending:
            k = _kernels.get(key)
            if k is None:
                values = {**tiles(stage, spec, target), **options} if options else None
                k = _kernels[key] = compile_program(stage, spec, target, values)
    return k


def clear_caches() -> None:
    """Forget configs and compiled kernels (after MATE_CONFIG_DIR or a config file changed)."""
    load_config.cache_clear()
    supported_targets.cache_clear()
    _tiles.cache_clear()
    _kernels.clear()


class Placeholders:
    """One call's 1-element stand-ins for absent optional kernel buffers (the kernel's flags say it never reads or
    writes them): `Placeholders(device)(dtype, ndim)`, views of one 4-byte allocation made at the first need.

    Made per call, never kept: a device tensor kept across calls and made at a first call inside a CUDA graph
    capture (or torch.compile's cudagraph warm-up, which allocates from the graph's pool too) would be the
    graph's memory, which torch.compile refuses and a freed graph hands to others."""

    def __init__(self, device):
        self._device, self._base, self._views = device, None, {}

    def __call__(self, dtype: torch.dtype, ndim: int) -> torch.Tensor:
        x = self._views.get((dtype, ndim))
        if x is None:
            if self._base is None:
                self._base = torch.empty(1, dtype=torch.int32, device=self._device)
            x = self._views[dtype, ndim] = self._base.view(dtype)[:1].view((1,) * ndim)
        return x
