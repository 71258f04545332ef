"""Garbage in unused cache memory (issue 18): cases for tests/test_garbage.py (reference, CPU) and
tests/test_garbage_gpu.py (native).

Serving engines allocate caches with torch.empty and recycle pages, so every place that no row
may read (unselected tokens and blocks, unowned pages, the unused tail of a page, keys outside
every window, keys past a length, the slot a -1 would point at) can hold NaN, Inf or huge
values. A case builds random inputs on a device, says which cache entries are used, and
`poison()` fills all the others with garbage in place; the outputs must not change by a bit.

The used sets are computed here from the documented semantics with plain loops over the
(small) inputs, not with the oracle's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

import mate
from inputs import randint, randn

I32 = torch.int32
BF16 = torch.bfloat16
GARBAGE = (float("nan"), float("inf"), float("-inf"), 3.0e38)


@dataclass
class Case:
    call: Callable[[str], tuple]  # backend -> output tensors
    caches: list  # (buffer, used): bool `used` over the buffer's leading dims

    def poison(self, used_too: bool = False) -> None:
        """Garbage into every unused place, in place (with used_too, into every place)."""
        for buf, used in self.caches:
            poison_unused(buf, torch.zeros_like(used) if used_too else used)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# FP8 garbage as bytes (torch.where has no FP8 kernel): NaN and -NaN in both kinds; e4m3fn's largest value 448 and
# -256 (it has no inf), which are e5m2's NaN and -inf
FP8_GARBAGE = (0x7F, 0xFF, 0x7E, 0xFC)


def garbage_like(x: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf, -Inf and a huge finite value in turn (of an FP8 x: its bytes, FP8_GARBAGE in turn)."""
    vals = torch.tensor(FP8_GARBAGE, dtype=torch.uint8) if x.dtype in FP8 else torch.tensor(GARBAGE, dtype=torch.float32)
    idx = torch.arange(x.numel()) % len(vals)
    return vals[idx].reshape(x.shape).to(device=x.device, dtype=torch.uint8 if x.dtype in FP8 else x.dtype)


def poison_unused(x: torch.Tensor, used: torch.Tensor) -> None:
    """Garbage into x where `used` (bool, x's leading dims) is False."""
    mask = used.to(x.device).reshape(*used.shape, *([1] * (x.dim() - used.dim()))).expand(x.shape)
    target = x.view(torch.uint8) if x.dtype in FP8 else x
    target.copy_(torch.where(mask, target, garbage_like(x)))


def with_tail(gen, shape, tail, *, device, dtype=BF16):
    """A view of `shape` over a buffer with `tail` more entries on axis 1, and that buffer (the tail is unused)."""
    base = randn(gen, shape[0], shape[1] + tail, *shape[2:], device=device, dtype=dtype)
    return base[:, : shape[1]], base


# ---------------------------------------------------------------- QSA sparse core attention


def _qsa_rows(gen, B, Q, S, width):
    """Token ids per padded row: -1, -2, ids past S, duplicates; seq_lens_k per request."""
    idx = randint(gen, -2, S + 3, (B, Q, width))
    idx[..., 1] = idx[..., 0]  # duplicates
    idx[..., 2] = -1
    idx[idx == 0] = 1  # token 0, a gather's natural placeholder, stays unused (so it is poisoned)
    sk = randint(gen, S // 2, S + 1, (B,))
    return idx, sk


def qsa_padded(dtype=BF16, hq=4, hkv=2, D=256):
    def make(device, gen):
        B, Q, S, W = 2, 6, 70, 19
        q = randn(gen, B, Q, hq, D, device=device, dtype=dtype)
        k, kb = with_tail(gen, (B, S, hkv, D), 5, device=device, dtype=dtype)
        v, vb = with_tail(gen, (B, S, hkv, D), 5, device=device, dtype=dtype)
        idx, sk = _qsa_rows(gen, B, Q, S, W)
        used = torch.zeros(B, S + 5, dtype=torch.bool)
        for b in range(B):
            for i in range(Q):
                pos = int(sk[b]) - Q + i
                for t in idx[b, i].tolist():
                    if 0 <= t < int(sk[b]) and t <= pos:
                        used[b, t] = True
        idx, sk = idx.to(device), sk.to(device)

        def call(backend):
            return mate.qsa_sparse_attention(q, k, v, idx, seq_lens_k=sk, return_lse=True, backend=backend)

        return Case(call, [(kb, used), (vb, used)])

    return make


def _fp8_kv(k, v, kv_dtype, tensor_scale, kw):
    """K/V as an FP8 cache (issue 38) with its scales in kw (floats, or FP32 tensors with tensor_scale); 16-bit as given."""
    if kv_dtype is None:
        return k, v
    ks, vs = 0.02, 0.03
    kw.update(k_scale=torch.tensor([ks], device=k.device) if tensor_scale else ks, v_scale=torch.tensor(vs, device=k.device) if tensor_scale else vs)
    return (k / ks).to(kv_dtype), (v / vs).to(kv_dtype)


def qsa_paged(q_form="padded", splits=None, dtype=BF16, hq=4, hkv=2, D=256, kv_dtype=None, tensor_scale=False):
    """Paged K/V: -1 and past-the-pool pages, pages no request owns, the unused tail of pages; kv_dtype an FP8 cache."""

    def make(device, gen):
        B, Q, ps, maxp, pages, W = 3, 5, 4, 6, 20, 23
        S = maxp * ps
        q = randn(gen, B, Q, hq, D, device=device, dtype=dtype)
        k = randn(gen, pages, ps, hkv, D, device=device, dtype=dtype)
        v = randn(gen, pages, ps, hkv, D, device=device, dtype=dtype)
        table = (1 + torch.randperm(pages - 1, generator=gen)[: B * maxp]).to(I32).reshape(B, maxp)  # page 0 unowned
        table[0, 2], table[1, 0], table[2, -1] = -1, pages, pages + 7
        idx, sk = _qsa_rows(gen, B, Q, S, W)
        rows = [Q, 3, 0]  # rows per request for the flattened forms (an empty request)
        used = torch.zeros(pages, ps, dtype=torch.bool)
        for b in range(B):
            n = Q if q_form == "padded" else rows[b]
            for i in range(n):
                pos = int(sk[b]) - n + i
                for t in idx[b, i].tolist():
                    if 0 <= t < int(sk[b]) and t <= pos:
                        page = int(table[b, t // ps])
                        if 0 <= page < pages:
                            used[page, t % ps] = True
        kw = dict(block_table=table.to(device), seq_lens_k=sk.to(device), num_splits=splits)
        k, v = _fp8_kv(k, v, kv_dtype, tensor_scale, kw)
        if q_form == "padded":
            qq, ii = q, idx.to(device)
        else:
            qq = torch.cat([q[b, : rows[b]] for b in range(B)])
            ii = torch.cat([idx[b, : rows[b]] for b in range(B)]).to(device)
            if q_form == "cu_seqlens":
                kw["cu_seqlens_q"] = torch.tensor([0, rows[0], rows[0] + rows[1], sum(rows)], dtype=I32, device=device)
            else:
                kw["token_to_req"] = torch.tensor(sum(([b] * rows[b] for b in range(B)), []), dtype=I32, device=device)
                kw["num_requests"] = B

        def call(backend):
            return mate.qsa_sparse_attention(qq, k, v, ii, **kw, return_lse=True, backend=backend)

        return Case(call, [(k, used), (v, used)])

    return make


def qsa_physical(device, gen, hq=4, hkv=2, D=256, kv_dtype=None):
    R, N, W = 9, 50, 21
    q = randn(gen, R, hq, D, device=device)
    k = randn(gen, N, hkv, D, device=device)
    v = randn(gen, N, hkv, D, device=device)
    ids = randint(gen, -2, N + 3, (R, W))
    ids[:, 1] = -1
    ids[ids == 0] = 1  # id 0 (a natural placeholder) unused
    used = torch.zeros(N, dtype=torch.bool)
    for i in ids.flatten().tolist():
        if 0 <= i < N:
            used[i] = True
    ids = ids.to(device)
    kw = {}
    k, v = _fp8_kv(k, v, kv_dtype, True, kw)

    def call(backend):
        return mate.qsa_sparse_attention(q, k, v, selected_kv_indices=ids, **kw, return_lse=True, backend=backend)

    return Case(call, [(k, used), (v, used)])


def qsa_varlen_kv(device, gen, hq=4, hkv=2, D=32):
    """Flattened varlen K/V (reference only): the keys between and after requests are unused."""
    B, Q, W = 2, 4, 9
    lens, gaps = [13, 20], [3, 4]
    starts = [0, lens[0] + gaps[0]]
    total = starts[1] + lens[1] + gaps[1]
    q = randn(gen, B, Q, hq, D, device=device)
    k = randn(gen, total, hkv, D, device=device)
    v = randn(gen, total, hkv, D, device=device)
    idx = randint(gen, -1, 24, (B, Q, W))
    used = torch.zeros(total, dtype=torch.bool)
    for b in range(B):
        for i in range(Q):
            pos = lens[b] - Q + i
            for t in idx[b, i].tolist():
                if 0 <= t < lens[b] and t <= pos:
                    used[starts[b] + t] = True
    # cu_seqlens_k names where each request starts; the gaps hold another request's stale keys
    cu = torch.tensor([0, starts[1], total - gaps[1]], dtype=I32, device=device)
    sk = torch.tensor(lens, dtype=I32, device=device)
    idx = idx.to(device)

    def call(backend):
        return mate.qsa_sparse_attention(q, k, v, idx, cu_seqlens_k=cu, seq_lens_k=sk, return_lse=True, backend=backend)

    return Case(call, [(k, used), (v, used)])


# ---------------------------------------------------------------- NSA selection


def nsa(D=64, bs=32, dtype=BF16):
    def make(device, gen):
        B, M, N, G, hpg, T = 2, 37, 150, 2, 3, 6
        q = randn(gen, B, M, G * hpg, D, device=device, dtype=dtype)
        k, kb = with_tail(gen, (B, N, G, D), 11, device=device, dtype=dtype)
        v, vb = with_tail(gen, (B, N, G, D), 11, device=device, dtype=dtype)
        n_blocks = math.ceil(N / bs)
        idx = randint(gen, -2, n_blocks + 3, (B, M, G, T))
        idx[..., 0] = randint(gen, 0, n_blocks // 2, (B, M, G))
        idx[..., 3] = -1
        idx[0, 0, 0, 4] = 2**31 - 1
        counts = randint(gen, -1, T + 2, (B, M, G))
        used = torch.zeros(B, N + 11, G, dtype=torch.bool)
        for b in range(B):
            for m in range(M):
                pos = N - M + m
                for g in range(G):
                    for t, j in enumerate(idx[b, m, g].tolist()):
                        if t < int(counts[b, m, g]) and j >= 0 and j * bs <= pos:
                            used[b, j * bs : min(pos + 1, (j + 1) * bs, N), g] = True
        idx, counts = idx.to(device), counts.to(device)

        def call(backend):
            return mate.nsa_selection_attention(q, k, v, idx, block_size=bs, block_counts=counts, backend=backend)

        return Case(call, [(kb, used), (vb, used)])

    return make


# ---------------------------------------------------------------- GQA sliding window


def window_keys(Sq, Sk, window, rows=None):
    """[Sk] bool: keys in the window of some row of `rows` (default: all rows)."""
    left, right = (-1, -1) if window is None else window
    seen = torch.zeros(Sk, dtype=torch.bool)
    for i in range(Sq) if rows is None else rows:
        p = i + Sk - Sq
        lo = 0 if left < 0 else max(p - left, 0)
        hi = Sk - 1 if right < 0 else min(p + right, Sk - 1)
        if lo <= hi:
            seen[lo : hi + 1] = True
    return seen


def gqa(window, Sq=130, Sk=1000, D=64, dtype=BF16):
    """Keys outside every row's window and past Sk (the buffer's tail) are garbage."""

    def make(device, gen):
        B, H, Hkv = 2, 4, 2
        q = randn(gen, B, Sq, H, D, device=device, dtype=dtype)
        k, kb = with_tail(gen, (B, Sk, Hkv, D), 77, device=device, dtype=dtype)
        v, vb = with_tail(gen, (B, Sk, Hkv, D), 77, device=device, dtype=dtype)
        used = torch.cat([window_keys(Sq, Sk, window), torch.zeros(77, dtype=torch.bool)]).expand(B, -1)

        def call(backend):
            return mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend=backend)

        return Case(call, [(kb, used), (vb, used)])

    return make


# ---------------------------------------------------------------- MQA indexer


def mqa_score(device, gen):
    B, Q, N = 2, 9, 40
    q = randn(gen, B, Q, 4, 128, device=device)
    k, kb = with_tail(gen, (B, N, 128), 9, device=device)
    pos = randint(gen, -2, 4 * 20, (B, Q))  # positions see at most the first 20 blocks
    lens = torch.tensor([Q, 5], dtype=I32)
    used = torch.zeros(B, N + 9, dtype=torch.bool)
    for b in range(B):
        for i in range(int(lens[b])):
            used[b, : max(0, (int(pos[b, i]) + 1) // 4)] = True
    pos, lens = pos.to(device), lens.to(device)

    def call(backend):
        return (mate.qsa_indexer_mqa_score(q, k, query_positions=pos, seq_lens_q=lens, backend=backend),)

    return Case(call, [(kb, used)])


def _decode_pages(gen, B, pages, ps, maxp, ctx):
    table = torch.randperm(pages, generator=gen)[: B * maxp].to(I32).reshape(B, maxp)
    table[0, 1], table[1, 0] = -1, pages + 3
    used = torch.zeros(pages, ps, dtype=torch.bool)
    for b in range(B):
        for n in range(min(int(ctx[b]), maxp * ps)):
            page = int(table[b, n // ps])
            if 0 <= page < pages:
                used[page, n % ps] = True
    return table, used


def mqa_decode(device, gen, kv_dtype=None, k_scale=1.0, tensor_scale=False):
    B, pages, ps, maxp = 3, 16, 16, 4
    q = randn(gen, B, 4, 128, device=device)
    cache = randn(gen, pages, ps, 1, 128, device=device, scale=1 if kv_dtype is None else 50.0).to(kv_dtype or BF16)
    ctx = torch.tensor([37, 64, 5], dtype=I32)
    table, used = _decode_pages(gen, B, pages, ps, maxp, ctx)
    table, ctx = table.to(device), ctx.to(device)
    kw = {} if kv_dtype is None else dict(k_scale=torch.tensor(k_scale, device=device) if tensor_scale else k_scale)

    def call(backend):
        return (mate.qsa_mqa_decode(q, cache, table, ctx, maxp * ps, **kw, backend=backend),)

    return Case(call, [(cache, used)])


def mqa_decode_fp8(kv_dtype, k_scale, tensor_scale=False):
    """An FP8 key cache (issue 38): garbage bytes in its unused places; k_scale a float or (tensor_scale) a tensor."""
    return lambda device, gen: mqa_decode(device, gen, kv_dtype, k_scale, tensor_scale)


def mqa_score_paged(device, gen):
    """Paged qsa_indexer_mqa_score (reference only)."""
    B, Q, pages, ps, maxp = 2, 7, 12, 4, 5
    q = randn(gen, B, Q, 4, 32, device=device)
    cache = randn(gen, pages, ps, 32, device=device)
    pos = randint(gen, -2, 4 * maxp * ps - 20, (B, Q))
    lens = torch.tensor([Q, 3], dtype=I32)
    # position p sees blocks j with 4j + 3 <= p: the used blocks of a request are its widest row's
    ctx = torch.tensor([max(0, max((int(p) + 1) // 4 for p in pos[b, : int(lens[b])])) for b in range(B)], dtype=I32)
    table, used = _decode_pages(gen, B, pages, ps, maxp, ctx)
    table, lens, pos = table.to(device), lens.to(device), pos.to(device)

    def call(backend):
        return (mate.qsa_indexer_mqa_score(q, cache, block_table=table, query_positions=pos, seq_lens_q=lens, backend=backend),)

    return Case(call, [(cache, used)])


def mqa_prefill(device, gen):
    rows, keys = 20, 90
    q = randn(gen, rows, 4, 128, device=device)
    k = randn(gen, keys, 128, device=device)
    starts = randint(gen, 10, 40, (rows,))
    ends = starts + randint(gen, -3, 30, (rows,))
    used = torch.zeros(keys, dtype=torch.bool)
    for s, e in zip(starts.tolist(), ends.tolist()):
        used[max(s, 0) : max(min(e, keys), 0)] = True
    starts, ends = starts.to(device), ends.to(device)

    def call(backend):
        return (mate.qsa_mqa_prefill(q, k, starts, ends, backend=backend),)

    return Case(call, [(k, used)])


def outputs(case, backend):
    """The case's outputs, copied (a call may return a buffer the next call writes)."""
    return [t.clone() for t in case.call(backend)]


def assert_ignores_unused(make, device, gen, backend, what=""):
    """Clean run, garbage into every unused place, run again: the same bits."""
    case = make(device, gen)
    clean = outputs(case, backend)
    case.poison()
    assert_unchanged(clean, outputs(case, backend), what)


def assert_unchanged(clean, dirty, what=""):
    for i, (a, b) in enumerate(zip(clean, dirty)):
        assert not torch.isnan(a).any(), f"{what} output {i}: NaN in the clean result"
        assert torch.equal(a, b), f"{what} output {i}: garbage in unused memory changed the result"
