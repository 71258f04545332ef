"""The hostile-input probe (tests/hostile_probe.py) on the CPU: 0 crashes, 0 stray exceptions,
0 silently wrong results over every entrypoint and both backends (the native one must refuse
CPU tensors with a clear ValueError). On a GPU host run `python tests/hostile_probe.py`."""

import hostile_probe


def test_probe_finds_nothing_on_cpu():
    tally = hostile_probe.run("cpu")
    assert tally.counts["crash_or_stray"] == 0 and tally.counts["silently_wrong"] == 0, "\n".join(tally.failures)
    assert tally.counts["ok"] > 50 and tally.counts["clear_error"] > 200


def test_documented_results_of_empty_pools_and_bad_offsets():
    """The reference's answers the probe relies on, spelled out (issue 18)."""
    import pytest
    import torch

    import mate

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    q, cache = torch.randn(2, 4, 32), torch.randn(3, 4, 32)
    table = i32(0, 1, 2, -1).reshape(2, 2)
    out = mate.qsa_mqa_decode(q, cache[:0], table, i32(5, 8), 8, backend="reference")  # empty pool
    assert out.shape == (2, 8) and torch.isneginf(out).all()
    assert torch.isneginf(mate.qsa_mqa_decode(q, cache, table[:, :0], i32(5, 8), 8, backend="reference")).all()
    qi = torch.randn(5, 4, 32)
    s = mate.qsa_indexer_mqa_score(qi, cache[:0], cu_seqlens_q=i32(0, 2, 5), block_table=table, backend="reference")
    assert torch.isneginf(s).all()
    for cu in (i32(0, 4, 2), i32(0, 2, 6), i32(-1, 2, 5)):
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            mate.qsa_indexer_mqa_score(qi, cache, cu_seqlens_q=cu, block_table=table, backend="reference")
    qq, kp = torch.randn(2, 3, 4, 16), torch.randn(4, 4, 2, 16)
    tok = torch.randint(-1, 8, (2, 3, 5), dtype=torch.int32)
    o, lse = mate.qsa_sparse_attention(qq, kp, kp, tok, block_table=table[:, :0], return_lse=True, backend="reference")
    assert (o == 0).all() and torch.isneginf(lse).all()
    o, lse = mate.qsa_sparse_attention(qq, kp[:0], kp[:0], tok, block_table=table, return_lse=True, backend="reference")
    assert (o == 0).all() and torch.isneginf(lse).all()
