"""benchmarks/bench_nsa.py on the CPU: the smooth selection generator (its invariants, and a rebuild from its
docstring) and the gathered-bytes counter of CTAs that share their queries' blocks. The timing needs a GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_nsa  # noqa: E402


@pytest.mark.parametrize("B, M, N, G, T, bs", [(1, 300, 300, 2, 16, 64), (2, 130, 1000, 3, 5, 32), (1, 2500, 2400, 1, 8, 64)])
def test_smooth_selection_invariants(B, M, N, G, T, bs):
    idx = bench_nsa.smooth_block_indices(B, M, N, G, T, bs, seed=3)
    assert idx.shape == (B, M, G, T) and idx.dtype == torch.int32 and idx.device.type == "cpu"
    pos = N - M + torch.arange(M)
    last = torch.where(pos >= 0, torch.div(pos, bs, rounding_mode="floor"), -1).view(1, M, 1, 1)
    valid = idx >= 0
    assert ((idx == -1) | valid).all()
    assert (idx <= last).all(), "a future block"
    # sorted, the -1 pads last; as many blocks as are visible, up to T; distinct
    key = torch.where(valid, idx, 2**30)
    assert ((key[..., 1:] > key[..., :-1]) | ~valid[..., 1:]).all() and (valid[..., :-1] | ~valid[..., 1:]).all()
    assert torch.equal(valid.sum(-1), torch.minimum(last + 1, torch.tensor(T)).clamp_min(0).squeeze(-1).expand(B, M, G))
    has = lambda j: ((idx == j) & (j >= 0)).any(-1) | (j < 0).squeeze(-1)  # noqa: E731
    seen = last.squeeze(-1) >= 0
    assert (has(torch.zeros_like(last)) | ~seen).all(), "block 0 missing"
    assert (has(last) | ~seen).all(), "the query's own block missing"
    assert (has(last - 1) | ~seen).all(), "the block before the query's missing"
    assert torch.equal(idx, bench_nsa.smooth_block_indices(B, M, N, G, T, bs, seed=3)), "not deterministic"
    assert not torch.equal(idx, bench_nsa.smooth_block_indices(B, M, N, G, T, bs, seed=4)) or N // bs <= T + 2  # all visible blocks fit: no choice


def test_smooth_selection_as_its_docstring_describes():
    """A slow rebuild, query by query, from the docstring's definition (the chunks' noise order included)."""
    B, M, N, G, T, bs = 1, 2 * bench_nsa.SMOOTH_CHUNK + 40, 4500, 2, 6, 64
    idx = bench_nsa.smooth_block_indices(B, M, N, G, T, bs, seed=11)
    nb = -(-N // bs)
    gen = torch.Generator().manual_seed(11)
    F = torch.randn(B, M // 64 + 2, G, nb, generator=gen)
    Z = torch.cat([torch.randn(B, min(M, m0 + bench_nsa.SMOOTH_CHUNK) - m0, G, nb, generator=gen)
                   for m0 in range(0, M, bench_nsa.SMOOTH_CHUNK)], 1)
    for m in list(range(0, M, 97)) + [M - 1]:
        p = N - M + m
        for g in range(G):
            if p < 0:
                assert (idx[0, m, g] == -1).all()
                continue
            a, w = m // 64, (m % 64) / 64
            score = torch.lerp(F[0, a, g], F[0, a + 1, g], torch.tensor(w)) + 0.1 * Z[0, m, g]
            last = p // bs
            score[last + 1 :] = float("-inf")
            score[[0, last, max(last - 1, 0)]] = float("inf")
            want = sorted(score.topk(min(T, last + 1)).indices.tolist())
            assert idx[0, m, g].tolist() == want + [-1] * (T - len(want)), (m, g)


def test_gathered_blocks_on_a_hand_checked_case():
    # M = N = 6 queries at positions 0..5, block size 2 (blocks 0, 1, 2), one group, T = 3.
    idx = torch.tensor([[0, -1, 1],   # pos 0: block 0 (1 is future)
                        [0, 0, -1],   # pos 1: block 0 twice
                        [1, 0, 5],    # pos 2: blocks 1, 0 (5 out of range)
                        [1, -1, -1],  # pos 3: block 1
                        [2, 0, 1],    # pos 4: blocks 2, 0, 1
                        [2, 2, 2]],   # pos 5: block 2 three times
                       dtype=torch.int32).view(1, 6, 1, 3)
    g = lambda W, **kw: bench_nsa.gathered_blocks(idx, 6, 2, W, **kw)  # noqa: E731
    assert g(1) == 1 + 2 + 2 + 1 + 3 + 3  # every used slot, duplicates too
    assert g(2) == 1 + 2 + 3  # {0} {0, 1} {0, 1, 2}
    assert g(4) == 2 + 3  # rows 0-3 {0, 1}; rows 4-5 (a partial CTA) {0, 1, 2}
    assert g(6) == 3 and g(8) == 3
    assert g(1, block_counts=torch.tensor([3, 1, 1, 0, 2, 3], dtype=torch.int32).view(1, 6, 1)) == 1 + 1 + 1 + 0 + 2 + 3
    assert bench_nsa.gathered_bytes(idx, 6, 2, 128, 2) == 6 * 2 * 2 * 128 * 2
    assert bench_nsa.sharing(idx, 6, 2, (2, 4)) == pytest.approx({2: 1 - 6 / 12, 4: 1 - 5 / 12})
    # groups and batches add up, each CTA within one (b, g)
    two = torch.cat([idx, torch.where(idx == 0, -1, idx)], 2).repeat(2, 1, 1, 1)  # group 1 without block 0
    assert bench_nsa.gathered_blocks(two, 6, 2, 1) == 2 * (12 + 7)
    assert bench_nsa.gathered_blocks(two, 6, 2, 6) == 2 * (3 + 2)


def test_tables_and_figures_have_a_row_of_each_selection(monkeypatch, tmp_path, capsys):
    """main() and figures() on fake rows (the timing needs a GPU): one row per selection, the shared bytes printed."""
    seen = []

    def fake_shape(L, H, G, T=16, hot=False, dense=True, D=128, selection="uniform", queries=(), fla=False):
        seen.append((selection, dense))
        gb = {1: 273.0, 4: 250.0, 8: 226.0, 16: 195.0} if selection == "uniform" else {1: 273.0, 4: 86.0, 8: 48.0, 16: 28.0}
        return dict(L=L, H=H, G=G, D=D, T=T, hot=hot, selection=selection, ms=29.0, rel_err=1e-3, gathered_GBps=9e3,
                    gathered_GB_at_W=gb, dense_ms={"cudnn": 90.0 if dense else None}, speedup={})

    monkeypatch.setattr(bench_nsa, "run_shape", fake_shape)
    monkeypatch.setattr(bench_nsa, "environment", lambda: dict(gpu="fake", commit="x"))
    monkeypatch.setattr(bench_nsa, "copy_tbps", lambda: 4.0)
    res = bench_nsa.main(["--lengths", "8192", "--heads", "128:8", "--out", str(tmp_path / "r.json")])
    assert seen == [("uniform", True), ("smooth", False)]
    out = capsys.readouterr().out
    assert "  smooth  128  8    8192" in out and "82.4%" in out and "17.2%" in out
    figs = bench_nsa.figures(res)
    assert set(figs[0]["lines"]) == {"mate", "mate (smooth selection)", "dense causal SDPA (cudnn)"} | ({"dense causal SDPA (flash)"} & set(figs[0]["lines"]))
    assert bench_nsa.main(["--selection", "smooth", "--lengths", "8192", "--heads", "128:8", "--out", str(tmp_path / "s.json")])
    assert seen[-1] == ("smooth", True)


def test_shared_table(monkeypatch, tmp_path, capsys):
    """--queries: the table of the shared program's times beside W = 1 and FLA (fake rows)."""

    def fake_shape(L, H, G, T=16, hot=False, dense=True, D=128, selection="uniform", queries=(), fla=False):
        assert queries == [4, 8] and fla and not dense
        return dict(L=L, H=H, G=G, D=D, T=T, hot=hot, selection=selection, ms=29.0, rel_err=1e-3, gathered_GBps=9e3,
                    gathered_GB_at_W={1: 273.0, 4: 86.0, 8: 48.0, 16: 28.0}, dense_ms={}, speedup={}, fla_fwd_ms=41.7,
                    shared={4: dict(ms=12.5, rel_err=2e-3), 8: dict(error="RuntimeError('x')")})

    monkeypatch.setattr(bench_nsa, "run_shape", fake_shape)
    monkeypatch.setattr(bench_nsa, "environment", lambda: dict(gpu="fake", commit="x"))
    monkeypatch.setattr(bench_nsa, "copy_tbps", lambda: 4.0)
    bench_nsa.main(["--lengths", "65536", "--heads", "128:8", "--queries", "4", "8", "--fla", "--no-dense", "--selection", "smooth",
                    "--out", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "W=4 ms" in out and "12.500" in out and "failed" in out and "41.700" in out and "  48.0" in out
    assert set(bench_nsa.SHARED_TILES) == {2, 4, 8}
