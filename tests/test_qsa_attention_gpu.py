"""QSA sparse core attention, native vs reference on the GPU (run with `pytest -m gpu`).

Problems come from the CPU tests' generators (random requests with empty rows,
-1 pads, duplicates, ids past the cache, missing pages), at D = 256, moved to
the GPU; the reference runs on the same GPU tensors. Outputs are poisoned first.
"""

import itertools
import zlib

import pytest
import torch

import mate
from mate.qsa import attention
from helpers import capture_graph, poison_allocator
from common import qsa_serving_problem
from inputs import FP8_KV, K_SCALE, V_SCALE, fp8_kv, qsa_kv_layout, qsa_physical_layout, qsa_query_layout, qsa_requests

pytestmark = pytest.mark.gpu

D = 256
GEOMETRIES = [(2, 2), (4, 2), (24, 2), (16, 1)]  # GQA groups 1, 2, 12, 16
LAYOUTS = [("padded", "padded"), ("padded", "paged"), ("cu_seqlens", "paged"), ("token_to_req", "paged")]


@pytest.fixture(params=["wgmma", "warp"])
def family(request, monkeypatch):
    """The attention tests under each kernel family: the dispatcher picks one by the grid's size
    (mate.qsa.attention.family), and most problems here are small."""
    monkeypatch.setattr(attention, "family", lambda *a: request.param)
    return request.param


def cuda(kw):
    return {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    """Exact -inf pattern and zeros of empty rows; bf16/fp16 output within rounding of the FP32 reference."""
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf pattern of lse differs"
    fin = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=0, atol=2e-3)
    assert (out[~fin] == 0).all(), "rows with nothing visible must be exactly 0"
    ref = ref_out.to(dtype).float()
    err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 1e-2, f"relative error {err:.3e}"
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2 * float(ref.abs().max().clamp_min(1)))


def run_both(q, k, v, kw, **native_kw):
    poison_allocator("cuda")
    out, lse = mate.qsa_sparse_attention(q, k, v, **kw, **native_kw, return_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = mate.qsa_sparse_attention(q, k, v, **kw, return_lse=True, backend="reference")
    return out, lse, ref_out, ref_lse


def logical_problem(seed, hq, hkv, width, q_form, kv_form, dtype, page_size=4, n_req=3):
    gen = torch.Generator().manual_seed(seed)
    reqs = qsa_requests(gen, n_req=n_req, hq=hq, hkv=hkv, d=D, width=width, dtype=dtype)
    tq, extra_q, _ = qsa_query_layout(reqs, q_form, gen)
    k, v, extra_kv = qsa_kv_layout(reqs, kv_form, gen, page_size=page_size)
    return reqs, tq, extra_q, k, v, extra_kv


def option_problem(seed, hq, hkv, width, q_form, kv_form, dtype, options):
    """A logical problem with the keyword arguments of `options` ("plain", "lens+gate", "positions+gate_head"):
    (query tensors, key, value, the call's keywords) on the CPU."""
    reqs, tq, extra_q, k, v, extra_kv = logical_problem(seed, hq, hkv, width, q_form, kv_form, dtype)
    kw = dict(token_indices=tq["token_indices"], **extra_q, **extra_kv)
    if "lens" in options:
        kw["seq_lens_q"] = torch.tensor([r["rows"] for r in reqs], dtype=torch.int32)
        kw["seq_lens_k"] = torch.tensor([r["seq_k"] for r in reqs], dtype=torch.int32)
    if "positions" in options:
        kw["query_positions"] = tq["query_positions"]
    if "gate" in options:
        kw["gate"] = tq["gate"] if options.endswith("gate") else tq["gate"][..., 0].float()
    return tq, k, v, kw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", GEOMETRIES, ids=[f"group{a // b}" for a, b in GEOMETRIES])
@pytest.mark.parametrize("q_form, kv_form", LAYOUTS, ids=[f"{a}-{b}" for a, b in LAYOUTS])
@pytest.mark.parametrize("options", ["plain", "lens+gate", "positions+gate_head"])
@pytest.mark.parametrize("width", [1, 7, 130])
def test_native_matches_reference(dtype, hq, hkv, q_form, kv_form, options, width, family):
    seed = zlib.crc32(f"{dtype},{hq},{hkv},{q_form},{kv_form},{options},{width}".encode()) % 10_000
    tq, k, v, kw = option_problem(seed, hq, hkv, width, q_form, kv_form, dtype, options)
    q, k, v, kw = tq["query"].cuda(), k.cuda(), v.cuda(), cuda(kw)
    for splits in ([None] if kv_form == "padded" else [None, 1, 3]):
        assert_matches(*run_both(q, k, v, kw, num_splits=splits), dtype)


@pytest.mark.parametrize("width", [1, 7, 2051, 4100])
@pytest.mark.parametrize("splits", [None, 1, 2, 9, 33])  # 9, 33: under and over the merge's 16 splits a step
def test_physical(width, splits, family):
    gen = torch.Generator().manual_seed(width)
    reqs = qsa_requests(gen, n_req=3, hq=24, hkv=2, d=D, width=width, dtype=torch.bfloat16)
    q, k, v, ids = (x.cuda() for x in qsa_physical_layout(reqs, {}))
    poison_allocator("cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:-1], float("nan"), device="cuda")
    res = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, out=out, lse=lse, num_splits=splits)
    assert res is out
    ref_out, ref_lse = mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 2, 256])
def test_split_decode_at_serving_shape(batch, family):
    """Issue #16's decode inputs (2051-token selections, 24 / 2 heads, BF16 gate): every split count merges to
    the reference, and the same every call. Batch 256 (its requests share a 512-page pool) is a grid past one
    wave: num_splits=None takes 2 splits there, the split kernel's wide entry (two CTAs an SM)."""
    p = qsa_serving_problem(torch.Generator().manual_seed(batch), batch, 1)[0]
    ref_out, ref_lse = mate.qsa_sparse_attention(**p, return_lse=True, backend="reference")
    for splits in (None, 2, 8, 9, 17, 33):
        poison_allocator("cuda")
        out, lse = mate.qsa_sparse_attention(**p, return_lse=True, num_splits=splits)
        assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
        again = mate.qsa_sparse_attention(**p, return_lse=True, num_splits=splits)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), f"splits {splits}: not deterministic"


def block_problem(gen, rows, nb, cap_blocks, compact):
    """Block ids (random, -1 pads; a valid prefix when compact) and the token list they expand to, plus a 3-token tail."""
    blocks = torch.randint(0, cap_blocks, (rows, nb), generator=gen, dtype=torch.int32)
    pad = torch.rand(rows, nb, generator=gen) < 0.3
    if compact:
        count = torch.randint(0, nb + 1, (rows,), generator=gen)
        pad = torch.arange(nb) >= count[:, None]
    blocks[pad] = -1
    tokens = torch.where(blocks[..., None] >= 0, blocks[..., None] * 4 + torch.arange(4, dtype=torch.int32), -1)
    tail = (cap_blocks * 4 - 3 + torch.arange(3, dtype=torch.int32)).expand(rows, 3)
    return blocks, torch.cat([tokens.flatten(1), tail], dim=1).contiguous()


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("nb", [1, 17, 512])
def test_block_hint_matches_token_path(compact, nb, family):
    gen = torch.Generator().manual_seed(nb + compact)
    page_size, rows, cap_blocks = 64, 5, 600
    pool = cap_blocks * 4 // page_size + 2
    k = torch.randn(pool, page_size, 2, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(pool, page_size, 2, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(rows, 24, D, generator=gen).to(torch.bfloat16).cuda()
    table = torch.randperm(pool, generator=gen)[: pool - 1].to(torch.int32).expand(2, -1).contiguous().cuda()
    blocks, tokens = (x.cuda() for x in block_problem(gen, rows, nb, cap_blocks, compact))
    kw = dict(block_table=table, cu_seqlens_q=torch.tensor([0, 3, rows], dtype=torch.int32, device="cuda"), return_lse=True)
    for splits in (None, 1, 3):
        token_out, token_lse = mate.qsa_sparse_attention(q, k, v, tokens, num_splits=splits, **kw)
        poison_allocator("cuda")
        out, lse = mate.qsa_sparse_attention(q, k, v, tokens, block_indices=blocks, assume_compact_blocks=compact,
                                             num_splits=splits, **kw)
        if compact:  # the compact path drops the pad slots, so tiles (and FP32 rounding) differ
            assert_matches(out, lse, token_out.float(), token_lse, torch.bfloat16)
        else:
            assert torch.equal(out, token_out) and torch.equal(lse, token_lse)
    ref_out, ref_lse = mate.qsa_sparse_attention(q, k, v, tokens, **kw, backend="reference")
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


def test_sliced_views_and_out_surroundings(family):
    """Views with storage offsets everywhere; out is a slice whose poisoned surroundings must stay untouched."""
    gen = torch.Generator().manual_seed(7)
    reqs, tq, extra_q, k, v, extra_kv = logical_problem(7, 24, 2, 9, "cu_seqlens", "paged", torch.bfloat16, page_size=16)
    rows = tq["query"].shape[0]
    q_big = torch.randn(rows + 1, 26, D + 8, generator=gen).to(torch.bfloat16).cuda()
    q_big[1:, 1:25, 8:] = tq["query"].cuda()
    q = q_big[1:, 1:25, 8:]  # offsets and non-contiguous strides on every axis but the feature one
    k_big = torch.randn(k.shape[0] + 1, k.shape[1], 3, D, generator=gen).to(torch.bfloat16).cuda()
    k_big[1:, :, 1:] = k.cuda()
    v_big = torch.randn_like(k_big)
    v_big[1:, :, 1:] = v.cuda()
    idx_big = torch.full((rows, 2 * tq["token_indices"].shape[1] + 1), 5, dtype=torch.int32, device="cuda")
    idx = idx_big[:, 1::2]
    idx.copy_(tq["token_indices"])
    meta = dict(cu_seqlens_q=extra_q["cu_seqlens_q"].cuda(), block_table=extra_kv["block_table"].cuda())
    ref_out, ref_lse = mate.qsa_sparse_attention(q, k_big[1:, :, 1:], v_big[1:, :, 1:], idx, **meta, return_lse=True,
                                                 backend="reference")
    for splits in (1, 2):
        out_big = torch.full((rows + 2, 24, 2 * D), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = out_big[1:-1, :, D:]
        res, lse = mate.qsa_sparse_attention(q, k_big[1:, :, 1:], v_big[1:, :, 1:], idx, **meta, out=out,
                                             return_lse=True, num_splits=splits)
        assert res is out
        assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
        assert out_big[0].isnan().all() and out_big[-1].isnan().all() and out_big[:, :, :D].isnan().all()


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_graph_replay_with_new_metadata(splits, family):
    """Capture a paged decode call after warm-up, write new indices, lengths and page table into the same
    buffers, replay: the result equals an eager call on the new values."""
    gen = torch.Generator().manual_seed(splits or 0)
    batch, page_size, pool, max_pages, width = 8, 64, 80, 8, 300
    k = torch.randn(pool, page_size, 2, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(pool, page_size, 2, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(batch, 24, D, generator=gen).to(torch.bfloat16).cuda()
    gate = torch.randn(batch, 24, generator=gen).cuda()

    def fresh():
        return dict(
            token_indices=torch.randint(-1, max_pages * page_size, (batch, width), generator=gen, dtype=torch.int32),
            block_table=torch.randperm(pool, generator=gen)[: batch * max_pages].view(batch, max_pages).to(torch.int32),
            seq_lens_k=torch.randint(1, max_pages * page_size, (batch,), generator=gen, dtype=torch.int32),
        )

    bufs = cuda(fresh())
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    def call():
        return mate.qsa_sparse_attention(q, k, v, cu_seqlens_q=cu, gate=gate, num_splits=splits, return_lse=True, **bufs)

    graph, (out, lse) = capture_graph(call)
    for _ in range(2):
        for name, x in fresh().items():
            bufs[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = call()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        ref_out, ref_lse = mate.qsa_sparse_attention(q, k, v, cu_seqlens_q=cu, gate=gate, return_lse=True,
                                                     backend="reference", **bufs)
        assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


# ---------------------------------------------------------------- FP8 K/V caches (issue 38)

FP8 = list(FP8_KV)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float_scale", "tensor_scale"])
@pytest.mark.parametrize("hq, hkv", [(24, 2), (16, 1), (3, 1)], ids=["group12", "group16", "group3"])
@pytest.mark.parametrize("q_form, kv_form", LAYOUTS, ids=[f"{a}-{b}" for a, b in LAYOUTS])
@pytest.mark.parametrize("options", ["plain", "lens+gate"])
@pytest.mark.parametrize("width", [7, 130])
def test_fp8_matches_reference(kv_dtype, tensor_scale, hq, hkv, q_form, kv_form, options, width):
    """FP8 K/V against the reference on the same FP8 inputs (it dequantizes exactly), at the BF16 tolerances;
    every split count, an FP16 query in one geometry."""
    dtype = torch.float16 if hq == 3 else torch.bfloat16
    seed = zlib.crc32(f"fp8,{kv_dtype},{tensor_scale},{hq},{q_form},{kv_form},{options},{width}".encode()) % 10_000
    tq, k, v, kw = option_problem(seed, hq, hkv, width, q_form, kv_form, dtype, options)
    k8, v8, scales = fp8_kv(k.cuda(), v.cuda(), kv_dtype, tensor_scale)
    q, kw = tq["query"].cuda(), {**cuda(kw), **scales}
    for splits in ([None] if kv_form == "padded" else [None, 1, 3]):
        out, lse, ref_out, ref_lse = run_both(q, k8, v8, kw, num_splits=splits)
        assert_matches(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [None, 1, 9])
def test_fp8_physical(kv_dtype, splits):
    gen = torch.Generator().manual_seed(11)
    reqs = qsa_requests(gen, n_req=3, hq=24, hkv=2, d=D, width=300, dtype=torch.bfloat16)
    q, k, v, ids = (x.cuda() for x in qsa_physical_layout(reqs, {}))
    k8, v8, scales = fp8_kv(k, v, kv_dtype, True)
    poison_allocator("cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:-1], float("nan"), device="cuda")
    mate.qsa_sparse_attention(q, k8, v8, selected_kv_indices=ids, out=out, lse=lse, num_splits=splits, **scales)
    ref = mate.qsa_sparse_attention(q, k8, v8, selected_kv_indices=ids, return_lse=True, backend="reference", **scales)
    assert_matches(out, lse, *ref, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitudes", [(3e5, 1.0, 1e-3), (1e-20,), (6e4,)], ids=["mixed", "tiny", "fp16max"])
def test_fp8_query_range(kv_dtype, magnitudes):
    """An FP8 call runs FP16 MMAs on the query times a power of two (mate._tl.scale_into_fp16): BF16 queries far
    outside FP16's range, and heads of very different sizes in one group, still match the reference. (Not all heads
    at 1e6 or more: there the scores' FP32 rounding, the reference's own, moves the softmax by percents.)"""
    gen = torch.Generator().manual_seed(13)
    reqs = qsa_requests(gen, n_req=3, hq=24, hkv=2, d=D, width=300, dtype=torch.bfloat16)
    q, k, v, ids = (x.cuda() for x in qsa_physical_layout(reqs, {}))
    mags = torch.tensor(magnitudes, device="cuda").repeat(24)[:24]
    q = (q.float() * mags[None, :, None]).to(torch.bfloat16)
    k8, v8, scales = fp8_kv(k, v, kv_dtype, False)
    for splits in (1, 9):
        poison_allocator("cuda")
        out, lse = mate.qsa_sparse_attention(q, k8, v8, selected_kv_indices=ids, return_lse=True, num_splits=splits, **scales)
        ref_out, ref_lse = mate.qsa_sparse_attention(q, k8, v8, selected_kv_indices=ids, return_lse=True, backend="reference", **scales)
        # the lse grows with the query: relative there
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=2e-3)
        assert_matches(out, ref_lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("batch, rows", [(1, 1), (16, 1), (1, 300)], ids=["decode1", "decode16", "prefill300"])
def test_fp8_serving_shape(kv_dtype, batch, rows):
    """Issue 37's inputs (2051 slots a row, per-element gate) on FP8 caches: each split count, deterministic; the
    error against the unquantized BF16 call is the quantization's (printed, loosely bounded)."""
    p = qsa_serving_problem(torch.Generator().manual_seed(batch + rows), batch, rows, gate="element")[0]
    k8, v8, scales = fp8_kv(p["key"], p["value"], kv_dtype, batch == 1)
    p8 = {**p, "key": k8, "value": v8, **scales}
    ref_out, ref_lse = mate.qsa_sparse_attention(**p8, return_lse=True, backend="reference")
    for splits in ((None, 1, 8) if rows == 1 else (None,)):
        poison_allocator("cuda")
        out, lse = mate.qsa_sparse_attention(**p8, return_lse=True, num_splits=splits)
        assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
        again = mate.qsa_sparse_attention(**p8, return_lse=True, num_splits=splits)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), f"splits {splits}: not deterministic"
    bf16 = mate.qsa_sparse_attention(**p).float()
    err = float((out.float() - bf16).norm() / bf16.norm())
    print(f"{kv_dtype} batch {batch} rows {rows}: relative error against the BF16 cache {err:.2e}")
    assert err < 0.1


def test_fp8_graph_replay_with_new_scales_and_metadata():
    """A captured FP8 call with tensor scales: new scale values, indices and page table written into the same
    buffers, then replay, equal the eager call and match the reference (no host sync reads the scales)."""
    gen = torch.Generator().manual_seed(5)
    batch, page_size, pool, max_pages, width = 8, 64, 80, 8, 300
    k8 = (torch.randn(pool, page_size, 2, D, generator=gen) / K_SCALE).to(torch.float8_e4m3fn).cuda()
    v8 = (torch.randn(pool, page_size, 2, D, generator=gen) / V_SCALE).to(torch.float8_e4m3fn).cuda()
    q = torch.randn(batch, 24, D, generator=gen).to(torch.bfloat16).cuda()
    ks, vs = torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda")

    def fresh():
        return dict(
            token_indices=torch.randint(-1, max_pages * page_size, (batch, width), generator=gen, dtype=torch.int32),
            block_table=torch.randperm(pool, generator=gen)[: batch * max_pages].view(batch, max_pages).to(torch.int32),
        )

    bufs = cuda(fresh())
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    def call(backend="tilelang"):
        return mate.qsa_sparse_attention(q, k8, v8, cu_seqlens_q=cu, k_scale=ks, v_scale=vs, return_lse=True,
                                         backend=backend, **bufs)

    graph, (out, lse) = capture_graph(call)
    for step in range(2):
        for name, x in fresh().items():
            bufs[name].copy_(x)
        ks.fill_(K_SCALE * (0.5 + step))
        vs.fill_(V_SCALE * (2.0 - step))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = call()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        assert_matches(out, lse, *call("reference"), torch.bfloat16)


@pytest.mark.parametrize("splits", [5, 37])  # 37: past the kernel's 16 (wide: 4) loads in flight, with a remainder
@pytest.mark.parametrize("pdtype, odtype", list(itertools.product([torch.float32, torch.bfloat16], [torch.bfloat16, torch.float32])))
# 198 pairs: one a CTA; 2,100 (over MERGE_CTAS, not a multiple of it): the wide grid, whose four-element chunks
# end past D = 130, on partials sliced `pad` elements into wider rows
@pytest.mark.parametrize("rows, heads, dim, pad", [(33, 6, 200, 0), (300, 7, 130, 3)])
def test_merge_native(pdtype, odtype, splits, rows, heads, dim, pad):
    gen = torch.Generator().manual_seed(3 + splits)
    po = torch.randn(splits, rows, heads, dim + pad, generator=gen).to(pdtype).cuda()[..., pad:]
    pl = torch.randn(splits, rows, heads, generator=gen).cuda()
    pl[torch.rand(splits, rows, heads, generator=gen).cuda() < 0.3] = float("-inf")
    pl[:, 0] = float("-inf")  # a row with no live split
    po[pl.isinf().unsqueeze(-1).expand_as(po)] = float("nan")  # dead splits are never read
    gate = torch.randn(rows, heads, dim, generator=gen).cuda()
    poison_allocator("cuda")
    out, lse = mate.merge_attention_states(po, pl, gate=gate, out_dtype=odtype)
    ref_out, ref_lse = mate.merge_attention_states(po, pl, gate=gate, out_dtype=odtype, backend="reference")
    assert out.dtype == odtype
    assert_matches(out, lse, ref_out.float(), ref_lse, odtype)


def test_cluster_probe_counts_co_resident_whole_sm_clusters():
    """mate._hopper.whole_sm_clusters (what cluster_splits decides by): one-CTA clusters are the SMs, the
    portable sizes (up to 8) all fit, and a larger cluster never fits more often than a smaller one."""
    from mate import _hopper

    counts = [_hopper.whole_sm_clusters(torch.cuda.current_device(), c) for c in range(1, _hopper.MAX_CLUSTER + 1)]
    print("clusters of 1..16 whole-SM CTAs at once:", counts, _hopper.PROBE_ERROR or "")
    assert _hopper.PROBE_ERROR is None, _hopper.PROBE_ERROR
    assert counts[0] == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    assert all(n >= 1 for n in counts[:8]) and all(a >= b for a, b in zip(counts, counts[1:]))
    assert _hopper.whole_sm_clusters(0, _hopper.MAX_CLUSTER + 1) == 0
