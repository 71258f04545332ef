"""What the tuner knows about each native stage: one `Tunable` per stage card that names a workload.

A `Tunable` takes everything from the stage's card (mate/*/kernels/*_card.py): the
search space (values per tile parameter), the limits a candidate must meet before it
is compiled (shared memory, registers, the kernel's own shape rules), the problem
shapes it is timed on (presets `quick` and `full`), the tolerance, and its workload,
a function of mate.tuning.workloads that builds inputs on the GPU and two calls, the native
entrypoint and its reference. The tuner runs the native call under each candidate's
tiles (through the public API, so the wrapper sees the tiles too) and compares it
with the reference. Nothing here names a stage.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from mate import _dispatch
from mate._stage import Stage
from mate.tuning import workloads


@dataclass(frozen=True)
class Tunable:
    stage: str
    space: dict[str, tuple[int, ...]]
    # (spec, tiles) -> why the candidate cannot run or would spill, or None when legal.
    limits: Callable[[dict, dict], str | None]
    # preset -> problem shapes; each shape is a dict that `workload` understands.
    shapes: dict[str, list[dict]]
    # (spec, shape) -> (native call, reference call[, pick]), as mate._stage.Stage describes it.
    workload: Callable[[dict, dict], tuple]
    # Largest accepted relative error (L2 norm over finite values) of each output against the reference.
    tol: float

    @classmethod
    def of(cls, card: Stage) -> "Tunable":
        """The tuner's entry of a stage, all from its card (the workload by name from mate.tuning.workloads)."""
        return cls(card.name, card.space, card.limits, card.shapes, getattr(workloads, card.workload), card.tol)


def candidates(t: Tunable, spec: dict) -> tuple[list[dict], list[tuple[dict, str]]]:
    """The legal tile candidates of the space, and the pruned ones with the reason."""
    legal, pruned = [], []
    for values in itertools.product(*t.space.values()):
        tiles = dict(zip(t.space, values))
        why = t.limits(spec, tiles)
        (pruned.append((tiles, why)) if why else legal.append(tiles))
    return legal, pruned


# Every stage whose card names a workload (tests/test_tuning.py requires each card to).
TUNABLES = {name: Tunable.of(card) for name, card in _dispatch.STAGES.items() if card.workload}


def rel_error(out, ref) -> float:
    """Largest relative L2 error over the outputs; inf when NaN appears or the infinities differ."""
    if isinstance(out, torch.Tensor):
        out, ref = (out,), (ref,)
    worst = 0.0
    for o, r in zip(out, ref):
        o, r = o.double(), r.double().to(o.device)
        if torch.isnan(o).any() or not torch.equal(torch.isinf(o), torch.isinf(r)) or not torch.equal(o[torch.isinf(o)], r[torch.isinf(r)]):
            return math.inf
        fin = torch.isfinite(r)
        worst = max(worst, float((o[fin] - r[fin]).norm() / r[fin].norm().clamp_min(1e-30)))
    return worst
