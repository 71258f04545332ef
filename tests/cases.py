"""Every native path as one case: small inputs full of edge cases, the public call, a metadata refresh.

The CUDA Graph, sync-debug, determinism and torch.compile tests and the
sanitizer script (tests/sanitize.py) iterate over CASES, so a new native path
is one entry there. `make(device, gen)` builds a Problem on `device`:

- `call(backend)` runs the public entrypoint and returns its output tensors
  (a tuple); with backend="tilelang" it runs the native kernel, with
  "reference" the oracle on the same inputs;
- `refresh()` writes new random metadata (and data) into the same buffers, as a
  server does between CUDA Graph replays;
- `tol`: relative norm error allowed between native and reference.

Inputs cover -1 pads, ids past the capacity, -1 and past-the-pool pages, empty
rows and requests, duplicates, odd sizes and sliced views with storage offsets.
Views are cut from the end of their base tensors, so a read past a view runs
off the allocation, where compute-sanitizer sees it. Random values come from
`gen` (a CPU generator), so a case is the same on every device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import mate
from inputs import K_SCALE, V_SCALE, fp8_cache, fp8_quantized, fp8_scales, nsa_indices, qsa_token_rows, randint, randn, tail_view
from mate.tuning.workloads import indexer_like_scores

I32 = torch.int32
BF16 = torch.bfloat16


@dataclass
class Problem:
    call: Callable[[str], tuple]
    refresh: Callable[[], None]
    tol: float = 1e-2


# ---------------------------------------------------------------- MQA indexer (H = 4, D = 128)


def mqa_score(device, gen):
    B, Q, N = 3, 37, 45
    q = tail_view(gen, (B, Q, 4, 128), device=device, pad_cols=8)
    k = tail_view(gen, (B, N, 128), device=device, pad_rows=1)
    pos = torch.zeros(B, Q, dtype=I32, device=device)
    lens = torch.zeros(B, dtype=I32, device=device)

    def refresh():
        pos.copy_(randint(gen, -3, 4 * N + 8, (B, Q), device))  # negative and past the keys
        lens.copy_(torch.tensor([Q, int(torch.randint(0, Q, (1,), generator=gen)), 0], dtype=I32))  # an empty request

    def call(backend):
        return (mate.qsa_indexer_mqa_score(q, k, query_positions=pos, seq_lens_q=lens, scale=0.7, backend=backend),)

    refresh()
    return Problem(call, refresh, tol=1e-4)


def _prefill_intervals(gen, starts, ends, keys, device):
    """New [start, end) rows in place: empty, inverted and past-the-end intervals among them."""
    s = randint(gen, -4, keys, starts.shape, device)
    starts.copy_(s)
    ends.copy_(s + randint(gen, -5, keys // 2 + 5, starts.shape, device))


def mqa_prefill(device, gen):
    rows, keys = 53, 75
    q = tail_view(gen, (rows, 4, 128), device=device)
    k = tail_view(gen, (keys, 128), device=device, pad_rows=5, pad_cols=16)
    meta = torch.zeros(2 * rows + 1, dtype=I32, device=device)
    starts, ends = meta[1::2], meta[:-1:2]  # strided metadata at an offset

    def refresh():
        _prefill_intervals(gen, starts, ends, keys, device)

    def call(backend):
        return (mate.qsa_mqa_prefill(q, k, starts, ends, backend=backend),)

    refresh()
    return Problem(call, refresh, tol=1e-4)


def mqa_prefill_topk(device, gen):
    """The prefill selection (qsa_mqa_prefill(topk=...)): q and k small integers, scale 1/4, so the scores are
    exact and the selection must be too; views at offsets, empty, inverted and past-the-end intervals, rows with
    fewer visible keys than k."""
    rows, keys, k = 37, 300, 64
    q = randint(gen, -3, 4, (rows + 1, 4, 128), device).to(BF16)[1:]
    keys_t = randint(gen, -3, 4, (keys + 1, 128), device).to(BF16)[1:]
    starts = torch.zeros(rows, dtype=I32, device=device)
    ends = torch.zeros(rows, dtype=I32, device=device)
    pos = torch.zeros(rows, dtype=I32, device=device)

    def refresh():
        _prefill_intervals(gen, starts, ends, keys, device)
        pos.copy_(4 * ends + randint(gen, -3, 4, (rows,), device))

    def call(backend):
        return mate.qsa_mqa_prefill(q, keys_t, starts, ends, scale=0.25, topk=k, query_positions=pos, backend=backend)

    refresh()
    return Problem(call, refresh, tol=0.0)


def _mqa_decode(kv_dtype=None, q_dtype=BF16, tensor_scale=False):
    """Paged decode; kv_dtype an FP8 key cache (issue 38) with a float k_scale, or with tensor_scale a 0-dim
    FP32 tensor at a storage offset whose value refresh() rewrites in place, as a server does between replays."""

    def make(device, gen):
        B, pages, ps, max_pages = 5, 9, 16, 4
        q = tail_view(gen, (B, 4, 128), device=device, pad_rows=1, dtype=q_dtype)
        if kv_dtype is None:
            cache, kw = tail_view(gen, (pages, ps, 1, 128), device=device, pad_rows=1), {}
        else:
            cache = fp8_cache(gen, pages + 1, ps, 1, 128, device=device, dtype=kv_dtype)[1:]
            k_scale = torch.zeros(2, device=device)[1] if tensor_scale else 0.0173
            kw = dict(k_scale=k_scale)
        table = torch.zeros(B, max_pages, dtype=I32, device=device)
        ctx = torch.zeros(B, dtype=I32, device=device)

        def refresh():
            t = randint(gen, 0, pages, (B, max_pages), device)
            t[0, 1], t[1, 0], t[2, -1] = -1, pages, pages + 1000  # missing and past-the-pool pages
            table.copy_(t)
            c = randint(gen, 1, max_pages * ps + 1, (B,), device)
            c[3], c[4] = 0, max_pages * ps + 40  # empty, past the table
            ctx.copy_(c)
            if tensor_scale:
                kw["k_scale"].copy_(torch.empty(()).uniform_(0.01, 4.0, generator=gen))

        def call(backend):
            return (mate.qsa_mqa_decode(q, cache, table, ctx, max_pages * ps + 5, **kw, backend=backend),)  # a -inf tail

        refresh()
        return Problem(call, refresh, tol=1e-4)

    return make


mqa_decode = _mqa_decode()


def mqa_decode_topk(device, gen):
    """The decode selection (qsa_mqa_decode(topk=...)): q and keys small integers, scale 1/4, so the scores are
    exact and the selection must be too; views at offsets, missing and past-the-pool pages, empty and long
    contexts, a -inf tail past the table, rows with fewer visible keys than k, positions around the block edges."""
    B, pages, ps, max_pages, k = 6, 40, 16, 8, 100
    base_q = randint(gen, -3, 4, (B + 1, 4, 128), device).to(BF16)
    q = base_q[1:]
    cache = randint(gen, -3, 4, (pages + 1, ps, 1, 128), device).to(BF16)[1:]
    table = torch.zeros(B, max_pages, dtype=I32, device=device)
    ctx = torch.zeros(B, dtype=I32, device=device)
    pos = torch.zeros(B, dtype=I32, device=device)

    def refresh():
        t = randint(gen, 0, pages, (B, max_pages), device)
        t[0, 1], t[1, 0], t[2, -1] = -1, pages, pages + 1000
        table.copy_(t)
        c = randint(gen, 1, max_pages * ps + 1, (B,), device)
        c[3], c[4], c[5] = 0, max_pages * ps + 40, 50
        ctx.copy_(c)
        pos.copy_(4 * c + randint(gen, -3, 4, (B,), device))

    def call(backend):
        return mate.qsa_mqa_decode(q, cache, table, ctx, max_pages * ps + 5, scale=0.25, topk=k, query_positions=pos, backend=backend)

    refresh()
    return Problem(call, refresh, tol=0.0)


# ---------------------------------------------------------------- NSA selection


def _nsa_problem(refresh, q, k, v, idx, out, lse, **kw):
    """The native call writes the caller's out and lse buffers; the reference allocates its own."""

    def call(backend):
        if backend == "reference":
            return mate.nsa_selection_attention(q, k, v, idx, **kw, backend=backend)
        return mate.nsa_selection_attention(q, k, v, idx, **kw, out=out, lse=lse)

    refresh()
    return Problem(call, refresh)


def nsa_selection(device, gen):
    B, M, N, G, hpg, D, T, bs = 2, 37, 150, 2, 3, 64, 6, 32
    q = tail_view(gen, (B, M, G * hpg, D), device=device, pad_cols=8)
    kv = tail_view(gen, (B, N, 2, G, D), device=device)
    k, v = kv[:, :, 0], kv[:, :, 1]
    idx = torch.zeros(B, M, G, 2 * T, dtype=I32, device=device)[..., 1::2]  # strided at an offset
    counts = torch.zeros(B, M, G, dtype=I32, device=device)
    out = torch.empty(B, M, G * hpg, D + 8, dtype=BF16, device=device)[..., 8:]
    lse = torch.empty(B, G * hpg, M, device=device)

    def refresh():
        idx.copy_(nsa_indices(gen, B, M, G, T, N, bs, device))
        counts.copy_(randint(gen, -1, T + 2, (B, M, G), device))
        q.copy_(randn(gen, *q.shape, device=device))

    return _nsa_problem(refresh, q, k, v, idx, out, lse, block_size=bs, block_counts=counts)


def nsa_packed(device, gen):
    """Packed sequences (cu_seqlens): an empty one, one shorter than a block, block ids local to each."""
    lens, G, hpg, D, T, bs = [0, 5, 40, 1, 90], 2, 4, 128, 5, 64
    total = sum(lens)
    q = tail_view(gen, (total, G * hpg, D), device=device)
    kv = tail_view(gen, (total, 2, G, D), device=device)
    k, v = kv[:, 0], kv[:, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32, device=device)
    idx = torch.zeros(total, G, T, dtype=I32, device=device)
    out = torch.empty(total, G * hpg, D, dtype=BF16, device=device)
    lse = torch.empty(G * hpg, total, device=device)

    def refresh():
        idx.copy_(torch.cat([nsa_indices(gen, 1, n, G, T, n, bs)[0] for n in lens if n]).to(device))
        q.copy_(randn(gen, *q.shape, device=device))

    return _nsa_problem(refresh, q, k, v, idx, out, lse, block_size=bs, cu_seqlens=cu)


# ---------------------------------------------------------------- GQA


def gqa(window, Sq, Sk, D, caller_out=True):
    """B 2, H 4 / 2; the native call writes a caller's out buffer, or (caller_out=False) allocates its output."""

    def make(device, gen):
        B, H, Hkv = 2, 4, 2
        packed = tail_view(gen, (B, max(Sq, Sk), H + 2 * Hkv, D), device=device, pad_rows=1)
        q, k, v = packed[:, :Sq, :H], packed[:, -Sk:, H : H + Hkv], packed[:, -Sk:, H + Hkv :]
        out = torch.empty(B, Sq, H, D, dtype=BF16, device=device)

        def refresh():
            q.copy_(randn(gen, *q.shape, device=device))
            v.copy_(randn(gen, *v.shape, device=device))

        def call(backend):
            o = out if backend == "tilelang" and caller_out else None
            return mate.gqa_attention(q, k, v, sliding_window=window, out=o, return_lse=True, backend=backend)

        return Problem(call, refresh)

    return make


def gqa_launcher(device, gen):
    B, S, H, Hkv, D = 2, 33, 4, 1, 128
    stride = (H + 2 * Hkv) * D + 64  # padded rows
    packed = tail_view(gen, (B * S, stride), device=device, pad_rows=1)
    q, k, v = packed[:, : H * D], packed[:, H * D : (H + Hkv) * D], packed[:, (H + Hkv) * D : (H + 2 * Hkv) * D]
    o = torch.empty(B * S, H * D, dtype=BF16, device=device)
    launch = mate.build_gqa_attn(B, H, Hkv, D, sliding_window=(-1, 0))

    def four(x, heads):
        return x.as_strided((B, S, heads, D), (S * stride, stride, D, 1))

    def refresh():
        packed.copy_(randn(gen, *packed.shape, device=device))

    def call(backend):
        if backend == "reference":
            return (mate.gqa_attention(four(q, H), four(k, Hkv), four(v, Hkv), sliding_window=(-1, 0), backend=backend),)
        return (launch(q, k, v, o, stride, stride, stride, H * D, S, S).view(B, S, H, D),)

    return Problem(call, refresh)


def _kv(gen, shape, device, kv_dtype, scale):
    """A K or V tensor at a storage offset: BF16 (kv_dtype None), or FP8 (issue 38) of unit-scale values / scale."""
    if kv_dtype is None:
        return tail_view(gen, shape, device=device)
    return fp8_quantized(torch.randn(shape[0] + 1, *shape[1:], generator=gen), kv_dtype, scale).to(device)[1:]


def _scales(kv_dtype, tensor_scale, device):
    """The call's k_scale / v_scale of an FP8 case (inputs.fp8_scales), none for a 16-bit one."""
    return {} if kv_dtype is None else fp8_scales(tensor_scale, device)


def gqa_varlen(window, D, kv_dtype=None, tensor_scale=False):
    """Packed sequences (one empty, one with more rows than keys), sinks and softcap; the refresh permutes the
    lengths (same totals, within the same max_seqlen_*) and redraws the sinks. kv_dtype: an FP8 K/V (issue 38, the
    split-KV kernel's varlen keys) with float or tensor scales."""
    H, Hkv = 4, 2
    lens_q, lens_k = [30, 0, 75, 1, 9], [40, 0, 50, 90, 9]
    max_q, max_k = max(lens_q), max(lens_k)

    def make(device, gen):
        scales = _scales(kv_dtype, tensor_scale, device)
        q = tail_view(gen, (sum(lens_q), H, D), device=device)
        k = _kv(gen, (sum(lens_k) + 5, Hkv, D), device, kv_dtype, K_SCALE)[:-5]  # an unused tail past cu_seqlens_k[B]
        v = _kv(gen, (sum(lens_k) + 5, Hkv, D), device, kv_dtype, V_SCALE)[:-5]
        cu_q = torch.zeros(len(lens_q) + 1, dtype=I32, device=device)
        cu_k = torch.zeros_like(cu_q)
        sinks = torch.empty(H, device=device)
        out = torch.empty_like(q)

        def refresh():
            order = torch.randperm(len(lens_q), generator=gen)
            cu_q[1:] = torch.tensor(lens_q, dtype=I32)[order].cumsum(0).to(device)
            cu_k[1:] = torch.tensor(lens_k, dtype=I32)[order].cumsum(0).to(device)
            sinks.copy_(torch.randn(H, generator=gen).to(device))
            q.copy_(randn(gen, *q.shape, device=device))

        def call(backend):
            o = out if backend == "tilelang" else None
            return mate.gqa_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                      sliding_window=window, sinks=sinks, softcap=8.0, out=o, return_lse=True, backend=backend,
                                      **scales)

        refresh()
        return Problem(call, refresh)

    return make


def gqa_paged_decode(lens, window, kv_dtype=None, tensor_scale=False):
    """Decode steps of 2 rows against a paged cache (pages of 16 in random order, a -1 page inside one sequence,
    an out-of-range id past another's length), a window, sinks and softcap; the refresh gives the sequences new
    lengths within their pages and redraws q and the sinks (and a tensor k_scale's value). Sequences of `lens` keys
    at most: where the window lets a row see at most 256 keys (four tiles) the kernel runs one split and writes the
    output itself, else it splits and merges. kv_dtype: an FP8 cache (issue 38) with float or tensor scales."""

    def make(device, gen):
        H, Hkv, D, ps = 8, 2, 128, 16
        scales = _scales(kv_dtype, tensor_scale, device)
        need = [-(-n // ps) for n in lens]
        k = _kv(gen, (sum(need) + 2, ps, Hkv, D), device, kv_dtype, K_SCALE)
        v = _kv(gen, (sum(need) + 2, ps, Hkv, D), device, kv_dtype, V_SCALE)
        table = torch.full((len(lens), max(need) + 1), -1, dtype=I32)
        order = torch.randperm(sum(need), generator=gen).tolist()
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(order[:n], dtype=I32)
            order = order[n:]
        table[0, 3], table[2, need[2]] = -1, k.shape[0] + 4
        table = table.to(device)
        seq_lens = torch.tensor(lens, dtype=I32, device=device)
        q = tail_view(gen, (len(lens), 2, H, D), device=device)
        sinks = torch.empty(H, device=device)
        out = torch.empty_like(q)

        def refresh():
            seq_lens.copy_(torch.tensor([int(torch.randint(0, ps * n + 1, (1,), generator=gen)) for n in need], dtype=I32))
            sinks.copy_(torch.randn(H, generator=gen).to(device))
            q.copy_(randn(gen, *q.shape, device=device))
            if tensor_scale:
                scales["k_scale"].copy_(torch.empty(()).uniform_(0.01, 0.04, generator=gen))

        def call(backend):
            o = out if backend == "tilelang" else None
            return mate.gqa_attention(q, k, v, block_table=table, seq_lens_k=seq_lens, sliding_window=window, sinks=sinks,
                                      softcap=8.0, out=o, return_lse=True, backend=backend, **scales)

        refresh()
        return Problem(call, refresh)

    return make


# ---------------------------------------------------------------- QSA sparse attention and SplitKV merge


def merge_states(rows, D):
    """3 splits of `rows` rows x 4 heads: up to the kernel's MERGE_CTAS (1,024) pairs one (row, head) pair a CTA,
    past that several a CTA in four-element chunks, which D = 66 ends mid-chunk."""

    def make(device, gen):
        splits, heads = 3, 4
        po = tail_view(gen, (splits, rows, heads, D), device=device, pad_rows=1)
        pl = torch.zeros(splits, rows, heads, device=device)
        gate = randn(gen, rows, heads, device=device, dtype=torch.float32)

        def refresh():
            lse = torch.randn(splits, rows, heads, generator=gen) * 4
            lse[torch.rand(splits, rows, heads, generator=gen) < 0.3] = float("-inf")
            lse[:, 1] = float("-inf")  # a row with every split empty
            pl.copy_(lse)
            po.copy_(randn(gen, *po.shape, device=device).masked_fill(torch.isinf(pl).unsqueeze(-1), float("nan")))

        def call(backend):
            return mate.merge_attention_states(po, pl, gate=gate, backend=backend)

        refresh()
        return Problem(call, refresh)

    return make


def qsa_paged(device, gen, kv_dtype=None):
    """Flattened query rows of two requests over a paged pool with missing pages; kv_dtype an FP8 pool (issue 38,
    the small-CTA program's FP8 variant) with float scales."""
    n_req, hq, hkv, D, ps, pages, max_pages, width = 2, 8, 1, 256, 16, 5, 3, 19
    rows = 13
    scales = _scales(kv_dtype, False, device)
    query = tail_view(gen, (rows, hq, D), device=device)
    key = _kv(gen, (pages, ps, hkv, D), device, kv_dtype, K_SCALE)
    value = _kv(gen, (pages, ps, hkv, D), device, kv_dtype, V_SCALE)
    cu = torch.tensor([0, 6, rows], dtype=I32, device=device)
    table = torch.zeros(n_req, max_pages, dtype=I32, device=device)
    lens_k = torch.zeros(n_req, dtype=I32, device=device)
    tokens = torch.zeros(rows, width, dtype=I32, device=device)

    def refresh():
        t = randint(gen, 0, pages, (n_req, max_pages), device)
        t[0, 1], t[1, 2] = -1, pages + 7
        table.copy_(t)
        lens_k.copy_(randint(gen, 1, max_pages * ps + 1, (n_req,), device))
        tokens.copy_(qsa_token_rows(gen, rows, width, max_pages * ps, device))

    def call(backend):
        return mate.qsa_sparse_attention(query, key, value, tokens, cu_seqlens_q=cu, block_table=table, page_size=ps,
                                         seq_lens_k=lens_k, return_lse=True, backend=backend, **scales)

    refresh()
    return Problem(call, refresh)


def qsa_split(device, gen, kv_dtype=None):
    """SplitKV paged decode in the canonical geometry (24 / 2 heads, a group of 12 in a 16-head tile): 3 splits
    of a 5-tile list and their merge, with a per-head gate and the LSE; kv_dtype an FP8 pool with tensor scales
    whose k_scale value the refresh rewrites (as a server does between graph replays)."""
    n_req, hq, hkv, D, ps, pages, max_pages, width = 3, 24, 2, 256, 64, 9, 4, 300
    scales = _scales(kv_dtype, True, device)
    query = tail_view(gen, (n_req, hq, D), device=device)
    key = _kv(gen, (pages, ps, hkv, D), device, kv_dtype, K_SCALE)
    value = _kv(gen, (pages, ps, hkv, D), device, kv_dtype, V_SCALE)
    gate = tail_view(gen, (n_req, hq), device=device)
    cu = torch.arange(n_req + 1, dtype=I32, device=device)
    table = torch.zeros(n_req, max_pages, dtype=I32, device=device)
    tokens = torch.zeros(n_req, width, dtype=I32, device=device)

    def refresh():
        t = randint(gen, 0, pages, (n_req, max_pages), device)
        t[1, 2] = -1
        table.copy_(t)
        tokens.copy_(qsa_token_rows(gen, n_req, width, max_pages * ps, device))
        if kv_dtype is not None:
            scales["k_scale"].copy_(torch.empty(()).uniform_(0.01, 0.04, generator=gen))

    def call(backend):
        return mate.qsa_sparse_attention(query, key, value, tokens, cu_seqlens_q=cu, block_table=table, gate=gate,
                                         num_splits=3, return_lse=True, backend=backend, **scales)

    refresh()
    return Problem(call, refresh)


def qsa_padded(device, gen):
    B, Q, S, hq, hkv, D, width = 2, 5, 40, 8, 2, 256, 11
    query = tail_view(gen, (B, Q, hq, D), device=device)
    key = tail_view(gen, (B, S, hkv, D), device=device)
    value = tail_view(gen, (B, S, hkv, D), device=device)
    tokens = torch.zeros(B, Q, width, dtype=I32, device=device)
    lens_q = torch.tensor([Q, 2], dtype=I32, device=device)  # padded rows

    def refresh():
        tokens.copy_(qsa_token_rows(gen, B * Q, width, S, device).view(B, Q, width))

    def call(backend):
        return mate.qsa_sparse_attention(query, key, value, tokens, seq_lens_q=lens_q, return_lse=True, backend=backend)

    refresh()
    return Problem(call, refresh)


def qsa_physical(device, gen):
    rows, N, hq, hkv, D, width = 11, 50, 16, 1, 256, 9
    query = tail_view(gen, (rows, hq, D), device=device)
    key = tail_view(gen, (N, hkv, D), device=device)
    value = tail_view(gen, (N, hkv, D), device=device)
    ids = torch.zeros(rows, width, dtype=I32, device=device)
    out = torch.empty(rows, hq, D, dtype=BF16, device=device)
    lse = torch.empty(rows, hq, device=device)

    def refresh():
        ids.copy_(qsa_token_rows(gen, rows, width, N, device))

    def call(backend):
        if backend == "reference":
            return mate.qsa_sparse_attention(query, key, value, selected_kv_indices=ids, return_lse=True, backend=backend)
        return mate.qsa_sparse_attention(query, key, value, selected_kv_indices=ids, out=out, lse=lse, return_lse=True)

    refresh()
    return Problem(call, refresh)


# ---------------------------------------------------------------- QSA selection


def _select_scores(gen, rows, keys, device):
    """Indexer-like scores as a strided view at an offset (the row stride is not a multiple of 4), some rows
    with ties on a few values, one with fewer selectable scores than any k here, one all NaN."""
    s = indexer_like_scores(gen, rows, keys, device="cpu")
    s[1::3] = (s[1::3] * 2).round() / 2
    s[2, 5:] = float("-inf")
    s[3] = float("nan")
    base = torch.full((rows, keys + 3), float("nan"))
    base[:, 3:] = s
    return base.to(device)[:, 3:]


def qsa_topk(rows, keys, k):
    """Top-k with the expansion fused (below one row per SM: one CTA an SM), positions past the keys and negative."""

    def make(device, gen):
        scores = _select_scores(gen, rows, keys, device)
        pos = torch.zeros(rows, dtype=I32, device=device)

        def refresh():
            scores.copy_(_select_scores(gen, rows, keys, device))
            pos.copy_(randint(gen, -5, 4 * keys + 9, (rows,), device))

        def call(backend):
            return mate.qsa_topk_tokens(scores, k, pos, backend=backend)

        refresh()
        return Problem(call, refresh, tol=0.0)

    return make


def qsa_topk_blocks_out(device, gen):
    """Top-k alone into a strided out buffer, more rows than SMs (the wide tiles)."""
    rows, keys, k = 300, 700, 64
    scores = _select_scores(gen, rows, keys, device)
    out = torch.full((rows, 2 * k), -7, dtype=I32, device=device)[:, ::2]

    def refresh():
        scores.copy_(_select_scores(gen, rows, keys, device))

    def call(backend):
        if backend == "reference":
            return (mate.qsa_topk_blocks(scores, k, backend=backend),)
        return (mate.qsa_topk_blocks(scores, k, out=out),)

    refresh()
    return Problem(call, refresh, tol=0.0)


def qsa_expand(device, gen):
    """The expansion of strided block ids (-1 and other negatives) at positions around the block edges."""
    rows, k, bs = 41, 33, 4
    blocks = torch.zeros(rows, k + 2, dtype=I32, device=device)[:, 1:-1]
    pos = torch.zeros(rows, dtype=I32, device=device)

    def refresh():
        blocks.copy_(randint(gen, -3, 5000, (rows, k), device))
        pos.copy_(randint(gen, -6, 4 * 5000, (rows,), device))

    def call(backend):
        return (mate.qsa_expand_blocks(blocks, pos, block_size=bs, backend=backend),)

    refresh()
    return Problem(call, refresh, tol=0.0)


CASES = {
    "mqa_score": mqa_score,
    "mqa_prefill": mqa_prefill,
    "mqa_decode": mqa_decode,
    "mqa_decode_topk": mqa_decode_topk,
    "mqa_prefill_topk": mqa_prefill_topk,
    "mqa_decode_fp8": _mqa_decode(torch.float8_e4m3fn),  # a float k_scale, BF16 q
    "mqa_decode_fp8_tensor_scale": _mqa_decode(torch.float8_e5m2, torch.float16, tensor_scale=True),
    "nsa_selection": nsa_selection,
    "nsa_packed": nsa_packed,
    "gqa_local": gqa((16, 0), 45, 70, 64),
    "gqa_causal_short_keys": gqa((-1, 0), 70, 45, 128),  # the first 25 rows see nothing
    # padded decode (at most DECODE_MAX_ROWS rows) on the split-KV kernel: 1 row, its keys split and merged, into outputs
    # of its own (no mutated input: torch.compile's cudagraphs take it); 3 rows, one split
    "gqa_decode_padded_split": gqa((1500, 0), 1, 2000, 128, caller_out=False),
    "gqa_decode_padded": gqa((100, 0), 3, 300, 128),
    "gqa_launcher": gqa_launcher,
    "gqa_varlen_sinks_softcap": gqa_varlen((20, 0), 64),
    "gqa_paged_decode": gqa_paged_decode([200, 1, 77, 0], (100, 0)),  # one split
    "gqa_paged_decode_split": gqa_paged_decode([2000, 1, 77, 0], (1000, 0)),  # 4 splits and the merge
    # FP8 K/V (issue 38) on the split-KV kernel: paged with tensor scales (split and merged), varlen keys (KEY_BASE)
    "gqa_paged_decode_fp8": gqa_paged_decode([2000, 1, 77, 0], None, torch.float8_e4m3fn, tensor_scale=True),
    "gqa_varlen_fp8": gqa_varlen((20, 0), 64, torch.float8_e5m2),
    "merge_states": merge_states(29, 128),
    "merge_states_wide": merge_states(300, 66),
    "qsa_paged": qsa_paged,
    "qsa_split": qsa_split,
    "qsa_paged_fp8": lambda device, gen: qsa_paged(device, gen, torch.float8_e5m2),
    "qsa_split_fp8": lambda device, gen: qsa_split(device, gen, torch.float8_e4m3fn),
    "qsa_padded": qsa_padded,
    "qsa_physical": qsa_physical,
    "qsa_topk": qsa_topk(37, 3000, 100),
    "qsa_topk_long": qsa_topk(5, 20000, 2048),  # the 32768-key bucket: keys in shared memory
    "qsa_topk_blocks_out": qsa_topk_blocks_out,
    "qsa_expand": qsa_expand,
}

# The message of a stage whose native path is not written yet (merge, QSA attention today).
NOT_YET = re.compile(r"no \w+ kernels? yet")


def native(problem: Problem) -> tuple:
    """The native outputs; skips the test while the stage has no native path."""
    try:
        return problem.call("tilelang")
    except ValueError as e:
        if NOT_YET.search(str(e)):
            pytest.skip(str(e))
        raise


def assert_matches(got: tuple, want: tuple, tol: float) -> None:
    """Same shapes, no NaN, the same -inf pattern, finite values within tol (relative norm)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        g, w = g.detach().cpu().double(), w.detach().cpu().double()
        assert not torch.isnan(g).any(), "NaN in the output (unwritten element?)"
        assert torch.equal(torch.isinf(g), torch.isinf(w)), "-inf pattern differs"
        assert torch.equal(g[torch.isinf(g)], w[torch.isinf(w)])
        fin = torch.isfinite(w)
        if fin.any():
            err = (g[fin] - w[fin]).norm() / w[fin].norm().clamp_min(1e-30)
            assert err <= tol, f"relative error {err:.3e}"


def bitwise_equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        # reshape(-1): a "contiguous" tensor may have any stride on a size-1 dim (GQA decode's LSE at one row);
        # contiguous(): a strided out buffer (qsa_topk_blocks_out's every other column) flattens to a view of
        # stride 2, which cannot be viewed as bytes
        x.shape == y.shape and x.dtype == y.dtype
        and torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))
        for x, y in zip(a, b)
    )
