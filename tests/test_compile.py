"""Every specialization of configs/sm90.yaml lowers for sm_90a, and a subset compiles with nvcc (CPU only: no GPU needed).

CI has nvcc but no GPU, so this is where CI sees the native kernels. It also
checks that the MMA stages use Hopper's wgmma, not a slower path (the one-warp
small-CTA QSA program: mma.sync, as it is designed).

By default every entry is lowered (TileLang's passes and code generation; the
generated CUDA is checked, nothing is cached) and the first entry of each stage
is compiled by nvcc too, in one process pool with a worker per core. On 2 cores
that takes 2.5 minutes, where nvcc for all 49 entries in the same pool takes
3-6 (14 one after another). MATE_COMPILE_ALL=1 sends every entry through nvcc
(CI's second step, .ci/run).
"""

import os
import shutil

import pytest

from mate import precompile

pytestmark = [pytest.mark.compile, pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")]

ENTRIES = precompile.entries("sm90")
COMPILE_ALL = os.environ.get("MATE_COMPILE_ALL") == "1"
FIRST_KEY = {}
for _stage, _key in ENTRIES:
    FIRST_KEY.setdefault(_stage, _key)


def _full(stage, key) -> bool:
    return COMPILE_ALL or FIRST_KEY[stage] == key


@pytest.fixture(scope="module")
def built():
    """(source, error) per entry, built in one process pool for the module's tests."""
    jobs = [(s, k, None, _full(s, k)) for s, k in ENTRIES]
    return {(stage, key): result for (stage, key, _, _), result in precompile.build_all(jobs, "sm90", os.cpu_count() or 1)}


@pytest.mark.parametrize("stage, key", ENTRIES, ids=[f"{s}[{k}]{'' if _full(s, k) else '-lowered'}" for s, k in ENTRIES])
def test_lowers_or_compiles_for_sm90a(built, stage, key):
    source, error = built[stage, key]
    assert error is None, f"{stage}[{key}]: {error}"
    if stage in ("qsa_merge", "qsa_topk", "qsa_expand"):  # elementwise, selection: no MMA
        return
    # the small-CTA family is one warp: mma.sync by design (wgmma needs a warpgroup); the rest take wgmma
    mma = "tl::mma_sync" if stage == "qsa_attention_warp" else "wgmma"
    assert mma in source, f"{stage}[{key}] does not use {mma}"
    if stage in ("qsa_attention", "qsa_attention_warp"):
        assert "cp_async_gs_conditional" in source, f"{stage}[{key}]: the K/V gather is not cp.async"

