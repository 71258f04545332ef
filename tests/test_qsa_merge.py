"""SplitKV merge on the CPU: the reference against a naive float64 loop oracle, against attention
computed whole, and every documented error."""

import math

import pytest
import torch

import mate


def naive_merge(partial_out, partial_lse, gate=None):
    """Row by row, head by head, in float64: skip -inf splits, weight the rest by exp(l_s - lse)."""
    splits, rows, heads, d = partial_out.shape
    out = torch.zeros(rows, heads, d, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            live = [s for s in range(splits) if partial_lse[s, r, h] != float("-inf")]
            if not live:
                continue
            m = max(float(partial_lse[s, r, h]) for s in live)
            w = {s: math.exp(float(partial_lse[s, r, h]) - m) for s in live}
            z = sum(w.values())
            o = sum(w[s] * partial_out[s, r, h].double() for s in live) / z
            if gate is not None:
                o = o * torch.sigmoid(gate[r, h].double())
            out[r, h] = o
            lse[r, h] = m + math.log(z)
    return out, lse


def partials(gen, splits=4, rows=7, heads=3, d=10, dtype=torch.float32):
    po = torch.randn(splits, rows, heads, d, generator=gen).to(dtype)
    pl = torch.randn(splits, rows, heads, generator=gen) * 4
    empty = torch.rand(splits, rows, heads, generator=gen) < 0.3
    pl[empty] = float("-inf")
    pl[:, 0, 0] = float("-inf")  # a row-head with every split empty
    pl[:, 1] = float("-inf")  # a whole row
    pl[0, 2, 1] = 80.0  # far apart LSEs
    pl[-1, 2, 1] = -80.0
    po[torch.isinf(pl)] = float("nan")  # an empty split's partial output may be garbage: it must not be read
    return po, pl


def check(out, lse, ref_out, ref_lse, tol=1e-5):
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=tol, atol=tol)
    assert (out[~fin] == 0).all()
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < tol, f"relative error {err:.3e}"


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("gate_kind", [None, "head", "element"])
def test_merge_matches_naive(gen, splits, gate_kind):
    po, pl = partials(gen, splits=splits)
    gate = {None: None, "head": torch.randn(7, 3, generator=gen), "element": torch.randn(7, 3, 10, generator=gen)}[gate_kind]
    out, lse = mate.merge_attention_states(po, pl, gate=gate, backend="reference")
    assert out.shape == (7, 3, 10) and out.dtype == po.dtype and lse.shape == (7, 3)
    ref_out, ref_lse = naive_merge(po, pl, gate)
    check(out, lse, ref_out, ref_lse)
    assert torch.isinf(lse[0, 0]) and torch.isinf(lse[1]).all() and (out[1] == 0).all()


def test_merge_bf16_partials_and_out_dtype(gen):
    po, pl = partials(gen, dtype=torch.bfloat16)
    ref_out, ref_lse = naive_merge(po, pl)
    out, lse = mate.merge_attention_states(po, pl, backend="reference")
    assert out.dtype == torch.bfloat16
    check(out.float(), lse, ref_out, ref_lse, tol=1e-2)
    out, _ = mate.merge_attention_states(po.float(), pl, out_dtype=torch.bfloat16, backend="reference")
    assert out.dtype == torch.bfloat16


def test_merge_no_splits():
    out, lse = mate.merge_attention_states(torch.zeros(0, 2, 3, 4), torch.zeros(0, 2, 3), backend="reference")
    assert (out == 0).all() and out.shape == (2, 3, 4) and torch.isinf(lse).all() and (lse < 0).all()


def test_merge_buffers(gen):
    po, pl = partials(gen)
    ref_out, ref_lse = mate.merge_attention_states(po, pl, backend="reference")
    store = torch.full((9, 3, 12), float("nan"), dtype=torch.bfloat16)
    out = store[1:8, :, 1:11]
    lse_store = torch.full((7, 5), float("nan"))
    lse = lse_store[:, 1:4]
    got_out, got_lse = mate.merge_attention_states(po, pl, out=out, lse=lse, backend="reference")
    assert got_out is out and got_lse is lse
    assert torch.equal(out, ref_out.to(torch.bfloat16)) and torch.equal(lse, ref_lse)
    mask = torch.ones_like(store, dtype=torch.bool)
    mask[1:8, :, 1:11] = False
    assert torch.isnan(store[mask]).all() and torch.isnan(lse_store[:, [0, 4]]).all()


def test_split_attention_then_merge_equals_whole(gen):
    """Attention over chunks of each row's token list, merged, equals attention over the whole list."""
    rows, hq, hkv, d, n, width = 8, 24, 2, 16, 40, 29
    q = torch.randn(rows, hq, d, generator=gen)
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    ids = torch.randint(-2, n + 2, (rows, width), generator=gen, dtype=torch.int32)
    ids[0] = -1
    ids[1, :10] = -1  # the first chunk of row 1 is empty
    gate = torch.randn(rows, hq, generator=gen)
    whole, whole_lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    parts = [mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids[:, c : c + 10].contiguous(), return_lse=True, backend="reference")
             for c in range(0, width, 10)]
    out, lse = mate.merge_attention_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                                           gate=gate, backend="reference")
    torch.testing.assert_close(out, whole * torch.sigmoid(gate).unsqueeze(-1))
    assert torch.equal(torch.isinf(lse), torch.isinf(whole_lse))
    torch.testing.assert_close(lse[1:], whole_lse[1:])


# ---------------------------------------------------------------- errors


def ok():
    return torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)


ERRORS = [
    (TypeError, "partial_out", dict(partial_out=[0.0])),
    (TypeError, "partial_out", dict(partial_out=torch.zeros(2, 3, 4, 8, dtype=torch.int32))),
    (TypeError, "partial_lse", dict(partial_lse=None)),
    (TypeError, "gate", dict(gate=torch.zeros(3, 4, dtype=torch.int64))),
    (TypeError, "out_dtype", dict(out_dtype="bfloat16")),
    (TypeError, "out", dict(out=[0.0])),
    (TypeError, "backend", dict(backend=None)),
    (ValueError, "backend", dict(backend="auto")),
    (ValueError, "partial_out", dict(partial_out=torch.zeros(3, 4, 8))),
    (ValueError, "partial_lse", dict(partial_lse=torch.zeros(2, 3, 4, dtype=torch.float64))),
    (ValueError, "partial_lse", dict(partial_lse=torch.zeros(2, 3, 5))),
    (ValueError, "partial_lse", dict(partial_lse=torch.zeros(6, 4))),
    (ValueError, "gate", dict(gate=torch.zeros(3, 4, 1))),
    (ValueError, "out_dtype", dict(out_dtype=torch.int32)),
    (ValueError, "out_dtype", dict(out=torch.zeros(3, 4, 8), out_dtype=torch.bfloat16)),
    (ValueError, "out", dict(out=torch.zeros(3, 4, 9))),
    (ValueError, "out", dict(out=torch.zeros(1, 4, 8).expand(3, 4, 8))),
    (ValueError, "lse", dict(lse=torch.zeros(3, 4, dtype=torch.bfloat16))),
    (ValueError, "lse", dict(lse=torch.zeros(4, 3))),
]


@pytest.mark.parametrize("exc, text, kw", ERRORS, ids=[f"{e.__name__}-{t}-{i}" for i, (e, t, _) in enumerate(ERRORS)])
def test_merge_errors(exc, text, kw):
    po, pl = ok()
    kw = dict(kw)
    po, pl = kw.pop("partial_out", po), kw.pop("partial_lse", pl)
    kw.setdefault("backend", "reference")
    with pytest.raises(exc, match=text):
        mate.merge_attention_states(po, pl, **kw)


def test_merge_overlap_errors():
    po, pl = ok()
    with pytest.raises(ValueError, match="out overlaps partial_out"):
        mate.merge_attention_states(po, pl, out=po[0], backend="reference")
    with pytest.raises(ValueError, match="lse overlaps partial_lse"):
        mate.merge_attention_states(po, pl, lse=pl[1], backend="reference")
    g = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="out overlaps gate"):
        mate.merge_attention_states(po, pl, gate=g, out=g, backend="reference")
    buf = torch.zeros(3 * 4 * 8)
    with pytest.raises(ValueError, match="out overlaps lse"):
        mate.merge_attention_states(po, pl, out=buf.view(3, 4, 8), lse=buf[:12].view(3, 4), backend="reference")


def test_merge_native_rejects_cpu_and_names_targets():
    po, pl = ok()
    with pytest.raises(ValueError, match="sm90"):
        mate.merge_attention_states(po, pl)
