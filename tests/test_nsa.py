"""NSA selection attention on the CPU: the reference against a naive float64 loop oracle, and every documented error."""

import math

import pytest
import torch

import mate
from mate.nsa import reference
from inputs import nsa_indices

I32 = torch.int32


# ---------------------------------------------------------------- naive oracle


def naive(q, k, v, idx, counts, block_size, scale):
    """Query by query, head by head, slot by slot, in float64: gather the keys of each used slot and softmax."""
    B, M, H, D = q.shape
    N, G = k.shape[1], k.shape[2]
    hpg = H // G
    out = torch.zeros(B, M, H, D, dtype=torch.float64)
    lse = torch.full((B, H, M), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for m in range(M):
            pos = N - M + m
            for g in range(G):
                slots = idx.shape[-1] if counts is None else max(0, min(int(counts[b, m, g]), idx.shape[-1]))
                keys = []
                for t in range(slots):
                    j = int(idx[b, m, g, t])
                    if j < 0 or j * block_size > pos:
                        continue
                    keys += [n for n in range(j * block_size, (j + 1) * block_size) if n <= pos and n < N]
                if not keys:
                    continue
                kk, vv = k[b, keys, g].double(), v[b, keys, g].double()
                for h in range(g * hpg, (g + 1) * hpg):
                    s = (kk @ q[b, m, h].double()) * scale
                    lse[b, h, m] = torch.logsumexp(s, 0)
                    out[b, m, h] = torch.softmax(s, 0) @ vv
    return out, lse


def check(out, lse, ref_out, ref_lse, tol=1e-5):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf pattern of the LSE differs"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    dead = ~fin.transpose(1, 2)  # [B, M, H]
    assert torch.all(out[dead] == 0), "a query with nothing visible must give 0"


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("hpg", [1, 3, 16])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("M, N", [(7, 37), (5, 5), (9, 4), (1, 30)])
def test_reference_matches_oracle(gen, hpg, block_size, M, N):
    B, G, D, T = 2, 2, 16, 6
    q, k, v = rand(gen, B, M, G * hpg, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    idx = nsa_indices(gen, B, M, G, T, N, block_size)
    out, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=block_size, backend="reference")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (B, G * hpg, M) and lse.dtype == torch.float32
    check(out, lse, *naive(q, k, v, idx, None, block_size, 1 / math.sqrt(D)))


def test_reference_block_counts_and_scale(gen):
    B, M, N, G, hpg, D, T, bs = 2, 11, 50, 3, 2, 8, 5, 8
    q, k, v = rand(gen, B, M, G * hpg, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    idx = nsa_indices(gen, B, M, G, T, N, bs)
    counts = torch.randint(-1, T + 3, (B, M, G), generator=gen, dtype=I32)
    out, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, block_counts=counts, scale=0.7, backend="reference")
    check(out, lse, *naive(q, k, v, idx, counts, bs, 0.7))


def test_reference_nothing_visible(gen):
    """M > N puts early queries before the first key; all -1, and zero counts, hide everything."""
    B, M, N, G, D, bs = 1, 6, 3, 1, 8, 2
    q, k, v = rand(gen, B, M, 2, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    idx = torch.zeros(B, M, G, 3, dtype=I32)
    out, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, backend="reference")
    assert torch.isinf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert torch.all(out[:, :3] == 0)
    check(out, lse, *naive(q, k, v, idx, None, bs, 1 / math.sqrt(D)))
    out, lse = mate.nsa_selection_attention(q, k, v, torch.full_like(idx, -1), block_size=bs, backend="reference")
    assert torch.isinf(lse).all() and torch.all(out == 0) and not torch.isnan(out).any()
    zero = torch.zeros(B, M, G, dtype=I32)
    out, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, block_counts=zero, backend="reference")
    assert torch.isinf(lse).all() and torch.all(out == 0)


def test_reference_duplicates_count_twice(gen):
    """Selecting a block twice doubles its weight: the same as adding log 2 to its scores."""
    B, M, N, G, D, bs = 1, 1, 8, 1, 4, 4
    q, k, v = rand(gen, B, M, 1, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    out, lse = mate.nsa_selection_attention(q, k, v, torch.tensor([[[[0, 1, 0]]]], dtype=I32), block_size=bs, backend="reference")
    s = (k[0, :, 0] @ q[0, 0, 0]) / 2 + torch.tensor([math.log(2)] * 4 + [0.0] * 4)
    torch.testing.assert_close(lse[0, 0, 0], torch.logsumexp(s, 0))
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(s, 0) @ v[0, :, 0])


def test_reference_chunks_and_low_precision(gen):
    B, M, N, G, hpg, D, T, bs = 2, 13, 40, 2, 4, 16, 4, 8
    q, k, v = rand(gen, B, M, G * hpg, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    idx = nsa_indices(gen, B, M, G, T, N, bs)
    whole = reference.selection_attention(q, k, v, idx, None, bs, 0.25)
    chunked = reference.selection_attention(q, k, v, idx, None, bs, 0.25, chunk_elems=1)
    torch.testing.assert_close(whole, chunked)
    for dtype in (torch.bfloat16, torch.float16):
        out, lse = mate.nsa_selection_attention(q.to(dtype), k.to(dtype), v.to(dtype), idx, block_size=bs, scale=0.25,
                                                backend="reference")
        assert out.dtype == dtype and lse.dtype == torch.float32
        ref_out, ref_lse = naive(q.to(dtype), k.to(dtype), v.to(dtype), idx, None, bs, 0.25)
        check(out.double(), lse, ref_out.to(dtype).double(), ref_lse, tol=1e-2)


def test_reference_out_buffers_returned_in_place(gen):
    B, M, N, G, D, bs = 1, 4, 16, 2, 8, 4
    q, k, v = rand(gen, B, M, 4, D), rand(gen, B, N, G, D), rand(gen, B, N, G, D)
    idx = nsa_indices(gen, B, M, G, 3, N, bs)
    out = torch.full_like(q, float("nan"))
    lse_big = torch.full((B, 4, M + 3), float("nan"))
    lse = lse_big[:, :, 1 : M + 1]  # a strided view
    o2, l2 = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, out=out, lse=lse, backend="reference")
    assert o2 is out and l2 is lse
    check(out, lse, *naive(q, k, v, idx, None, bs, 1 / math.sqrt(D)))
    assert torch.isnan(lse_big[:, :, 0]).all() and torch.isnan(lse_big[:, :, M + 1 :]).all()


def test_reference_empty_shapes(gen):
    q, k, v = rand(gen, 1, 0, 2, 8), rand(gen, 1, 5, 1, 8), rand(gen, 1, 5, 1, 8)
    out, lse = mate.nsa_selection_attention(q, k, v, torch.zeros(1, 0, 1, 2, dtype=I32), block_size=2, backend="reference")
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    q = rand(gen, 1, 3, 2, 8)
    out, lse = mate.nsa_selection_attention(q, k, v, torch.zeros(1, 3, 1, 0, dtype=I32), block_size=2, backend="reference")
    assert torch.all(out == 0) and torch.isinf(lse).all()


# ---------------------------------------------------------------- errors


def args(B=1, M=4, N=16, G=2, hpg=2, D=64, T=3, dtype=torch.bfloat16):
    q = torch.randn(B, M, G * hpg, D).to(dtype)
    k = torch.randn(B, N, G, D).to(dtype)
    v = torch.randn(B, N, G, D).to(dtype)
    idx = torch.zeros(B, M, G, T, dtype=I32)
    return q, k, v, idx


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: a.update(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
        (lambda a: a.update(q=a["q"][0]), ValueError, "q must have rank 4"),
        (lambda a: a.update(q=a["q"].to(torch.int16)), TypeError, "q must be a floating-point"),
        (lambda a: a.update(k=a["k"].float()), ValueError, "k has dtype"),
        (lambda a: a.update(k=a["k"][:, :, :, :32]), ValueError, "k must be \\[B, N, G, D\\]"),
        (lambda a: a.update(v=a["v"][:, :8]), ValueError, "v must have the shape of k"),
        (lambda a: a.update(q=a["q"][:, :, :3]), ValueError, "multiple of k's KV groups"),
        (lambda a: a.update(block_indices=a["block_indices"].long()), TypeError, "block_indices must be an int32"),
        (lambda a: a.update(block_indices=a["block_indices"][:, :2]), ValueError, "block_indices must be \\[B, M, G, T\\]"),
        (lambda a: a.update(block_counts=torch.zeros(1, 4, 2)), TypeError, "block_counts must be an int32"),
        (lambda a: a.update(block_counts=torch.zeros(1, 4, 1, dtype=I32)), ValueError, "block_counts must have shape"),
        (lambda a: a.update(block_size=64.0), TypeError, "block_size must be an int"),
        (lambda a: a.update(block_size=0), ValueError, "block_size must be positive"),
        (lambda a: a.update(scale=-1.0), ValueError, "scale must be a positive"),
        (lambda a: a.update(scale="1"), TypeError, "scale must be a float"),
        (lambda a: a.update(backend="auto"), ValueError, "backend must be 'tilelang' or 'reference'"),
        (lambda a: a.update(out=torch.empty(1, 4, 4, 32, dtype=torch.bfloat16)), ValueError, "out must have shape"),
        (lambda a: a.update(out=torch.empty(1, 4, 4, 64)), ValueError, "out must have dtype"),
        (lambda a: a.update(lse=torch.empty(1, 4, 5)), ValueError, "lse must have shape"),
        (lambda a: a.update(lse=torch.empty(1, 4, 4, dtype=torch.float64)), ValueError, "lse must have dtype"),
        (lambda a: a.update(out=a["q"]), ValueError, "out overlaps q"),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "tilelang"])
def test_errors(change, exc, match, backend):
    q, k, v, idx = args()
    a = dict(q=q, k=k, v=v, block_indices=idx, backend=backend)
    change(a)
    with pytest.raises(exc, match=match):
        mate.nsa_selection_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("block_indices"), **a)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dtype=torch.float32), "supports bfloat16 and float16 q"),
        (dict(D=96), "head dim 64 or 128"),
        (dict(T=129), "at most 128 selected blocks"),
    ],
)
def test_native_rejects_unsupported(kw, match):
    q, k, v, idx = args(**kw)
    with pytest.raises(ValueError, match=match):
        mate.nsa_selection_attention(q, k, v, idx)


def test_native_rejects_block_size_layout_and_cpu():
    q, k, v, idx = args()
    with pytest.raises(ValueError, match="block_size 32 or 64"):
        mate.nsa_selection_attention(q, k, v, idx, block_size=16)
    kk = torch.randn(1, 16, 2, 72).to(torch.bfloat16)[..., 4:68]  # rows start 8 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="k: vector loads require"):
        mate.nsa_selection_attention(q, kk, v, idx)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        mate.nsa_selection_attention(q, k, v, idx)
