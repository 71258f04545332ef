"""Every stage's tuning workload on the GPU (run with `pytest -m gpu`).

mate-tune measures a key's current entry first and drops any candidate its check calls wrong, so a
workload whose native call and reference disagree under the shipped tiles would make the tuner replace
a right entry. For one key of each stage, on the quick preset's first shape: the shipped tiles pass the
tuner's own check (cli.workloads, rel_error against the card's tolerance).
"""

import pytest
import torch

from mate import _dispatch
from mate.tuning import cli
from mate.tuning.stages import TUNABLES, rel_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stage", sorted(TUNABLES))
def test_shipped_tiles_pass_the_tuners_check(stage):
    t = TUNABLES[stage]
    key = next(iter(_dispatch.load_config("sm90")[stage]))
    [(native, reference, pick)] = cli.workloads(t, _dispatch.parse_key(key), t.shapes["quick"][:1])
    err = rel_error(pick(native()), reference())
    assert err <= t.tol, f"{stage} {key}: relative error {err:.2e} > {t.tol:.0e}"
    torch.cuda.empty_cache()
