"""QSA selection on the CPU: the reference top-k and expansion against naive loops (ties, NaN, -inf, +inf,
-0, fewer selectable scores than k, strided rows, k = 1 and 2048), the fused entrypoint, out buffers, and
every documented error."""

import math

import pytest
import torch

import mate

INF = float("inf")


def naive_topk(scores, k):
    """Row by row: the selectable (not NaN, not -inf) scores sorted by (score descending, id ascending)."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for r, row in enumerate(scores.tolist()):
        ids = sorted((i for i, v in enumerate(row) if not math.isnan(v) and v != -INF), key=lambda i: (-row[i], i))
        out[r, : min(k, len(ids))] = torch.tensor(ids[:k], dtype=torch.int32)
    return out


def naive_expand(blocks, positions, block_size):
    rows, k = blocks.shape
    out = torch.full((rows, block_size * k + block_size - 1), -1, dtype=torch.int32)
    for r in range(rows):
        for j, b in enumerate(blocks[r].tolist()):
            if b >= 0:
                out[r, block_size * j : block_size * (j + 1)] = torch.arange(block_size * b, block_size * (b + 1))
        p = int(positions[r])
        first = (p + 1) // block_size * block_size if p >= 0 else 0
        for t in range(block_size - 1):
            if 0 <= first + t <= p:
                out[r, block_size * k + t] = first + t
    return out


def scores_of(gen, rows, keys, kind):
    s = torch.randn(rows, keys, generator=gen)
    if kind == "ties":
        s = (s * 2).round() / 2  # a few values, many ties
    elif kind == "equal":
        s = torch.full((rows, keys), 0.25)
    elif kind == "hostile":
        u = torch.rand(rows, keys, generator=gen)
        s[u < 0.3] = -INF
        s[(u >= 0.3) & (u < 0.4)] = float("nan")
        s[(u >= 0.4) & (u < 0.42)] = INF
        s[(u >= 0.42) & (u < 0.5)] = -0.0
        s[(u >= 0.5) & (u < 0.55)] = 0.0
        s[(u >= 0.55) & (u < 0.6)] = 3.4e38
        s[(u >= 0.6) & (u < 0.65)] = -3.4e38
        s[(u >= 0.65) & (u < 0.7)] = 1e-45  # denormal
    elif kind == "few":
        s[:, 3:] = -INF  # fewer selectable scores than k
        s[0] = float("nan")
    return s


@pytest.mark.parametrize("kind", ["normal", "ties", "equal", "hostile", "few"])
@pytest.mark.parametrize("k", [1, 5, 64, 100])
def test_topk_matches_naive(gen, kind, k):
    s = scores_of(gen, 6, 130, kind)
    assert torch.equal(mate.qsa_topk_blocks(s, k, backend="reference"), naive_topk(s, k))


def test_topk_ties_go_to_the_lower_id_and_zeros_of_either_sign_tie():
    s = torch.tensor([[1.0, 2.0, 1.0, -0.0, 2.0, 0.0, float("nan"), INF, -INF, 0.0]])
    assert mate.qsa_topk_blocks(s, 10, backend="reference").tolist() == [[7, 1, 4, 0, 2, 3, 5, 9, -1, -1]]


def test_topk_prefix_is_the_smaller_top_k(gen):
    s = scores_of(gen, 4, 300, "ties")
    full = mate.qsa_topk_blocks(s, 200, backend="reference")
    for k in (1, 17, 128):
        assert torch.equal(mate.qsa_topk_blocks(s, k, backend="reference"), full[:, :k])


def test_topk_strided_rows_and_k_2048(gen):
    base = torch.randn(5, 2 * 2051 + 1, generator=gen)
    s = base[:, 1::2]  # column stride 2, row stride 4103, storage offset 1
    assert torch.equal(mate.qsa_topk_blocks(s, 2048, backend="reference"), naive_topk(s, 2048))
    assert torch.equal(mate.qsa_topk_blocks(s, 1, backend="reference"), s.argmax(-1, keepdim=True).int())


def test_topk_out_is_written_in_place(gen):
    s = scores_of(gen, 3, 40, "hostile")
    base = torch.full((3, 20), -7, dtype=torch.int32)
    out = base[:, ::2]
    res = mate.qsa_topk_blocks(s, 10, out=out, backend="reference")
    assert res is out and torch.equal(out, naive_topk(s, 10))
    assert (base[:, 1::2] == -7).all()  # the storage around it untouched


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_expand_matches_naive(gen, block_size):
    blocks = torch.randint(-3, 50, (9, 7), generator=gen, dtype=torch.int32)
    pos = torch.tensor([-5, -1, 0, 1, 2, 3, 4, 7, 230], dtype=torch.int32)
    got = mate.qsa_expand_blocks(blocks, pos, block_size=block_size, backend="reference")
    assert torch.equal(got, naive_expand(blocks, pos, block_size))


def test_expand_is_what_sparse_attention_takes(gen):
    """Width 4k + 3 with the blocks as the hint: qsa_sparse_attention accepts both and gives the token list's result."""
    q, kv = torch.randn(2, 1, 4, 16, generator=gen), torch.randn(2, 64, 1, 16, generator=gen)
    pos = torch.tensor([41, 63], dtype=torch.int32)
    s = torch.randn(2, 16, generator=gen).masked_fill(torch.arange(16) * 4 + 3 > pos[:, None], -INF)
    blocks, tokens = mate.qsa_topk_tokens(s, 5, pos, backend="reference")
    assert tokens.shape == (2, 23)
    with_hint = mate.qsa_sparse_attention(q, kv, kv, tokens[:, None], block_indices=blocks[:, None], backend="reference")
    plain = mate.qsa_sparse_attention(q, kv, kv, tokens[:, None], backend="reference")
    assert torch.equal(with_hint, plain)


def test_topk_tokens_is_topk_then_expand(gen):
    s = scores_of(gen, 7, 90, "hostile")
    pos = torch.randint(-3, 400, (7,), generator=gen, dtype=torch.int32)
    blocks, tokens = mate.qsa_topk_tokens(s, 33, pos, block_size=3, backend="reference")
    assert torch.equal(blocks, naive_topk(s, 33))
    assert torch.equal(tokens, naive_expand(blocks, pos, 3))


def test_expand_out_is_written_in_place(gen):
    blocks = torch.randint(-1, 9, (3, 4), generator=gen, dtype=torch.int32)
    pos = torch.tensor([5, 40, -1], dtype=torch.int32)
    out = torch.full((3, 19), -7, dtype=torch.int32)
    assert mate.qsa_expand_blocks(blocks, pos, out=out, backend="reference") is out
    assert torch.equal(out, naive_expand(blocks, pos, 4))


def test_empty_rows():
    s = torch.empty(0, 10)
    assert mate.qsa_topk_blocks(s, 3, backend="reference").shape == (0, 3)
    b, t = mate.qsa_topk_tokens(s, 3, torch.empty(0, dtype=torch.int32), backend="reference")
    assert b.shape == (0, 3) and t.shape == (0, 15)


S = torch.randn(4, 30)
POS = torch.zeros(4, dtype=torch.int32)
B = torch.zeros(4, 6, dtype=torch.int32)

TOPK_ERRORS = [
    (dict(scores=S.numpy()), TypeError, "scores must be a torch.Tensor"),
    (dict(scores=S[0]), ValueError, "scores must have rank 2"),
    (dict(scores=S.int()), TypeError, "scores must be a floating-point"),
    (dict(scores=S.half()), ValueError, "scores must be float32"),
    (dict(scores=S.double()), ValueError, "scores must be float32"),
    (dict(k=2.0), TypeError, "k must be an int"),
    (dict(k=True), TypeError, "k must be an int"),
    (dict(k=0), ValueError, r"k must be in \[1, min\(keys, 2048\)\] = \[1, 30\].*got 0"),
    (dict(k=31), ValueError, "k must be in .* 30 keys, got 31"),
    (dict(scores=torch.randn(2, 3000), k=2049), ValueError, r"k must be in \[1, min\(keys, 2048\)\] = \[1, 2048\]"),
    (dict(out=torch.zeros(4, 5, dtype=torch.int32)), ValueError, r"out must have shape \(4, 3\)"),
    (dict(out=torch.zeros(4, 3, dtype=torch.int64)), ValueError, "out must have dtype torch.int32"),
    (dict(out=torch.zeros(1, 3, dtype=torch.int32).expand(4, 3)), ValueError, "out must have positive strides"),
    (dict(out=S.view(torch.int32)[:, :3]), ValueError, "out overlaps scores"),
    (dict(backend="auto"), ValueError, "backend must be 'tilelang' or 'reference'"),
    (dict(backend=None), TypeError, "backend must be a str"),
]


@pytest.mark.parametrize("kw, exc, match", TOPK_ERRORS)
def test_topk_errors(kw, exc, match):
    a = dict(scores=S, k=3, backend="reference") | kw
    with pytest.raises(exc, match=match):
        mate.qsa_topk_blocks(a.pop("scores"), a.pop("k"), **a)


TOKENS_ERRORS = [
    (dict(query_positions=POS.long()), TypeError, "query_positions must be an int32"),
    (dict(query_positions=POS[:3]), ValueError, r"query_positions must have shape \(4,\)"),
    (dict(query_positions=None), TypeError, "query_positions must be a torch.Tensor"),
    (dict(block_size=0), ValueError, "block_size must be positive"),
    (dict(block_size=4.0), TypeError, "block_size must be an int"),
    (dict(k=0), ValueError, "k must be in"),
    (dict(scores=S.half()), ValueError, "scores must be float32"),
]


@pytest.mark.parametrize("kw, exc, match", TOKENS_ERRORS)
def test_topk_tokens_errors(kw, exc, match):
    a = dict(scores=S, k=3, query_positions=POS, backend="reference") | kw
    with pytest.raises(exc, match=match):
        mate.qsa_topk_tokens(a.pop("scores"), a.pop("k"), a.pop("query_positions"), **a)


EXPAND_ERRORS = [
    (dict(block_indices=B.tolist()), TypeError, "block_indices must be a torch.Tensor"),
    (dict(block_indices=B.long()), TypeError, "block_indices must be an int32"),
    (dict(block_indices=B[0]), ValueError, "block_indices must have rank 2"),
    (dict(query_positions=POS.float()), TypeError, "query_positions must be an int32"),
    (dict(query_positions=POS[:2]), ValueError, r"query_positions must have shape \(4,\)"),
    (dict(block_size=-1), ValueError, "block_size must be positive"),
    (dict(block_size="4"), TypeError, "block_size must be an int"),
    (dict(block_size=2**29), ValueError, "exceed int32"),
    (dict(out=torch.zeros(4, 26, dtype=torch.int32)), ValueError, r"out must have shape \(4, 27\)"),
    (dict(out=torch.zeros(4, 27)), ValueError, "out must have dtype torch.int32"),
    (dict(out=torch.zeros(1, 27, dtype=torch.int32).expand(4, 27)), ValueError, "out must have positive strides"),
    (dict(backend="fast"), ValueError, "backend must be"),
]


@pytest.mark.parametrize("kw, exc, match", EXPAND_ERRORS)
def test_expand_errors(kw, exc, match):
    a = dict(block_indices=B, query_positions=POS, backend="reference") | kw
    with pytest.raises(exc, match=match):
        mate.qsa_expand_blocks(a.pop("block_indices"), a.pop("query_positions"), **a)


def test_expand_rejects_an_out_overlapping_its_inputs():
    base = torch.zeros(4 * 27 + 24, dtype=torch.int32)
    blocks = base[:24].view(4, 6)
    with pytest.raises(ValueError, match="out overlaps block_indices"):
        mate.qsa_expand_blocks(blocks, POS, out=base[20 : 20 + 108].view(4, 27), backend="reference")


@pytest.mark.parametrize("call", [
    lambda: mate.qsa_topk_blocks(S, 3),
    lambda: mate.qsa_topk_tokens(S, 3, POS),
    lambda: mate.qsa_expand_blocks(B, POS),
])
def test_native_refuses_cpu_tensors_before_compiling(call):
    with pytest.raises(ValueError, match="backend='tilelang' needs CUDA tensors"):
        call()
