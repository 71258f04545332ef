"""NSA selection forward, the shared program (a CTA of W queries gathers the union of their blocks once:
mate/nsa/kernels/selection_shared.py), native vs reference on the GPU (run with `pytest -m gpu`).

The shipped configs route nothing to it (their nsa_selection entries leave `queries` at 1): these tests run it
through a patched copy of the config (mate.tuning.measure.using_tiles), an entry with queries = W. Every call
writes into NaN-poisoned out / lse buffers, on fresh random inputs, with K/V rows that no query sees set to
NaN; selections from both benchmark generators (benchmarks/bench_nsa.py) and hostile ones (duplicates, -1,
future and out-of-range ids, INT32_MAX, block_counts), padded and packed (cu_seqlens) sequences.
"""

import sys
from pathlib import Path

import pytest
import torch

import mate
from helpers import poison_allocator
from test_nsa_gpu import assert_close, draw_indices

from mate.tuning.measure import using_tiles

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_nsa  # noqa: E402

pytestmark = pytest.mark.gpu

I32 = torch.int32
# The tiles of each W the benchmark times (bench_nsa.SHARED_TILES): the kernels scripts/gpu-cache.sh-like
# precompiles fill the cache with.
TILES = bench_nsa.SHARED_TILES


def key(dtype, D, bs=64):
    return f"dtype={str(dtype).removeprefix('torch.')},dim={D},block_size={bs}"


def shared(W, dtype=torch.bfloat16, D=128, bs=64):
    return using_tiles("sm90", "nsa_selection", key(dtype, D, bs), TILES[W])


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def seen_rows(idx, counts, N, bs, cu=None):
    """[B, N, G] bool (padded) or [T_total, G] (packed): the K/V rows some query's used slot covers."""
    idx, B = (idx.unsqueeze(0), 1) if cu is not None else (idx, idx.shape[0])
    M, G, T = idx.shape[1:]
    rows = torch.zeros(B, N, G, dtype=torch.bool, device=idx.device)
    m = torch.arange(M, device=idx.device)
    if cu is None:
        start, pos = torch.zeros_like(m), (N - M + m)
    else:
        seq = torch.searchsorted(cu[1:].long(), m, right=True)
        start = cu[seq].long()
        pos = m - start
    t = torch.arange(T, device=idx.device)
    used = (idx >= 0) & (idx.long() * bs <= pos.view(1, M, 1, 1))
    if counts is not None:
        used &= t < (counts.unsqueeze(0) if cu is not None else counts).unsqueeze(-1)
    for off in range(bs):
        n = idx.long() * bs + off
        ok = used & (n <= pos.view(1, M, 1, 1))
        r = (start.view(1, M, 1, 1) + n).clamp(0, N - 1)
        b = torch.arange(B, device=idx.device).view(B, 1, 1, 1).expand_as(r)
        g = torch.arange(G, device=idx.device).view(1, 1, G, 1).expand_as(r)
        rows.index_put_((b[ok], r[ok], g[ok]), torch.ones_like(r[ok], dtype=torch.bool))
    return rows[0] if cu is not None else rows


def poisoned_kv(shape, rows, dtype):
    """K or V with NaN in every row no query sees."""
    x = randn(*shape, dtype=dtype)
    return torch.where(rows.unsqueeze(-1), x, torch.full_like(x, float("nan")))


def run(W, q, k, v, idx, **kw):
    """The shared program's (o, lse) in NaN-filled buffers, and the reference's."""
    poison_allocator("cuda")
    out = torch.full_like(q, float("nan"))
    lse_shape = (q.shape[1], q.shape[0]) if kw.get("cu_seqlens") is not None else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, float("nan"), device="cuda")
    with shared(W, q.dtype, q.shape[-1], kw.get("block_size", 64)):
        o2, l2 = mate.nsa_selection_attention(q, k, v, idx, out=out, lse=lse, **kw)
        torch.cuda.synchronize()
    assert o2 is out and l2 is lse
    ref_o, ref_l = mate.nsa_selection_attention(q, k, v, idx, backend="reference", **kw)
    return out, lse, ref_o, ref_l


def selection(name, B, M, N, G, T, bs):
    if name == "hostile":
        return draw_indices(B, M, G, T, N, bs)
    return bench_nsa.block_indices(name, B, M, N, G, T, bs, seed=5, device="cuda")


@pytest.mark.parametrize("W", sorted(TILES))
@pytest.mark.parametrize("name", ["uniform", "smooth", "hostile"])
@pytest.mark.parametrize("hpg", [1, 5, 16])
def test_shared_matches_reference(W, name, hpg):
    B, M, N, G, T, bs, D = 2, 301, 1100, 2, 16, 64, 128  # M not a multiple of W; M < N (rows end at N)
    idx = selection(name, B, M, N, G, T, bs)
    counts = torch.randint(-1, T + 2, (B, M, G), device="cuda", dtype=I32) if name == "hostile" and hpg != 1 else None
    rows = seen_rows(idx, counts, N, bs)
    q = randn(B, M, G * hpg, D, dtype=torch.bfloat16)
    k, v = poisoned_kv((B, N, G, D), rows, torch.bfloat16), poisoned_kv((B, N, G, D), rows, torch.bfloat16)
    assert_close(*run(W, q, k, v, idx, block_size=bs, block_counts=counts))


@pytest.mark.parametrize("W", sorted(TILES))
def test_shared_duplicates_and_pads(W):
    """The same block in many slots of a row (each counts once per slot), rows of -1 only, the first queries with
    nothing visible (M > N)."""
    B, M, N, G, hpg, T, D = 1, 200, 150, 2, 16, 16, 128
    idx = draw_indices(B, M, G, T, N, 64)
    idx[..., 4:12] = idx[..., 0:1]
    idx[:, 7] = -1
    idx[:, 100:104, :, :8] = idx[:, 99:100, :, :8]  # neighbours share duplicated slots too
    rows = seen_rows(idx, None, N, 64)
    q = randn(B, M, G * hpg, D, dtype=torch.bfloat16)
    k, v = poisoned_kv((B, N, G, D), rows, torch.bfloat16), poisoned_kv((B, N, G, D), rows, torch.bfloat16)
    out, lse, ro, rl = run(W, q, k, v, idx, block_size=64)
    assert torch.isinf(lse[:, :, :M - N]).all()
    assert_close(out, lse, ro, rl)


@pytest.mark.parametrize("W", sorted(TILES))
@pytest.mark.parametrize("name", ["smooth", "hostile"])
def test_shared_varlen(W, name):
    """Packed sequences whose boundaries fall inside a CTA's W rows (lengths not multiples of W)."""
    lens = [37, 64, 5, 190, 1, 99]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=I32)
    Tt, G, hpg, T, D, bs = sum(lens), 2, 8, 16, 128, 64
    parts = [selection(name, 1, n, n, G, T, bs)[0] for n in lens]
    idx = torch.cat(parts, 0)
    counts = torch.randint(0, T + 1, (Tt, G), device="cuda", dtype=I32) if name == "hostile" else None
    rows = seen_rows(idx, counts, Tt, bs, cu)
    q = randn(Tt, G * hpg, D, dtype=torch.bfloat16)
    k, v = poisoned_kv((Tt, G, D), rows, torch.bfloat16), poisoned_kv((Tt, G, D), rows, torch.bfloat16)
    out, lse, ro, rl = run(W, q, k, v, idx, block_size=bs, block_counts=counts, cu_seqlens=cu)
    assert_close(out.unsqueeze(0), lse.unsqueeze(0), ro.unsqueeze(0), rl.unsqueeze(0))


def test_shared_fp16_and_dim_64():
    B, M, N, G, hpg, T, D = 1, 257, 700, 4, 4, 16, 64
    idx = selection("smooth", B, M, N, G, T, 64)
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.float16), randn(B, N, G, D, dtype=torch.float16), randn(B, N, G, D, dtype=torch.float16)
    assert_close(*run(4, q, k, v, idx, block_size=64))


def test_shared_entry_falls_back_past_its_limits():
    """T above SHARED_SLOTS (16) runs the one-query program under a queries > 1 entry, and gives its result."""
    B, M, N, G, hpg, T, D = 1, 128, 900, 2, 16, 24, 128
    idx = draw_indices(B, M, G, T, N, 64)
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    assert_close(*run(8, q, k, v, idx, block_size=64))


@pytest.mark.parametrize("W", sorted(TILES))
def test_shared_is_deterministic_and_graph_capturable(W):
    B, M, N, G, hpg, T, D = 1, 512, 2048, 2, 16, 16, 128
    idx = selection("smooth", B, M, N, G, T, 64)
    q, k, v = randn(B, M, G * hpg, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16), randn(B, N, G, D, dtype=torch.bfloat16)
    with shared(W):
        a = mate.nsa_selection_attention(q, k, v, idx)
        b = mate.nsa_selection_attention(q, k, v, idx)
        out, lse = torch.empty_like(q), torch.empty(B, G * hpg, M, device="cuda")
        g = torch.cuda.CUDAGraph()
        mate.nsa_selection_attention(q, k, v, idx, out=out, lse=lse)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            mate.nsa_selection_attention(q, k, v, idx, out=out, lse=lse)
        idx.copy_(selection("uniform", B, M, N, G, T, 64))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert_close(out, lse, *mate.nsa_selection_attention(q, k, v, idx, backend="reference"))
