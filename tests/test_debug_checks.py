"""MATE_DEBUG_CHECKS / mate.debug_checks(): value checks of what the fast path trusts (mate/_debug.py).

Run on the CPU through the reference backend (the checks sit in each entrypoint's
validation, before the backend is chosen); the GPU run of benchmarks/experiments/debug_checks_cost.py
exercises them on device tensors.
"""

import pytest
import torch

import mate
from mate import _debug

I32 = torch.int32


def i32(*v):
    return torch.tensor(v, dtype=I32)


def test_off_by_default_and_scoped(monkeypatch):
    monkeypatch.delenv(_debug.ENV, raising=False)
    assert not _debug.enabled()
    with mate.debug_checks():
        assert _debug.enabled()
        with mate.debug_checks(False):
            assert not _debug.enabled()
        assert _debug.enabled()
    assert not _debug.enabled()
    monkeypatch.setenv(_debug.ENV, "1")
    assert _debug.enabled()
    monkeypatch.setenv(_debug.ENV, "0")
    assert not _debug.enabled()


def qsa_inputs(gen):
    q = torch.randn(2, 3, 4, 8, generator=gen)
    k = torch.randn(2, 10, 2, 8, generator=gen)
    v = torch.randn(2, 10, 2, 8, generator=gen)
    tok = torch.randint(-1, 10, (2, 3, 11), generator=gen, dtype=I32)
    return q, k, v, tok


def raises_in_debug(match, fn, *a, **kw):
    fn(*a, **kw)  # accepted (masked or trusted) without debug checks
    with mate.debug_checks(), pytest.raises(ValueError, match=match):
        fn(*a, **kw)


def test_qsa_token_ids_and_lengths(gen):
    q, k, v, tok = qsa_inputs(gen)
    with mate.debug_checks():
        mate.qsa_sparse_attention(q, k, v, tok, backend="reference")  # clean input passes
    bad = tok.clone()
    bad[1, 2, 5] = 10
    raises_in_debug(r"token_indices\[1, 2, 5\] is 10, expected -1 <= value < 10", mate.qsa_sparse_attention, q, k, v, bad, backend="reference")
    bad[1, 2, 5] = -2
    raises_in_debug(r"token_indices\[1, 2, 5\] is -2", mate.qsa_sparse_attention, q, k, v, bad, backend="reference")
    raises_in_debug(r"seq_lens_k\[1\] is 11", mate.qsa_sparse_attention, q, k, v, tok, seq_lens_k=i32(4, 11), backend="reference")
    raises_in_debug(r"seq_lens_q\[0\] is -1", mate.qsa_sparse_attention, q, k, v, tok, seq_lens_q=i32(-1, 2), backend="reference")


def expand(blocks):
    """The token list a block hint stands for: 4 tokens a block (-1 for -1), then a 3-token tail."""
    tok = torch.where(blocks[..., None] >= 0, 4 * blocks[..., None] + torch.arange(4, dtype=I32), -1).flatten(-2)
    return torch.cat([tok, i32(1, 2, 3).expand(*blocks.shape[:-1], 3)], -1)


def test_qsa_block_hint(gen):
    q, k, v, _ = qsa_inputs(gen)
    blocks = i32(0, 1, -1, 1, 1, -1, 0, 0, 1, 1, -1, -1).reshape(2, 3, 2)
    tok = expand(blocks)
    with mate.debug_checks():
        mate.qsa_sparse_attention(q, k, v, tok, block_indices=blocks, backend="reference")
    wrong = blocks.clone()
    wrong[1, 0, 1] = 1 - int(blocks[1, 0, 1])
    raises_in_debug(r"block_indices\[1, 0, 1\] = .* disagrees with token_indices\[1, 0, 4\]", mate.qsa_sparse_attention,
                    q, k, v, tok, block_indices=wrong, backend="reference")
    gap = blocks.clone()
    gap[0, 0] = i32(-1, 0)
    raises_in_debug(r"assume_compact_blocks=True but block_indices row \[0, 0\]", mate.qsa_sparse_attention,
                    q, k, v, expand(gap), block_indices=gap, assume_compact_blocks=True, backend="reference")


def test_qsa_flattened_rows_and_pages(gen):
    q = torch.randn(5, 4, 8, generator=gen)
    k = torch.randn(6, 4, 2, 8, generator=gen)
    tok = torch.randint(-1, 8, (5, 7), generator=gen, dtype=I32)
    table = i32(0, 1, 2, 3).reshape(2, 2)
    kw = dict(block_table=table, backend="reference")
    with mate.debug_checks():
        mate.qsa_sparse_attention(q, k, k, tok, cu_seqlens_q=i32(0, 2, 5), **kw)
    raises_in_debug(r"cu_seqlens_q must run from 0 to the row count 5", mate.qsa_sparse_attention, q, k, k, tok, cu_seqlens_q=i32(0, 2, 4), **kw)
    raises_in_debug(r"token_to_req\[3\] is 2", mate.qsa_sparse_attention, q, k, k, tok, token_to_req=i32(0, 0, 1, 2, 1), num_requests=2, **kw)
    kw["block_table"] = i32(0, 1, 6, 3).reshape(2, 2)
    raises_in_debug(r"block_table\[1, 0\] is 6, expected -1 <= value < 6", mate.qsa_sparse_attention, q, k, k, tok, cu_seqlens_q=i32(0, 2, 5), **kw)


def test_physical_ids(gen):
    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(7, 2, 8, generator=gen)
    ids = i32(0, 6, -1, 3, 7, 2).reshape(3, 2)
    raises_in_debug(r"selected_kv_indices\[2, 0\] is 7", mate.qsa_sparse_attention, q, k, k, selected_kv_indices=ids, backend="reference")


def test_indexer_decode_prefill(gen):
    q = torch.randn(2, 4, 32, generator=gen)
    cache = torch.randn(3, 4, 32, generator=gen)
    raises_in_debug(r"page_table\[1, 1\] is 3", mate.qsa_mqa_decode, q, cache, i32(0, 1, 2, 3).reshape(2, 2), i32(5, 8), 8, backend="reference")
    raises_in_debug(r"context_lens\[0\] is 9", mate.qsa_mqa_decode, q, cache, i32(0, 1, 2, -1).reshape(2, 2), i32(9, 8), 8, backend="reference")
    k = torch.randn(10, 32, generator=gen)
    raises_in_debug(r"row_ends\[1\] is 11", mate.qsa_mqa_prefill, q, k, i32(0, 2), i32(5, 11), backend="reference")
    qi = torch.randn(5, 4, 32, generator=gen)
    keys = torch.randn(3, 4, 32, generator=gen)
    raises_in_debug(r"cu_seqlens_q must run from 0", mate.qsa_indexer_mqa_score, qi, keys, cu_seqlens_q=i32(1, 3, 5),
                    block_table=i32(0, 1, 2, -1).reshape(2, 2), backend="reference")


def test_nsa(gen):
    q = torch.randn(1, 4, 2, 16, generator=gen)
    k = torch.randn(1, 100, 1, 16, generator=gen)
    idx = i32(0, 1, -1, 3, 0, 4, 1, 0).reshape(1, 4, 1, 2)
    raises_in_debug(r"block_indices\[0, 2, 0, 1\] is 4, expected -1 <= value < 4", mate.nsa_selection_attention, q, k, k, idx,
                    block_size=32, backend="reference")
    raises_in_debug(r"block_counts\[0, 1, 0\] is 3", mate.nsa_selection_attention, q, k, k, idx.clamp_max(3), block_size=32,
                    block_counts=i32(1, 3, 0, 2).reshape(1, 4, 1), backend="reference")
