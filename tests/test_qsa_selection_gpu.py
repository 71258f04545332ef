"""QSA selection natively (run with `pytest -m gpu`): the top-k and the expansion against the reference, bit for
bit, on fresh random rows of every key bucket, with ties (scores on a few values, all equal), NaN, +-inf, -0,
huge and denormal scores and fewer selectable scores than k; poisoned outputs, strided views, CUDA-graph
replays with new inputs, the same bits twice. (tests/cases.py's selection cases also run in the graph,
sync-debug, determinism, torch.compile and sanitizer tests; tests/test_stress_gpu.py launches each config
entry 1000 times back to back.)"""

import pytest
import torch

import mate
from helpers import capture_graph, poison_allocator
from mate.tuning.workloads import indexer_like_scores

pytestmark = pytest.mark.gpu

INF = float("inf")


def draw(gen, rows, keys, kind):
    s = torch.randn(rows, keys, generator=gen)
    if kind == "ties":
        s = (s * 1.5).round()  # about 9 values
    elif kind == "equal":
        s = torch.full((rows, keys), 0.5)
        s[:, ::7] = -INF
    elif kind == "indexer":
        s = indexer_like_scores(gen, rows, keys, device="cpu")
    elif kind == "hostile":
        u = torch.rand(rows, keys, generator=gen)
        for lo, hi, v in [(0, 0.2, -INF), (0.2, 0.3, float("nan")), (0.3, 0.31, INF), (0.31, 0.4, -0.0), (0.4, 0.5, 0.0),
                          (0.5, 0.52, 3.4e38), (0.52, 0.54, -3.4e38), (0.54, 0.6, 1e-45), (0.6, 0.62, -1e-45)]:
            s[(u >= lo) & (u < hi)] = v
    elif kind == "few":
        s[torch.rand(rows, keys, generator=gen) < 0.97] = -INF  # about 3% selectable: fewer than k in long rows
        s[0] = float("nan")
    elif kind == "some":
        # about 9% selectable: at 8192 keys and k 512, more than k but fewer than the sort's twice k's power of
        # two (the sort takes every valid key, no radix round)
        s[torch.rand(rows, keys, generator=gen) < 0.91] = -INF
    return s.cuda()


# every key bucket, narrow and wide (more rows than the H200's 132 multiprocessors), and each power of two of k
# (the sort's size is compile-time: 32 .. 2048)
SHAPES = [(1, 8192, 512), (64, 8192, 512), (300, 8192, 512), (5, 100, 100), (3, 8192, 1), (140, 5000, 2048),
          (7, 16384, 2048), (200, 12000, 333), (5, 30000, 1000), (2, 49152, 2048), (9, 8192, 40), (150, 8192, 200),
          (140, 40000, 1024)]
KINDS = ["normal", "ties", "equal", "indexer", "hostile", "few", "some"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows, keys, k", SHAPES, ids=[f"{r}x{n}-k{k}" for r, n, k in SHAPES])
def test_topk_matches_reference(rows, keys, k, kind):
    gen = torch.Generator().manual_seed(rows * 7 + keys + k)
    s = draw(gen, rows, keys, kind)
    want = mate.qsa_topk_blocks(s, k, backend="reference")
    out = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    assert mate.qsa_topk_blocks(s, k, out=out) is out
    assert torch.equal(out, want)
    pos = torch.randint(-3, 4 * keys + 5, (rows,), generator=gen, dtype=torch.int32).cuda()
    poison_allocator("cuda")
    blocks, tokens = mate.qsa_topk_tokens(s, k, pos)
    assert torch.equal(blocks, want)
    assert torch.equal(tokens, mate.qsa_expand_blocks(want, pos, backend="reference"))


def test_topk_of_strided_views():
    gen = torch.Generator().manual_seed(2)
    base = draw(gen, 70, 2 * 8193 + 3, "ties")
    s = base[1:, 3::2]  # row stride 16389, column stride 2, storage offset
    out = torch.full((69, 1024), -7, dtype=torch.int32, device="cuda")[:, ::2]
    mate.qsa_topk_blocks(s, 512, out=out)
    assert torch.equal(out, mate.qsa_topk_blocks(s, 512, backend="reference"))


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_expand_matches_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    blocks = torch.randint(-3, 9000, (300, 2 * 513), generator=gen, dtype=torch.int32).cuda()[:, ::2]
    pos = torch.randint(-9, 4 * 9000, (300,), generator=gen, dtype=torch.int32).cuda()
    out = torch.full((300, block_size * 513 + block_size - 1), -7, dtype=torch.int32, device="cuda")
    assert mate.qsa_expand_blocks(blocks, pos, block_size=block_size, out=out) is out
    assert torch.equal(out, mate.qsa_expand_blocks(blocks, pos, block_size=block_size, backend="reference"))


@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_graph_replays_follow_new_scores(rows):
    gen = torch.Generator().manual_seed(rows)
    s = draw(gen, rows, 8192, "indexer")
    pos = torch.zeros(rows, dtype=torch.int32, device="cuda")

    def step():
        blocks, tokens = mate.qsa_topk_tokens(s, 512, pos)
        return blocks, tokens, mate.qsa_expand_blocks(mate.qsa_topk_blocks(s, 256), pos)

    graph, outs = capture_graph(step)
    for kind in ("indexer", "ties", "hostile"):
        s.copy_(draw(gen, rows, 8192, kind))
        pos.copy_(torch.randint(0, 4 * 8192, (rows,), generator=gen, dtype=torch.int32))
        for o in outs:
            o.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = mate.qsa_topk_blocks(s, 512, backend="reference")
        assert torch.equal(outs[0], want)
        assert torch.equal(outs[1], mate.qsa_expand_blocks(want, pos, backend="reference"))
        assert torch.equal(outs[2], mate.qsa_expand_blocks(want[:, :256], pos, backend="reference"))


def test_same_bits_twice_at_scale():
    gen = torch.Generator().manual_seed(9)
    s = draw(gen, 4096, 8192, "ties")
    pos = torch.randint(0, 4 * 8192, (4096,), generator=gen, dtype=torch.int32).cuda()
    first = [t.clone() for t in mate.qsa_topk_tokens(s, 512, pos)]
    for _ in range(2):
        poison_allocator("cuda")
        assert all(torch.equal(a, b) for a, b in zip(mate.qsa_topk_tokens(s, 512, pos), first))
