"""gqa_attention on FP8 K/V caches (issue 38) against the reference on the GPU (run with `pytest -m gpu`).

Every FP8 call runs the split-KV kernel's kv_dtype variant (mate/swa/kernels/gqa_decode.py): paged caches, padded
k (decode and prefill) and varlen k (the keys as one page from cu_seqlens_k). The reference dequantizes the same FP8
inputs exactly, so the BF16 tolerances hold; NaN in unused FP8 bytes, poisoned outputs, both split policies."""

import pytest
import torch

import garbage as G
import mate
from mate.tuning.measure import capture_graph
from inputs import FP8_KV, K_SCALE, V_SCALE, fp8_kv
from test_gqa_gpu import assert_attention_matches, run_both
from test_gqa_options_gpu import LENS_K, LENS_Q, PAGED_LENS_K, offsets, paged_cache, randn, split_policy  # noqa: F401

pytestmark = pytest.mark.gpu

FP8 = list(FP8_KV)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float_scale", "tensor_scale"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window", [None, (-1, 0), (300, 0)], ids=str)
def test_fp8_paged_matches_reference(kv_dtype, tensor_scale, dim, window, split_policy):
    """Paged caches (pages of 16, 32, 64; a -1 page inside a sequence, ids past the pool, NaN in unused bytes): decode
    steps of 1-8 rows, a paged prefill, sinks and softcap, padded and varlen q, a FP16 q at D 64."""
    H, Hkv = 8, 2
    dtype = torch.float16 if dim == 64 and window is None else torch.bfloat16
    page_size = {None: 16, (-1, 0): 32, (300, 0): 64}[window]
    k, v, table, lens = paged_cache(PAGED_LENS_K, page_size, Hkv, dim, torch.float32)
    k8, v8, scales = fp8_kv(k, v, kv_dtype, tensor_scale)
    kw = dict(block_table=table, seq_lens_k=lens, **scales)
    for sq, sinks, softcap in [(1, False, False), (8, True, False), (3, True, True), (100, False, True)]:
        opts = dict(sinks=torch.randn(H, device="cuda") * 2 if sinks else None, softcap=15.0 if softcap else None)
        q = randn(len(PAGED_LENS_K), sq, H, dim, dtype=dtype, scale=2.0)
        assert_attention_matches(*run_both(q, k8, v8, window, **kw, **opts))
    lens_q = [1, 8, 0, 3, 70]
    q = randn(sum(lens_q), H, dim, dtype=dtype, scale=2.0)
    assert_attention_matches(*run_both(q, k8, v8, window, cu_seqlens_q=offsets(lens_q), max_seqlen_q=max(lens_q),
                                       sinks=torch.randn(H, device="cuda"), **kw))


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window", [None, (-1, 0), (128, 0), (256, 256)], ids=str)
def test_fp8_varlen_matches_reference(kv_dtype, dim, window, split_policy):
    """Varlen q and k (odd lengths, an empty sequence, one with more rows than keys; NaN/Inf garbage before
    cu_seqlens_k[0] and past cu_seqlens_k[B]): each key tile starts at any row of k (whole-tile TMA boxes there),
    with sinks and softcap, tensor scales."""
    H, Hkv, head = 8, 2, 16
    q = randn(sum(LENS_Q), H, dim, dtype=torch.bfloat16, scale=2.0)
    k = randn(head + sum(LENS_K) + 40, Hkv, dim, dtype=torch.float32, scale=2.0)
    v = randn(*k.shape, dtype=torch.float32)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    used[head : head + sum(LENS_K)] = True
    for x in (k, v):
        G.poison_unused(x, used)
    k8, v8, scales = fp8_kv(k, v, kv_dtype, True)
    kw = dict(cu_seqlens_q=offsets(LENS_Q), cu_seqlens_k=offsets(LENS_K, head), max_seqlen_q=max(LENS_Q),
              max_seqlen_k=max(LENS_K), **scales)
    assert_attention_matches(*run_both(q, k8, v8, window, **kw))
    assert_attention_matches(*run_both(q, k8, v8, window, sinks=torch.randn(H, device="cuda"), softcap=10.0, **kw))


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("sq", [1, 16, 700])
def test_fp8_padded_matches_reference(kv_dtype, sq, split_policy):
    """Padded q and k (k as one page per sequence): decode rows and a prefill of more rows than DECODE_MAX_ROWS; MQA
    and MHA groups."""
    for H, Hkv in [(32, 8), (16, 1), (4, 4)]:
        q = randn(2, sq, H, 128, dtype=torch.bfloat16, scale=2.0)
        k8, v8, scales = fp8_kv(randn(2, 1333, Hkv, 128, dtype=torch.float32, scale=2.0), randn(2, 1333, Hkv, 128, dtype=torch.float32),
                                kv_dtype, False)
        assert_attention_matches(*run_both(q, k8, v8, (-1, 0), **scales))


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitudes", [(3e5, 1.0, 1e-3), (1e-20,), (6e4,)], ids=["mixed", "tiny", "fp16max"])
def test_fp8_query_range(kv_dtype, magnitudes):
    """FP16 MMAs on the query times a power of two (mate._tl.scale_into_fp16, per CTA tile of packed rows): BF16 queries
    far outside FP16's range, and heads of very different sizes in one tile, still match the reference."""
    H, Hkv = 16, 2
    k, v, table, lens = paged_cache(PAGED_LENS_K, 32, Hkv, 128, torch.float32, poison=False)
    k8, v8, scales = fp8_kv(k, v, kv_dtype, False)
    mags = torch.tensor(magnitudes, device="cuda").repeat(H)[:H]
    q = (randn(len(PAGED_LENS_K), 2, H, 128, dtype=torch.float32) * mags[None, None, :, None]).to(torch.bfloat16)
    out, lse, ref_out, ref_lse = run_both(q, k8, v8, None, block_table=table, seq_lens_k=lens, **scales)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=5e-5, atol=2e-3)  # the LSE grows with the query: relative (FP32 rounding of logits ~1e5)
    assert_attention_matches(out, ref_lse, ref_out, ref_lse)


def test_fp8_garbage_changes_nothing(split_policy):
    """NaN bytes in unowned pages, last pages' tails and -1 pages: bit-identical to zeros there."""
    k, v, table, lens = paged_cache([3000, 17, 64, 1], 16, 2, 128, torch.float32)
    k8, v8, scales = fp8_kv(k, v, torch.float8_e4m3fn, True)
    q = randn(4, 4, 8, 128, dtype=torch.bfloat16)
    kw = dict(block_table=table, seq_lens_k=lens, sinks=torch.randn(8, device="cuda"), return_lse=True, **scales)
    clean_k, clean_v = (x.view(torch.uint8).masked_fill(x.float().isnan(), 0).view(x.dtype) for x in (k8, v8))
    for window in [None, (100, 0)]:
        dirty = mate.gqa_attention(q, k8, v8, sliding_window=window, **kw)
        clean = mate.gqa_attention(q, clean_k, clean_v, sliding_window=window, **kw)
        assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
        assert torch.isfinite(dirty[0]).all()


def test_fp8_deterministic_and_error_against_bf16():
    """The issue's decode shape, smaller: the same call twice is bit-identical; the error against the unquantized
    BF16 cache is the quantization's (printed, loosely bounded)."""
    B, H, Hkv, D, ctx = 8, 64, 8, 128, 2048
    k, v, table, lens = paged_cache([ctx] * B, 64, Hkv, D, torch.bfloat16, hole=False, poison=False)
    k = k / 2  # unit-scale keys, as the benchmark's
    q = randn(B, 1, H, D, dtype=torch.bfloat16)
    kw = dict(block_table=table, seq_lens_k=lens)
    bf16 = mate.gqa_attention(q, k, v, **kw).float()
    for kv_dtype in FP8:
        k8, v8, scales = fp8_kv(k.float(), v.float(), kv_dtype, False)
        out = mate.gqa_attention(q, k8, v8, **kw, **scales)
        assert torch.equal(out, mate.gqa_attention(q, k8, v8, **kw, **scales))
        err = float((out.float() - bf16).norm() / bf16.norm())
        print(f"{kv_dtype}: relative error against the BF16 cache {err:.2e}")
        assert err < 0.2  # e5m2 keeps 2 mantissa bits: ~2x e4m3's error


def test_fp8_graph_replay_with_new_scales_and_lengths():
    """A captured paged decode with tensor scales: new scale values and lengths written into the same buffers, then
    replay, match the reference (the kernel reads the scales on the GPU, no host sync)."""
    H, Hkv, D, B = 16, 2, 128, 6
    k, v, table, lens = paged_cache([500, 1, 2000, 64, 0, 1234], 32, Hkv, D, torch.float32, hole=False, poison=False)
    k8, v8, _ = fp8_kv(k, v, torch.float8_e4m3fn, False)
    q = randn(B, 1, H, D, dtype=torch.bfloat16)
    ks, vs = torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda")
    out = torch.empty_like(q)
    kw = dict(block_table=table, seq_lens_k=lens, sliding_window=(1000, 0), softcap=20.0, k_scale=ks, v_scale=vs)
    g, _ = capture_graph(lambda: mate.gqa_attention(q, k8, v8, out=out, **kw))
    for step in range(3):
        lens.copy_(torch.tensor([500 - step, 1 + step, 2000 - 7 * step, 64 + step, step, 1234], dtype=torch.int32))
        ks.fill_(K_SCALE * (1 + step))
        vs.fill_(V_SCALE / (1 + step))
        g.replay()
        torch.cuda.synchronize()
        ref = mate.gqa_attention(q, k8, v8, backend="reference", **kw)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert err < 1e-2, f"step {step}: relative error {err:.2e}"
