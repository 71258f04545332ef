"""gqa_attention's native options (issue 17) against the reference on the GPU: varlen, sinks, softcap
(run with `pytest -m gpu`). Fresh random inputs, poisoned outputs, odd lengths, an empty sequence, one
with more rows than keys, garbage before cu_seqlens_k[0] and past cu_seqlens_k[B]; a CUDA graph replayed
with new offsets; the options' timing cost is benchmarks/bench_gqa.py --options."""

import pytest
import torch

import garbage as G
import mate
from test_gqa_gpu import assert_attention_matches, run_both
from mate.swa.kernels.gqa_card import WINDOWS as WINDOW_CLASSES

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
# The compiled variants under test, (dtype, dim, window class, varlen, sinks, softcap): every option
# alone and all together, on each window class and head dim (all three on both dtypes).
VARIANTS = [
    *[(dt, d, w, True, True, True) for dt in (BF16, FP16) for d in (64, 128) for w in WINDOW_CLASSES],
    *[(BF16, d, w, True, False, False) for d in (64, 128) for w in WINDOW_CLASSES],
    (BF16, 128, "causal", False, True, False),
    (BF16, 128, "local", False, True, False),
    (BF16, 64, "causal", False, False, True),
    (FP16, 128, "none", False, True, True),
    (BF16, 64, "local", False, True, True),
]
# What benchmarks/bench_gqa.py --options also times (precompiled with the above).
BENCH_VARIANTS = [(BF16, 128, w, False, sinks, True) for w in ("causal", "local") for sinks in (False, True)]
WINDOWS = {"none": [None], "causal": [(-1, 0), (-1, 3)], "local": [(128, 0), (0, 0), (256, 256), (5, -1)]}
# Sequence lengths: odd sizes, an empty sequence, one with more rows than keys, a single row.
LENS_Q = [300, 0, 1, 777, 129, 450]
LENS_K = [300, 50, 900, 777, 100, 1000]
HEAD = 16  # garbage rows before cu_seqlens_k[0]
TAIL = 40  # and past cu_seqlens_k[B]


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def offsets(lens, start=0):
    return torch.tensor([start, *(start + torch.tensor(lens).cumsum(0)).tolist()], dtype=torch.int32, device="cuda")


def varlen_inputs(dtype, dim, H=8, Hkv=2):
    """q, k, v packed, with garbage in k/v's unused head and tail rows."""
    q = randn(sum(LENS_Q), H, dim, dtype=dtype, scale=2.0)
    k = randn(HEAD + sum(LENS_K) + TAIL, Hkv, dim, dtype=dtype, scale=2.0)
    v = randn(*k.shape, dtype=dtype)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    used[HEAD : HEAD + sum(LENS_K)] = True
    for x in (k, v):
        G.poison_unused(x, used)
    return q, k, v, dict(cu_seqlens_q=offsets(LENS_Q), cu_seqlens_k=offsets(LENS_K, HEAD),
                         max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K))


def variant_id(v):
    dt, d, w, varlen, sinks, softcap = v
    return f"{str(dt)[6:]}-d{d}-{w}" + "".join(f"-{n}" for n, on in (("varlen", varlen), ("sinks", sinks), ("softcap", softcap)) if on)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_options_match_reference(variant):
    dtype, dim, wclass, varlen, sinks, softcap = variant
    H = 8
    opts = dict(sinks=torch.randn(H, device="cuda") * 2 if sinks else None, softcap=15.0 if softcap else None)
    for window in WINDOWS[wclass]:
        if varlen:
            q, k, v, meta = varlen_inputs(dtype, dim, H)
            out, lse, ref_out, ref_lse = run_both(q, k, v, window, **meta, **opts)
            assert lse.shape == (H, q.shape[0])
            assert_attention_matches(out, lse, ref_out, ref_lse)
        else:
            for sq, sk in [(1000, 1100), (1100, 300)]:
                q = randn(2, sq, H, dim, dtype=dtype, scale=2.0)
                k, v = randn(2, sk, 2, dim, dtype=dtype, scale=2.0), randn(2, sk, 2, dim, dtype=dtype)
                assert_attention_matches(*run_both(q, k, v, window, **opts))


def test_sink_only_rows_and_no_keys():
    """Rows that see no key: output 0 and LSE the sink; no keys at all (host path) likewise."""
    H = 4
    sinks = torch.randn(H, device="cuda")
    q, k, v = randn(1, 300, H, 128, dtype=BF16), randn(1, 100, 2, 128, dtype=BF16), randn(1, 100, 2, 128, dtype=BF16)
    out, lse, ref_out, ref_lse = run_both(q, k, v, (-1, 0), sinks=sinks)
    assert_attention_matches(out, lse, ref_out, ref_lse)
    assert torch.equal(out[0, :200], torch.zeros_like(out[0, :200]))
    torch.testing.assert_close(lse[0, :, :200], sinks.view(H, 1).expand(H, 200), rtol=1e-5, atol=1e-5)  # through exp2/log2
    out, lse = mate.gqa_attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks.view(1, H, 1).expand(1, H, 300))


def test_varlen_garbage_outside_the_sequences_changes_nothing():
    """Garbage in the unused rows of k/v (before cu_seqlens_k[0], past cu_seqlens_k[B]): bit-identical results."""
    q, k, v, meta = varlen_inputs(BF16, 128)
    k.nan_to_num_(0.0, 0.0, 0.0)
    v.nan_to_num_(0.0, 0.0, 0.0)
    clean = mate.gqa_attention(q, k, v, sliding_window=(128, 0), return_lse=True, **meta)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    used[HEAD : HEAD + sum(LENS_K)] = True
    for x in (k, v):
        G.poison_unused(x, used)
    dirty = mate.gqa_attention(q, k, v, sliding_window=(128, 0), return_lse=True, **meta)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


def test_varlen_cuda_graph_replay_uses_current_offsets():
    q, k, v, meta = varlen_inputs(BF16, 64)
    sinks = torch.randn(8, device="cuda")
    out = torch.empty_like(q)
    kw = dict(sliding_window=(256, 0), sinks=sinks, softcap=20.0, out=out, **meta)
    mate.gqa_attention(q, k, v, **kw)  # warm-up: compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mate.gqa_attention(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mate.gqa_attention(q, k, v, **kw)
    for perm in ([5, 4, 3, 2, 1, 0], [2, 0, 1, 5, 3, 4]):
        meta["cu_seqlens_q"].copy_(offsets([LENS_Q[i] for i in perm]))
        meta["cu_seqlens_k"].copy_(offsets([LENS_K[i] for i in perm], HEAD))
        sinks.copy_(torch.randn(8, device="cuda"))
        q.copy_(randn(*q.shape, dtype=q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = mate.gqa_attention(q, k, v, backend="reference", **{**kw, "out": None})
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 1e-2 and not torch.isnan(out).any()
