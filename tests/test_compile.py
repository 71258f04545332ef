"""Lower and compile every specialization of configs/sm90.yaml for sm_90a (CPU only: no GPU needed).

CI has nvcc but no GPU, so this is where CI sees the native kernels. It also
checks that the MMA stages use Hopper's wgmma, not a slower path.
"""

import shutil

import pytest

import mate  # noqa: F401  (registers the stages)
from mate import _dispatch

pytestmark = pytest.mark.compile

ENTRIES = [(stage, key) for stage, entries in _dispatch.load_config("sm90").items() for key in entries]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("stage, key", ENTRIES, ids=[f"{s}[{k}]" for s, k in ENTRIES])
def test_compiles_for_sm90a(stage, key):
    kernel = _dispatch.compile_program(stage, _dispatch.parse_key(key), "sm90")
    source = kernel.get_kernel_source()
    if stage == "qsa_merge":  # elementwise: no MMA
        return
    assert "wgmma" in source, f"{stage}[{key}] does not use wgmma"
    if stage == "qsa_attention":
        assert "cp_async_gs_conditional" in source, f"{stage}[{key}]: the K/V gather is not cp.async"
