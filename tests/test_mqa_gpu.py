"""MQA indexer, native vs reference on the GPU (run with `pytest -m gpu`)."""

import pytest
import torch

import mate
from helpers import assert_scores_match, capture_graph, poison_allocator

pytestmark = pytest.mark.gpu

H, D = 4, 128
DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def native_and_reference(fn, *args, **kw):
    poison_allocator("cuda")
    out = fn(*args, **kw)
    torch.cuda.synchronize()
    return out, fn(*args, **kw, backend="reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Q, N", [(2, 77, 301), (1, 1, 1), (3, 300, 1000), (1, 513, 64)])
@pytest.mark.parametrize("meta", ["default", "positions", "seq_lens"])
def test_score(dtype, B, Q, N, meta):
    q, k = randn(B, Q, H, D, dtype=dtype), randn(B, N, D, dtype=dtype)
    kw = {}
    if meta == "positions":
        kw["query_positions"] = torch.randint(-3, 4 * N + 8, (B, Q), device="cuda", dtype=torch.int32)
    if meta == "seq_lens":
        kw["seq_lens_q"] = torch.randint(0, Q + 1, (B,), device="cuda", dtype=torch.int32)
        kw["query_positions"] = torch.randint(0, 4 * N, (B, Q), device="cuda", dtype=torch.int32)
    out, ref = native_and_reference(mate.qsa_indexer_mqa_score, q, k, **kw)
    assert out.shape == (B, Q, N)
    assert_scores_match(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_sliced_views_and_scales(dtype):
    qbig = randn(2, 70, H, D + 8, dtype=dtype)
    kbig = randn(3, 260, D + 16, dtype=dtype)
    q, k = qbig[:, 5:, :, 8:], kbig[1:, 3:, :D]  # aligned outer slices with storage offsets
    pos = torch.randint(0, 4 * 257, (2, 65), device="cuda", dtype=torch.int32)
    for kw in ({"scale": 0.3}, {"score_scale": 7.0}, {"block_size": 2}):
        out, ref = native_and_reference(mate.qsa_indexer_mqa_score, q, k, query_positions=pos, **kw)
        assert_scores_match(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, keys", [(1000, 777), (1, 5), (129, 4096)])
def test_prefill(dtype, rows, keys):
    q, k = randn(rows, H, D, dtype=dtype), randn(keys, D, dtype=dtype)
    starts = torch.randint(-4, keys, (rows,), device="cuda", dtype=torch.int32)
    ends = starts + torch.randint(-5, keys // 2 + 5, (rows,), device="cuda", dtype=torch.int32)
    out, ref = native_and_reference(mate.qsa_mqa_prefill, q, k, starts, ends)
    assert_scores_match(out, ref)
    out, ref = native_and_reference(mate.qsa_mqa, q, k.unsqueeze(1), starts, ends, 3.0)
    assert_scores_match(out, ref)


def test_prefill_strided_metadata():
    """row_starts/row_ends as strided views at a 4-byte offset: read with plain loads, never converted."""
    rows, keys = 300, 500
    q, k = randn(rows, H, D, dtype=torch.bfloat16), randn(keys, D, dtype=torch.bfloat16)
    meta = torch.randint(0, keys, (2 * rows + 1,), device="cuda", dtype=torch.int32)
    starts = meta[1::2]
    ends = (starts + 100).clamp_max(keys)[::1]
    out, ref = native_and_reference(mate.qsa_mqa_prefill, q, k, starts, ends)
    assert_scores_match(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [8, 16, 32, 64])
def test_decode(dtype, page_size):
    B, pages, max_pages = 5, 40, 9
    L = max_pages * page_size - 3
    q = randn(B, H, D, dtype=dtype)
    cache = randn(pages, page_size, 1, D, dtype=dtype)
    table = torch.randint(0, pages, (B, max_pages), device="cuda", dtype=torch.int32)
    table[0, 2] = -1
    table[1, 0] = pages + 3  # past the pool
    table[2, -1] = -1
    ctx = torch.tensor([L, L - 5, 0, 1, max_pages * page_size + 50], device="cuda", dtype=torch.int32)
    out, ref = native_and_reference(mate.qsa_mqa_decode, q, cache, table, ctx, L)
    assert_scores_match(out, ref)
    # max_model_len longer than the table: the tail is -inf.
    out, ref = native_and_reference(mate.qsa_mqa_decode, q.unsqueeze(1), cache[:, :, 0], table, ctx, L + 2 * page_size + 1, score_scale=2.0)
    assert_scores_match(out, ref)


def test_decode_broadcast_q_and_sliced_cache():
    B, pages, ps, max_pages = 6, 20, 16, 8
    q = randn(1, H, D, dtype=torch.bfloat16).expand(B, H, D)  # stride 0 on the batch axis
    pool = randn(pages + 2, ps, 1, D + 32, dtype=torch.bfloat16)
    cache = pool[2:, :, :, 16 : 16 + D]
    table = torch.stack([torch.randperm(pages, device="cuda")[:max_pages] for _ in range(B)]).to(torch.int32)
    ctx = torch.randint(0, max_pages * ps + 1, (B,), device="cuda", dtype=torch.int32)
    out, ref = native_and_reference(mate.qsa_mqa_decode, q, cache, table, ctx, max_pages * ps)
    assert_scores_match(out, ref)


def test_graph_replay_uses_current_metadata():
    """Capture after warm-up, write new metadata into the same buffers, replay: equals eager on the new values."""
    B, pages, ps, max_pages, L = 4, 64, 16, 8, 128
    q = randn(B, H, D, dtype=torch.bfloat16)
    cache = randn(pages, ps, D, dtype=torch.bfloat16)
    table = torch.zeros(B, max_pages, device="cuda", dtype=torch.int32)
    ctx = torch.zeros(B, device="cuda", dtype=torch.int32)
    rows, keys = 100, 300
    qp, kp = randn(rows, H, D, dtype=torch.bfloat16), randn(keys, D, dtype=torch.bfloat16)
    starts = torch.zeros(rows, device="cuda", dtype=torch.int32)
    ends = torch.zeros(rows, device="cuda", dtype=torch.int32)
    qs, ks = randn(2, 50, H, D, dtype=torch.bfloat16), randn(2, 40, D, dtype=torch.bfloat16)
    pos = torch.zeros(2, 50, device="cuda", dtype=torch.int32)

    def calls():
        return (
            mate.qsa_mqa_decode(q, cache, table, ctx, L),
            mate.qsa_mqa_prefill(qp, kp, starts, ends),
            mate.qsa_indexer_mqa_score(qs, ks, query_positions=pos),
        )

    graph, outs = capture_graph(calls)
    for _ in range(2):
        table.copy_(torch.randint(-1, pages + 2, (B, max_pages), device="cuda", dtype=torch.int32))
        ctx.copy_(torch.randint(0, L + 1, (B,), device="cuda", dtype=torch.int32))
        starts.copy_(torch.randint(0, keys, (rows,), device="cuda", dtype=torch.int32))
        ends.copy_(starts + torch.randint(0, 100, (rows,), device="cuda", dtype=torch.int32))
        pos.copy_(torch.randint(0, 160, (2, 50), device="cuda", dtype=torch.int32))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, calls()):
            assert_scores_match(got, want, rtol=0)


# ---------------------------------------------------------------- FP8 key caches (issue 38)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# every page size with BF16 q, one with FP16 (each pair is a kernel of its own to compile)
FP8_SPECS = [(torch.bfloat16, ps) for ps in (8, 16, 32, 64)] + [(torch.float16, 16)]


def fp8_decode_problem(kv_dtype, q_dtype, page_size, B=5, pages=40, max_pages=9):
    from inputs import fp8_cache

    gen = torch.Generator().manual_seed(page_size)
    q = randn(B, H, D, dtype=q_dtype)
    pool = fp8_cache(gen, pages + 1, page_size, 1, D + 16, device="cuda", dtype=kv_dtype)
    cache = pool[1:, :, :, 16:]  # a page and 16 bytes in, key stride 144 bytes: legal for FP8, not a contiguous view
    table = torch.randint(0, pages, (B, max_pages), device="cuda", dtype=torch.int32)
    table[0, 2], table[1, 0], table[2, -1] = -1, pages + 3, -1  # missing, past the pool
    L = max_pages * page_size - 3
    ctx = torch.tensor([L, L - 5, 0, 1, max_pages * page_size + 50], device="cuda", dtype=torch.int32)
    return q, cache, table, ctx, L


@pytest.mark.parametrize("scale", ["float", "tensor"])
@pytest.mark.parametrize("q_dtype, page_size", FP8_SPECS, ids=[f"{str(d)[6:]}-page{p}" for d, p in FP8_SPECS])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_fp8(kv_dtype, q_dtype, page_size, scale):
    """Native vs reference on the same random FP8 cache (values across the format's range), output memory poisoned."""
    q, cache, table, ctx, L = fp8_decode_problem(kv_dtype, q_dtype, page_size)
    k_scale = 0.0213 if scale == "float" else torch.tensor([0.0213], device="cuda")
    out, ref = native_and_reference(mate.qsa_mqa_decode, q, cache, table, ctx, L, k_scale=k_scale)
    assert torch.isfinite(ref).sum() > L  # rows with keys
    assert_scores_match(out, ref)
    # max_model_len past the table (a -inf tail), the 3-d cache form and score_scale
    out, ref = native_and_reference(mate.qsa_mqa_decode, q, cache[:, :, 0], table, ctx, L + 2 * page_size + 1,
                                    score_scale=2.0, k_scale=k_scale)
    assert_scores_match(out, ref)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_fp8_graph_replay_reads_the_tensor_scale(kv_dtype):
    """A tensor k_scale is read at each replay: rewritten in place between two replays (same metadata), the scores
    follow it exactly (powers of 2), and each replay equals the reference on the current scale; outputs NaN first."""
    q, cache, table, ctx, L = fp8_decode_problem(kv_dtype, torch.bfloat16, 16)
    ks = torch.tensor(4.0, device="cuda")
    mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=ks)  # compiles outside the capture
    graph, out = capture_graph(lambda: mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=ks))
    replays = []
    for value, new_table in ((4.0, False), (0.5, False), (0.125, True)):
        ks.fill_(value)
        if new_table:  # and new metadata too
            table.copy_(torch.randint(-1, 43, table.shape, device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replays.append(out.clone())
        assert_scores_match(replays[-1], mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=ks, backend="reference"))
    fin = torch.isfinite(replays[0])
    assert fin.sum() > L and torch.equal(fin, torch.isfinite(replays[1]))
    assert torch.equal(replays[1][fin], replays[0][fin] / 8)  # not the captured 4.0
