"""GQA / sliding-window attention, native vs reference on the GPU (run with `pytest -m gpu`)."""

import math
import os

import pytest
import torch

import mate
from helpers import poison_allocator
from mate import _dispatch
from mate.swa import attention as swa

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
WINDOWS = [None, (-1, 0), (0, 0), (128, 0), (512, 0), (1024, 0), (4096, 0), (256, 256), (0, 512)]


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def assert_attention_matches(out, lse, ref_out, ref_lse, tol=1e-2):
    """Exact empty-row pattern (LSE -inf, output 0), no NaN, relative norm errors under tol (out) and 1e-3 (LSE).

    LSE [B, H, Sq] for out [B, Sq, H, D], or [H, total_q] for varlen out [total_q, H, D]."""
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    assert not torch.isnan(lse).any(), "NaN in LSE (unwritten element?)"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), f"-inf LSE pattern differs at {torch.nonzero(torch.isinf(lse) != empty)[:5].tolist()}"
    assert (lse[empty] < 0).all()
    rows_empty = empty.transpose(-1, -2)  # [B, Sq, H] or [total_q, H]
    assert torch.equal(out[rows_empty].float(), torch.zeros_like(out[rows_empty].float())), "empty rows must be exactly 0"
    err = (out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp_min(1e-30)
    assert err < tol, f"relative output error {err:.3e}"
    fin = ~empty
    if fin.any():
        lerr = (lse[fin].double() - ref_lse[fin].double()).norm() / ref_lse[fin].double().norm().clamp_min(1e-30)
        assert lerr < 1e-3, f"relative LSE error {lerr:.3e}"


def run_both(q, k, v, window, **kw):
    out = torch.full_like(q, float("nan"))
    poison_allocator("cuda")  # the LSE buffer the wrapper allocates starts as NaN
    res, lse = mate.gqa_attention(q, k, v, sliding_window=window, out=out, return_lse=True, **kw)
    assert res is out
    torch.cuda.synchronize()
    ref_out, ref_lse = mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference", **kw)
    return out, lse, ref_out, ref_lse


def shape_for(window):
    # Lengths not multiples of the 128 tiles; long enough that the widest windows still slide.
    if window in [(1024, 0), (4096, 0)]:
        return 1, 4500, 4500, 8, 2
    return 2, 1000, 1000, 8, 2


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_matches_reference(dim, dtype, window):
    B, Sq, Sk, H, Hkv = shape_for(window)
    q, k, v = randn(B, Sq, H, dim, dtype=dtype), randn(B, Sk, Hkv, dim, dtype=dtype), randn(B, Sk, Hkv, dim, dtype=dtype)
    assert_attention_matches(*run_both(q, k, v, window))


@pytest.mark.parametrize("sq, sk", [(300, 1100), (1100, 300), (1, 777), (129, 129), (77, 5), (640, 640)])
@pytest.mark.parametrize("window", [None, (-1, 0), (0, 0), (128, 0), (256, 256), (0, 512), (5, -1), (-1, 3)], ids=str)
def test_unequal_lengths(sq, sk, window):
    q, k, v = randn(2, sq, 4, 128, dtype=torch.bfloat16), randn(2, sk, 2, 128, dtype=torch.bfloat16), randn(2, sk, 2, 128, dtype=torch.bfloat16)
    assert_attention_matches(*run_both(q, k, v, window))


@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 2), (8, 1), (16, 2), (6, 3)])
@pytest.mark.parametrize("window", [None, (-1, 0), (512, 0)], ids=str)
def test_gqa_ratios(H, Hkv, window):
    q, k, v = randn(1, 900, H, 128, dtype=torch.bfloat16), randn(1, 900, Hkv, 128, dtype=torch.bfloat16), randn(1, 900, Hkv, 128, dtype=torch.bfloat16)
    assert_attention_matches(*run_both(q, k, v, window))


@pytest.mark.parametrize("window", [None, (-1, 0), (300, 0)], ids=str)
def test_large_scores_and_scale(window):
    """Scores of a few hundred: the running max must keep exp2 in range."""
    q, k, v = randn(1, 700, 4, 128, dtype=torch.bfloat16, scale=6.0), randn(1, 700, 2, 128, dtype=torch.bfloat16, scale=6.0), randn(1, 700, 2, 128, dtype=torch.bfloat16)
    assert_attention_matches(*run_both(q, k, v, window))
    assert_attention_matches(*run_both(q, k, v, window, scale=0.02))


def test_strided_views_and_empty_keys():
    big = randn(2, 600, 12, 128, dtype=torch.bfloat16)
    q, k, v = big[:, :, :8], big[:, 100:, 8:10], big[:, 100:, 10:12]  # views into one packed tensor
    assert_attention_matches(*run_both(q, k, v, (200, 0)))
    out, lse = mate.gqa_attention(q, k[:, :0], v[:, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    assert mate.gqa_attention(q[:, :0], k, v).shape == (2, 0, 8, 128)


BASE = {"block_m": 128, "block_n": 128, "threads": 256, "num_stages": 2}
VARIANTS = [  # (head dims, tiles): the schedules and tile shapes a config may pick
    ((64, 128), dict(BASE, mma_depth=1)),
    ((64, 128), dict(BASE, mma_depth=2)),
    ((64, 128), dict(BASE, num_stages=3, mma_depth=2)),
    ((64,), dict(BASE, block_m=192, threads=384, mma_depth=2)),
]


VARIANT_WINDOWS = [None, (-1, 0), (384, 0), (100, 700), (0, 0)]


@pytest.fixture(scope="module")
def variant_kernels():
    """Compiles the kernels of test_tile_variants in parallel, into TileLang's disk cache: about 70
    that no config entry holds, which compiled one after another take longer than the rest of the suite."""
    from mate import precompile

    jobs = {}
    for window in VARIANT_WINDOWS:
        left, right = swa.parse_window(window)
        for dtype in DTYPES:
            for dims, overrides in VARIANTS:
                for dim in dims:
                    key = _dispatch.spec_key(swa._spec(dtype, dim, left, right))
                    jobs[key, tuple(overrides.items())] = (swa.STAGE.name, key, dict(overrides), True)
    jobs = list(jobs.values())
    failed = [f"{job}: {error}" for job, (_, error) in precompile.build_all(jobs, "sm90", min(16, os.cpu_count() or 1)) if error]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("dims, overrides", VARIANTS, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", VARIANT_WINDOWS, ids=str)
def test_tile_variants(dims, overrides, dtype, window, variant_kernels):
    """Every schedule and tile shape the config may choose is correct, whichever one it holds now."""
    left, right = swa.parse_window(window)
    for dim in dims:
        spec = swa._spec(dtype, dim, left, right)
        tiles = dict(overrides)
        kern = _dispatch.compile_program(swa.STAGE.name, spec, "sm90", tiles)
        # Sq > Sk leaves whole query tiles with nothing visible under the bounded-right windows.
        for sq, sk in [(1000, 1200), (1100, 300)]:
            q, k, v = randn(2, sq, 4, dim, dtype=dtype), randn(2, sk, 2, dim, dtype=dtype), randn(2, sk, 2, dim, dtype=dtype)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((2, 4, sq), float("nan"), device="cuda")
            kern(q, k, v, out, lse, swa.LOG2E / math.sqrt(dim), swa._runtime(left), swa._runtime(right))
            ref_out, ref_lse = mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference")
            assert_attention_matches(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("window", [None, (-1, 0), (1024, 0)], ids=str)
@pytest.mark.parametrize("form", ["2d", "3d", "4d"])
def test_launcher_packed_qkv(window, form):
    B, S, H, Hkv, D = 2, 1500, 8, 2, 128
    width = (H + 2 * Hkv) * D
    packed = randn(B * S, width, dtype=torch.bfloat16)
    cols = [(0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)]
    if form == "4d":
        four = packed.view(B, S, H + 2 * Hkv, D)
        q, k, v = (four[:, :, a:b] for a, b in cols)
        o = torch.full((B, S, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    elif form == "3d":
        three = packed.view(B * S, H + 2 * Hkv, D)
        q, k, v = (three[:, a:b] for a, b in cols)
        o = torch.full((B * S, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    else:
        q, k, v = (packed[:, a * D : b * D] for a, b in cols)
        o = torch.full((B * S, H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch = mate.build_gqa_attn(B, H, Hkv, D, sliding_window=window)
    assert launch(q, k, v, o, width, width, width, H * D, S, S) is o
    four = packed.view(B, S, H + 2 * Hkv, D)
    ref_out, ref_lse = mate.gqa_attention(*(four[:, :, a:b] for a, b in cols), sliding_window=window, return_lse=True, backend="reference")
    assert_attention_matches(o.view(B, S, H, D), ref_lse, ref_out, ref_lse)


def test_launcher_runtime_lengths():
    """One launcher, several sequence lengths (Sq != Sk), packed rows with a padded row stride."""
    B, H, Hkv, D = 2, 4, 1, 64
    launch = mate.build_gqa_attn(B, H, Hkv, D, sliding_window=(-1, 0))
    for sq, sk in [(200, 900), (901, 901), (1, 64)]:
        stride = (H + 2 * Hkv) * D + 64  # rows padded by 64 elements
        packed = randn(B * max(sq, sk), stride, dtype=torch.float16)
        q = packed[: B * sq, : H * D]
        k = packed[: B * sk, H * D : (H + Hkv) * D]
        v = packed[: B * sk, (H + Hkv) * D : (H + 2 * Hkv) * D]
        o = torch.full((B * sq, H * D), float("nan"), device="cuda", dtype=torch.float16)
        launch(q, k, v, o, stride, stride, stride, H * D, sq, sk)
        q4 = q.as_strided((B, sq, H, D), (sq * stride, stride, D, 1))
        k4 = k.as_strided((B, sk, Hkv, D), (sk * stride, stride, D, 1))
        v4 = v.as_strided((B, sk, Hkv, D), (sk * stride, stride, D, 1))
        ref_out, ref_lse = mate.gqa_attention(q4, k4, v4, sliding_window=(-1, 0), return_lse=True, backend="reference")
        assert_attention_matches(o.view(B, sq, H, D), ref_lse, ref_out, ref_lse)


def test_cuda_graph_replay_uses_current_inputs():
    q, k, v = randn(1, 777, 8, 128, dtype=torch.bfloat16), randn(1, 777, 2, 128, dtype=torch.bfloat16), randn(1, 777, 2, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    mate.gqa_attention(q, k, v, sliding_window=(256, 0), out=out)  # warm-up: compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mate.gqa_attention(q, k, v, sliding_window=(256, 0), out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mate.gqa_attention(q, k, v, sliding_window=(256, 0), out=out)
    for _ in range(2):
        q.copy_(randn(*q.shape, dtype=q.dtype))
        v.copy_(randn(*v.shape, dtype=v.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = mate.gqa_attention(q, k, v, sliding_window=(256, 0), backend="reference")
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 1e-2 and not torch.isnan(out).any()
