"""gqa_attention's options on the CPU (issue 17): varlen, paged caches, sinks and softcap on the reference
against per-sequence padded calls, gathered dense caches and a float64 loop; garbage in unused memory;
every error of the new arguments."""

import math

import pytest
import torch

import garbage as G
import mate
from test_gqa import check, naive, raises

I32 = torch.int32


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)


def ref(*args, **kw):
    return mate.gqa_attention(*args, return_lse=True, backend="reference", **kw)


WINDOWS = [None, (-1, 0), (3, 0), (0, 4), (5, 2), (-1, 2)]
# Lengths with an empty sequence, one with more rows than keys and one with no rows.
LENS_Q, LENS_K = [5, 0, 9, 1, 0, 7], [8, 0, 4, 12, 3, 7]


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_sinks_and_softcap_match_the_formula(gen, window):
    B, Sq, Sk, H, Hkv, D = 2, 7, 9, 4, 2, 8
    q, k, v = rand(gen, B, Sq, H, D) * 2, rand(gen, B, Sk, Hkv, D) * 2, rand(gen, B, Sk, Hkv, D)
    sinks = rand(gen, H)
    left, right = (-1, -1) if window is None else window
    for kw in (dict(sinks=sinks), dict(softcap=1.5), dict(sinks=sinks, softcap=3.0, scale=0.7)):
        out, lse = ref(q, k, v, sliding_window=window, **kw)
        check(out, lse, *naive(q, k, v, left, right, kw.get("scale", 1 / math.sqrt(D)), kw.get("sinks"), kw.get("softcap")))


def test_softcap_zero_or_none_is_off_and_caps_scores(gen):
    q, k, v = rand(gen, 1, 6, 2, 8) * 5, rand(gen, 1, 6, 1, 8) * 5, rand(gen, 1, 6, 1, 8)
    plain = ref(q, k, v)
    for off in (None, 0, 0.0):
        assert all(torch.equal(a, b) for a, b in zip(plain, ref(q, k, v, softcap=off)))
    _, lse = ref(q, k, v, softcap=0.5)  # every score in (-0.5, 0.5): the LSE is within 0.5 of log(6)
    assert ((lse - math.log(6)).abs() < 0.5).all()


def test_sinks_take_mass_and_empty_rows_get_the_sink(gen):
    """Sq > Sk, causal: the first rows see nothing; with a sink their output is 0 and their LSE the sink."""
    q, k, v = rand(gen, 1, 10, 2, 4), rand(gen, 1, 4, 1, 4), rand(gen, 1, 4, 1, 4)
    sinks = torch.tensor([0.5, -2.0])
    out, lse = ref(q, k, v, sliding_window=(-1, 0), sinks=sinks)
    assert torch.equal(out[0, :6], torch.zeros(6, 2, 4))
    assert torch.equal(lse[0, :, :6], sinks.view(2, 1).expand(2, 6))
    plain, plain_lse = ref(q, k, v, sliding_window=(-1, 0))
    # out = plain * (1 - p_sink), lse = logaddexp(plain lse, sink)
    want_lse = torch.logaddexp(plain_lse[0, :, 6:], sinks.view(2, 1))
    torch.testing.assert_close(lse[0, :, 6:], want_lse)
    keep = torch.exp(plain_lse[0, :, 6:] - want_lse).T.unsqueeze(-1)  # [rows, H, 1]
    torch.testing.assert_close(out[0, 6:], plain[0, 6:] * keep)
    # No keys at all: LSE = the sink everywhere.
    out, lse = ref(q, k[:, :0], v[:, :0], sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 10))


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("opts", [{}, {"sinks": True, "softcap": 2.0}], ids=["plain", "sinks+softcap"])
def test_varlen_equals_per_sequence_padded_calls(gen, window, opts):
    H, Hkv, D = 4, 2, 8
    q = rand(gen, sum(LENS_Q), H, D)
    k, v = rand(gen, sum(LENS_K) + 3, Hkv, D), rand(gen, sum(LENS_K) + 3, Hkv, D)  # 3 unused rows at the end
    kw = dict(sliding_window=window, softcap=opts.get("softcap"), sinks=rand(gen, H) if opts.get("sinks") else None)
    out, lse = ref(q, k, v, cu_seqlens_q=cu(LENS_Q), cu_seqlens_k=cu(LENS_K), max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K), **kw)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    cq, ck = cu(LENS_Q).tolist(), cu(LENS_K).tolist()
    for b in range(len(LENS_Q)):
        qb, kb, vb = q[cq[b] : cq[b + 1]][None], k[ck[b] : ck[b + 1]][None], v[ck[b] : ck[b + 1]][None]
        ob, lb = ref(qb, kb, vb, **kw)
        torch.testing.assert_close(out[cq[b] : cq[b + 1]], ob[0], rtol=1e-6, atol=1e-6, msg=f"sequence {b}")
        torch.testing.assert_close(lse[:, cq[b] : cq[b + 1]], lb[0], rtol=1e-6, atol=1e-6, msg=f"sequence {b}")


def test_varlen_max_seqlen_larger_than_needed_changes_nothing(gen):
    q, k, v = rand(gen, 14, 2, 8), rand(gen, 20, 1, 8), rand(gen, 20, 1, 8)
    a = ref(q, k, v, cu_seqlens_q=cu([5, 9]), cu_seqlens_k=cu([8, 12]), max_seqlen_q=9, max_seqlen_k=12, sliding_window=(-1, 0))
    b = ref(q, k, v, cu_seqlens_q=cu([5, 9]), cu_seqlens_k=cu([8, 12]), max_seqlen_q=40, max_seqlen_k=33, sliding_window=(-1, 0))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def paged(gen, lens_k, page_size, Hkv, D, extra_pages=3):
    """A paged cache holding the keys of lens_k, its block table (pages in random order, -1 and
    out-of-range ids past each length) and the dense keys [B, max(lens), Hkv, D] it stands for."""
    B = len(lens_k)
    max_pages = max(-(-n // page_size) for n in lens_k) + 1
    n_pages = sum(-(-n // page_size) for n in lens_k) + extra_pages
    kc, vc = rand(gen, n_pages, page_size, Hkv, D), rand(gen, n_pages, page_size, Hkv, D)
    order = torch.randperm(n_pages, generator=gen).tolist()
    table = torch.full((B, max_pages), -1, dtype=I32)
    dense_k = torch.zeros(B, max(lens_k), Hkv, D)
    dense_v = torch.zeros_like(dense_k)
    for b, n in enumerate(lens_k):
        for p in range(-(-n // page_size)):
            table[b, p] = order.pop()
        if -(-n // page_size) < max_pages:
            table[b, -1] = n_pages + 5 if b % 2 else -1  # past the pool or -1, past the length
        for j in range(n):
            dense_k[b, j], dense_v[b, j] = kc[table[b, j // page_size], j % page_size], vc[table[b, j // page_size], j % page_size]
    return kc, vc, table, torch.tensor(lens_k, dtype=I32), dense_k, dense_v


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("window", [None, (-1, 0), (4, 0), (2, 3)], ids=str)
def test_paged_equals_gathered_dense(gen, page_size, window):
    H, Hkv, D, Sq = 4, 2, 8, 3
    lens_k = [9, 17, 3, 20]
    kc, vc, table, seq_lens, dk, dv = paged(gen, lens_k, page_size, Hkv, D)
    q = rand(gen, len(lens_k), Sq, H, D)
    sinks = rand(gen, H)
    out, lse = ref(q, kc, vc, block_table=table, seq_lens_k=seq_lens, sliding_window=window, sinks=sinks, softcap=4.0)
    assert out.shape == q.shape and lse.shape == (len(lens_k), H, Sq)
    for b, n in enumerate(lens_k):
        ob, lb = ref(q[b : b + 1], dk[b : b + 1, :n], dv[b : b + 1, :n], sliding_window=window, sinks=sinks, softcap=4.0)
        torch.testing.assert_close(out[b], ob[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[b], lb[0], rtol=1e-6, atol=1e-6)


def test_paged_with_varlen_queries(gen):
    H, Hkv, D = 4, 1, 8
    lens_k, lens_q = [9, 17, 3], [2, 0, 5]
    kc, vc, table, seq_lens, dk, dv = paged(gen, lens_k, 4, Hkv, D)
    q = rand(gen, sum(lens_q), H, D)
    out, lse = ref(q, kc, vc, cu_seqlens_q=cu(lens_q), max_seqlen_q=5, block_table=table, seq_lens_k=seq_lens, sliding_window=(-1, 0))
    assert lse.shape == (H, sum(lens_q))
    cq = cu(lens_q).tolist()
    for b, n in enumerate(lens_k):
        ob, lb = ref(q[cq[b] : cq[b + 1]][None], dk[b : b + 1, :n], dv[b : b + 1, :n], sliding_window=(-1, 0))
        torch.testing.assert_close(out[cq[b] : cq[b + 1]], ob[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, cq[b] : cq[b + 1]], lb[0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- garbage in unused memory


def test_garbage_in_unused_pages_and_slots_never_matters(gen):
    """NaN/Inf in unowned pages, the tail of a sequence's last page and the pages of -1 / out-of-range ids."""
    H, Hkv, D = 4, 2, 8
    lens_k = [9, 17, 3, 20]
    kc, vc, table, seq_lens, _, _ = paged(gen, lens_k, 4, Hkv, D)
    q = rand(gen, len(lens_k), 2, H, D)
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens_k):
        for j in range(n):
            used[table[b, j // 4], j % 4] = True
    clean = ref(q, kc, vc, block_table=table, seq_lens_k=seq_lens, sliding_window=(5, 0))
    G.poison_unused(kc, used)
    G.poison_unused(vc, used)
    dirty = ref(q, kc, vc, block_table=table, seq_lens_k=seq_lens, sliding_window=(5, 0))
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    assert not torch.isfinite(kc).all()  # the poisoning did put garbage somewhere


def test_garbage_outside_the_varlen_windows_never_matters(gen):
    H, Hkv, D, window = 2, 1, 8, (3, 0)
    q, k, v = rand(gen, sum(LENS_Q), H, D), rand(gen, sum(LENS_K) + 4, Hkv, D), rand(gen, sum(LENS_K) + 4, Hkv, D)
    kw = dict(cu_seqlens_q=cu(LENS_Q), cu_seqlens_k=cu(LENS_K), max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K), sliding_window=window)
    clean = ref(q, k, v, **kw)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    ck = cu(LENS_K).tolist()
    for b, (nq, nk) in enumerate(zip(LENS_Q, LENS_K)):
        used[ck[b] : ck[b + 1]] = G.window_keys(nq, nk, window)
    G.poison_unused(k, used)
    G.poison_unused(v, used)
    assert all(torch.equal(a, b) for a, b in zip(clean, ref(q, k, v, **kw)))


# ---------------------------------------------------------------- errors


def test_option_errors():
    q, k, v = rand(torch.Generator(), 14, 4, 8), rand(torch.Generator(), 20, 2, 8), rand(torch.Generator(), 20, 2, 8)
    cq, ck = cu([5, 9]), cu([8, 12])
    vl = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=9, max_seqlen_k=12, backend="reference")
    f = mate.gqa_attention
    raises(ValueError, r"q must be \[total_q, H, D\]", f, q[None], k, v, **vl)
    raises(ValueError, r"k must be \[total_k, H_kv, D\]", f, q, k[None], v[None], **vl)
    raises(TypeError, "cu_seqlens_q must be an int32", f, q, k, v, **{**vl, "cu_seqlens_q": cq.long()})
    raises(TypeError, "cu_seqlens_k must be a torch.Tensor", f, q, k, v, **{**vl, "cu_seqlens_k": [0, 8, 20]})
    raises(ValueError, "cu_seqlens_q must have rank 1", f, q, k, v, **{**vl, "cu_seqlens_q": cq[None]})
    raises(ValueError, "cu_seqlens_q must hold B \\+ 1 >= 2", f, q, k, v, **{**vl, "cu_seqlens_q": cq[:1]})
    raises(ValueError, r"cu_seqlens_k must have shape \(3,\)", f, q, k, v, **{**vl, "cu_seqlens_k": cu([8, 6, 6])})
    raises(ValueError, "max_seqlen_q is required", f, q, k, v, **{**vl, "max_seqlen_q": None})
    raises(TypeError, "max_seqlen_k must be an int", f, q, k, v, **{**vl, "max_seqlen_k": 12.0})
    raises(ValueError, "max_seqlen_k must be >= 0", f, q, k, v, **{**vl, "max_seqlen_k": -1})
    raises(ValueError, "max_seqlen_q is 0 but q holds 14 rows", f, q, k, v, **{**vl, "max_seqlen_q": 0})
    raises(ValueError, "needs varlen k", f, q, k, v, cu_seqlens_q=cq, max_seqlen_q=9, backend="reference")
    q4, k4, v4 = q[None], k[None], v[None]
    raises(ValueError, "cu_seqlens_k needs varlen q", f, q4, k[:8], v[:8], cu_seqlens_k=ck, max_seqlen_k=12, backend="reference")
    raises(ValueError, "max_seqlen_q applies to varlen q", f, q4, k4, v4, max_seqlen_q=9, backend="reference")
    raises(ValueError, "max_seqlen_k applies to varlen k", f, q4, k4, v4, max_seqlen_k=9, backend="reference")
    raises(ValueError, "seq_lens_k applies to a paged cache", f, q4, k4, v4, seq_lens_k=torch.zeros(1, dtype=I32), backend="reference")
    # paged
    kc, vc = rand(torch.Generator(), 6, 4, 2, 8), rand(torch.Generator(), 6, 4, 2, 8)
    table, lens = torch.zeros(1, 3, dtype=I32), torch.tensor([7], dtype=I32)
    pg = dict(block_table=table, seq_lens_k=lens, backend="reference")
    raises(ValueError, r"k must be \[pages, page_size, H_kv, D\]", f, q4, k, v, **pg)
    raises(ValueError, "block_table must have one row per request", f, q4, kc, vc, **{**pg, "block_table": torch.zeros(2, 3, dtype=I32)})
    raises(TypeError, "block_table must be an int32", f, q4, kc, vc, **{**pg, "block_table": table.long()})
    raises(ValueError, "block_table needs seq_lens_k", f, q4, kc, vc, **{**pg, "seq_lens_k": None})
    raises(ValueError, r"seq_lens_k must have shape \(1,\)", f, q4, kc, vc, **{**pg, "seq_lens_k": torch.tensor([7, 7], dtype=I32)})
    raises(TypeError, "seq_lens_k must be an int32", f, q4, kc, vc, **{**pg, "seq_lens_k": lens.long()})
    raises(ValueError, "either cu_seqlens_k .* or block_table", f, q, kc, vc, cu_seqlens_q=cq, max_seqlen_q=9, cu_seqlens_k=ck,
           max_seqlen_k=12, block_table=torch.zeros(2, 3, dtype=I32), seq_lens_k=torch.zeros(2, dtype=I32), backend="reference")
    # sinks and softcap
    raises(TypeError, "sinks must be a float32", f, q4, k4, v4, sinks=torch.zeros(4, dtype=torch.bfloat16), backend="reference")
    raises(TypeError, "sinks must be a torch.Tensor", f, q4, k4, v4, sinks=[0.0] * 4, backend="reference")
    raises(ValueError, r"sinks must have shape \(4,\)", f, q4, k4, v4, sinks=torch.zeros(2), backend="reference")
    raises(ValueError, "sinks must have rank 1", f, q4, k4, v4, sinks=torch.zeros(1, 4), backend="reference")
    raises(ValueError, "softcap must be None, 0", f, q4, k4, v4, softcap=-1.0, backend="reference")
    raises(ValueError, "softcap must be None, 0", f, q4, k4, v4, softcap=float("nan"), backend="reference")
    raises(TypeError, "softcap must be None or a float", f, q4, k4, v4, softcap="1", backend="reference")
    raises(TypeError, "softcap must be None or a float", f, q4, k4, v4, softcap=True, backend="reference")


def test_native_option_limits():
    """On the CPU the native backend names the target (paged caches too) and still checks the native limits."""
    q, kc, vc = torch.randn(1, 2, 4, 64).bfloat16(), torch.randn(3, 16, 2, 64).bfloat16(), torch.randn(3, 16, 2, 64).bfloat16()
    table, lens = torch.zeros(1, 2, dtype=I32), torch.tensor([20], dtype=I32)
    raises(ValueError, "sm90", mate.gqa_attention, q, kc, vc, block_table=table, seq_lens_k=lens)
    raises(ValueError, "head dim 64 or 128", mate.gqa_attention, q[..., :32], kc[..., :32], vc[..., :32], block_table=table, seq_lens_k=lens)
    raises(ValueError, "float16", mate.gqa_attention, q.float(), kc.float(), vc.float(), block_table=table, seq_lens_k=lens)
    odd = torch.randn(3, 16, 2, 65).bfloat16()[..., :64]  # rows 130 bytes apart
    raises(ValueError, "stride", mate.gqa_attention, q, odd, odd, block_table=table, seq_lens_k=lens)
    q3, k3 = torch.randn(5, 4, 64).bfloat16(), torch.randn(6, 2, 64).bfloat16()
    raises(ValueError, "sm90", mate.gqa_attention, q3, k3, k3, cu_seqlens_q=cu([5]), cu_seqlens_k=cu([6]), max_seqlen_q=5, max_seqlen_k=6)
    raises(ValueError, "sm90", mate.gqa_attention, q, q, q, sinks=torch.zeros(4), softcap=5.0)


def test_debug_checks_catch_bad_offsets_and_lengths():
    q, k = torch.randn(14, 2, 8), torch.randn(20, 1, 8)
    kw = dict(cu_seqlens_k=cu([8, 12]), max_seqlen_k=12, backend="reference")
    with mate.debug_checks():
        raises(ValueError, "cu_seqlens_q must run from 0", mate.gqa_attention, q, k, k, cu_seqlens_q=cu([5, 8]), max_seqlen_q=9, **kw)
        raises(ValueError, "nondecreasing", mate.gqa_attention, q, k, k, cu_seqlens_q=torch.tensor([0, 9, 5], dtype=I32), max_seqlen_q=9, **kw)
        raises(ValueError, "max_seqlen_q = 4", mate.gqa_attention, q, k, k, cu_seqlens_q=cu([5, 9]), max_seqlen_q=4, **kw)
        raises(ValueError, "cu_seqlens_k must be offsets within", mate.gqa_attention, q, k, k, cu_seqlens_q=cu([5, 9]), max_seqlen_q=9,
               cu_seqlens_k=cu([8, 13]), max_seqlen_k=13, backend="reference")
        kc = torch.randn(3, 4, 1, 8)
        raises(ValueError, "block_table", mate.gqa_attention, q[:2][None], kc, kc, block_table=torch.tensor([[0, 3]], dtype=I32),
               seq_lens_k=torch.tensor([5], dtype=I32), backend="reference")
        raises(ValueError, "seq_lens_k", mate.gqa_attention, q[:2][None], kc, kc, block_table=torch.tensor([[0, 2]], dtype=I32),
               seq_lens_k=torch.tensor([9], dtype=I32), backend="reference")


# ---------------------------------------------------------------- the native variants lower (no GPU)


@pytest.mark.compile
@pytest.mark.parametrize("key, mma_depth", [("dtype=bfloat16,dim=128,window=causal", 2), ("dtype=float16,dim=64,window=local", 2),
                                            ("dtype=bfloat16,dim=128,window=none", 1), ("dtype=bfloat16,dim=128,window=local", 1)])
def test_option_variants_lower_for_sm90a(key, mma_depth):
    """The program with every option on, both consumer schedules: TileLang lowers it to CUDA that reads the offsets,
    the sinks and applies the softcap (the GPU tests run what these generate)."""
    from mate import _dispatch

    spec = _dispatch.parse_key(key)
    tiles = dict(_dispatch.tiles("gqa_fwd", spec, "sm90"), mma_depth=mma_depth)
    src = _dispatch.lower_program("gqa_fwd", spec, "sm90", {**tiles, "varlen": True, "sinks": True, "softcap": True})
    assert all(name in src for name in ("CuQ[", "CuK[", "Sinks[", "tanhf(")), key


# ---------------------------------------------------------------- the split-KV kernel's routing (no GPU)


def _problem(q, k, **kw):
    from mate.swa import attention as A

    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None, seq_lens_k=None,
                sliding_window=None, sinks=None, softcap=None, scale=None, k_scale=1.0, v_scale=1.0, out=None, return_lse=False,
                backend="reference")
    return A._resolve(q, k, k, **{**args, **kw})


def test_split_kv_takes_paged_caches_and_padded_decode():
    from mate.swa.attention import DECODE_MAX_ROWS

    k = torch.randn(2, 50, 2, 8)
    assert _problem(torch.randn(2, DECODE_MAX_ROWS, 4, 8), k).split_kv
    assert not _problem(torch.randn(2, DECODE_MAX_ROWS + 1, 4, 8), k).split_kv
    kc, _, table, lens, _, _ = paged(torch.Generator().manual_seed(0), [9, 40], 16, 2, 8)
    assert _problem(torch.randn(2, 300, 4, 8), kc, block_table=table, seq_lens_k=lens).split_kv
    assert _problem(torch.randn(5, 4, 8), kc, block_table=table, seq_lens_k=lens, cu_seqlens_q=cu([2, 3]), max_seqlen_q=3).split_kv
    assert not _problem(torch.randn(5, 4, 8), torch.randn(7, 2, 8), cu_seqlens_q=cu([2, 3]), max_seqlen_q=3,
                        cu_seqlens_k=cu([3, 4]), max_seqlen_k=4).split_kv


# H200-shaped (132 multiprocessors), B x 1 row x 8192 keys, H 64 / 8 (one row tile of 8 packed rows a KV head):
# at D 128 two CTAs are resident a multiprocessor (264 slots), at D 64 four (528).
@pytest.mark.parametrize("dim, batch, window, want", [
    (128, 64, None, 1), (128, 32, (4096, 0), 1),  # 512 / 256 CTAs: whole waves unsplit
    (128, 48, None, 2), (128, 40, None, 4), (128, 24, (4096, 0), 4), (128, 16, None, 2),  # partial waves
    (128, 56, None, 1),  # 7 splits would be 14% below one: less than SPLIT_GAIN
    (64, 32, None, 2), (64, 16, (4096, 0), 4), (64, 64, None, 1),
    (128, 1, None, 32), (128, 1, (4096, 0), 17),  # MIN_SPLIT_TILES bound the splits
    (128, 2, (100, 0), 1),  # a band of two tiles
])
def test_key_splits_fill_the_resident_slots(monkeypatch, dim, batch, window, want):
    """_num_splits' wave model on the shipped tiles: one split unless a count fills the slots SPLIT_GAIN better."""
    from mate import _dispatch
    from mate.swa import attention as A

    monkeypatch.setattr(_dispatch, "sm_count", lambda device: 132)
    p = _problem(torch.randn(batch, 1, 64, dim), torch.randn(batch, 8192, 8, dim), sliding_window=window)
    spec = A._spec(torch.bfloat16, dim, p.left, p.right)
    assert A._num_splits(p, 8, 8, 8192, spec, _dispatch.tiles("gqa_decode", spec, "sm90")) == want


def test_gqa_decode_splits_forces_records_and_restores_the_choice(monkeypatch):
    from mate import _dispatch
    from mate.swa import attention as A
    from overrides import gqa_decode_splits

    monkeypatch.setattr(_dispatch, "sm_count", lambda device: 132)
    choose = A._num_splits
    p = _problem(torch.randn(16, 1, 64, 128), torch.randn(16, 8192, 8, 128))
    spec = A._spec(torch.bfloat16, 128, p.left, p.right)
    args = (p, 8, 8, 8192, spec, _dispatch.tiles("gqa_decode", spec, "sm90"))
    seen = []
    with gqa_decode_splits(5, seen):
        assert A._num_splits(*args) == 5
    with gqa_decode_splits(None, seen):
        assert A._num_splits(*args) == 2  # the shipped choice (test_key_splits_fill_the_resident_slots)
    assert seen == [5, 2] and A._num_splits is choose


@pytest.mark.compile
def test_split_kv_program_gathers_by_tma_boxes_or_zero_filling_cp_async():
    """The split-KV program lowers to TMA boxes of r rows x 64 columns (r = 64, 32, 16: one expect_tx size each)
    beside a zero-filling cp.async gather of K and V, and wgmma, with only its own barriers."""
    import re

    from mate import _dispatch

    spec = _dispatch.parse_key("dtype=bfloat16,dim=128,window=local")
    src = _dispatch.lower_program("gqa_decode", spec, "sm90")
    assert src.count("cp_async_gs_conditional<16>") == 4 and "wgmma_rs" in src and "wgmma_ss" in src
    assert set(map(int, re.findall(r"expect_transaction\((\d+)\)", src))) == {r * 64 * 2 for r in (64, 32, 16)}
    # mbarriers initialized; rows published; the prologue's page ids published; tile landed; stage released (the
    # next tile's ids, loaded a tile ahead, written with it)
    in_flight = _dispatch.tiles("gqa_decode", spec, "sm90")["num_stages"] - 1
    assert src.count("__syncthreads()") == 5 and src.count(f"cp_async_wait<{in_flight}>") == 1
