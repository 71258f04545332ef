"""NSA selection attention, native vs reference on the GPU (run with `pytest -m gpu`)."""

import math

import pytest
import torch

import mate
from helpers import capture_graph, poison_allocator

pytestmark = pytest.mark.gpu

I32 = torch.int32
DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def draw_indices(B, M, G, T, N, block_size):
    """Visible blocks mostly, plus -1 pads, other negatives, future and out-of-range blocks, and duplicates."""
    n_blocks = math.ceil(N / block_size)
    pos = N - M + torch.arange(M, device="cuda")
    last = torch.div(pos, block_size, rounding_mode="floor").clamp_min(0)
    frac = torch.rand(B, M, G, T, device="cuda")
    idx = (frac * (last.view(1, M, 1, 1) + 1)).to(I32)  # visible
    noise = torch.randint(-3, n_blocks + 4, (B, M, G, T), device="cuda", dtype=I32)
    idx = torch.where(torch.rand(B, M, G, T, device="cuda") < 0.25, noise, idx)
    if T > 2:
        idx[..., 1] = idx[..., 0]  # duplicates
    if T > 3:
        idx[..., T - 1] = -1
    if T > 4:
        idx[0, 0, 0, 2] = 2**31 - 1
    return idx


def assert_close(out, lse, ref_out, ref_lse):
    """Exact -inf and zero pattern, no NaN, relative norm error < 1e-2 (output) and < 1e-4 (LSE)."""
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element?)"
    assert not torch.isnan(lse).any(), "NaN in the LSE (unwritten element?)"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), dead), f"-inf pattern differs at {torch.nonzero(torch.isinf(lse) != dead)[:5].tolist()}"
    assert (lse[dead] < 0).all()
    assert torch.all(out.transpose(1, 2)[dead] == 0), "a query with nothing visible must give 0"
    o, r = out.double(), ref_out.double()
    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"output relative error {err:.3e}"
    fin = ~dead
    if fin.any():
        a, b = lse[fin].double(), ref_lse[fin].double()
        lerr = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert lerr < 1e-4, f"LSE relative error {lerr:.3e}"


def run_both(q, k, v, idx, **kw):
    poison_allocator("cuda")
    out, lse = mate.nsa_selection_attention(q, k, v, idx, **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = mate.nsa_selection_attention(q, k, v, idx, **kw, backend="reference")
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("hpg", list(range(1, 17)))
def test_every_specialization(hpg, D, dtype, block_size):
    B, M, N, G, T = 2, 67, 301, 2, 7
    q, k, v = randn(B, M, G * hpg, D, dtype=dtype), randn(B, N, G, D, dtype=dtype), randn(B, N, G, D, dtype=dtype)
    idx = draw_indices(B, M, G, T, N, block_size)
    counts = torch.randint(-1, T + 2, (B, M, G), device="cuda", dtype=I32) if hpg % 2 else None
    out, lse, ref_out, ref_lse = run_both(q, k, v, idx, block_size=block_size, block_counts=counts)
    assert out.shape == q.shape and lse.shape == (B, G * hpg, M)
    assert_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("M, N", [(1, 1), (33, 100), (257, 64), (128, 128), (999, 1000), (1000, 4096)])
def test_lengths(M, N, block_size):
    """M != N both ways (M > N leaves the first M - N queries with nothing visible), odd M, N not a multiple of the block."""
    B, G, hpg, D, T = 1, 4, 4, 128, 16
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    idx = draw_indices(B, M, G, T, N, block_size)
    assert_close(*run_both(q, k, v, idx, block_size=block_size, scale=0.3))


@pytest.mark.parametrize("block_size", [32, 64])
def test_typical_selection(block_size):
    """T distinct visible blocks per row (as the NSA benchmarks draw them), sorted, -1 where fewer exist."""
    B, M, N, G, hpg, D, T = 1, 2048, 2048, 2, 16, 128, 16
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    n_blocks = N // block_size
    pos = torch.arange(M, device="cuda")
    r = torch.rand(B, M, G, n_blocks, device="cuda")
    r = torch.where(torch.arange(n_blocks, device="cuda") <= (pos // block_size).view(1, M, 1, 1), r, -1.0)
    val, idx = r.topk(T, dim=-1)
    idx = torch.where(val >= 0, idx, n_blocks + 10).sort(-1).values
    idx = torch.where(idx >= n_blocks, -1, idx).to(I32)
    assert_close(*run_both(q, k, v, idx, block_size=block_size))


def test_nothing_visible_and_block_counts():
    B, M, N, G, hpg, D, T = 2, 40, 200, 2, 8, 64, 5
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.float16), randn(B, N, G, D, dtype=torch.float16), randn(B, N, G, D, dtype=torch.float16)
    idx = draw_indices(B, M, G, T, N, 64)
    for counts in (torch.zeros(B, M, G, device="cuda", dtype=I32), torch.full((B, M, G), -5, device="cuda", dtype=I32)):
        out, lse, ref_out, ref_lse = run_both(q, k, v, idx, block_counts=counts)
        assert torch.isinf(lse).all() and torch.all(out == 0)
        assert_close(out, lse, ref_out, ref_lse)
    out, lse, ref_out, ref_lse = run_both(q, k, v, torch.full_like(idx, -1))
    assert torch.isinf(lse).all() and torch.all(out == 0)
    counts = torch.randint(-2, T + 3, (B, M, G), device="cuda", dtype=I32)
    assert_close(*run_both(q, k, v, idx, block_counts=counts, block_size=32))
    # no slots at all, and no keys at all
    assert_close(*run_both(q, k, v, idx[..., :0]))
    k0, v0 = k[:, :0], v[:, :0]
    out, lse = mate.nsa_selection_attention(q, k0, v0, idx)
    assert torch.isinf(lse).all() and torch.all(out == 0)


def test_many_slots_and_duplicates():
    B, M, N, G, hpg, D, T = 1, 300, 2000, 1, 16, 128, 128  # T at the native cap
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    idx = draw_indices(B, M, G, T, N, 32)
    idx[..., 100:150] = idx[..., 0:1]  # the same block fifty more times
    assert_close(*run_both(q, k, v, idx, block_size=32))
    assert_close(*run_both(q, k, v, idx[..., :1], block_size=64))


def test_strided_views_and_out_buffers():
    """Sliced q/k/v (offset rows, packed KV), strided block metadata, and caller-provided out/lse written in place."""
    B, M, N, G, hpg, D, T = 2, 50, 333, 2, 3, 128, 9
    qbig = randn(B, M + 2, G * hpg + 1, D + 8, dtype=torch.bfloat16)
    q = qbig[:, 2:, 1:, 8:]
    kv = randn(B, N, 2, G, D, dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    idx = draw_indices(B, M, G, 2 * T, N, 64)[..., ::2]
    counts = torch.randint(0, T + 1, (B, M, G, 2), device="cuda", dtype=I32)[..., 1]
    out_big = torch.full((B, M, G * hpg, D + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = out_big[..., :D]
    lse_big = torch.full((B, G * hpg, M + 5), float("nan"), device="cuda")
    lse = lse_big[:, :, 5:]
    o2, l2 = mate.nsa_selection_attention(q, k, v, idx, block_counts=counts, out=out, lse=lse)
    assert o2 is out and l2 is lse
    ref_out, ref_lse = mate.nsa_selection_attention(q, k, v, idx, block_counts=counts, backend="reference")
    assert_close(out, lse, ref_out, ref_lse)
    assert torch.isnan(out_big[..., D:]).all() and torch.isnan(lse_big[:, :, :5]).all()


def test_single_batch_single_group():
    """Size-1 axes may carry any stride (canonicalized for TMA)."""
    q = randn(1, 70, 16, 64, dtype=torch.bfloat16)
    kbig = randn(130, 2, 64, dtype=torch.bfloat16)
    k, v = kbig[:, :1].unsqueeze(0), kbig[:, 1:].unsqueeze(0)
    idx = draw_indices(1, 70, 1, 4, 130, 32)
    assert_close(*run_both(q, k, v, idx, block_size=32))


def test_cuda_graph_replay_uses_current_metadata():
    B, M, N, G, hpg, D, T = 1, 256, 1024, 2, 8, 128, 8
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    idx = draw_indices(B, M, G, T, N, 64)
    counts = torch.full((B, M, G), T, device="cuda", dtype=I32)
    out = torch.empty_like(q)
    lse = torch.empty(B, G * hpg, M, device="cuda")
    call = lambda: mate.nsa_selection_attention(q, k, v, idx, block_counts=counts, out=out, lse=lse)  # noqa: E731
    g, _ = capture_graph(call)
    idx.copy_(draw_indices(B, M, G, T, N, 64))
    counts.random_(0, T + 1)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = mate.nsa_selection_attention(q, k, v, idx, block_counts=counts, backend="reference")
    assert_close(out, lse, ref_out, ref_lse)


def test_native_rejects_too_many_heads_per_group():
    q, k, v = randn(1, 4, 17, 64, dtype=torch.bfloat16), randn(1, 8, 1, 64, dtype=torch.bfloat16), randn(1, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="up to 16 query heads per KV group"):
        mate.nsa_selection_attention(q, k, v, torch.zeros(1, 4, 1, 2, device="cuda", dtype=I32))
