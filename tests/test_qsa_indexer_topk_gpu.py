"""The indexer's selection, qsa_mqa_decode(topk=...) and qsa_mqa_prefill(topk=...), native vs reference on the GPU
(run with `pytest -m gpu`).

Exact where the scores are exact: integer-valued q and keys (|value| <= 3, 128 products) give integer dot
products in FP32 whatever the summation order, so the native scores equal the reference's bit for bit and the
selection (ties to the lower id included: such scores tie often) must too. On Gaussian inputs the scores differ
by rounding, so a row's i-th selected score must equal the reference's i-th within FP32-accumulation tolerance,
and the tokens must be the expansion of the returned blocks.
"""

import pytest
import torch

import mate
from helpers import capture_graph, poison_allocator

pytestmark = pytest.mark.gpu

H, D = 4, 128


def value_maker(gen, dtype, integer):
    """Tensors of small integers (exact scores) or Gaussians, in dtype, from gen."""

    def values(*shape):
        if integer:
            return torch.randint(-3, 4, shape, device="cuda", generator=gen).to(dtype)
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    return values


def problem(B, page_size, L, *, dtype=torch.bfloat16, integer=False, seed=0, poison_unused=True):
    """B requests over one shuffled pool of pages (unused pages NaN), contexts of 0 .. past the table, a hole and a
    page past the pool in the tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = -(-L // page_size)
    pages = B * max_pages + 3
    values = value_maker(gen, dtype, integer)

    q = values(B, H, D)
    cache = values(pages, page_size, 1, D)
    table = torch.randperm(pages, device="cuda", generator=gen)[: B * max_pages].view(B, max_pages).to(torch.int32)
    if poison_unused:
        used = torch.zeros(pages, dtype=torch.bool, device="cuda")
        used[table.flatten().long()] = True
        cache[~used] = float("nan")
    if B > 1:
        table[1, 0] = -1
    if B > 2:
        table[2, -1] = pages + 5  # past the pool
    ctx = torch.randint(0, L + 1, (B,), device="cuda", dtype=torch.int32, generator=gen)
    ctx[0] = L
    if B > 3:
        ctx[3] = 0
    if B > 4:
        ctx[4] = L + 3 * page_size  # past max_model_len and the table
    pos = 4 * ctx + torch.randint(-2, 4, (B,), device="cuda", dtype=torch.int32, generator=gen)
    return q, cache, table, ctx, pos


def selected_and_reference(entry, args, k, pos, **kw):
    """entry(*args, topk=k, ...) native (the allocator poisoned first) and by the reference, and the reference's scores."""
    poison_allocator("cuda")
    got = entry(*args, topk=k, query_positions=pos, **kw)
    torch.cuda.synchronize()
    ref = entry(*args, topk=k, query_positions=pos, **kw, backend="reference")
    scores = entry(*args, **kw, backend="reference")
    return got, ref, scores


def assert_same_selection_within(got, ref, scores, rtol=1e-4):
    """-1 at the same slots; the i-th selected score of each row equal to the reference's i-th within rtol."""
    assert torch.equal(got < 0, ref < 0)
    sel = got >= 0
    a = scores.gather(1, got.clamp(min=0).long())[sel]
    b = scores.gather(1, ref.clamp(min=0).long())[sel]
    assert torch.isfinite(a).all()
    assert torch.allclose(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    for row in got:  # distinct ids
        ids = row[row >= 0]
        assert ids.unique().numel() == ids.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [8, 16, 32, 64])
@pytest.mark.parametrize("B, L, k", [(1, 8192, 512), (5, 8192, 2048), (7, 5000, 100), (3, 300, 1), (64, 8192, 512), (150, 2049, 33)])
def test_exact_on_integer_scores(dtype, page_size, B, L, k):
    q, cache, table, ctx, pos = problem(B, page_size, L, dtype=dtype, integer=True)
    (blocks, tokens), (rb, rt), _ = selected_and_reference(mate.qsa_mqa_decode, (q, cache, table, ctx, L), k, pos, scale=0.25)
    assert torch.equal(blocks, rb)
    assert torch.equal(tokens, rt)


@pytest.mark.parametrize("B, L, k, page_size", [(1, 8192, 512, 16), (64, 8192, 512, 16), (9, 6000, 2048, 64), (4, 100, 50, 8)])
def test_on_gaussian_scores(B, L, k, page_size):
    q, cache, table, ctx, pos = problem(B, page_size, L)
    (blocks, tokens), (rb, _), scores = selected_and_reference(mate.qsa_mqa_decode, (q, cache, table, ctx, L), k, pos, score_scale=0.7)
    assert_same_selection_within(blocks, rb, scores)
    assert torch.equal(tokens, mate.qsa_expand_blocks(blocks, pos, backend="reference"))


@pytest.mark.parametrize("case", ["long_rows", "fp8", "empty_pool", "broadcast_q_block_size_2"])
def test_other_paths(case):
    """Rows of another top-k key bucket, an FP8 cache, an empty pool (selects nothing), a stride-0 q with another
    block size."""
    L, kw, bs = (12000, {}, 4) if case == "long_rows" else (4096, {}, 4)
    q, cache, table, ctx, pos = problem(6, 16, L, integer=True)
    if case == "fp8":
        cache = cache.nan_to_num(0).to(torch.float8_e4m3fn)
        kw = {"k_scale": 0.5}
    if case == "empty_pool":
        cache = cache[:0]
    if case == "broadcast_q_block_size_2":
        q = q[:1].expand_as(q)
        bs = 2
    args = (q, cache, table, ctx, L)
    (blocks, tokens), (rb, rt), _ = selected_and_reference(mate.qsa_mqa_decode, args, 300, pos, block_size=bs, scale=0.25, **kw)
    assert torch.equal(blocks, rb)
    assert torch.equal(tokens, rt)
    if case == "empty_pool":
        assert (blocks == -1).all()


def test_graph_replay_uses_current_metadata_and_is_deterministic():
    B, ps, L, k = 8, 16, 8192, 512
    # no NaN pages: the new tables read pages the first one left unused
    q, cache, table, ctx, pos = problem(B, ps, L, integer=True, poison_unused=False)
    mate.qsa_mqa_decode(q, cache, table, ctx, L, topk=k, query_positions=pos)  # compiles outside the capture
    graph, (blocks, tokens) = capture_graph(lambda: mate.qsa_mqa_decode(q, cache, table, ctx, L, topk=k, query_positions=pos))
    for seed in (1, 2):
        _, _, t2, c2, p2 = problem(B, ps, L, integer=True, seed=seed, poison_unused=False)
        table.copy_(t2)
        ctx.copy_(c2)
        pos.copy_(p2)
        blocks.fill_(-7)
        tokens.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        rb, rt = mate.qsa_mqa_decode(q, cache, table, ctx, L, topk=k, query_positions=pos, backend="reference")
        assert torch.equal(blocks, rb) and torch.equal(tokens, rt)
    eager = [mate.qsa_mqa_decode(q, cache, table, ctx, L, topk=k, query_positions=pos) for _ in range(3)]
    assert all(torch.equal(e[0], eager[0][0]) and torch.equal(e[1], eager[0][1]) for e in eager)


def test_rows_past_the_native_top_k_raise_before_the_indexer_runs():
    q, cache, table, ctx, pos = problem(2, 64, 1024, integer=True)
    with pytest.raises(ValueError, match="up to 49152 keys"):
        mate.qsa_mqa_decode(q, cache, table, ctx, 49153, topk=8, query_positions=pos)
    mate.qsa_mqa_decode(q, cache, table, ctx, 49153, topk=8, query_positions=pos, backend="reference")  # the reference has no limit


# ---------------------------------------------------------------- packed prefill


def prefill_problem(rows, keys, *, dtype=torch.bfloat16, integer=False, seed=0, key_rank=2):
    """Rows over one packed k: causal-like intervals ending anywhere, one empty, one inverted, one past the keys;
    q and k as views at an offset."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = value_maker(gen, dtype, integer)
    q = values(rows + 1, H, D)[1:]
    k = values(keys + 1, D)[1:]
    if key_rank == 3:
        k = k.unsqueeze(1)
    ends = torch.randint(1, keys + 1, (rows,), device="cuda", dtype=torch.int32, generator=gen)
    starts = (ends - torch.randint(0, keys + 1, (rows,), device="cuda", dtype=torch.int32, generator=gen)).clamp(min=0)
    ends[0], starts[0] = keys, 0
    if rows > 3:
        starts[1], ends[1] = 5, 5  # empty
        starts[2], ends[2] = 9, 3  # inverted
        starts[3], ends[3] = keys - 3, keys + 40  # past the keys
    pos = 4 * ends + torch.randint(-2, 4, (rows,), device="cuda", dtype=torch.int32, generator=gen)
    return q, k, starts, ends, pos


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows, keys, kk", [(1, 8192, 512), (300, 8192, 512), (64, 5000, 2048), (150, 20000, 100), (7, 300, 1),
                                            (40, 49152, 64)])
def test_prefill_exact_on_integer_scores(dtype, rows, keys, kk):
    q, k, starts, ends, pos = prefill_problem(rows, keys, dtype=dtype, integer=True)
    (blocks, tokens), (rb, rt), _ = selected_and_reference(mate.qsa_mqa_prefill, (q, k, starts, ends), kk, pos, scale=0.25)
    assert torch.equal(blocks, rb)
    assert torch.equal(tokens, rt)
    if rows > 3:
        assert (blocks[1:3] == -1).all()  # the empty and the inverted row select nothing


@pytest.mark.parametrize("rows, keys, kk, key_rank", [(4096, 8192, 512, 2), (33, 3000, 700, 3)])
def test_prefill_on_gaussian_scores(rows, keys, kk, key_rank):
    q, k, starts, ends, pos = prefill_problem(rows, keys, key_rank=key_rank)
    (blocks, tokens), (rb, _), scores = selected_and_reference(mate.qsa_mqa_prefill, (q, k, starts, ends), kk, pos, score_scale=0.7)
    assert_same_selection_within(blocks, rb, scores)
    assert torch.equal(tokens, mate.qsa_expand_blocks(blocks, pos, backend="reference"))


def test_prefill_graph_replay_uses_current_metadata_and_is_deterministic():
    rows, keys, kk = 200, 8192, 512
    q, k, starts, ends, pos = prefill_problem(rows, keys, integer=True)
    call = lambda: mate.qsa_mqa_prefill(q, k, starts, ends, scale=0.25, topk=kk, query_positions=pos, block_size=2)  # noqa: E731
    call()  # compiles outside the capture
    graph, (blocks, tokens) = capture_graph(call)
    for seed in (1, 2):
        _, _, s2, e2, p2 = prefill_problem(rows, keys, integer=True, seed=seed)
        starts.copy_(s2)
        ends.copy_(e2)
        pos.copy_(p2)
        blocks.fill_(-7)
        tokens.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        rb, rt = mate.qsa_mqa_prefill(q, k, starts, ends, scale=0.25, topk=kk, query_positions=pos, block_size=2, backend="reference")
        assert torch.equal(blocks, rb) and torch.equal(tokens, rt)
    eager = [call() for _ in range(3)]
    assert all(torch.equal(e[0], eager[0][0]) and torch.equal(e[1], eager[0][1]) for e in eager)


def test_prefill_rows_past_the_native_top_k_raise_before_the_indexer_runs():
    q, k, starts, ends, pos = prefill_problem(2, 49153, integer=True)
    with pytest.raises(ValueError, match="up to 49152 keys"):
        mate.qsa_mqa_prefill(q, k, starts, ends, topk=8, query_positions=pos)
    mate.qsa_mqa_prefill(q, k, starts, ends, topk=8, query_positions=pos, backend="reference")  # the reference has no limit
