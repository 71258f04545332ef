"""QSA sparse core attention on the CPU: the reference against a naive float64 loop oracle on
random problems of every layout and option, agreement between layouts, and every documented error."""

import itertools
import math
import zlib

import pytest
import torch

import mate
from mate import _hopper
from inputs import qsa_kv_layout, qsa_physical_layout, qsa_query_layout, qsa_requests

# ---------------------------------------------------------------- naive oracle


def naive_attention(query, key, value, token_indices=None, *, selected_kv_indices=None, cu_seqlens_q=None,
                    token_to_req=None, num_requests=None, cu_seqlens_k=None, seq_lens_q=None, seq_lens_k=None,
                    query_positions=None, block_table=None, scale=None, softmax_scale=None, gate=None, **_):
    """Row by row, head by head: gather the visible tokens, softmax in float64.

    Returns float64 (out, lse) of shapes query.shape and query.shape[:-1].
    """
    hq, d = query.shape[-2:]
    group = hq // key.shape[-2]
    scale = scale if scale is not None else softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full(query.shape[:-1], float("-inf"), dtype=torch.float64)

    # every row as (index into query, request, index within the request, rows of the request)
    rows = []
    if selected_kv_indices is not None:
        rows = [((r,), None, r, None) for r in range(query.shape[0])]
    elif query.dim() == 4:
        rows = [((b, i), b, i, query.shape[1]) for b in range(query.shape[0]) for i in range(query.shape[1])]
    elif cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        owner = {}
        for b in range(len(cu) - 1):
            for r in range(cu[b], cu[b + 1]):
                owner[r] = (b, r - cu[b], cu[b + 1] - cu[b])
        rows = [((r,), *owner.get(r, (None, None, None))) for r in range(query.shape[0])]
    else:
        reqs = token_to_req.tolist()
        seen = [0] * num_requests
        for r, b in enumerate(reqs):
            if 0 <= b < num_requests:
                rows.append(((r,), b, seen[b], reqs.count(b)))
                seen[b] += 1
            else:
                rows.append(((r,), None, None, None))

    for at, b, i, n_rows in rows:
        picked = []  # (k [Hkv, D], v [Hkv, D]) per visible slot, duplicates included
        if selected_kv_indices is not None:
            for x in selected_kv_indices[at].tolist():
                if 0 <= x < key.shape[0]:
                    picked.append((key[x], value[x]))
        elif b is not None:
            sq = int(seq_lens_q[b]) if seq_lens_q is not None else n_rows
            if seq_lens_q is not None and i >= sq:
                continue  # padded row
            if block_table is not None:
                cap = block_table.shape[1] * key.shape[1]
            elif cu_seqlens_k is not None:
                cap = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            else:
                cap = key.shape[1]
            sk = int(seq_lens_k[b]) if seq_lens_k is not None else cap
            p = int(query_positions[at]) if query_positions is not None else sk - sq + i
            for t in token_indices[at].tolist():
                if t < 0 or t >= cap or t >= sk or t > p:
                    continue
                if block_table is not None:
                    page = int(block_table[b, t // key.shape[1]])
                    if 0 <= page < key.shape[0]:
                        picked.append((key[page, t % key.shape[1]], value[page, t % key.shape[1]]))
                elif cu_seqlens_k is not None:
                    picked.append((key[int(cu_seqlens_k[b]) + t], value[int(cu_seqlens_k[b]) + t]))
                else:
                    picked.append((key[b, t], value[b, t]))
        if not picked:
            continue
        for h in range(hq):
            q = query[at][h].double()
            s = [scale * float(q @ k[h // group].double()) for k, _ in picked]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = sum(e)
            o = sum(w * v[h // group].double() for w, (_, v) in zip(e, picked)) / z
            if gate is not None:
                o = o * torch.sigmoid(gate[at][h].double())
            out[at][h] = o
            lse[at][h] = m + math.log(z)
    return out, lse


def assert_close(out, lse, ref_out, ref_lse, tol=1e-5):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf pattern of lse differs"
    assert (lse[torch.isinf(lse)] < 0).all()
    fin = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=tol, atol=tol)
    assert (out[~fin] == 0).all(), "rows with nothing visible must be exactly 0"
    err = (out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.3e}"


def call(query, key, value, kw, **extra):
    return mate.qsa_sparse_attention(query, key, value, **kw, **extra, return_lse=True, backend="reference")


GEOMETRIES = [(2, 2), (4, 2), (24, 2), (16, 1)]  # GQA groups 1, 2, 12, 16


@pytest.mark.parametrize("hq, hkv", GEOMETRIES, ids=[f"group{a // b}" for a, b in GEOMETRIES])
@pytest.mark.parametrize("q_form, kv_form", list(itertools.product(["padded", "cu_seqlens", "token_to_req"], ["padded", "paged", "varlen"])))
def test_reference_matches_naive_oracle(hq, hkv, q_form, kv_form):
    seed = zlib.crc32(f"{hq},{hkv},{q_form},{kv_form}".encode()) % 10_000
    gen = torch.Generator().manual_seed(seed)
    flags = torch.randint(0, 2, (5,), generator=gen).tolist()
    width = [1, 6, 7, 8, 13, 19][seed % 6]
    reqs = qsa_requests(gen, hq=hq, hkv=hkv, width=width)
    qt, qkw, _ = qsa_query_layout(reqs, q_form, gen)
    key, value, kvkw = qsa_kv_layout(reqs, kv_form, gen, page_size=[1, 3, 4, 16][seed % 4])
    kw = dict(token_indices=qt["token_indices"], **qkw, **kvkw)
    if q_form == "padded" or flags[0]:
        kw["seq_lens_q"] = torch.tensor([r["rows"] for r in reqs], dtype=torch.int32)
    if flags[1]:
        kw["seq_lens_k"] = torch.tensor([r["seq_k"] for r in reqs], dtype=torch.int32)
    if flags[2]:
        kw["query_positions"] = qt["query_positions"]
    if flags[3]:
        kw["gate"] = qt["gate"] if flags[4] else qt["gate"][..., 0]
    if seed % 3 == 0:
        kw["scale"] = 0.3
    out, lse = call(qt["query"], key, value, kw)
    ref_out, ref_lse = naive_attention(qt["query"], key, value, **kw)
    assert_close(out, lse, ref_out, ref_lse)
    assert torch.isinf(lse).any() and torch.isfinite(lse).any(), "a problem with both empty and non-empty rows"


@pytest.mark.parametrize("hq, hkv", GEOMETRIES, ids=[f"group{a // b}" for a, b in GEOMETRIES])
def test_physical_matches_naive_oracle(gen, hq, hkv):
    rows, n, d, width = 9, 23, 16, 11
    q = torch.randn(rows, hq, d, generator=gen)
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    ids = torch.randint(-3, n + 3, (rows, width), generator=gen, dtype=torch.int32)  # negative and past-the-pool ids
    ids[:, 5] = -1
    ids[:, 6] = ids[:, 1]  # duplicates
    ids[2] = -1  # empty row
    ids[3] = torch.tensor([n, n + 7, -2] + [-1] * (width - 3))  # only masked ids
    out, lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    ref_out, ref_lse = naive_attention(q, k, v, selected_kv_indices=ids)
    assert_close(out, lse, ref_out, ref_lse)
    assert torch.isinf(lse[2]).all() and torch.isinf(lse[3]).all() and (out[2:4] == 0).all()


def test_bf16_inputs(gen):
    reqs = qsa_requests(gen, hq=24, hkv=2, d=32, width=15, dtype=torch.bfloat16)
    qt, qkw, _ = qsa_query_layout(reqs, "padded", gen)
    key, value, kvkw = qsa_kv_layout(reqs, "paged", gen, page_size=4)
    kw = dict(token_indices=qt["token_indices"], seq_lens_q=torch.tensor([r["rows"] for r in reqs], dtype=torch.int32),
              gate=qt["gate"][..., 0], **qkw, **kvkw)
    out, lse = call(qt["query"], key, value, kw)
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse = naive_attention(qt["query"], key, value, **kw)
    assert_close(out.float(), lse, ref_out, ref_lse, tol=1e-2)


def test_defaults_are_bottom_right():
    """Without positions, the last real row of a request sits at Sk - 1 and row i at Sk - Sq + i."""
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    tok = torch.arange(6, dtype=torch.int32).expand(1, 3, 6)
    _, lse = mate.qsa_sparse_attention(q, k, v, tok, return_lse=True, backend="reference")
    logits = torch.einsum("bqhd,bkhd->bqhk", q, k) / math.sqrt(8)
    for i in range(3):
        expect = torch.logsumexp(logits[0, i, :, : 3 + i + 1], -1)  # row i at position 3 + i
        torch.testing.assert_close(lse[0, i], expect)
    # seq_lens_k shortens the cache, seq_lens_q marks rows 2.. as padding
    out, lse = mate.qsa_sparse_attention(q, k, v, tok, seq_lens_k=torch.tensor([4], dtype=torch.int32),
                                         seq_lens_q=torch.tensor([2], dtype=torch.int32), return_lse=True, backend="reference")
    for i in range(2):
        torch.testing.assert_close(lse[0, i], torch.logsumexp(logits[0, i, :, : 2 + i + 1], -1))
    assert torch.isinf(lse[0, 2]).all() and (out[0, 2] == 0).all()


# ---------------------------------------------------------------- layouts agree


def test_layouts_agree(gen):
    reqs = qsa_requests(gen, n_req=4, hq=24, hkv=2, d=16, width=11)
    lens = dict(seq_lens_q=torch.tensor([r["rows"] for r in reqs], dtype=torch.int32),
                seq_lens_k=torch.tensor([r["seq_k"] for r in reqs], dtype=torch.int32))
    results = {}
    for q_form, kv_form, page_size in [("padded", "padded", None), ("padded", "paged", 1), ("cu_seqlens", "paged", 3),
                                       ("token_to_req", "paged", 4), ("cu_seqlens", "paged", 16), ("padded", "varlen", None),
                                       ("token_to_req", "varlen", None), ("cu_seqlens", "padded", None)]:
        qt, qkw, rows = qsa_query_layout(reqs, q_form, gen)
        key, value, kvkw = qsa_kv_layout(reqs, kv_form, gen, page_size=page_size or 4)
        gate = qt["gate"][..., 0]
        out, lse = call(qt["query"], key, value, dict(token_indices=qt["token_indices"], gate=gate, **qkw, **kvkw, **lens))
        hq, d = out.shape[-2:]
        # the real rows, in request order
        results[(q_form, kv_form, page_size)] = (out.reshape(-1, hq, d)[rows], lse.reshape(-1, hq)[rows], gate.reshape(-1, hq)[rows])
    q, k, v, ids = qsa_physical_layout(reqs, lens)
    first_gate = next(iter(results.values()))[2]
    out, lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    results["physical"] = (out * torch.sigmoid(first_gate).unsqueeze(-1), lse, first_gate)
    base_out, base_lse, _ = results[("padded", "padded", None)]
    assert torch.isinf(base_lse).any() and torch.isfinite(base_lse).any()
    for name, (out, lse, _) in results.items():
        assert torch.equal(torch.isinf(lse), torch.isinf(base_lse)), name
        torch.testing.assert_close(out, base_out, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        fin = torch.isfinite(base_lse)
        torch.testing.assert_close(lse[fin], base_lse[fin], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_positions_agree_across_layouts(gen):
    """Explicit query_positions give the same answer whichever way the rows are laid out."""
    reqs = qsa_requests(gen, n_req=3, hq=4, hkv=1, d=8, width=9)
    outs = []
    for q_form in ("padded", "cu_seqlens", "token_to_req"):
        qt, qkw, rows = qsa_query_layout(reqs, q_form, gen)
        key, value, kvkw = qsa_kv_layout(reqs, "paged", gen, page_size=2)
        kw = dict(token_indices=qt["token_indices"], query_positions=qt["query_positions"], **qkw, **kvkw)
        if q_form == "padded":
            kw["seq_lens_q"] = torch.tensor([r["rows"] for r in reqs], dtype=torch.int32)
        out, lse = call(qt["query"], key, value, kw)
        outs.append((out.reshape(-1, 4, 8)[rows], lse.reshape(-1, 4)[rows]))
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0])
        assert torch.equal(torch.isinf(lse), torch.isinf(outs[0][1]))


# ---------------------------------------------------------------- options


def small(gen, b=2, q=5, hq=4, hkv=2, d=8, s=9, width=7):
    query = torch.randn(b, q, hq, d, generator=gen)
    key, value = torch.randn(b, s, hkv, d, generator=gen), torch.randn(b, s, hkv, d, generator=gen)
    tok = torch.randint(-1, s, (b, q, width), generator=gen, dtype=torch.int32)
    return query, key, value, tok


def test_schedule_options_and_block_hint_are_result_neutral(gen):
    query, key, value, _ = small(gen, width=11)
    tok = torch.randint(-1, 9, (2, 5, 11), generator=gen, dtype=torch.int32)
    blocks = torch.randint(-1, 3, (2, 5, 2), generator=gen, dtype=torch.int32)  # 11 == 4 * 2 + 3
    base = mate.qsa_sparse_attention(query, key, value, tok, return_lse=True, backend="reference")
    for kw in [dict(num_splits=1), dict(num_splits=7), dict(num_splits=None, warp_specialized=True),
               dict(block_indices=blocks), dict(block_indices=blocks, assume_compact_blocks=True),
               dict(compute_dtype=None), dict(k_scale=1, v_scale=1.0)]:
        out, lse = mate.qsa_sparse_attention(query, key, value, tok, return_lse=True, backend="reference", **kw)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), kw


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_reference_dequantizes_exactly(gen, kv_dtype, q_dtype):
    """FP8 K/V with float or tensor scales: the reference equals its own run on the FP32 dequantized cache
    (value x scale), bit for bit; the query's dtype is the output's."""
    query, key, value, tok = small(gen)
    q = query.to(q_dtype)
    k8, v8 = (key * 30).to(kv_dtype), (value * 20).to(kv_dtype)
    ref = mate.qsa_sparse_attention(q.float(), k8.float() * 0.03, v8.float() * 0.05, tok, return_lse=True, backend="reference")
    for ks, vs in [(0.03, 0.05), (torch.tensor(0.03), torch.tensor([0.05]))]:
        out, lse = mate.qsa_sparse_attention(q, k8, v8, tok, k_scale=ks, v_scale=vs, return_lse=True, backend="reference")
        assert out.dtype == q_dtype
        assert torch.equal(out, ref[0].to(q_dtype)) and torch.equal(lse, ref[1])


def test_compute_dtype_is_the_inputs_dtype(gen):
    """None (default) means the inputs' dtype; an explicit compute_dtype must be that dtype."""
    query, key, value, tok = small(gen)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
        base = mate.qsa_sparse_attention(q, k, v, tok, backend="reference")
        assert torch.equal(mate.qsa_sparse_attention(q, k, v, tok, compute_dtype=dtype, backend="reference"), base)
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        with pytest.raises(ValueError, match="compute_dtype.*differs"):
            mate.qsa_sparse_attention(q, k, v, tok, compute_dtype=other, backend="reference")
    with pytest.raises(ValueError, match="compute_dtype.*differs"):  # float32 inputs take None only
        mate.qsa_sparse_attention(query, key, value, tok, compute_dtype=torch.bfloat16, backend="reference")


def test_block_hint_widths(gen):
    query, key, value, _ = small(gen)
    for nb in (1, 512):
        tok = torch.full((2, 5, 4 * nb + 3), -1, dtype=torch.int32)
        tok[..., 0] = 0
        mate.qsa_sparse_attention(query, key, value, tok, block_indices=torch.zeros(2, 5, nb, dtype=torch.int32), backend="reference")
    # token-only selections may be wider than the block-hint maximum of 2051
    tok = torch.randint(-1, 9, (2, 5, 2055), generator=gen, dtype=torch.int32)
    out, lse = mate.qsa_sparse_attention(query, key, value, tok, return_lse=True, backend="reference")
    ref_out, ref_lse = naive_attention(query, key, value, tok)
    assert_close(out, lse, ref_out, ref_lse)


def test_scale_aliases(gen):
    query, key, value, tok = small(gen)
    a = mate.qsa_sparse_attention(query, key, value, tok, scale=0.2, backend="reference")
    b = mate.qsa_sparse_attention(query, key, value, tok, softmax_scale=0.2, backend="reference")
    c = mate.qsa_sparse_attention(query, key, value, tok, backend="reference")
    d = mate.qsa_sparse_attention(query, key, value, tok, scale=8**-0.5, backend="reference")
    assert torch.equal(a, b) and torch.equal(c, d) and not torch.equal(a, c)


def test_gate_shapes(gen):
    query, key, value, tok = small(gen)
    plain = mate.qsa_sparse_attention(query, key, value, tok, backend="reference")
    g_head = torch.randn(2, 5, 4, generator=gen)
    g_elem = torch.randn(2, 5, 4, 8, generator=gen)
    torch.testing.assert_close(mate.qsa_sparse_attention(query, key, value, tok, gate=g_head, backend="reference"),
                               plain * torch.sigmoid(g_head).unsqueeze(-1))
    torch.testing.assert_close(mate.qsa_sparse_attention(query, key, value, tok, gate=g_elem, backend="reference"),
                               plain * torch.sigmoid(g_elem))


def test_out_buffer_is_returned_and_surroundings_untouched(gen):
    query, key, value, tok = small(gen)
    ref, ref_lse = mate.qsa_sparse_attention(query, key, value, tok, return_lse=True, backend="reference")
    store = torch.full((3, 7, 6, 10), float("nan"))
    out = store[1:, 1:6, 1:5, 1:9]  # a strided view inside NaN storage
    got, got_lse = mate.qsa_sparse_attention(query, key, value, tok, out=out, return_lse=True, backend="reference")
    assert got is out and torch.equal(out, ref) and torch.equal(got_lse, ref_lse)
    mask = torch.ones_like(store, dtype=torch.bool)
    mask[1:, 1:6, 1:5, 1:9] = False
    assert torch.isnan(store[mask]).all()
    out_t = torch.empty(2, 4, 5, 8).transpose(1, 2)  # positive non-contiguous strides
    assert mate.qsa_sparse_attention(query, key, value, tok, out=out_t, backend="reference") is out_t
    assert torch.equal(out_t, ref)


def test_physical_out_and_lse_buffers(gen):
    rows, n = 6, 10
    q, k, v = torch.randn(rows, 4, 8, generator=gen), torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)
    ids = torch.randint(-1, n + 2, (rows, 5), generator=gen, dtype=torch.int32)
    ids[0] = -1
    ref, ref_lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    out = torch.full((rows, 4, 8), float("nan"))
    lse_store = torch.full((rows, 5), float("nan"))
    lse = lse_store[:, :4]
    got = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, out=out, lse=lse, backend="reference")
    assert got is out and torch.equal(out, ref)  # return_lse=False: the output alone, lse still written
    assert torch.equal(lse, ref_lse) and torch.isinf(lse[0]).all() and torch.isnan(lse_store[:, 4]).all()
    got, got_lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, lse=lse, return_lse=True, backend="reference")
    assert got_lse is lse and torch.equal(got, ref)


def test_flattened_rows_outside_requests(gen):
    """Rows past cu_seqlens_q[-1] and rows whose token_to_req is out of range belong to no request: 0 and -inf."""
    q, k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(1, 6, 1, 8, generator=gen), torch.randn(1, 6, 1, 8, generator=gen)
    tok = torch.zeros(5, 3, dtype=torch.int32)
    out, lse = mate.qsa_sparse_attention(q, k, v, tok, cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                                         return_lse=True, backend="reference")
    assert torch.isfinite(lse[:3]).all() and torch.isinf(lse[3:]).all() and (out[3:] == 0).all()
    out, lse = mate.qsa_sparse_attention(q, k, v, tok, token_to_req=torch.tensor([0, -1, 0, 1, 0], dtype=torch.int32),
                                         num_requests=1, return_lse=True, backend="reference")
    assert torch.isinf(lse[[1, 3]]).all() and torch.isfinite(lse[[0, 2, 4]]).all()


def test_empty_inputs(gen):
    q, k, v = torch.randn(0, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out, lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=torch.zeros(0, 4, dtype=torch.int32), return_lse=True, backend="reference")
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)
    query, key, value, _ = small(gen)
    out, lse = mate.qsa_sparse_attention(query, key, value, torch.zeros(2, 5, 0, dtype=torch.int32), return_lse=True, backend="reference")
    assert (out == 0).all() and torch.isinf(lse).all()
    out, lse = mate.qsa_sparse_attention(query, key[:, :0], value[:, :0], torch.zeros(2, 5, 3, dtype=torch.int32),
                                         return_lse=True, backend="reference")
    assert (out == 0).all() and torch.isinf(lse).all()


# ---------------------------------------------------------------- errors


def bf(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def i32(*shape, fill=0):
    return torch.full(shape, fill, dtype=torch.int32)


def base_logical():
    """A valid logical call: padded query [2, 4, 4, 8], padded K/V [2, 6, 2, 8], width 7."""
    return (bf(2, 4, 4, 8), bf(2, 6, 2, 8), bf(2, 6, 2, 8)), dict(token_indices=i32(2, 4, 7), backend="reference")


def base_flat():
    return (bf(6, 4, 8), bf(2, 6, 2, 8), bf(2, 6, 2, 8)), dict(token_indices=i32(6, 7), cu_seqlens_q=i32(3), backend="reference")


def base_paged():
    return (bf(2, 4, 4, 8), bf(5, 4, 2, 8), bf(5, 4, 2, 8)), dict(token_indices=i32(2, 4, 7), block_table=i32(2, 3), backend="reference")


def base_physical():
    return (bf(6, 4, 8), bf(10, 2, 8), bf(10, 2, 8)), dict(selected_kv_indices=i32(6, 5), backend="reference")


BASES = dict(logical=base_logical, flat=base_flat, paged=base_paged, physical=base_physical)


def _qkv(base, q=..., k=..., v=...):
    (q0, k0, v0), kw = BASES[base]()
    return (q0 if q is ... else q, k0 if k is ... else k, v0 if v is ... else v), kw


# (exception, text the message must contain, base call, args override, kwargs override)
FP8_KV = dict(k=bf(2, 6, 2, 8).to(torch.float8_e4m3fn), v=bf(2, 6, 2, 8).to(torch.float8_e4m3fn))  # a valid FP8 cache

ERRORS = [
    # Python types and metadata dtypes
    (TypeError, "query", "logical", dict(q=[1.0]), {}),
    (TypeError, "key", "logical", dict(k=None), {}),
    (TypeError, "value", "logical", dict(v=torch.zeros(2, 6, 2, 8, dtype=torch.int32)), {}),
    (TypeError, "token_indices", "logical", {}, dict(token_indices=torch.zeros(2, 4, 7, dtype=torch.int64))),
    (TypeError, "block_indices", "logical", {}, dict(block_indices=torch.zeros(2, 4, 1, dtype=torch.int64))),
    (TypeError, "cu_seqlens_q", "flat", {}, dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int64))),
    (TypeError, "token_to_req", "flat", {}, dict(cu_seqlens_q=None, token_to_req=torch.zeros(6), num_requests=2)),
    (TypeError, "num_requests", "flat", {}, dict(cu_seqlens_q=None, token_to_req=i32(6), num_requests=2.0)),
    (TypeError, "cu_seqlens_k", "logical", dict(k=bf(12, 2, 8), v=bf(12, 2, 8)), dict(cu_seqlens_k=torch.zeros(3, dtype=torch.int64))),
    (TypeError, "seq_lens_q", "logical", {}, dict(seq_lens_q=torch.zeros(2, dtype=torch.int64))),
    (TypeError, "seq_lens_k", "logical", {}, dict(seq_lens_k=torch.zeros(2))),
    (TypeError, "query_positions", "logical", {}, dict(query_positions=torch.zeros(2, 4, dtype=torch.int64))),
    (TypeError, "block_table", "paged", {}, dict(block_table=torch.zeros(2, 3, dtype=torch.int64))),
    (TypeError, "page_size", "paged", {}, dict(page_size=4.0)),
    (TypeError, "selected_kv_indices", "physical", {}, dict(selected_kv_indices=torch.zeros(6, 5, dtype=torch.int64))),
    (TypeError, "scale", "logical", {}, dict(scale="0.1")),
    (TypeError, "softmax_scale", "logical", {}, dict(softmax_scale=[0.1])),
    (TypeError, "gate", "logical", {}, dict(gate=[[0.0]])),
    (TypeError, "gate", "logical", {}, dict(gate=torch.zeros(2, 4, 4, dtype=torch.int32))),
    (TypeError, "num_splits", "logical", {}, dict(num_splits=2.0)),
    (TypeError, "return_lse", "logical", {}, dict(return_lse=1)),
    (TypeError, "warp_specialized", "logical", {}, dict(warp_specialized="yes")),
    (TypeError, "assume_compact_blocks", "logical", {}, dict(assume_compact_blocks=None)),
    (TypeError, "backend", "logical", {}, dict(backend=None)),
    (TypeError, "out", "logical", {}, dict(out=[0.0])),
    (TypeError, "lse", "physical", {}, dict(lse="buffer")),
    (TypeError, "k_scale", "logical", {}, dict(k_scale="1")),
    (TypeError, "v_scale", "logical", {}, dict(v_scale=True)),
    (TypeError, "compute_dtype", "logical", {}, dict(compute_dtype="bfloat16")),
    # backend
    (ValueError, "backend", "logical", {}, dict(backend="auto")),
    (ValueError, "backend", "logical", {}, dict(backend="torch")),
    # dtypes, FP8, scales
    (ValueError, "key", "logical", dict(k=bf(2, 6, 2, 8).to(torch.float8_e4m3fn)), {}),
    (ValueError, "FP8", "logical", dict(v=bf(2, 6, 2, 8).to(torch.float8_e5m2)), {}),
    (ValueError, "query", "logical", dict(q=bf(2, 4, 4, 8).to(torch.float8_e4m3fn)), {}),
    (ValueError, "compute_dtype", "logical", {}, dict(compute_dtype=torch.float8_e4m3fn)),
    (ValueError, "compute_dtype", "logical", {}, dict(compute_dtype=torch.float32)),
    (ValueError, "k_scale", "logical", {}, dict(k_scale=0.5)),
    (ValueError, "v_scale", "logical", {}, dict(v_scale=2.0)),
    # FP8 K/V (issue 38): the scales' rules, two FP8 kinds, a tensor scale on a 16-bit cache
    (ValueError, "float8_e4m3fn or float8_e5m2", "logical", dict(k=bf(2, 6, 2, 8).to(torch.float8_e4m3fn), v=bf(2, 6, 2, 8).to(torch.float8_e5m2)), {}),
    (ValueError, "k_scale", "logical", FP8_KV, dict(k_scale=0.0)),
    (ValueError, "k_scale", "logical", FP8_KV, dict(k_scale=-0.5)),
    (ValueError, "v_scale", "logical", FP8_KV, dict(v_scale=float("nan"))),
    (ValueError, "v_scale", "logical", FP8_KV, dict(v_scale=float("inf"))),
    (TypeError, "k_scale", "logical", FP8_KV, dict(k_scale=torch.tensor([0.5], dtype=torch.float64))),
    (ValueError, "k_scale", "logical", FP8_KV, dict(k_scale=torch.tensor([0.5, 0.5]))),
    (ValueError, "v_scale", "logical", FP8_KV, dict(v_scale=torch.ones(1, 1))),
    (ValueError, "k_scale", "logical", FP8_KV, dict(k_scale=torch.tensor(float("nan")))),  # its value, read by the reference
    (ValueError, "v_scale", "logical", FP8_KV, dict(v_scale=torch.tensor([-1.0]))),
    (ValueError, "tensor applies to FP8", "logical", {}, dict(k_scale=torch.tensor([1.0]))),
    (TypeError, "k_scale", "logical", FP8_KV, dict(k_scale="0.5")),
    (ValueError, "FP8 compute", "logical", FP8_KV, dict(compute_dtype=torch.float8_e4m3fn)),
    (ValueError, "dtype", "logical", dict(k=bf(2, 6, 2, 8).half()), {}),
    (ValueError, "value", "logical", dict(v=bf(2, 6, 2, 8).float()), {}),
    (ValueError, "softmax_scale", "logical", {}, dict(scale=0.1, softmax_scale=0.1)),
    (ValueError, "scale", "logical", {}, dict(scale=0.0)),
    (ValueError, "softmax_scale", "logical", {}, dict(softmax_scale=float("inf"))),
    # shapes of Q/K/V
    (ValueError, "query", "logical", dict(q=bf(4, 4, 8)[0]), {}),
    (ValueError, "key", "logical", dict(k=bf(2, 6, 2, 16), v=bf(2, 6, 2, 16)), {}),
    (ValueError, "value", "logical", dict(v=bf(2, 5, 2, 8)), {}),
    (ValueError, "heads", "logical", dict(k=bf(2, 6, 3, 8), v=bf(2, 6, 3, 8)), {}),
    (ValueError, "key", "logical", dict(k=bf(3, 6, 2, 8), v=bf(3, 6, 2, 8)), {}),
    (ValueError, "key", "logical", dict(k=bf(12, 2, 8), v=bf(12, 2, 8)), {}),
    # query layout and requests
    (ValueError, "cu_seqlens_q", "logical", {}, dict(cu_seqlens_q=i32(3))),
    (ValueError, "token_to_req", "logical", {}, dict(token_to_req=i32(2, 4))),
    (ValueError, "num_requests", "logical", {}, dict(num_requests=3)),
    (ValueError, "cu_seqlens_q", "flat", {}, dict(cu_seqlens_q=None)),
    (ValueError, "cu_seqlens_q", "flat", {}, dict(token_to_req=i32(6), num_requests=2)),
    (ValueError, "cu_seqlens_q", "flat", {}, dict(cu_seqlens_q=i32(1))),
    (ValueError, "num_requests", "flat", {}, dict(num_requests=3)),
    (ValueError, "num_requests", "flat", {}, dict(cu_seqlens_q=None, token_to_req=i32(6))),
    (ValueError, "num_requests", "flat", {}, dict(cu_seqlens_q=None, token_to_req=i32(6), num_requests=0)),
    (ValueError, "token_to_req", "flat", {}, dict(cu_seqlens_q=None, token_to_req=i32(5), num_requests=2)),
    (ValueError, "key", "flat", dict(k=bf(3, 6, 2, 8), v=bf(3, 6, 2, 8)), {}),
    # indices and the block hint
    (ValueError, "token_indices", "logical", {}, dict(token_indices=None)),
    (ValueError, "token_indices", "logical", {}, dict(token_indices=i32(2, 3, 7))),
    (ValueError, "token_indices", "logical", {}, dict(token_indices=i32(8, 7))),
    (ValueError, "token_indices", "flat", {}, dict(token_indices=i32(2, 3, 7))),
    (ValueError, "block_indices", "logical", {}, dict(block_indices=i32(2, 4, 2))),  # 7 != 4 * 2 + 3
    (ValueError, "token_indices width", "logical", {}, dict(token_indices=i32(2, 4, 8), block_indices=i32(2, 4, 1))),
    (ValueError, "block_indices", "logical", {}, dict(token_indices=i32(2, 4, 3), block_indices=i32(2, 4, 0))),
    (ValueError, "block_indices", "logical", {}, dict(token_indices=i32(2, 4, 2055), block_indices=i32(2, 4, 513))),
    (ValueError, "block_indices", "logical", {}, dict(block_indices=i32(2, 3, 1))),
    (ValueError, "block_indices", "logical", {}, dict(block_indices=i32(2, 4))),
    (ValueError, "assume_compact_blocks", "logical", {}, dict(assume_compact_blocks=True)),
    # K/V layouts and lengths
    (ValueError, "block_table", "paged", {}, dict(block_table=i32(3, 3))),
    (ValueError, "block_table", "paged", {}, dict(block_table=i32(6))),
    (ValueError, "page_size", "paged", {}, dict(page_size=8)),
    (ValueError, "page_size", "paged", {}, dict(page_size=0)),
    (ValueError, "page_size", "logical", {}, dict(page_size=6)),
    (ValueError, "paged key", "paged", dict(k=bf(20, 2, 8), v=bf(20, 2, 8)), {}),
    (ValueError, "page size", "paged", dict(k=bf(5, 0, 2, 8), v=bf(5, 0, 2, 8)), {}),
    (ValueError, "cu_seqlens_k", "paged", {}, dict(cu_seqlens_k=i32(3))),
    (ValueError, "cu_seqlens_k", "logical", dict(k=bf(12, 2, 8), v=bf(12, 2, 8)), dict(cu_seqlens_k=i32(4))),
    (ValueError, "cu_seqlens_k", "logical", {}, dict(cu_seqlens_k=i32(3))),
    (ValueError, "seq_lens_q", "logical", {}, dict(seq_lens_q=i32(3))),
    (ValueError, "seq_lens_k", "flat", {}, dict(seq_lens_k=i32(2, 1))),
    (ValueError, "query_positions", "logical", {}, dict(query_positions=i32(2, 5))),
    (ValueError, "query_positions", "flat", {}, dict(query_positions=i32(2, 3))),
    # gate
    (ValueError, "gate", "logical", {}, dict(gate=bf(2, 4, 4, 1))),
    (ValueError, "gate", "flat", {}, dict(gate=bf(6, 4, 8, 1))),
    # physical ids exclude logical metadata and gating
    (ValueError, "token_indices", "physical", {}, dict(token_indices=i32(6, 5))),
    (ValueError, "block_indices", "physical", {}, dict(block_indices=i32(6, 1))),
    (ValueError, "cu_seqlens_q", "physical", {}, dict(cu_seqlens_q=i32(3))),
    (ValueError, "token_to_req", "physical", {}, dict(token_to_req=i32(6))),
    (ValueError, "num_requests", "physical", {}, dict(num_requests=1)),
    (ValueError, "cu_seqlens_k", "physical", {}, dict(cu_seqlens_k=i32(2))),
    (ValueError, "seq_lens_q", "physical", {}, dict(seq_lens_q=i32(1))),
    (ValueError, "seq_lens_k", "physical", {}, dict(seq_lens_k=i32(1))),
    (ValueError, "query_positions", "physical", {}, dict(query_positions=i32(6))),
    (ValueError, "block_table", "physical", {}, dict(block_table=i32(1, 1))),
    (ValueError, "page_size", "physical", {}, dict(page_size=4)),
    (ValueError, "gate", "physical", {}, dict(gate=bf(6, 4))),
    (ValueError, "assume_compact_blocks", "physical", {}, dict(assume_compact_blocks=True)),
    (ValueError, "selected_kv_indices", "physical", dict(q=bf(2, 3, 4, 8)), {}),
    (ValueError, "selected_kv_indices", "physical", dict(k=bf(5, 2, 2, 8), v=bf(5, 2, 2, 8)), {}),
    (ValueError, "selected_kv_indices", "physical", {}, dict(selected_kv_indices=i32(5, 5))),
    (ValueError, "selected_kv_indices", "physical", {}, dict(selected_kv_indices=i32(6))),
    (ValueError, "lse", "logical", {}, dict(lse=torch.zeros(2, 4, 4))),
    # out and lse buffers
    (ValueError, "out", "logical", {}, dict(out=bf(2, 4, 4, 9))),
    (ValueError, "out", "logical", {}, dict(out=torch.zeros(2, 4, 4, 8))),
    (ValueError, "out", "logical", {}, dict(out=bf(1, 4, 4, 8).expand(2, 4, 4, 8))),  # stride 0: not writable element-wise
    (ValueError, "out", "logical", {}, dict(out=bf(2, 4, 1, 8).expand(2, 4, 4, 8))),
    (ValueError, "out", "logical", {}, dict(out=bf(2, 4, 4, 16).as_strided((2, 4, 4, 8), (128, 32, 4, 1)))),
    (ValueError, "lse", "physical", {}, dict(lse=torch.zeros(6, 5))),
    (ValueError, "lse", "physical", {}, dict(lse=torch.zeros(6, 4, dtype=torch.float64))),
    (ValueError, "lse", "physical", {}, dict(lse=torch.zeros(1, 4).expand(6, 4))),
]


@pytest.mark.parametrize("exc, text, base, args, kwargs", ERRORS, ids=[f"{e.__name__}-{t}-{i}" for i, (e, t, *_) in enumerate(ERRORS)])
def test_errors(exc, text, base, args, kwargs):
    (q, k, v), kw = _qkv(base, **args)
    kw.update(kwargs)
    kw = {n: x for n, x in kw.items() if x is not None or n in ("backend", "assume_compact_blocks")}
    with pytest.raises(exc, match=text):
        mate.qsa_sparse_attention(q, k, v, **kw)


def test_overlap_errors():
    (q, k, v), kw = base_logical()
    with pytest.raises(ValueError, match="out overlaps query"):
        mate.qsa_sparse_attention(q, k, v, **kw, out=q)
    store = bf(2, 6, 2, 8 * 3)
    kk, vv = store[..., :8], store[..., 8:16]
    with pytest.raises(ValueError, match="out overlaps key"):
        mate.qsa_sparse_attention(q, kk, vv, **kw, out=store.view(-1)[: 2 * 4 * 4 * 8].view(2, 4, 4, 8))
    g = torch.zeros(2, 4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out overlaps gate"):
        mate.qsa_sparse_attention(q, k, v, **kw, gate=g, out=g)
    with pytest.raises(ValueError, match="out overlaps token_indices"):
        tok = torch.zeros(2 * 4 * 4 * 8, dtype=torch.bfloat16)
        mate.qsa_sparse_attention(q, k, v, token_indices=tok.view(torch.int32)[: 2 * 4 * 7].view(2, 4, 7), out=tok.view(2, 4, 4, 8), backend="reference")
    (q, k, v), kw = base_physical()
    buf = torch.zeros(6 * 4 * 8 * 2)
    with pytest.raises(ValueError, match="lse"):
        mate.qsa_sparse_attention(q, k, v, **kw, out=buf.view(torch.bfloat16)[: 6 * 4 * 8].view(6, 4, 8), lse=buf[:24].view(6, 4))
    with pytest.raises(ValueError, match="lse overlaps selected_kv_indices"):
        ids = torch.zeros(6, 5, dtype=torch.int32)
        mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, lse=ids.view(torch.float32)[:, :4], backend="reference")


def test_reference_rejects_broken_offsets():
    q, k, v = torch.randn(4, 2, 8), torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 8)
    tok = torch.zeros(4, 3, dtype=torch.int32)
    for cu in ([0, 3, 2], [0, 2, 5], [-1, 2, 4]):
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            mate.qsa_sparse_attention(q, k, v, tok, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), backend="reference")
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        mate.qsa_sparse_attention(q, k[0], v[0], tok, cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 4, 6], dtype=torch.int32), backend="reference")


# ---------------------------------------------------------------- the native path's limits (checked before any device)


def native_call(q, k, v, **kw):
    return mate.qsa_sparse_attention(q, k, v, **kw)


def test_native_limits():
    tok = i32(1, 2, 7)
    q, k = bf(1, 2, 24, 256), bf(1, 8, 2, 256)
    with pytest.raises(ValueError, match="cu_seqlens_k.*reference"):
        native_call(q, bf(8, 2, 256), bf(8, 2, 256), token_indices=tok, cu_seqlens_k=i32(2))
    with pytest.raises(ValueError, match="bfloat16 and float16 query"):
        native_call(q.float(), k.float(), k.float(), token_indices=tok)
    with pytest.raises(ValueError, match="head dim 256"):
        native_call(bf(1, 2, 24, 128), bf(1, 8, 2, 128), bf(1, 8, 2, 128), token_indices=tok)
    with pytest.raises(ValueError, match="groups up to 16"):
        native_call(bf(1, 2, 24, 256), bf(1, 8, 1, 256), bf(1, 8, 1, 256), token_indices=tok)
    with pytest.raises(ValueError, match="num_splits"):
        native_call(q, k, k, token_indices=tok, num_splits=2)
    with pytest.raises(ValueError, match="paged"):
        native_call(bf(2, 24, 256), k, k, token_indices=i32(2, 7), cu_seqlens_q=i32(2))
    with pytest.raises(ValueError, match="warp_specialized"):
        native_call(bf(1, 2, 16, 256), k, k, token_indices=tok, warp_specialized=True)
    with pytest.raises(ValueError, match="selected_kv_indices.*bfloat16"):
        native_call(bf(2, 24, 256).half(), bf(8, 2, 256).half(), bf(8, 2, 256).half(), selected_kv_indices=i32(2, 7))


def test_native_rejects_cpu_tensors_and_names_targets():
    with pytest.raises(ValueError, match="sm90"):
        native_call(bf(1, 2, 24, 256), bf(1, 8, 2, 256), bf(1, 8, 2, 256), token_indices=i32(1, 2, 7))


def test_row_chunking_is_result_neutral(gen, monkeypatch):
    """The reference gathers K/V a few rows at a time under a memory budget; chunk boundaries change nothing."""
    from mate.qsa import reference

    reqs = qsa_requests(gen, n_req=3, hq=4, hkv=2, d=8, width=9)
    qt, qkw, _ = qsa_query_layout(reqs, "cu_seqlens", gen)
    key, value, kvkw = qsa_kv_layout(reqs, "paged", gen, page_size=3)
    kw = dict(token_indices=qt["token_indices"], gate=qt["gate"], **qkw, **kvkw)
    whole = call(qt["query"], key, value, kw)
    monkeypatch.setattr(reference, "_GATHER_BUDGET", 2 * 9 * 2 * 8)  # two rows per chunk
    chunked = call(qt["query"], key, value, kw)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_split_heuristic_fills_one_wave():
    """num_splits=None on 132 SMs, 2051 tokens (33 tiles): the split counts the H200 sweep favoured."""
    from mate.qsa.attention import choose_splits

    assert [choose_splits(rows * 2, 33, 132) for rows in (1, 8, 64, 96, 256, 512, 4096)] == [16, 8, 1, 2, 2, 2, 1]
    assert choose_splits(1, 1, 132) == 1  # one tile is never split


def test_small_cta_family_from_half_a_wave_of_row_heads():
    """family() on 132 SMs: issue 37's decode rows 1 and 8 (2, 16 row-heads) stay on the wgmma family, rows 64 and
    256 and prefill (128, 512, 8192) take the small-CTA one."""
    from mate.qsa.attention import family

    assert [family(n, 132) for n in (2, 16, 66, 67, 128, 512, 8192)] == ["wgmma"] * 3 + ["warp"] * 4


def test_small_cta_family_only_on_caches_its_int32_offsets_reach():
    """warp_offsets_fit on meta views (no memory): a row offset of 2^31 x 8 elements or more leaves the small-CTA
    family, whichever dim or stride makes it; an empty view fits."""
    from mate.qsa.attention import warp_offsets_fit

    def view(shape, stride):
        return torch.empty(1, device="meta", dtype=torch.bfloat16).as_strided(shape, stride)

    page = 64 * 2 * 256  # elements of one [64, 2, 256] page
    last = 2**34 // page  # pages below 2^34 elements: the last row starts 512 elements short of 2^34
    fits, too_far = view((last, 64, 2, 256), (page, 512, 256, 1)), view((last + 1, 64, 2, 256), (page, 512, 256, 1))
    assert warp_offsets_fit(fits, fits) and not warp_offsets_fit(fits, too_far) and not warp_offsets_fit(too_far, fits)
    assert not warp_offsets_fit(view((2, 64, 2, 256), (2**34, 512, 256, 1)))  # a page stride alone
    assert warp_offsets_fit(view((0, 64, 2, 256), (page, 512, 256, 1)))



def test_small_cta_splits_fill_one_wave():
    """warp_splits on 132 SMs at 5 resident CTAs (a wave of 660), 129 tiles (2051 tokens of 16): the most splits
    of one wave, of 4 tiles or more (MIN_SPLIT_TILES, the last fewer); past a wave 2 splits only where they end
    at least 10% sooner."""
    from mate.qsa.attention import warp_splits
    from mate.qsa.kernels import sparse_card

    assert [warp_splits(n, 129, 132, 5) for n in (2, 16, 20, 21, 128, 512, 660)] == [33, 33, 33, 31, 5, 1, 1]
    # 8192 row-heads (prefill): 13 waves in one split, 12.5 in two (4% sooner); 1980 = 3 waves either way; 700: 2
    # or 1.5 (25% sooner); 1400: 3 or 2.5 (17%)
    assert [warp_splits(n, 129, 132, 5) for n in (8192, 1980, 700, 1400)] == [1, 1, 2, 2]
    assert warp_splits(8192, 1, 132, 5) == 1 and warp_splits(2, 3, 132, 5) == 1 and warp_splits(2, 9, 132, 5) == 3
    # the shipped 16-token, 2-stage ring: 44032 B of shared memory (ptxas: 40960 dynamic + 3072 static), 5 CTAs an SM
    tiles = dict(block_n=16, num_stages=2)
    assert sparse_card.warp_attention_smem({"dtype": "bfloat16"}, tiles) == 44032
    assert _hopper.SMEM_PER_SM // (44032 + _hopper.SMEM_RESERVED_PER_CTA) == 5
    assert sparse_card.WARP_ATTENTION.limits({"dtype": "bfloat16", "split": 1}, tiles) is None
    assert "outlive" in sparse_card.WARP_ATTENTION.limits({"dtype": "bfloat16", "split": 1}, dict(block_n=64, num_stages=4))


def test_cluster_launch_only_where_every_cluster_runs_at_once():
    """cluster_splits on 33 tiles with the H200's co-resident whole-SM clusters (as its probe answered)."""
    from mate.qsa.attention import cluster_splits, split_tiles

    fits = [132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7]  # clusters of 1..16 (test_qsa_attention_gpu)
    h200 = lambda c: fits[c - 1] if 1 <= c <= 16 else 0  # noqa: E731
    assert split_tiles(33, 16) == (3, 11) and split_tiles(33, 7) == (5, 7) and split_tiles(33, 6) == (6, 6)
    # chosen (num_splits=None): rows 1 (2 clusters) keep 11 splits; rows 8 (16 clusters) drop from 7 to 6
    # splits (5 -> 6 tiles a split: 15 clusters of 7 fit); rows 16 (32) would drop from 4 to 3 (9 -> 11 tiles)
    assert [cluster_splits(n, 33, s, True, h200) for n, s in ((2, 11), (16, 7), (32, 4))] == [11, 6, 0]
    assert cluster_splits(16, 33, 11, True, h200) == 0  # 11 splits -> 6 would cost 3 tiles a split
    assert cluster_splits(66, 33, 2, True, h200) == 2 and cluster_splits(67, 33, 2, True, h200) == 0
    # the caller's count: a cluster of exactly that many splits, or the two launches
    assert cluster_splits(16, 33, 6, False, h200) == 6 and cluster_splits(16, 33, 7, False, h200) == 0
    assert cluster_splits(2, 33, 17, False, h200) == 0  # more splits than a cluster holds
    assert cluster_splits(2, 33, 1, True, h200) == 0  # nothing to merge
    assert cluster_splits(2, 33, 11, True, lambda c: 0) == 0  # no cluster where the driver reports none


@pytest.mark.compile
@pytest.mark.parametrize("cluster", [2, 16])
def test_cluster_program_merges_through_distributed_shared_memory(cluster):
    """The cluster variant lowers (no nvcc) to peer reads between two cluster barriers and writes no FP32 partials."""
    from mate import _dispatch

    spec = dict(dtype="bfloat16", split=1, wide=0)
    src = _dispatch.lower_program("qsa_attention", spec, "sm90", {**_dispatch.tiles("qsa_attention", spec, "sm90"), "cluster": cluster})
    body = src[src.index("main_kernel("):]
    first, second = body.index("tl::cluster_sync()"), body.rindex("tl::cluster_sync()")
    assert first < body.index("mate_ld_peer(") < second and body.count("mate_ld_peer(") == 2
    assert "float* __restrict__ LSE" in src and "float* __restrict__ O," not in src  # O is the caller's dtype
