"""The one benchmark module that reaches into mate's dispatcher: config lookups, and runs under other tiles,
other versions of a stage's program, other compiled kernels or a forced choice (split counts, cluster
launches), for the A/B scripts of benchmarks/experiments/, the stage benchmarks' tile variants and a few
tests. Everything else in benchmarks/ uses the public API and the tuner's measurement (mate.tuning).
Importing this module loads no TileLang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

from mate import _dispatch


def compile_kernels(jobs: list[tuple], workers: int, target: str = "sm90"):
    """Compile kernels of other tiles than the config's into TileLang's disk cache before a timed run, in
    `workers` processes: mate.precompile's pool, for a benchmark's variants. `jobs` are (stage, key,
    tiles or None, full); yields (job, (source, error)) as each ends."""
    from mate.precompile import build_all

    yield from build_all(jobs, target, workers)


@contextlib.contextmanager
def without_cluster_launches():
    """QSA split decode in two launches (attention, then merge) only: the GPU probe answers that no cluster
    fits (mate._hopper.whole_sm_clusters), so mate.qsa.attention.cluster_splits never picks one. For A/Bs."""
    from mate import _hopper

    probe = _hopper.whole_sm_clusters
    _hopper.whole_sm_clusters = lambda index, cluster: 0
    try:
        yield
    finally:
        _hopper.whole_sm_clusters = probe


@contextlib.contextmanager
def qsa_family(name: str | None):
    """qsa_sparse_attention with every native call on one kernel family ('wgmma' or 'warp',
    mate.qsa.attention.family); None: the shipped choice."""
    from mate.qsa import attention

    if name is None:
        yield
        return
    real = attention.family
    attention.family = lambda *a: name
    try:
        yield
    finally:
        attention.family = real


@contextlib.contextmanager
def qsa_warp_tiles(tiles: dict, dtype: str = "bfloat16", target: str = "sm90"):
    """qsa_sparse_attention's small-CTA family at `tiles` (block_n, num_stages) for both of its split keys."""
    from mate.tuning.measure import using_tiles

    with contextlib.ExitStack() as stack:
        for split in (0, 1):  # nested: the second patches the first's config
            stack.enter_context(using_tiles(target, "qsa_attention_warp", f"dtype={dtype},split={split}", tiles))
        yield


def qsa_warp_tiles_arg(text: str) -> tuple[dict, str]:
    """A command line's small-CTA tiles, BLOCK_N/STAGES[/WARPS] (WARPS: sparse_attention_warp's `warps`, not a
    config key; left out at 1), as (tiles for qsa_warp_tiles, label: block_n/num_stages[wWARPS])."""
    bn, ns, *w = map(int, text.split("/"))
    tiles = dict(block_n=bn, num_stages=ns, **({"warps": w[0]} if w and w[0] > 1 else {}))
    return tiles, f"{bn}/{ns}" + (f"w{tiles['warps']}" if "warps" in tiles else "")


def qsa_splits_run(tiles: int, num_splits: int) -> tuple[int, int]:
    """(tiles a split, splits) of a qsa_sparse_attention call asking for num_splits over `tiles` key tiles (no split
    left empty: mate.qsa.attention.split_tiles)."""
    from mate.qsa import attention

    return attention.split_tiles(tiles, num_splits)


def stage_card(stage: str):
    """The dispatcher's card of `stage` (its search space and limits)."""
    return _dispatch.STAGES[stage]


@contextlib.contextmanager
def gqa_decode_splits(splits: int | None, seen: list | None = None):
    """gqa_attention's split-KV kernel with `splits` key splits (1: one split, which writes the output itself),
    or None: the shipped choice (mate.swa.attention._num_splits); `seen` (a list) collects each call's count.
    For A/Bs of the split choice and tests of both output paths."""
    from mate.swa import attention

    choose = attention._num_splits

    def forced(*args):
        n = choose(*args) if splits is None else splits
        if seen is not None:
            seen.append(n)
        return n

    attention._num_splits = forced
    try:
        yield
    finally:
        attention._num_splits = choose


def gqa_config_key(dtype: torch.dtype, dim: int, sliding_window) -> str:
    """The gqa_fwd config key a padded gqa_attention call of this dtype, head dim and window runs under."""
    from mate.swa import attention

    return _dispatch.spec_key(attention._spec(dtype, dim, *attention.parse_window(sliding_window)))


def shipped_tiles(target: str, stage: str, key: str | dict) -> dict:
    """The tile parameters of config entry `key` (`dtype=bfloat16,dim=128,...`, or its spec as a dict) of `stage`, as
    the dispatcher reads them."""
    return _dispatch.tiles(stage, key if isinstance(key, dict) else _dispatch.parse_key(key), target)


def config_specs(target: str, stage: str) -> list[dict]:
    """The specializations (`dict(dtype=..., dim=..., ...)`) of the entries of `stage` in the target's config."""
    return [_dispatch.parse_key(key) for key in _dispatch.load_config(target).get(stage, {})]


def stage_kernels(stage: str) -> dict:
    """The kernels of `stage` the dispatcher holds now, by (spec items, target, option items): what the calls so far
    compiled or loaded (inside program_variants, the active version's)."""
    return {k[1:]: v for k, v in _dispatch._kernels.items() if k[0] == stage}


def _variant_card(card, name: str, source: Path):
    """`card` with its program taken from the file `source` (registered as module `name`: the card names its
    program by module); the card's pass options where that file defines them, else none."""
    spec = importlib.util.spec_from_file_location(name, source)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    passes = card.pass_configs if card.pass_configs and hasattr(module, card.pass_configs) else None
    return dataclasses.replace(card, module=name, pass_configs=passes)


def compile_variant(stage: str, spec: dict, tiles: dict, source=None, target: str = "sm90"):
    """The kernel of `stage` for `spec` at `tiles`: the shipped program, or the one in the file `source` (another
    version of its module, as in program_variants). Run in worker processes first, it fills TileLang's disk
    cache, so the benchmark's own compile of the same kernel is a load."""
    card = None if source is None else _variant_card(_dispatch.STAGES[stage], f"mate_variant_{stage}_{Path(source).stem}", Path(source))
    return _dispatch.compile_program(stage, spec, target, tiles, card)


def _cache_variant(job) -> str | None:
    from mate.precompile import error_line

    try:
        compile_variant(*job)  # a worker's kernel stays in the disk cache (it does not pickle)
        return None
    except Exception as e:
        return error_line(e)


def cache_variants(jobs: list[tuple], workers: int) -> list:
    """compile_variant(*job) for each job (stage, spec, tiles, source) in `workers` processes, into the disk
    cache (a benchmark's variants in parallel); each job's error line (mate.precompile.error_line) or None."""
    import concurrent.futures as cf
    import multiprocessing

    # spawn: TileLang and torch hold threads that a forked child would inherit broken.
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_cache_variant, jobs))


def compile_variants(jobs: list[tuple], workers: int) -> list:
    """The kernels of compile_variant(*job) for each job, in order: first cache_variants, then here from the
    cache. A job that does not compile raises."""
    failed = [(job, error) for job, error in zip(jobs, cache_variants(jobs, workers)) if error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(jobs)} variants did not compile; the first: {failed[0]}")
    return [compile_variant(*job) for job in jobs]


@contextlib.contextmanager
def using_kernel(stage: str, spec: dict, kernel, tiles: dict, target: str = "sm90"):
    """Inside, the dispatcher runs `kernel` (compile_variant's) for (stage, spec) and gives `tiles` as that
    entry's tiles to everyone who asks (the wrappers size grids from them). No config file is written and no
    other kernel forgotten, so switching between variants costs nothing (interleaved timing)."""
    key = (stage, tuple(spec.items()), target, ())
    real, saved = _dispatch.tiles, _dispatch._kernels.get(key)

    def tiles_of(s, sp, tg):
        return dict(tiles) if (s, tuple(sp.items()), tg) == key[:3] else real(s, sp, tg)

    _dispatch.tiles, _dispatch._kernels[key] = tiles_of, kernel
    try:
        yield
    finally:
        _dispatch.tiles = real
        _dispatch._kernels.pop(key)
        if saved is not None:
            _dispatch._kernels[key] = saved


@contextlib.contextmanager
def program_variants(stage: str, sources: dict):
    """Run `stage` with one of several versions of its program source, switched by name; yields `use(name)`.

    `sources` maps a name to a file (another version of the stage's kernel module, defining the
    card's program with the same signature) or to None (the shipped module). After `use(name)`,
    the public API runs that version: the dispatcher builds the program from its file with the
    config's tiles and the card's pass options, compiles it at its first call and keeps each
    version's compiled kernels apart, so switching back costs nothing (interleaved timing).
    Every kernel the dispatcher compiles for the stage switches (`_dispatch.kernel`, GQA's option
    variants, varlen, sinks and softcap, included: a version's program takes those arguments too);
    the API still reads flags and constants from the shipped module. Change tiles around this, not inside.
    On exit the shipped card and the kernels compiled before are back.
    """
    shipped = _dispatch.STAGES[stage]
    cards = {name: shipped if src is None else _variant_card(shipped, f"mate_variant_{stage}_{name}", Path(src))
             for name, src in sources.items()}
    held = {name: {} for name in cards}

    def take() -> dict:
        return {k: _dispatch._kernels.pop(k) for k in [k for k in _dispatch._kernels if k[0] == stage]}

    before = take()
    active = []

    def use(name: str) -> None:
        if active:
            held[active.pop()] = take()
        _dispatch.STAGES[stage] = cards[name]
        _dispatch._kernels.update(held[name])
        active.append(name)

    try:
        yield use
    finally:
        take()
        _dispatch.STAGES[stage] = shipped
        _dispatch._kernels.update(before)


def qsa_topk_key(rows: int, keys: int, device="cuda") -> str:
    """The qsa_topk config key a call on [rows, keys] scores takes (for tile overrides)."""
    from mate.qsa import selection

    return _dispatch.spec_key(selection.topk_spec(rows, keys, torch.device(device)))
