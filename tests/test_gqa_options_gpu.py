"""gqa_attention's native options (issue 17) against the reference on the GPU: varlen, sinks, softcap
(run with `pytest -m gpu`). Fresh random inputs, poisoned outputs, odd lengths, an empty sequence, one
with more rows than keys, garbage before cu_seqlens_k[0] and past cu_seqlens_k[B]; a CUDA graph replayed
with new offsets; the options' timing cost is benchmarks/bench_gqa.py --options."""

import os

import pytest
import torch

import garbage as G
import mate
from mate.tuning.measure import capture_graph
from overrides import gqa_decode_splits
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


@pytest.fixture(scope="module")
def option_kernels():
    """Compiles the option variants of VARIANTS and BENCH_VARIANTS in parallel into TileLang's disk cache, on their
    entries' tiles (what the calls compile at first use, one after another: minutes)."""
    from mate import _dispatch, precompile

    jobs = []
    for dt, d, w, varlen, sinks, softcap in dict.fromkeys([*VARIANTS, *BENCH_VARIANTS]):
        spec = {"dtype": str(dt).removeprefix("torch."), "dim": d, "window": w}
        tiles = {**_dispatch.tiles("gqa_fwd", spec, "sm90"), "varlen": varlen, "sinks": sinks, "softcap": softcap}
        jobs.append(("gqa_fwd", _dispatch.spec_key(spec), tiles, True))
    failed = [f"{job}: {error}" for job, (_, error) in precompile.build_all(jobs, "sm90", min(16, os.cpu_count() or 1)) if error]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_options_match_reference(variant, option_kernels):
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
    # Decode (the split-KV kernel, one split: it writes the output itself): 8 rows over 5 keys, rows 0-2 see none.
    q, k, v = randn(2, 8, H, 128, dtype=BF16), randn(2, 5, 2, 128, dtype=BF16), randn(2, 5, 2, 128, dtype=BF16)
    for s in (sinks, None):
        out, lse, ref_out, ref_lse = run_both(q, k, v, (-1, 0), sinks=s)
        assert_attention_matches(out, lse, ref_out, ref_lse)
        assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
        empty = sinks.view(1, H, 1).expand(2, H, 3) if s is not None else torch.full((2, H, 3), float("-inf"), device="cuda")
        torch.testing.assert_close(lse[:, :, :3], empty, rtol=1e-5, atol=1e-5)


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


def replay_matches_reference(g, q, k, v, kw):
    """New queries, kw["out"] poisoned, one replay of g: the output is the reference's on the current inputs."""
    out = kw["out"]
    q.copy_(randn(*q.shape, dtype=q.dtype))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = mate.gqa_attention(q, k, v, backend="reference", **{**kw, "out": None})
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < 1e-2 and not torch.isnan(out).any(), err


def test_varlen_cuda_graph_replay_uses_current_offsets():
    q, k, v, meta = varlen_inputs(BF16, 64)
    sinks = torch.randn(8, device="cuda")
    out = torch.empty_like(q)
    kw = dict(sliding_window=(256, 0), sinks=sinks, softcap=20.0, out=out, **meta)
    g, _ = capture_graph(lambda: mate.gqa_attention(q, k, v, **kw))
    for perm in ([5, 4, 3, 2, 1, 0], [2, 0, 1, 5, 3, 4]):
        meta["cu_seqlens_q"].copy_(offsets([LENS_Q[i] for i in perm]))
        meta["cu_seqlens_k"].copy_(offsets([LENS_K[i] for i in perm], HEAD))
        sinks.copy_(torch.randn(8, device="cuda"))
        replay_matches_reference(g, q, k, v, kw)


# ---------------------------------------------------------------- paged caches and decode (split-KV kernel)

PAGED_LENS_K = [1, 700, 0, 1500, 333]  # a one-key sequence, an empty one, odd lengths
PAGE_SIZES = (16, 32, 64)
# (query rows per sequence, sinks, softcap): decode steps of 1-8 rows, a longer paged prefill, each option
PAGED_STEPS = [(1, False, False), (8, True, False), (5, False, True), (3, True, True), (100, True, True)]


def paged_cache(lens_k, page_size, Hkv, dim, dtype, hole=True, poison=True):
    """k/v caches with pages in random order and (poison) NaN/Inf in every slot no sequence owns (spare pages,
    the tail of each last page); past each length a -1 or an out-of-range id; with hole, one sequence's second
    page is -1 (its keys masked, its page poisoned). Returns (k, v, block_table, seq_lens_k)."""
    need = [-(-n // page_size) for n in lens_k]
    n_pages = sum(need) + 5
    k = randn(n_pages, page_size, Hkv, dim, dtype=dtype, scale=2.0)
    v = randn(n_pages, page_size, Hkv, dim, dtype=dtype)
    order = torch.randperm(n_pages).tolist()
    table = torch.full((len(lens_k), max(need) + 2), -1, dtype=torch.int32)
    used = torch.zeros(n_pages, page_size, dtype=torch.bool)
    for b, n in enumerate(lens_k):
        for p in range(need[b]):
            table[b, p] = order.pop()
            if not (hole and b == 1 and p == 1):
                used[table[b, p], : min(page_size, n - p * page_size)] = True
        table[b, need[b]] = n_pages + 7 if b % 2 else -1
    if hole:
        table[1, 1] = -1
    for x in (k, v) if poison else ():
        G.poison_unused(x, used)
    return k, v, table.cuda(), torch.tensor(lens_k, dtype=torch.int32, device="cuda")


@pytest.fixture(params=[None, 1], ids=["splits", "one_split"])
def split_policy(request):
    """A split-KV test twice: with the shipped split counts (on these small batches several splits and the merge,
    where the band is longer than four tiles) and with one split forced (the kernel writes the output itself)."""
    with gqa_decode_splits(request.param):
        yield


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("wclass", WINDOW_CLASSES)
def test_paged_matches_reference(dtype, dim, wclass, split_policy):
    """Padded and varlen queries against a paged cache, every page size in turn, each option in some step."""
    H, Hkv = 8, 2
    for n, window in enumerate(WINDOWS[wclass]):
        page_size = PAGE_SIZES[(n + dim // 64 + (dtype == FP16)) % len(PAGE_SIZES)]
        k, v, table, lens = paged_cache(PAGED_LENS_K, page_size, Hkv, dim, dtype)
        for sq, sinks, softcap in PAGED_STEPS:
            opts = dict(sinks=torch.randn(H, device="cuda") * 2 if sinks else None, softcap=15.0 if softcap else None)
            q = randn(len(PAGED_LENS_K), sq, H, dim, dtype=dtype, scale=2.0)
            assert_attention_matches(*run_both(q, k, v, window, block_table=table, seq_lens_k=lens, **opts))
        lens_q = [1, 8, 0, 3, 70]
        q = randn(sum(lens_q), H, dim, dtype=dtype, scale=2.0)
        out, lse, ref_out, ref_lse = run_both(q, k, v, window, block_table=table, seq_lens_k=lens, cu_seqlens_q=offsets(lens_q),
                                              max_seqlen_q=max(lens_q), sinks=torch.randn(H, device="cuda"))
        assert lse.shape == (H, q.shape[0])
        assert_attention_matches(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("sq", [1, 8, 16])
@pytest.mark.parametrize("window", [None, (-1, 0), (300, 0), (64, 16)], ids=str)
def test_padded_decode_matches_reference(sq, window, split_policy):
    """Padded q with at most 16 rows takes the split-KV kernel (k as one page per sequence); MQA and MHA groups too."""
    for H, Hkv in [(64, 8), (16, 1), (4, 4)]:
        q = randn(3, sq, H, 128, dtype=BF16, scale=2.0)
        k, v = randn(3, 2333, Hkv, 128, dtype=BF16, scale=2.0), randn(3, 2333, Hkv, 128, dtype=BF16)
        assert_attention_matches(*run_both(q, k, v, window))


def test_decode_into_an_out_whose_rows_do_not_flatten(split_policy):
    """out [B, Sq, H, D] sliced from [B, Sq + 1, H, D]: its rows do not flatten into one axis, so the output goes
    beside it and is copied in; the slice's neighbours stay as they were."""
    q = randn(3, 4, 16, 128, dtype=BF16, scale=2.0)
    k, v = randn(3, 1500, 2, 128, dtype=BF16, scale=2.0), randn(3, 1500, 2, 128, dtype=BF16)
    base = torch.full((3, 5, 16, 128), float("nan"), dtype=BF16, device="cuda")
    out = base[:, :4]
    res, lse = mate.gqa_attention(q, k, v, sliding_window=(700, 0), out=out, return_lse=True)
    ref_out, ref_lse = mate.gqa_attention(q, k, v, sliding_window=(700, 0), return_lse=True, backend="reference")
    assert res is out
    assert_attention_matches(out, lse, ref_out, ref_lse)
    assert torch.isnan(base[:, 4]).all()


def test_paged_garbage_changes_nothing(split_policy):
    """NaN/Inf in unowned pages, last pages' tails and -1 pages: bit-identical to zeros there."""
    k, v, table, lens = paged_cache([3000, 17, 64, 1], 16, 2, 128, BF16)
    q = randn(4, 4, 8, 128, dtype=BF16)
    kw = dict(block_table=table, seq_lens_k=lens, sinks=torch.randn(8, device="cuda"), return_lse=True)
    for window in [None, (100, 0)]:
        dirty = mate.gqa_attention(q, k, v, sliding_window=window, **kw)
        clean = mate.gqa_attention(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), sliding_window=window, **kw)
        assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
        assert torch.isfinite(dirty[0]).all()


def test_paged_decode_cuda_graph_replay_uses_current_table_and_lengths(split_policy):
    H, Hkv, D, B = 16, 2, 128, 6
    # Clean memory: the replays give the sequences other lengths and other rows of the table.
    k, v, table, lens = paged_cache([500, 1, 2000, 64, 0, 1234], 32, Hkv, D, BF16, hole=False, poison=False)
    q = randn(B, 1, H, D, dtype=BF16)
    out = torch.empty_like(q)
    kw = dict(block_table=table, seq_lens_k=lens, sliding_window=(1000, 0), sinks=torch.randn(H, device="cuda"), softcap=20.0, out=out)
    g, _ = capture_graph(lambda: mate.gqa_attention(q, k, v, **kw))
    for step in range(3):
        lens.copy_(torch.tensor([500 - step, 1 + step, 2000 - 7 * step, 64 + step, step, 1234], dtype=torch.int32))
        table.copy_(table[torch.randperm(B, device="cuda")])  # other pages, the same capacity
        replay_matches_reference(g, q, k, v, kw)
