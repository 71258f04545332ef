"""The stage card type: what the dispatcher, the config checks and the tuner know of a native stage."""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

# The first import of TileLang and of each kernel module runs once, in the thread that asks first, while the
# others wait. Python's import machinery alone does not do that: a module is in sys.modules from the moment
# its import starts (a thread reading it there meanwhile gets it half initialised), and a submodule's import
# does not wait for its package's (TileLang puts TVM on sys.path during its own import: another thread's
# `import tilelang.language` meanwhile finds no `tvm`). An RLock: a kernel module's import imports TileLang.
_import_lock = threading.RLock()
_imported: set[str] = set()


def import_native(name: str):
    """The module `name` (a kernel module, `tilelang`, `tvm`), imported by the first caller, the others waiting; then
    the module as it is now in sys.modules (patched or reloaded, that is what the caller sees)."""
    module = sys.modules.get(name) if name in _imported else None
    if module is None:
        with _import_lock:
            module = importlib.import_module(name)
            _imported.add(name)
    return module


@dataclass(frozen=True)
class Stage:
    """A native stage's card: where its TileLang program lives, its tile search space, its
    specialization keys and the limits a tile candidate must meet.

    Each kernel module has its card beside it (`mate/<family>/kernels/<kernel>_card.py`),
    importable without TileLang, and the constants the program and the card's resource
    model share live in the card (the program imports them), so the two cannot drift.
    The dispatcher, the config checks and the tuner read the card.

    The program is named, not imported: `import mate` loads no TileLang (about a second
    of TileLang and TVM), the first compile does. `getattr(module, program)(**spec, **tiles)`
    returns a `T.prim_func`; `spec` is the specialization (dtype, page size, ...) named by
    the config key, whose names are `keys`, and `tiles` the entry's values, one of each of
    `space`'s parameters. `pass_configs` names the module's tuple of TileLang pass options
    the program needs to compile as written.

    mate-tune times a candidate on the card's `shapes` with its `workload`, named, like the
    program, so that the card imports neither it nor torch: a function of mate.tuning.workloads (where the
    tests and benchmarks find it too), `(spec, shape) -> (native call, reference call[, pick])`. The
    calls return a tensor or a tuple of tensors; `pick`, where given, maps the native outputs
    to the part the reference computes (a reference too slow for the whole timed shape checks
    a slice of it). `tol` is the largest relative error (L2 norm over the finite values) of
    each output against the reference.
    """

    name: str
    module: str
    program: str
    # tile parameter -> the values mate-tune searches; a config entry holds one value of each
    space: dict[str, tuple[int, ...]]
    # the specialization's names, in config-key order (`dtype=bfloat16,page_size=16`)
    keys: tuple[str, ...]
    # (spec, tiles) -> why the candidate cannot run or would spill (the resource model and the
    # program's own shape rules), or None when legal
    limits: Callable[[dict, dict], str | None]
    pass_configs: str | None = None
    # preset (`quick`, `full`) -> problem shapes, each a dict that the workload understands
    shapes: dict[str, list[dict]] = field(default_factory=dict)
    workload: str | None = None
    tol: float | None = None
    # spec -> the compile-time program arguments that are not config keys, one dict per variant a call may
    # compile with the entry's tiles (gqa_fwd's options, qsa_attention's cluster sizes): mate-precompile
    # --options compiles them, the tests and the stress test run them
    variants: Callable[[dict], list[dict]] = lambda spec: []
    # tile parameter -> the value an entry that leaves it out takes (a parameter added after the entries were
    # measured, whose default is the program they ran: nsa_selection's `queries`)
    defaults: dict[str, int] = field(default_factory=dict)

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(self.space)

    def entry_tiles(self, entry: dict) -> dict:
        """A config entry's tile values, the defaults filled in, in `space` order."""
        return {p: entry[p] if p in entry else self.defaults[p] for p in self.space}

    def build(self, **kwargs):
        return getattr(import_native(self.module), self.program)(**kwargs)

    def pass_config_dict(self) -> dict | None:
        return dict(getattr(import_native(self.module), self.pass_configs)) if self.pass_configs else None
