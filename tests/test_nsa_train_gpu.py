"""NSA selection attention for training on the GPU (run with `pytest -m gpu`): native gradients against the
reference's on fresh random inputs (allocator poisoned with NaN first), packed sequences natively, garbage in
unused keys, determinism, CUDA graph capture of forward + backward, torch.compile."""

import math

import pytest
import torch

import mate
from helpers import capture_graph, poison_allocator
from mate.nsa import reference
from test_nsa_gpu import assert_close, draw_indices

pytestmark = pytest.mark.gpu

I32 = torch.int32


def leaves(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype).requires_grad_()


def grads(q, k, v, idx, do, **kw):
    poison_allocator("cuda")
    o, lse = mate.nsa_selection_attention(q, k, v, idx, **kw)
    g = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    return (o.detach(), lse, *g)


def rel(a, b):
    # The floor (an element RMS of 1e-3, where gradients here are of order 1 to 10) keeps a gradient that is 0 up to
    # rounding from dividing noise by noise: at M = N = 1 on the H200, dq and dk had norms 2e-5 (native) and 1e-5
    # (reference) beside a dv of 60 that agreed to 3e-3.
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-3 * a.numel() ** 0.5)).item()


def assert_grads_close(got, want, tol=1e-2):
    """Output and LSE as the forward tests check them, then dq, dk, dv: no NaN, exact zeros where nothing
    flows (dq of a query head that sees no key, dk and dv of a key no query sees: where the reference's dv
    is 0), relative norm error < tol. (A row that sees one key has dq = 0 only up to rounding: there
    dO.v - delta is a difference of two equal sums taken in different orders.)"""
    assert_close(got[0], got[1], want[0], want[1])
    lse = want[1]
    dead_rows = torch.isinf(lse).transpose(-1, -2)  # [B, M, H] (padded) or [T, H] (packed)
    unseen_keys = (want[4] == 0).all(-1)
    for name, g, w, zero in zip(("dq", "dk", "dv"), got[2:], want[2:], (dead_rows, unseen_keys, unseen_keys)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert not torch.isnan(g).any(), f"NaN in {name}"
        assert torch.all(g[zero] == 0), f"{name}: nonzero where nothing flows, at {torch.nonzero(zero & (g != 0).any(-1))[:5].tolist()}"
        err = rel(g, w)
        assert err < tol, f"{name} relative error {err:.3e}"


def both(q, k, v, idx, do, **kw):
    return grads(q, k, v, idx, do, **kw), grads(q, k, v, idx, do, **kw, backend="reference")


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("hpg", [1, 2, 3, 5, 8, 16])
def test_every_specialization(hpg, D, dtype, block_size):
    B, M, N, G, T = 2, 67, 301, 2, 7
    q, k, v = leaves(B, M, G * hpg, D, dtype=dtype), leaves(B, N, G, D, dtype=dtype), leaves(B, N, G, D, dtype=dtype)
    idx = draw_indices(B, M, G, T, N, block_size)
    counts = torch.randint(-1, T + 2, (B, M, G), device="cuda", dtype=I32) if hpg % 2 else None
    do = torch.randn(q.shape, device="cuda").to(dtype)
    assert_grads_close(*both(q, k, v, idx, do, block_size=block_size, block_counts=counts))


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("M, N", [(1, 1), (33, 100), (257, 64), (128, 128), (999, 1000)])
def test_lengths(M, N, block_size):
    B, G, hpg, D, T = 1, 2, 16, 128, 16
    q, k, v = leaves(B, M, G * hpg, D), leaves(B, N, G, D), leaves(B, N, G, D)
    idx = draw_indices(B, M, G, T, N, block_size)
    do = torch.randn(q.shape, device="cuda").to(q.dtype)
    assert_grads_close(*both(q, k, v, idx, do, block_size=block_size, scale=0.3))


def test_many_slots_duplicates_and_nothing_visible():
    B, M, N, G, hpg, D, T = 1, 200, 1500, 1, 16, 128, 128  # T at the native cap
    q, k, v = leaves(B, M, G * hpg, D), leaves(B, N, G, D), leaves(B, N, G, D)
    idx = draw_indices(B, M, G, T, N, 32)
    idx[..., 100:150] = idx[..., 0:1]  # the same block fifty more times
    idx[:, :20] = -1  # rows with nothing selected: zero dq
    do = torch.randn(q.shape, device="cuda").to(q.dtype)
    got, want = both(q, k, v, idx, do, block_size=32)
    assert torch.all(got[2][:, :20] == 0) and torch.isinf(got[1][:, :, :20]).all()
    assert_grads_close(got, want)
    got = grads(q, k, v, torch.full_like(idx, -1), do)
    assert all(torch.all(g == 0) for g in got[2:])


def test_garbage_in_unused_keys_does_not_reach_gradients():
    """NaN keys and Inf values in every row no query sees: bitwise the gradients of clean memory there."""
    B, M, N, G, hpg, D, T, bs = 1, 300, 1000, 2, 4, 128, 8, 64
    q, k, v = leaves(B, M, G * hpg, D), leaves(B, N, G, D), leaves(B, N, G, D)
    idx = draw_indices(B, M, G, T, N, bs)
    used = reference.used_slots(idx, None, N, bs)
    seen = torch.zeros(B, N, G, dtype=torch.bool, device="cuda")
    for m, g, j in zip(*[x.tolist() for x in torch.nonzero(used[0])[:, :2].T], idx[0][used[0]].tolist()):
        seen[0, j * bs : min((j + 1) * bs, N - M + m + 1), g] = True
    do = torch.randn(q.shape, device="cuda").to(q.dtype)
    clean = grads(q, k, v, idx, do, block_size=bs)
    kd, vd = k.detach().clone(), v.detach().clone()
    kd[~seen], vd[~seen] = float("nan"), float("inf")
    dirty = grads(q, kd.requires_grad_(), vd.requires_grad_(), idx, do, block_size=bs)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


@pytest.mark.parametrize("block_size", [32, 64])
def test_packed_sequences(block_size):
    """Sequences shorter than one block, an empty one, -1 pads and counts; native forward and backward."""
    lens = [1, 5, 64, 0, 130, 33, 700]
    total, G, hpg, D, T = sum(lens), 2, 8, 128, 9
    q, k, v = leaves(total, G * hpg, D), leaves(total, G, D), leaves(total, G, D)
    idx = torch.full((total, G, T), -1, device="cuda", dtype=I32)
    start = 0
    for n in lens:
        if n:
            idx[start : start + n] = draw_indices(1, n, G, T, n, block_size)[0]
        start += n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=I32)
    counts = torch.randint(0, T + 1, (total, G), device="cuda", dtype=I32)
    do = torch.randn(q.shape, device="cuda").to(q.dtype)
    got, want = both(q, k, v, idx, do, block_size=block_size, block_counts=counts, cu_seqlens=cu)
    assert got[0].shape == q.shape and got[1].shape == (G * hpg, total)
    # assert_close takes the padded layout: one batch row
    assert_grads_close([x[None] for x in got], [x[None] for x in want])


def test_backward_is_deterministic():
    B, M, N, G, hpg, D, T = 1, 2048, 2048, 2, 16, 128, 16
    q, k, v = leaves(B, M, G * hpg, D), leaves(B, N, G, D), leaves(B, N, G, D)
    idx = draw_indices(B, M, G, T, N, 64)
    idx[..., :4] = 0  # a hot block: many queries on one key block
    do = torch.randn(q.shape, device="cuda").to(q.dtype)
    first = grads(q, k, v, idx, do)
    for _ in range(3):
        again = grads(q, k, v, idx, do)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_cuda_graph_of_forward_and_backward_uses_current_metadata(varlen):
    G, hpg, D, T, bs = 2, 8, 128, 8, 64
    if varlen:
        lens = [100, 3, 400]
        total = sum(lens)
        q, k, v = leaves(total, G * hpg, D), leaves(total, G, D), leaves(total, G, D)
        cu = torch.tensor([0, 100, 103, 503], device="cuda", dtype=I32)

        def draw():
            return torch.cat([draw_indices(1, n, G, T, n, bs)[0] for n in lens])
    else:
        q, k, v = leaves(1, 256, G * hpg, D), leaves(1, 1024, G, D), leaves(1, 1024, G, D)
        cu = None

        def draw():
            return draw_indices(1, 256, G, T, 1024, bs)
    idx = draw()
    do = torch.randn(q.shape, device="cuda").to(q.dtype)

    def step():
        o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu)
        return (o.detach(), lse, *torch.autograd.grad(o, (q, k, v), do))

    graph, outs = capture_graph(step)
    idx.copy_(draw())
    with torch.no_grad():
        q.copy_(torch.randn(q.shape, device="cuda"))
    for x in outs:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = grads(q, k, v, idx, do, block_size=bs, cu_seqlens=cu, backend="reference")
    got = list(outs)
    if varlen:
        got, want = [x[None] for x in got], [x[None] for x in want]
    assert_grads_close(got, want)


def test_compiled_forward_and_backward_is_bitwise_eager():
    torch._dynamo.reset()
    B, M, N, G, hpg, D, T = 1, 300, 700, 2, 4, 64, 6
    q, k, v = leaves(B, M, G * hpg, D), leaves(B, N, G, D), leaves(B, N, G, D)
    idx = draw_indices(B, M, G, T, N, 32)
    do = torch.randn(q.shape, device="cuda").to(q.dtype)

    def step(q, k, v):
        o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=32)
        return (o * do).sum() + lse.nan_to_num(neginf=0).sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_native_forward_packed_without_grad_matches_padded():
    """With cu_seqlens the forward alone (no grad) equals each sequence's padded call bitwise."""
    lens = [7, 64, 65, 200]
    total, G, hpg, D, T = sum(lens), 2, 16, 64, 5
    q, k, v = (torch.randn(total, n, D, device="cuda").to(torch.float16) for n in (G * hpg, G, G))
    idx = torch.cat([draw_indices(1, n, G, T, n, 32)[0] for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=I32)
    o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=32, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o1, l1 = mate.nsa_selection_attention(q[None, a:b], k[None, a:b], v[None, a:b], idx[None, a:b], block_size=32)
        assert torch.equal(o[a:b], o1[0]) and torch.equal(lse[:, a:b], l1[0])
    assert math.isfinite(float(o.float().abs().sum()))
