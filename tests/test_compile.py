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



# FP8 K/V caches (issue 38): compile-time variants of every mqa_decode, qsa_attention_warp and gqa_decode entry, on its tiles.
# the FP8 tile's buffer, the MMA, and the MMA's dtype for a BF16 query (None: the query's; sparse_warp runs FP16)
FP8_STAGES = {"mqa_decode": ("K8", "wgmma", None), "qsa_attention_warp": ("Kr", "tl::mma_sync<tl::DataType::kFloat16", "float16"),
              "gqa_decode": ("K_s", "wgmma", "float16")}
FP8_JOBS = precompile.variant_jobs([(s, k) for s, k in ENTRIES if s in FP8_STAGES], "sm90")
# what the generated CUDA calls the cache's element type, and how it upcasts pairs of it into BF16 / FP16
FP8_CUDA = {"float8_e4m3fn": ("fp8_e4_t", "e4m3", "__NV_E4M3"), "float8_e5m2": ("fp8_e5_t", "e5m2", "__NV_E5M2")}


@pytest.fixture(scope="module")
def built_fp8():
    jobs = [(s, k, tiles, _full(s, k)) for s, k, tiles, _ in FP8_JOBS]
    return {(stage, key, tiles["kv_dtype"]): result
            for (stage, key, tiles, _), result in precompile.build_all(jobs, "sm90", os.cpu_count() or 1)}


@pytest.mark.parametrize("stage, key, kv", [(s, k, t["kv_dtype"]) for s, k, t, _ in FP8_JOBS],
                         ids=[f"{s}[{k},{t['kv_dtype']}]{'' if _full(s, k) else '-lowered'}" for s, k, t, _ in FP8_JOBS])
def test_fp8_variants_compile(built_fp8, stage, key, kv):
    """Both FP8 kinds for every entry: the FP8 tile gathered by 16-byte cp.async (half the bytes of the 16-bit one),
    upcast in pairs by the exact conversions into the MMA's dtype (the query's, or FP16), the MMA on that, the k_scale
    tensor a parameter."""
    assert len(FP8_JOBS) == 2 * sum(s in FP8_STAGES for s, _ in ENTRIES)
    source, error = built_fp8[stage, key, kv]
    assert error is None, f"{stage}[{key}] {kv}: {error}"
    ctype, short, nv = FP8_CUDA[kv]
    buf, mma, mma_dtype = FP8_STAGES[stage]
    assert f"cp_async_gs_conditional<16>((&((({ctype}*){buf})" in source, "the FP8 tile is not gathered by 16-byte cp.async"
    if "dtype=bfloat16" in key and mma_dtype is None:
        assert f"__tl_cvt_{short}x2_to_bfloat162(" in source
    else:
        assert f"__tl_cvt_fp8x2_to_half2(" in source and f", {nv})" in source
    assert mma in source and "const float* __restrict__ KS" in source


# The small-CTA program with several warps a tile (sparse_attention_warp's `warps`, not a config key yet):
# it must keep lowering, with the tile's tokens and output split over the warps and P through shared memory.
WARPS_JOBS = [("qsa_attention_warp", f"dtype=bfloat16,split={split}", dict(block_n=64, num_stages=2, warps=4), False)
              for split in (0, 1)]


@pytest.mark.parametrize("job", WARPS_JOBS, ids=[j[1] for j in WARPS_JOBS])
def test_small_cta_program_with_four_warps_lowers(job):
    [(_, (source, error))] = list(precompile.build_all([job], "sm90", 1))
    assert error is None, error
    assert "__launch_bounds__(128, 1)" in source and "tl::mma_sync" in source
    # the softmax's row max across the four warps (through shared memory), and P read back by ldmatrix
    assert "tl::AllReduce<tl::MaxOp, 128, 32" in source and "((bfloat16_t*)Pr)" in source
