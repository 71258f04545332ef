"""MQA indexer on the CPU: the reference against a naive float64 loop oracle, and every documented error."""

import math

import pytest
import torch

import mate
from mate import _checks

H, D = 4, 128


# ---------------------------------------------------------------- naive oracle


def naive_row(q_row, key_of, visible, n_keys, scale):
    """One row's scores, key by key, in float64: sum_h max(0, q_h . k) * scale or -inf."""
    out = torch.full((n_keys,), float("-inf"), dtype=torch.float64)
    for j in range(n_keys):
        if visible(j):
            k = key_of(j).double()
            out[j] = sum(max(0.0, float(q_row[h].double() @ k)) for h in range(q_row.shape[0])) * scale
    return out


def paged_key(cache, table_row, page_size):
    def key_of(j):
        return cache[int(table_row[j // page_size]), j % page_size]

    def exists(j):
        c = j // page_size
        return c < table_row.shape[0] and 0 <= int(table_row[c]) < cache.shape[0]

    return key_of, exists


def close(out, ref):
    assert out.dtype == torch.float32
    ref = ref.to(out.shape and torch.float64)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    torch.testing.assert_close(out[fin].double(), ref[fin], rtol=1e-5, atol=1e-5)


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("block_size", [4, 2])
@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("with_seq_lens", [False, True])
def test_score_padded(gen, block_size, with_positions, with_seq_lens):
    B, Q, N, d = 3, 9, 6, 16
    q, k = rand(gen, B, Q, H, d), rand(gen, B, N, d)
    pos = torch.randint(-2, 4 * N + 4, (B, Q), generator=gen, dtype=torch.int32) if with_positions else None
    lens = torch.tensor([9, 4, 0], dtype=torch.int32) if with_seq_lens else None
    out = mate.qsa_indexer_mqa_score(q, k, query_positions=pos, seq_lens_q=lens, block_size=block_size, backend="reference")
    assert out.shape == (B, Q, N)
    for b in range(B):
        for i in range(Q):
            p = int(pos[b, i]) if pos is not None else i
            live = lens is None or i < int(lens[b])
            ref = naive_row(q[b, i], lambda j: k[b, j], lambda j: live and block_size * j + block_size - 1 <= p, N, 1 / math.sqrt(d))
            close(out[b, i], ref)


def test_score_paged_with_missing_pages(gen):
    B, Q, ps, pages, d = 2, 11, 3, 5, 16
    q, cache = rand(gen, B, Q, H, d), rand(gen, pages, ps, 1, d)
    table = torch.tensor([[4, -1, 0, 7], [2, 3, 1, -1]], dtype=torch.int32)  # -1 and 7 (past the pool) are missing
    pos = torch.randint(0, 20, (B, Q), generator=gen, dtype=torch.int32)
    out = mate.qsa_indexer_mqa_score(q, cache, block_table=table, page_size=ps, query_positions=pos, scale=0.5, backend="reference")
    assert out.shape == (B, Q, 4 * ps)
    for b in range(B):
        key_of, exists = paged_key(cache[:, :, 0], table[b], ps)
        for i in range(Q):
            p = int(pos[b, i])
            ref = naive_row(q[b, i], key_of, lambda j: exists(j) and 4 * j + 3 <= p, 4 * ps, 0.5)
            close(out[b, i], ref)


@pytest.mark.parametrize("form", ["cu_seqlens", "token_to_req"])
def test_score_varlen(gen, form):
    lens = [5, 0, 8]
    rows, N, d = sum(lens), 7, 16
    q, k = rand(gen, rows, H, d), rand(gen, 3, N, d)
    req = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    perm = torch.randperm(rows, generator=gen) if form == "token_to_req" else torch.arange(rows)
    q = q[perm]
    req = req[perm]
    if form == "cu_seqlens":
        kw = dict(cu_seqlens_q=torch.tensor([0, 5, 5, 13], dtype=torch.int32))
    else:
        kw = dict(token_to_req=req.to(torch.int32), num_requests=3)
    out = mate.qsa_indexer_mqa_score(q, k, score_scale=3.0, backend="reference", **kw)
    assert out.shape == (rows, N)
    seen = [0, 0, 0]
    for r in range(rows):
        b = int(req[r])
        p = seen[b]  # a row's default position is its index within its request
        seen[b] += 1
        ref = naive_row(q[r], lambda j: k[b, j], lambda j: 4 * j + 3 <= p, N, 1 / 3.0)
        close(out[r], ref)


def test_prefill(gen):
    rows, keys, d = 13, 10, 16
    q, k = rand(gen, rows, H, d), rand(gen, keys, 1, d)
    starts = torch.randint(-3, keys + 2, (rows,), generator=gen, dtype=torch.int32)
    ends = torch.randint(-3, keys + 4, (rows,), generator=gen, dtype=torch.int32)
    out = mate.qsa_mqa_prefill(q, k, starts, ends, backend="reference")
    assert out.shape == (rows, keys)
    for r in range(rows):
        ref = naive_row(q[r], lambda j: k[j, 0], lambda j: int(starts[r]) <= j < int(ends[r]), keys, 1 / math.sqrt(d))
        close(out[r], ref)
    assert mate.qsa_mqa is mate.qsa_mqa_prefill


def test_prefill_topk_is_the_selection_of_the_scores(gen):
    """topk= returns qsa_topk_tokens of the call's own scores: ids are columns of k, -1 where a row sees fewer
    than k keys (empty and inverted intervals included)."""
    rows, keys, d = 9, 24, 16
    q, k = rand(gen, rows, H, d), rand(gen, keys, d)
    starts = torch.tensor([0, 0, 5, 10, 3, 20, 0, 7, 12], dtype=torch.int32)
    ends = torch.tensor([24, 1, 17, 10, 2, 24, 30, 19, 20], dtype=torch.int32)
    pos = torch.randint(0, 4 * keys + 4, (rows,), generator=gen, dtype=torch.int32)
    scores = mate.qsa_mqa_prefill(q, k, starts, ends, scale=0.25, backend="reference")
    for kk, bs in ((5, 4), (13, 2), (24, 4)):
        blocks, tokens = mate.qsa_mqa_prefill(q, k, starts, ends, scale=0.25, topk=kk, query_positions=pos, block_size=bs,
                                              backend="reference")
        want = mate.qsa_topk_tokens(scores, kk, pos, block_size=bs, backend="reference")
        assert torch.equal(blocks, want[0]) and torch.equal(tokens, want[1])
        assert (blocks[3] == -1).all() and (blocks[4] == -1).all()  # empty and inverted rows select nothing
        assert ((blocks[2] >= 5) & (blocks[2] < 17)).sum() == min(kk, 12)  # row 2 sees keys 5 .. 16


def test_prefill_topk_errors():
    q, k, s, e, pos = bf16(2, H, D), bf16(16, D), i32(0, 0), i32(16, 8), i32(20, 30)
    call = mate.qsa_mqa_prefill
    raises(ValueError, "topk must be in", call, q, k, s, e, topk=0, query_positions=pos, backend="reference")
    raises(ValueError, "topk must be in", call, q, k, s, e, topk=17, query_positions=pos, backend="reference")
    raises(ValueError, "topk must be in", call, q, bf16(4096, D), s, e, topk=2049, query_positions=pos, backend="reference")
    raises(TypeError, "topk must be an int", call, q, k, s, e, topk=2.0, query_positions=pos, backend="reference")
    raises(TypeError, "query_positions", call, q, k, s, e, topk=4, backend="reference")
    raises(ValueError, "query_positions", call, q, k, s, e, topk=4, query_positions=i32(1, 2, 3), backend="reference")
    raises(ValueError, "query_positions is the selection", call, q, k, s, e, query_positions=pos, backend="reference")
    raises(ValueError, "block_size", call, q, k, s, e, topk=4, query_positions=pos, block_size=0, backend="reference")


@pytest.mark.parametrize("q_rank", [3, 4])
def test_decode(gen, q_rank):
    B, ps, pages, d, L = 4, 4, 6, 16, 22
    q = rand(gen, B, H, d) if q_rank == 3 else rand(gen, B, 1, H, d)
    cache = rand(gen, pages, ps, 1, d)
    table = torch.tensor([[0, 1, 2, 3], [5, -1, 4, 9], [2, 2, 2, 2], [1, 0, -1, -1]], dtype=torch.int32)
    ctx = torch.tensor([16, 13, 0, 30], dtype=torch.int32)  # 30 is past the table's capacity
    out = mate.qsa_mqa_decode(q, cache, table, ctx, L, scale=0.25, backend="reference")
    assert out.shape == (B, L)
    q3 = q.reshape(B, H, d)
    for b in range(B):
        key_of, exists = paged_key(cache[:, :, 0], table[b], ps)
        ref = naive_row(q3[b], key_of, lambda j: exists(j) and j < int(ctx[b]), L, 0.25)
        close(out[b], ref)


def test_decode_topk_is_the_selection_of_the_scores(gen):
    """topk= returns qsa_topk_tokens of the call's own scores (rows with fewer visible keys than k: -1 fills)."""
    B, ps, pages, d, L = 4, 4, 6, 16, 22
    q = rand(gen, B, H, d)
    cache = rand(gen, pages, ps, 1, d)
    table = torch.tensor([[0, 1, 2, 3], [5, -1, 4, 9], [2, 2, 2, 2], [1, 0, -1, -1]], dtype=torch.int32)
    ctx = torch.tensor([16, 13, 0, 30], dtype=torch.int32)
    pos = torch.tensor([70, 55, 2, 121], dtype=torch.int32)
    scores = mate.qsa_mqa_decode(q, cache, table, ctx, L, scale=0.25, backend="reference")
    for k, bs in ((5, 4), (13, 2), (22, 4)):
        blocks, tokens = mate.qsa_mqa_decode(q, cache, table, ctx, L, scale=0.25, topk=k, query_positions=pos, block_size=bs,
                                             backend="reference")
        want = mate.qsa_topk_tokens(scores, k, pos, block_size=bs, backend="reference")
        assert torch.equal(blocks, want[0]) and torch.equal(tokens, want[1])
        assert (blocks[2] == -1).all() and (blocks[0] >= 0).sum() == min(k, 16)  # request 0 sees 16 keys


def test_decode_topk_errors():
    q, k, table, ctx, pos = bf16(2, H, D), bf16(3, 16, D), i32(0, 1).view(2, 1), i32(5, 8), i32(20, 30)
    raises(ValueError, "topk must be in", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=0, query_positions=pos, backend="reference")
    raises(ValueError, "topk must be in", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=17, query_positions=pos, backend="reference")
    raises(ValueError, "topk must be in", mate.qsa_mqa_decode, q, k, table, ctx, 4096, topk=2049, query_positions=pos,
           backend="reference")
    raises(TypeError, "topk must be an int", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=2.0, query_positions=pos,
           backend="reference")
    raises(TypeError, "query_positions", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=4, backend="reference")
    raises(ValueError, "query_positions", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=4, query_positions=i32(1, 2, 3),
           backend="reference")
    raises(ValueError, "query_positions is the selection", mate.qsa_mqa_decode, q, k, table, ctx, 16, query_positions=pos,
           backend="reference")
    raises(ValueError, "block_size", mate.qsa_mqa_decode, q, k, table, ctx, 16, topk=4, query_positions=pos, block_size=0,
           backend="reference")


def test_scale_and_score_scale_agree(gen):
    q, k = rand(gen, 1, 8, H, 16), rand(gen, 1, 3, 16)
    a = mate.qsa_indexer_mqa_score(q, k, scale=0.25, backend="reference")
    b = mate.qsa_indexer_mqa_score(q, k, score_scale=4.0, backend="reference")
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- errors


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def i32(*vals_or_shape, shape=None):
    return torch.zeros(shape, dtype=torch.int32) if shape is not None else torch.tensor(vals_or_shape, dtype=torch.int32)


def raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def test_backend_errors():
    q, k = bf16(1, 4, H, D), bf16(1, 1, D)
    raises(ValueError, "backend", mate.qsa_indexer_mqa_score, q, k, backend="auto")
    raises(ValueError, "backend", mate.qsa_mqa_prefill, q[0], k[0], i32(0, 0, 0, 0), i32(1, 1, 1, 1), backend="cuda")
    raises(TypeError, "backend", mate.qsa_mqa_decode, q[:, 0], k, i32(0).view(1, 1), i32(1), 4, backend=None)


def test_native_rejects_cpu_and_names_targets():
    raises(ValueError, "sm90", mate.qsa_indexer_mqa_score, bf16(1, 4, H, D), bf16(1, 1, D))
    raises(ValueError, "sm90", mate.qsa_mqa_prefill, bf16(4, H, D), bf16(2, D), i32(0, 0, 0, 0), i32(1, 1, 1, 1))
    raises(ValueError, "sm90", mate.qsa_mqa_decode, bf16(1, H, D), bf16(2, 16, 1, D), i32(0).view(1, 1), i32(1), 16)


def test_type_errors():
    q, k = bf16(1, 4, H, D), bf16(1, 1, D)
    raises(TypeError, "q_idx", mate.qsa_indexer_mqa_score, q.tolist(), k)
    raises(TypeError, "block_keys", mate.qsa_indexer_mqa_score, q, None)
    raises(TypeError, "q_idx", mate.qsa_indexer_mqa_score, q.to(torch.int32), k)
    raises(TypeError, "query_positions", mate.qsa_indexer_mqa_score, q, k, query_positions=torch.zeros(1, 4, dtype=torch.int64))
    raises(TypeError, "seq_lens_q", mate.qsa_indexer_mqa_score, q, k, seq_lens_q=torch.zeros(1))
    raises(TypeError, "block_table", mate.qsa_indexer_mqa_score, q, bf16(2, 4, D), block_table=torch.zeros(1, 2, dtype=torch.int64))
    raises(TypeError, "cu_seqlens_q", mate.qsa_indexer_mqa_score, q[0], k, cu_seqlens_q=torch.tensor([0, 4]))
    raises(TypeError, "token_to_req", mate.qsa_indexer_mqa_score, q[0], k, token_to_req=torch.zeros(4), num_requests=1)
    raises(TypeError, "num_requests", mate.qsa_indexer_mqa_score, q[0], k, token_to_req=i32(shape=(4,)), num_requests=1.0)
    raises(TypeError, "block_size", mate.qsa_indexer_mqa_score, q, k, block_size="4")
    raises(TypeError, "scale", mate.qsa_indexer_mqa_score, q, k, scale="0.1")
    raises(TypeError, "row_starts", mate.qsa_mqa_prefill, q[0], k[0], torch.zeros(4, dtype=torch.int64), i32(1, 1, 1, 1))
    raises(TypeError, "row_ends", mate.qsa_mqa_prefill, q[0], k[0], i32(0, 0, 0, 0), torch.ones(4))
    raises(TypeError, "page_table", mate.qsa_mqa_decode, q[:, 0], k, torch.zeros(1, 1, dtype=torch.int64), i32(1), 4)
    raises(TypeError, "context_lens", mate.qsa_mqa_decode, q[:, 0], k, i32(0).view(1, 1), torch.ones(1, dtype=torch.int64), 4)
    raises(TypeError, "max_model_len", mate.qsa_mqa_decode, q[:, 0], k, i32(0).view(1, 1), i32(1), 4.0)
    raises(TypeError, "score_scale", mate.qsa_mqa_decode, q[:, 0], k, i32(0).view(1, 1), i32(1), 4, score_scale=[2])


def test_scale_errors():
    q, k = bf16(1, 4, H, D), bf16(1, 1, D)
    for fn, args in [
        (mate.qsa_indexer_mqa_score, (q, k)),
        (mate.qsa_mqa_prefill, (q[0], k[0], i32(0, 0, 0, 0), i32(1, 1, 1, 1))),
        (mate.qsa_mqa_decode, (q[:, 0], k, i32(0).view(1, 1), i32(1), 4)),
    ]:
        raises(ValueError, "scale.*score_scale|score_scale.*scale", fn, *args, scale=0.1, score_scale=10.0, backend="reference")
        raises(ValueError, "scale", fn, *args, scale=-1.0, backend="reference")
        raises(ValueError, "score_scale", fn, *args, score_scale=0.0, backend="reference")
        raises(ValueError, "scale", fn, *args, scale=float("nan"), backend="reference")


def test_shape_errors():
    q, k = bf16(2, 4, H, D), bf16(2, 3, D)
    raises(ValueError, "q_idx", mate.qsa_indexer_mqa_score, q[0, 0], k)
    raises(ValueError, "block_keys", mate.qsa_indexer_mqa_score, q, k[0])
    raises(ValueError, "block_keys", mate.qsa_indexer_mqa_score, q, k[:1])
    raises(ValueError, "feature dim", mate.qsa_indexer_mqa_score, q, bf16(2, 3, 64))
    raises(ValueError, "dtype", mate.qsa_indexer_mqa_score, q, k.half())
    raises(ValueError, "query_positions", mate.qsa_indexer_mqa_score, q, k, query_positions=i32(shape=(2, 5)))
    raises(ValueError, "seq_lens_q", mate.qsa_indexer_mqa_score, q, k, seq_lens_q=i32(shape=(3,)))
    raises(ValueError, "num_requests", mate.qsa_indexer_mqa_score, q, k, num_requests=3)
    raises(ValueError, "cu_seqlens_q", mate.qsa_indexer_mqa_score, q, k, cu_seqlens_q=i32(0, 4, 8))
    raises(ValueError, "exactly one", mate.qsa_indexer_mqa_score, q[0], k)
    raises(ValueError, "exactly one", mate.qsa_indexer_mqa_score, q[0], k, cu_seqlens_q=i32(0, 4), token_to_req=i32(shape=(4,)))
    raises(ValueError, "num_requests", mate.qsa_indexer_mqa_score, q[0], k, token_to_req=i32(shape=(4,)))
    raises(ValueError, "page_size", mate.qsa_indexer_mqa_score, q, k, page_size=16)
    raises(ValueError, "page_size", mate.qsa_indexer_mqa_score, q, bf16(5, 16, 1, D), block_table=i32(shape=(2, 2)), page_size=8)
    raises(ValueError, "block_table", mate.qsa_indexer_mqa_score, q, bf16(5, 16, 1, D), block_table=i32(shape=(3, 2)))
    raises(ValueError, "block_keys", mate.qsa_indexer_mqa_score, q, bf16(5, 16, 2, D), block_table=i32(shape=(2, 2)))
    raises(ValueError, "k", mate.qsa_mqa_prefill, q[0], bf16(3, 2, D), i32(shape=(4,)), i32(shape=(4,)))
    raises(ValueError, "row_starts", mate.qsa_mqa_prefill, q[0], k[0], i32(shape=(5,)), i32(shape=(4,)))
    raises(ValueError, "q", mate.qsa_mqa_decode, q, k, i32(shape=(2, 1)), i32(shape=(2,)), 4)
    raises(ValueError, "page_table", mate.qsa_mqa_decode, q[:, 0], bf16(3, 16, D), i32(shape=(3, 1)), i32(shape=(2,)), 4)
    raises(ValueError, "context_lens", mate.qsa_mqa_decode, q[:, 0], bf16(3, 16, D), i32(shape=(2, 1)), i32(shape=(3,)), 4)
    raises(ValueError, "max_model_len", mate.qsa_mqa_decode, q[:, 0], bf16(3, 16, D), i32(shape=(2, 1)), i32(shape=(2,)), 0)
    raises(ValueError, "k_cache", mate.qsa_mqa_decode, q[:, 0], bf16(3, 16, 2, D), i32(shape=(2, 1)), i32(shape=(2,)), 4)


def test_native_only_errors():
    q, k = bf16(2, 4, H, D), bf16(2, 3, D)
    raises(ValueError, "reference.*qsa_mqa_prefill", mate.qsa_indexer_mqa_score, q[0], k, cu_seqlens_q=i32(0, 2, 4))
    raises(ValueError, "reference.*qsa_mqa_decode", mate.qsa_indexer_mqa_score, q, bf16(5, 16, 1, D), block_table=i32(shape=(2, 2)))
    raises(ValueError, "float16", mate.qsa_indexer_mqa_score, q.float(), k.float())
    raises(ValueError, "4 heads", mate.qsa_indexer_mqa_score, bf16(2, 4, 8, D), k)
    raises(ValueError, "dim 128", mate.qsa_mqa_prefill, bf16(4, H, 64), bf16(3, 64), i32(shape=(4,)), i32(shape=(4,)))
    raises(ValueError, "page sizes 8, 16, 32, 64", mate.qsa_mqa_decode, q[:, 0], bf16(3, 12, 1, D), i32(shape=(2, 1)), i32(shape=(2,)), 4)


def test_native_layout_rule_message():
    """The seed's layout rule and its error text, on q and keys of score and prefill."""
    msg = _checks.LAYOUT_ERROR
    big = bf16(2, 4, H, 2 * D)
    raises(ValueError, msg, mate.qsa_indexer_mqa_score, big[..., ::2], bf16(2, 3, D))  # feature stride 2
    flat = bf16(2 * 4 * H * D + 1)
    raises(ValueError, msg, mate.qsa_indexer_mqa_score, flat[1:].view(2, 4, H, D), bf16(2, 3, D))  # 2-byte offset
    keys = bf16(2, 3, D + 4)[..., :D]  # row stride of 132 elements: 264 bytes, not a multiple of 16
    raises(ValueError, msg, mate.qsa_indexer_mqa_score, bf16(2, 4, H, D), keys)
    raises(ValueError, msg, mate.qsa_mqa_prefill, bf16(4, H, D), keys[0], i32(shape=(4,)), i32(shape=(4,)))
    q = bf16(1, 4, H, D).expand(2, 4, H, D)  # stride 0 on an axis of 2
    raises(ValueError, msg, mate.qsa_indexer_mqa_score, q, bf16(2, 3, D))
    raises(ValueError, "k_cache", mate.qsa_mqa_decode, bf16(2, H, D), bf16(3, 16, D + 4)[..., :D], i32(shape=(2, 1)), i32(shape=(2,)), 4)


def test_layout_rule_accepts_aligned_slices():
    """Aligned outer slices and size-1 axes with any stride pass the rule."""
    _checks.vector_layout("x", bf16(3, 8, H, D + 8)[1:, 2:, :, :D])
    _checks.vector_layout("x", bf16(1, 5, H, D)[:, :, :, :].as_strided((1, 5, H, D), (7, H * D, D, 1)))


def test_decode_accepts_broadcast_q_in_reference():
    q = torch.randn(1, H, 16).expand(3, H, 16)
    cache = torch.randn(2, 8, 16)
    out = mate.qsa_mqa_decode(q, cache, i32(shape=(3, 1)), i32(8, 4, 0), 8, backend="reference")
    assert torch.isinf(out[2]).all() and torch.isfinite(out[0]).all()


# ---------------------------------------------------------------- FP8 key caches (issue 38)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TABLE = [[0, 1, 2, 3], [5, -1, 4, 9], [2, 2, 2, 2], [1, 0, -1, -1]]  # a missing, a past-the-pool and a repeated page


def fp8_decode_inputs(gen, kv_dtype, q_dtype=torch.bfloat16, d=16):
    from inputs import fp8_cache

    q = rand(gen, 4, H, d, dtype=q_dtype)
    cache = fp8_cache(gen, 6, 4, 1, d, device="cpu", dtype=kv_dtype)
    table = torch.tensor(TABLE, dtype=torch.int32)
    ctx = torch.tensor([16, 13, 0, 30], dtype=torch.int32)  # an empty request, one past the table's capacity
    return q, cache, table, ctx, 22


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["float", "tensor ()", "tensor (1,) strided"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_fp8_reference_is_the_reference_on_the_dequantized_cache(gen, kv_dtype, kind, q_dtype):
    """Bitwise: the FP8 reference is the reference on FP32 keys = stored value x k_scale (and a float64 oracle agrees)."""
    q, cache, table, ctx, L = fp8_decode_inputs(gen, kv_dtype, q_dtype)
    value = 0.0371
    k_scale = {"float": value, "tensor ()": torch.tensor(value),
               "tensor (1,) strided": torch.full((6,), value)[::3][1:]}[kind]  # shape (1,), stride 3, at an offset
    got = mate.qsa_mqa_decode(q, cache, table, ctx, L, scale=0.25, k_scale=k_scale, backend="reference")
    real = cache.float() * k_scale
    want = mate.qsa_mqa_decode(q.float(), real, table, ctx, L, scale=0.25, backend="reference")
    assert torch.equal(got, want)
    assert torch.isfinite(got).sum() > 20  # not a vacuous comparison of -inf rows
    for b in range(4):
        key_of, exists = paged_key(real[:, :, 0], table[b], 4)
        close(got[b], naive_row(q[b].float(), key_of, lambda j: exists(j) and j < int(ctx[b]), L, 0.25))


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_fp8_scale_none_is_one_and_a_tensor_is_read_at_the_call(gen, kv_dtype):
    q, cache, table, ctx, L = fp8_decode_inputs(gen, kv_dtype)
    plain = mate.qsa_mqa_decode(q.float(), cache.float(), table, ctx, L, backend="reference")
    assert torch.equal(mate.qsa_mqa_decode(q, cache, table, ctx, L, backend="reference"), plain)
    assert torch.equal(mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=1.0, backend="reference"), plain)
    ks = torch.tensor(1.0)
    for value in (1.0, 8.0):  # the same tensor, rewritten in place: each call uses its value then (powers of 2: exact)
        ks.fill_(value)
        got = mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=ks, backend="reference")
        assert torch.equal(got, torch.where(torch.isinf(plain), plain, plain * value))


def test_kv_scales_raises_every_documented_error():
    """Every error of mate._checks.kv_scales, the one check of a cache's dtype and scales (the K/V pairs directly:
    the indexer's cache has keys only)."""
    e4, e5 = (torch.zeros(2, 4, 8, dtype=t) for t in FP8)
    b16, q = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16)
    ok = _checks.kv_scales(e4, e4.clone(), 0.5, torch.tensor([2.0]), q)
    assert ok.fp8 and ok.kv_dtype == torch.float8_e4m3fn and (ok.k, ok.v) == (0.5, 1.0) and ok.k_tensor is None
    assert ok.v_tensor.shape == (1,) and float(ok.v_tensor) == 2.0
    plain = _checks.kv_scales(b16, b16, None, 1.0, q)
    assert not plain.fp8 and (plain.k, plain.v) == (1.0, 1.0)
    raises(ValueError, "q has dtype torch.float8_e4m3fn: FP8 queries are not supported", _checks.kv_scales, e4, e4, None, None, q.to(torch.float8_e4m3fn))
    for k, v in ((e4, b16), (e4, e5), (b16, e5), (e5, e4)):
        raises(ValueError, "one FP8 dtype", _checks.kv_scales, k, v, None, None, q)
    raises(ValueError, "v has dtype", _checks.kv_scales, b16, b16.half(), None, None, q)
    raises(ValueError, "v_scale applies to a value cache", _checks.kv_scales, e4, None, None, 1.0, q)
    for name, at in (("k_scale", lambda s: (s, None)), ("v_scale", lambda s: (None, s))):
        bad = [
            (torch.tensor(1.0), ValueError, "applies to FP8 K/V only", b16),
            (torch.tensor(1.0, dtype=torch.float64), TypeError, "float32 tensor", e4),
            (torch.tensor(1.0, dtype=torch.bfloat16), TypeError, "float32 tensor", e4),
            (torch.ones(2), ValueError, "one-element tensor", e4),
            (torch.ones(1, 1), ValueError, "one-element tensor", e4),
            (torch.ones(0), ValueError, "one-element tensor", e4),
            (torch.ones(1, device="meta"), ValueError, "on the cache's device", e4),
            ("0.5", TypeError, "float or a one-element float32 tensor", e4),
            (True, TypeError, "float or a one-element float32 tensor", e4),
            ([0.5], TypeError, "float or a one-element float32 tensor", e4),
            (2.0, ValueError, "must be 1.0 for non-FP8", b16),
        ] + [(x, ValueError, "positive finite", e4) for x in (0.0, -0.5, 0, float("nan"), float("inf"), -float("inf"))]
        for s, exc, match, cache in bad:
            with pytest.raises(exc, match=match) as e:
                _checks.kv_scales(cache, cache, *at(s), q)
            assert str(e.value).startswith(name), (name, str(e.value))  # the message names the scale


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_fp8_errors(gen, kv_dtype):
    """The checks through qsa_mqa_decode: reference and native wrappers alike raise before any compute."""
    q, cache, table, ctx, L = fp8_decode_inputs(gen, kv_dtype)
    for backend in ("reference", "tilelang"):
        call = lambda k_scale, q=q, cache=cache: mate.qsa_mqa_decode(q, cache, table, ctx, L, k_scale=k_scale, backend=backend)
        raises(ValueError, "FP8 queries", call, None, q=q.to(kv_dtype))
        raises(ValueError, "k_scale must be a positive finite", call, 0.0)
        raises(ValueError, "k_scale must be a positive finite", call, float("nan"))
        raises(TypeError, "k_scale must be a float32 tensor", call, torch.tensor(0.5, dtype=torch.float64))
        raises(ValueError, "k_scale must be a one-element", call, torch.ones(2))
        raises(ValueError, "k_scale is on meta", call, torch.ones((), device="meta"))
        raises(TypeError, "k_scale must be a float", call, "1")
        raises(ValueError, "k_scale as a tensor applies to FP8", call, torch.tensor(1.0), cache=cache.bfloat16())
        raises(ValueError, "k_scale must be 1.0 for non-FP8", call, 0.5, cache=cache.bfloat16())
        raises(ValueError, "k_cache has dtype", call, None, cache=cache.half())  # BF16 q, FP16 keys
    # A tensor's value: the reference reads it, so it checks it always ...
    for value in (0.0, -1.0, float("nan"), float("inf")):
        raises(ValueError, "k_scale must be a positive finite number, got .* \\(its tensor's value\\)",
               mate.qsa_mqa_decode, q, cache, table, ctx, L, k_scale=torch.tensor(value), backend="reference")
    # ... the native wrapper never reads device memory: only in debug mode (here it raises that first, on the CPU,
    # where it would otherwise reach its device check).
    bad = torch.tensor(float("nan"))
    native = (bf16(2, H, D), torch.zeros(3, 16, D, dtype=kv_dtype), i32(shape=(2, 1)), i32(shape=(2,)), 16)  # native limits
    raises(ValueError, "sm90", mate.qsa_mqa_decode, *native, k_scale=bad)
    with mate.debug_checks():
        raises(ValueError, "its tensor's value", mate.qsa_mqa_decode, *native, k_scale=bad)
        raises(ValueError, "sm90", mate.qsa_mqa_decode, *native, k_scale=torch.tensor(0.5))  # a good value passes


def test_decode_fp8_native_layout_rule_counts_bytes():
    """16-byte copies: an FP8 cache's offsets and strides are multiples of 16 elements, a 16-bit one's of 8. The
    layout error comes before the device check, so both are seen on the CPU."""
    q, table, ctx = bf16(2, H, D), i32(shape=(2, 1)), i32(shape=(2,))
    fp8_pool = torch.zeros(3, 16, D + 16, dtype=torch.float8_e4m3fn)
    raises(ValueError, _checks.LAYOUT_ERROR, mate.qsa_mqa_decode, q, fp8_pool[..., 8 : 8 + D], table, ctx, 4)  # 8 bytes in
    raises(ValueError, "sm90", mate.qsa_mqa_decode, q, fp8_pool[..., 16 : 16 + D], table, ctx, 4)  # 16 bytes in: legal
    raises(ValueError, _checks.LAYOUT_ERROR, mate.qsa_mqa_decode, q, torch.zeros(3, 16, D + 8, dtype=torch.float8_e5m2)[..., :D],
           table, ctx, 4)  # key stride 136 bytes
    raises(ValueError, "sm90", mate.qsa_mqa_decode, q, bf16(3, 16, D + 8)[..., 8 : 8 + D], table, ctx, 4)  # 16 bytes for BF16
