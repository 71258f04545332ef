"""GQA / sliding-window attention on the CPU: the reference against a naive float64 loop oracle,
window edge cases, the launcher's views, and every documented error."""

import math

import pytest
import torch

import mate
from mate import _dispatch
from mate.swa import attention as swa
from mate.swa import reference

# ---------------------------------------------------------------- naive oracle


def visible(i, j, sq, sk, left, right):
    """SPEC: query i sees key j iff i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT (-1 unbounded), 0 <= j < Sk."""
    p = i + sk - sq
    return 0 <= j < sk and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)


def naive(q, k, v, left, right, scale, sinks=None, softcap=None):
    """Row by row in float64: softmax over the visible keys of the row's KV head; empty rows give 0 and -inf.

    softcap: a score s becomes softcap * tanh(s / softcap); sinks [H]: one more logit per head in the
    normaliser (and the LSE) whose value is 0 (an empty row then has LSE = the sink)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.zeros(B, Sq, H, D, dtype=torch.float64)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for i in range(Sq):
                js = [j for j in range(Sk) if visible(i, j, Sq, Sk, left, right)]
                s = [float(q[b, i, h].double() @ k[b, j, kv].double()) * scale for j in js]
                if softcap:
                    s = [softcap * math.tanh(x / softcap) for x in s]
                logits = s + ([float(sinks[h])] if sinks is not None else [])
                if not logits:
                    continue
                t = torch.tensor(logits, dtype=torch.float64)
                m = t.max()
                w = torch.exp(t - m)
                lse[b, h, i] = m + torch.log(w.sum())
                out[b, i, h] = sum((w[n] * v[b, j, kv].double() for n, j in enumerate(js)), torch.zeros(D, dtype=torch.float64)) / w.sum()
    return out, lse


def check(out, lse, ref_out, ref_lse):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf LSE pattern differs"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    fin = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen)


WINDOWS = [None, (-1, -1), (-1, 0), (0, 0), (3, 0), (0, 4), (2, 2), (-1, 3), (5, -1), (0, -1), (100, 0), (0, 100), (7, 9)]


# ---------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("sq, sk", [(11, 11), (6, 13), (13, 6), (1, 9), (9, 1)])
def test_reference_matches_naive(gen, window, sq, sk):
    B, H, Hkv, D = 2, 4, 2, 8
    q, k, v = rand(gen, B, sq, H, D), rand(gen, B, sk, Hkv, D), rand(gen, B, sk, Hkv, D)
    out, lse = mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference")
    assert out.shape == (B, sq, H, D) and out.dtype == q.dtype
    assert lse.shape == (B, H, sq) and lse.dtype == torch.float32
    left, right = (-1, -1) if window is None else window
    check(out, lse, *naive(q, k, v, left, right, 1 / math.sqrt(D)))


@pytest.mark.parametrize("H, Hkv", [(3, 3), (4, 1), (8, 2), (6, 3)])
def test_gqa_head_mapping(gen, H, Hkv):
    B, S, D = 1, 7, 4
    q, k, v = rand(gen, B, S, H, D), rand(gen, B, S, Hkv, D), rand(gen, B, S, Hkv, D)
    out, lse = mate.gqa_attention(q, k, v, sliding_window=(-1, 0), scale=0.3, return_lse=True, backend="reference")
    check(out, lse, *naive(q, k, v, -1, 0, 0.3))


def test_empty_rows_are_zero_with_minus_inf_lse(gen):
    """Sq > Sk, causal: the first Sq - Sk rows sit at negative positions and see nothing."""
    q, k, v = rand(gen, 1, 10, 2, 4), rand(gen, 1, 4, 1, 4), rand(gen, 1, 4, 1, 4)
    out, lse = mate.gqa_attention(q, k, v, sliding_window=(-1, 0), return_lse=True, backend="reference")
    assert torch.equal(out[0, :6], torch.zeros(6, 2, 4))
    assert torch.isinf(lse[0, :, :6]).all() and (lse[0, :, :6] < 0).all()
    assert torch.isfinite(lse[0, :, 6:]).all()
    # A window that lies wholly right of the keys: (0, 0) with Sq > Sk leaves the first rows empty too.
    out, lse = mate.gqa_attention(q, k, v, sliding_window=(0, 0), return_lse=True, backend="reference")
    assert torch.isinf(lse[0, :, :6]).all() and torch.isfinite(lse[0, :, 6:]).all()
    # No keys at all.
    out, lse = mate.gqa_attention(q, k[:, :0], v[:, :0], return_lse=True, backend="reference")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


def test_window_equivalences(gen):
    q, k, v = rand(gen, 2, 9, 4, 8), rand(gen, 2, 12, 2, 8), rand(gen, 2, 12, 2, 8)

    def run(w):
        return mate.gqa_attention(q, k, v, sliding_window=w, backend="reference")

    torch.testing.assert_close(run(None), run((-1, -1)))
    torch.testing.assert_close(run(None), run((100, 100)))  # windows longer than the sequence
    torch.testing.assert_close(run((-1, 0)), run((12, 0)))
    torch.testing.assert_close(run((-1, 0)), run([-1, 0]))  # a list works like a tuple
    # (0, 0): each row sees exactly its own position, so out == v at that key.
    out = run((0, 0))
    p = torch.arange(9) + 3
    torch.testing.assert_close(out, v[:, p].repeat_interleave(2, dim=2))


def test_window_mask_matches_spec():
    for sq, sk in [(5, 9), (9, 5), (7, 7)]:
        for left, right in WINDOWS[1:]:
            m = reference.window_mask(sq, sk, left, right)
            want = torch.tensor([[visible(i, j, sq, sk, left, right) for j in range(sk)] for i in range(sq)])
            assert torch.equal(m, want), (sq, sk, left, right)


def test_reference_chunks_agree(gen):
    q, k, v = rand(gen, 2, 33, 4, 8), rand(gen, 2, 40, 2, 8), rand(gen, 2, 40, 2, 8)
    whole = reference.gqa_attention(q, k, v, 5, 2, 0.4)
    chunked = reference.gqa_attention(q, k, v, 5, 2, 0.4, max_scores=100)
    torch.testing.assert_close(whole, chunked)


def test_out_written_in_place_and_dtypes(gen):
    q, k, v = rand(gen, 1, 5, 2, 8).half(), rand(gen, 1, 6, 1, 8).half(), rand(gen, 1, 6, 1, 8).half()
    out = torch.full_like(q, float("nan"))
    res = mate.gqa_attention(q, k, v, out=out, backend="reference")
    assert res is out and not torch.isnan(out).any()
    res, lse = mate.gqa_attention(q, k, v, out=out, return_lse=True, backend="reference")
    assert res is out and lse.dtype == torch.float32
    ref, _ = naive(q.float(), k.float(), v.float(), -1, -1, 1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_scale_default_and_explicit(gen):
    q, k, v = rand(gen, 1, 4, 2, 16), rand(gen, 1, 4, 2, 16), rand(gen, 1, 4, 2, 16)
    a = mate.gqa_attention(q, k, v, backend="reference")
    b = mate.gqa_attention(q, k, v, scale=0.25, backend="reference")
    torch.testing.assert_close(a, b)
    c = mate.gqa_attention(q, k, v, scale=1.0, backend="reference")
    assert not torch.allclose(a, c)


# ---------------------------------------------------------------- dispatch and configs


def test_window_classes():
    assert swa.window_class(*swa.parse_window(None)) == "none"
    assert swa.window_class(-1, -1) == "none"
    assert swa.window_class(-1, 0) == "causal"
    assert swa.window_class(-1, 7) == "causal"
    assert swa.window_class(0, 0) == "local"
    assert swa.window_class(4096, -1) == "local"


def test_every_native_specialization_has_a_config():
    for dtype in (torch.bfloat16, torch.float16):
        for dim in swa.NATIVE_DIMS:
            for window in [None, (-1, 0), (128, 0), (0, 512), (256, 256)]:
                left, right = swa.parse_window(window)
                tiles = _dispatch.tiles(swa.STAGE.name, swa._spec(dtype, dim, left, right), "sm90")
                assert tiles["mma_depth"] in (1, 2)


def test_rows_view_of_packed_qkv():
    B, S, H, Hkv, D = 2, 5, 4, 2, 8
    width = (H + 2 * Hkv) * D
    qkv = torch.randn(B * S, width)
    four = qkv.view(B, S, H + 2 * Hkv, D)
    q = swa._rows_view("Q", qkv[:, : H * D], B, S, H, D, width)
    k = swa._rows_view("K", qkv[:, H * D : (H + Hkv) * D].view(B * S, Hkv, D), B, S, Hkv, D, width)
    assert torch.equal(q, four[:, :, :H]) and torch.equal(k, four[:, :, H : H + Hkv])
    assert q.data_ptr() == qkv.data_ptr()
    v4 = four[:, :, H + Hkv :]
    assert swa._rows_view("V", v4, B, S, Hkv, D, width) is v4


# ---------------------------------------------------------------- errors


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def qkv(B=1, S=8, H=4, Hkv=2, D=128, dtype=torch.bfloat16):
    return (torch.randn(B, S, H, D).to(dtype), torch.randn(B, S, Hkv, D).to(dtype), torch.randn(B, S, Hkv, D).to(dtype))


def test_backend_errors():
    q, k, v = qkv()
    raises(ValueError, "backend", mate.gqa_attention, q, k, v, backend="auto")
    raises(ValueError, "backend", mate.gqa_attention, q, k, v, backend="torch")
    raises(TypeError, "backend", mate.gqa_attention, q, k, v, backend=None)


def test_native_rejects_cpu_and_names_targets():
    q, k, v = qkv()
    raises(ValueError, "sm90", mate.gqa_attention, q, k, v)
    raises(ValueError, "sm90", mate.gqa_attention, q, k, v, sliding_window=(128, 0))


def test_native_rejects_unsupported_combinations():
    q, k, v = qkv(dtype=torch.float32)
    raises(ValueError, "bfloat16 and float16", mate.gqa_attention, q, k, v)
    q, k, v = qkv(D=96)
    raises(ValueError, "head dim 64 or 128", mate.gqa_attention, q, k, v)
    q, k, v = qkv()
    raises(ValueError, "stride", mate.gqa_attention, q.transpose(1, 2).contiguous().transpose(1, 2)[..., ::2], k[..., :64], v[..., :64])
    raises(ValueError, "16-byte", mate.gqa_attention, q[..., 1:65], k[..., :64], v[..., :64])
    raises(ValueError, "out: vector loads", mate.gqa_attention, q[..., :64], k[..., :64], v[..., :64],
           out=torch.empty(1, 8, 4, 128, dtype=torch.bfloat16)[..., 1:65])


def test_type_errors():
    q, k, v = qkv()
    raises(TypeError, "q", mate.gqa_attention, q.tolist(), k, v, backend="reference")
    raises(TypeError, "k", mate.gqa_attention, q, None, v, backend="reference")
    raises(TypeError, "v", mate.gqa_attention, q, k, v.to(torch.int32), backend="reference")
    raises(TypeError, "sliding_window", mate.gqa_attention, q, k, v, sliding_window=128, backend="reference")
    raises(TypeError, "sliding_window", mate.gqa_attention, q, k, v, sliding_window=(1.0, 0), backend="reference")
    raises(TypeError, "sliding_window", mate.gqa_attention, q, k, v, sliding_window=(True, 0), backend="reference")
    raises(TypeError, "scale", mate.gqa_attention, q, k, v, scale="0.1", backend="reference")
    raises(TypeError, "return_lse", mate.gqa_attention, q, k, v, return_lse=1, backend="reference")
    raises(TypeError, "out", mate.gqa_attention, q, k, v, out=[0], backend="reference")


def test_value_errors():
    q, k, v = qkv()
    raises(ValueError, "rank 4", mate.gqa_attention, q[0], k, v, backend="reference")
    raises(ValueError, "k must be", mate.gqa_attention, q, k[..., :64], v[..., :64], backend="reference")
    raises(ValueError, "k must be", mate.gqa_attention, q, torch.cat([k, k]), torch.cat([v, v]), backend="reference")
    raises(ValueError, "v must have", mate.gqa_attention, q, k, v[:, :4], backend="reference")
    raises(ValueError, "multiple of k's H_kv", mate.gqa_attention, q[:, :, :3], k, v, backend="reference")
    raises(ValueError, "multiple of k's H_kv", mate.gqa_attention, q, k[:, :, :0], v[:, :, :0], backend="reference")
    raises(ValueError, "dtype", mate.gqa_attention, q, k.half(), v.half(), backend="reference")
    raises(ValueError, "pair", mate.gqa_attention, q, k, v, sliding_window=(1, 2, 3), backend="reference")
    raises(ValueError, "LEFT", mate.gqa_attention, q, k, v, sliding_window=(-2, 0), backend="reference")
    raises(ValueError, "RIGHT", mate.gqa_attention, q, k, v, sliding_window=(0, -5), backend="reference")
    raises(ValueError, "scale", mate.gqa_attention, q, k, v, scale=0.0, backend="reference")
    raises(ValueError, "scale", mate.gqa_attention, q, k, v, scale=float("inf"), backend="reference")
    raises(ValueError, "out must have shape", mate.gqa_attention, q, k, v, out=torch.empty_like(q[:, :4]), backend="reference")
    raises(ValueError, "out must have dtype", mate.gqa_attention, q, k, v, out=torch.empty_like(q, dtype=torch.float16), backend="reference")
    packed = torch.randn(1, 8, 8, 128).to(torch.bfloat16)
    raises(ValueError, "out overlaps q", mate.gqa_attention, packed[:, :, :4], k, v, out=packed[:, :, 4:], backend="reference")


def test_launcher_build_errors():
    raises(TypeError, "ATTN_B", mate.build_gqa_attn, 1.0, 8, 2, 128)
    raises(TypeError, "ATTN_H", mate.build_gqa_attn, 1, "8", 2, 128)
    raises(ValueError, "ATTN_H_KV", mate.build_gqa_attn, 1, 8, 0, 128)
    raises(ValueError, "multiple of ATTN_H_KV", mate.build_gqa_attn, 1, 8, 3, 128)
    raises(ValueError, "head dim 64 or 128", mate.build_gqa_attn, 1, 8, 2, 96)
    raises(TypeError, "sliding_window", mate.build_gqa_attn, 1, 8, 2, 128, sliding_window=4096)
    raises(ValueError, "LEFT", mate.build_gqa_attn, 1, 8, 2, 128, sliding_window=(-3, 0))


def test_launcher_launch_errors():
    B, S, H, Hkv, D = 2, 16, 4, 2, 64
    launch = mate.build_gqa_attn(B, H, Hkv, D, sliding_window=(8, 0))
    width = (H + 2 * Hkv) * D
    packed = torch.randn(B * S, width).to(torch.bfloat16)
    q, k, v = packed[:, : H * D], packed[:, H * D : (H + Hkv) * D], packed[:, (H + Hkv) * D :]
    o = torch.empty(B * S, H * D, dtype=torch.bfloat16)
    raises(ValueError, "sm90", launch, q, k, v, o, width, width, width, H * D, S, S)  # CPU tensors
    raises(ValueError, "row stride", launch, q, k, v, o, H * D, width, width, H * D, S, S)
    raises(ValueError, "batch \\* seq_len rows", launch, q, k, v, o, width, width, width, H * D, S - 1, S)
    raises(ValueError, "must be \\[2, 16, 4, 64\\]", launch, q.reshape(B, S, H, D + 0)[:, :8], k, v, o, width, width, width, H * D, S, S)
    raises(ValueError, "stride\\(1\\)", launch, o.view(B, S, H, D), k, v, torch.empty(B, S, H, D, dtype=torch.bfloat16),
           H * D + 8, width, width, H * D, S, S)
    raises(TypeError, "seq_len_q", launch, q, k, v, o, width, width, width, H * D, float(S), S)
    raises(ValueError, "seq_len_kv", launch, q, k, v, o, width, width, width, H * D, S, -1)
    raises(ValueError, "K_stride1", launch, q, k, v, o, width, 0, width, H * D, S, S)
    raises(ValueError, "dtype", launch, q, k, v, o.half(), width, width, width, H * D, S, S)
    raises(ValueError, "O overlaps", launch, q, k, v, packed[:, : H * D], width, width, width, width, S, S)
    p32 = packed.float()
    q32, k32, v32 = p32[:, : H * D], p32[:, H * D : (H + Hkv) * D], p32[:, (H + Hkv) * D :]
    raises(ValueError, "bfloat16 and float16", launch, q32, k32, v32, o.float(), width, width, width, H * D, S, S)


# ---------------------------------------------------------------- FP8 K/V (issue 38)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_reference_dequantizes_exactly(kv_dtype, q_dtype):
    """FP8 K/V with float or tensor scales, padded, varlen and paged: the reference equals its own run on the FP32
    dequantized cache (value x scale) bit for bit, in q's dtype."""
    torch.manual_seed(3)
    q = torch.randn(2, 5, 4, 64).to(q_dtype)
    k8, v8 = (torch.randn(2, 9, 2, 64) * 30).to(kv_dtype), (torch.randn(2, 9, 2, 64) * 20).to(kv_dtype)
    table = torch.tensor([[1, 0], [-1, 1]], dtype=torch.int32)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    layouts = [dict(q=q, k=k8, v=v8),
               dict(q=q.flatten(0, 1), k=k8.flatten(0, 1), v=v8.flatten(0, 1), cu_seqlens_q=torch.tensor([0, 3, 10], dtype=torch.int32),
                    max_seqlen_q=7, cu_seqlens_k=cu, max_seqlen_k=5),
               dict(q=q, k=k8, v=v8, block_table=table, seq_lens_k=torch.tensor([15, 7], dtype=torch.int32))]
    for kw in layouts:
        a = {n: kw[n] for n in ("q", "k", "v")}
        rest = {n: x for n, x in kw.items() if n not in a}
        opts = dict(sliding_window=(6, 0), sinks=torch.randn(4), softcap=10.0, return_lse=True, backend="reference", **rest)
        ref = mate.gqa_attention(a["q"].float(), a["k"].float() * 0.03, a["v"].float() * 0.05, **opts)
        for ks, vs in [(0.03, 0.05), (torch.tensor(0.03), torch.tensor([0.05]))]:
            out, lse = mate.gqa_attention(a["q"], a["k"], a["v"], k_scale=ks, v_scale=vs, **opts)
            assert out.dtype == q_dtype
            assert torch.equal(out, ref[0].to(q_dtype)) and torch.equal(lse, ref[1])


def test_fp8_errors():
    q, k, v = qkv()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref = dict(backend="reference")
    raises(ValueError, "FP8 queries", mate.gqa_attention, q.to(torch.float8_e4m3fn), k8, v8, **ref)
    raises(ValueError, "float8_e4m3fn or float8_e5m2", mate.gqa_attention, q, k8, v, **ref)
    raises(ValueError, "float8_e4m3fn or float8_e5m2", mate.gqa_attention, q, k, v8, **ref)
    raises(ValueError, "float8_e4m3fn or float8_e5m2", mate.gqa_attention, q, k8, v.to(torch.float8_e5m2), **ref)
    for name in ("k_scale", "v_scale"):
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            raises(ValueError, name, mate.gqa_attention, q, k8, v8, **{name: bad}, **ref)
        raises(TypeError, name, mate.gqa_attention, q, k8, v8, **{name: "0.5"}, **ref)
        raises(TypeError, name, mate.gqa_attention, q, k8, v8, **{name: torch.tensor([0.5], dtype=torch.float64)}, **ref)
        raises(ValueError, name, mate.gqa_attention, q, k8, v8, **{name: torch.tensor([0.5, 0.5])}, **ref)
        raises(ValueError, name, mate.gqa_attention, q, k8, v8, **{name: torch.ones(1, 1)}, **ref)
        raises(ValueError, name, mate.gqa_attention, q, k, v, **{name: 0.5}, **ref)  # a 16-bit cache takes no scale
        raises(ValueError, "tensor applies to FP8", mate.gqa_attention, q, k, v, **{name: torch.tensor([1.0])}, **ref)
    # a tensor's value: read by the reference (and by mate.debug_checks() on the native path)
    raises(ValueError, "k_scale", mate.gqa_attention, q, k8, v8, k_scale=torch.tensor(float("nan")), **ref)
    raises(ValueError, "v_scale", mate.gqa_attention, q, k8, v8, v_scale=torch.tensor([-1.0]), **ref)
    # the native layout rule counts bytes: an FP8 row of 64 features at an 8-element offset is not 16-byte aligned
    raises(ValueError, "16-byte", mate.gqa_attention, q[..., :64], k8[..., 8:72], v8[..., 8:72])
