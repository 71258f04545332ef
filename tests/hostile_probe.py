"""Hostile-input probe over every entrypoint and both backends (issue 18).

    python tests/hostile_probe.py [--device cuda] [-v]

Each case calls an entrypoint with one hostile input (a wrong type, metadata dtype, rank
or shape; -1, INT32_MIN/MAX or past-the-capacity ids; empty sizes, an empty pool, a
zero-width page table; non-monotonic offsets; a block hint that disagrees; NaN, Inf and
huge values; bad scalars and output buffers) and says what must happen:

- "error", arg: ValueError or TypeError whose message names `arg`;
- "ok": a result, checked against the documented value where there is one (scores -inf,
  output 0 and LSE -inf), free of NaN where the inputs are finite, and on the GPU equal
  to the reference's (the -inf pattern exactly, values within 2e-2 relative);
- "trusted", arg: a contract the fast path trusts without reading device memory: no
  crash and no stray exception on either backend, and with mate.debug_checks() a
  ValueError naming `arg`.

On a machine without a GPU the native backend must refuse every call with a clear
ValueError (or the case's own error). Outcomes are counted per class: ok, clear errors,
crashes/stray exceptions, silently wrong results; tests/test_hostile_probe.py runs it on
the CPU and wants 0 of the last two.
"""

from __future__ import annotations

import argparse
import math
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

import mate

I32 = torch.int32
BF16 = torch.bfloat16
BACKENDS = ("reference", "tilelang")
IMAX, IMIN = 2**31 - 1, -(2**31)


@dataclass
class Case:
    name: str
    fn: Callable  # (backend) -> result
    expect: str = "ok"  # "ok", "error" or "trusted"
    arg: str = ""  # the argument an error must name
    check: Callable | None = None  # (result) -> message or None, for "ok"
    finite: bool = True  # inputs are finite: no NaN allowed in the result
    native: bool = True  # False: a layout only the reference runs (the native backend must refuse it)


@dataclass
class Tally:
    counts: dict = field(default_factory=lambda: dict(ok=0, clear_error=0, crash_or_stray=0, silently_wrong=0))
    failures: list = field(default_factory=list)

    def bad(self, kind, case, backend, msg):
        self.counts[kind] += 1
        self.failures.append(f"{kind}: {case.name} [{backend}]: {msg}")


def tensors(res):
    if isinstance(res, torch.Tensor):
        return [res]
    return [t for t in res if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------- documented results


def all_neg_inf(res):
    return None if all(bool(torch.isneginf(t).all()) for t in tensors(res)) else "scores must all be -inf"


def empty_attention(res):
    out, lse = res
    if not bool((out == 0).all()):
        return "output must be 0"
    if not bool(torch.isneginf(lse).all()):
        return "LSE must be -inf"
    return None


def is_empty(res):
    return None if all(t.numel() == 0 for t in tensors(res)) else "expected empty outputs"


# ---------------------------------------------------------------- inputs


def rnd(*shape, device, dtype=BF16):
    return torch.randn(*shape, device=device).to(dtype)


def i32(v, device):
    return torch.tensor(v, dtype=I32, device=device)


def expand(blocks):
    """The token list a block hint stands for: 4 tokens a block (-1 for -1), then a 3-token tail."""
    four = 4 * blocks[..., None] + torch.arange(4, device=blocks.device, dtype=I32)
    tok = torch.where(blocks[..., None] >= 0, four, -1).flatten(-2)
    return torch.cat([tok, torch.arange(3, device=blocks.device, dtype=I32).expand(*blocks.shape[:-1], 3)], -1).contiguous()


def qsa_cases(dev):
    B, Q, S, hq, hkv, D, W = 2, 3, 24, 4, 2, 256, 11
    q, k, v = rnd(B, Q, hq, D, device=dev), rnd(B, S, hkv, D, device=dev), rnd(B, S, hkv, D, device=dev)
    tok = torch.randint(-1, S, (B, Q, W), dtype=I32).to(dev)
    pages, ps = 8, 4
    kp, vp = rnd(pages, ps, hkv, D, device=dev), rnd(pages, ps, hkv, D, device=dev)
    table = torch.randperm(pages)[:6].to(I32).reshape(B, 3).to(dev)
    qf = rnd(5, hq, D, device=dev)
    tokf = torch.randint(-1, 12, (5, W), dtype=I32).to(dev)
    cu = i32([0, 2, 5], dev)
    blocks = torch.randint(-1, 3, (B, Q, 2), dtype=I32).to(dev)
    hint_tok = expand(blocks)
    gap = torch.stack([torch.full_like(blocks[..., 0], -1), blocks[..., 1].clamp_min(0)], -1)
    ids = torch.randint(-1, 40, (5, W), dtype=I32).to(dev)
    kflat, vflat = rnd(40, hkv, D, device=dev), rnd(40, hkv, D, device=dev)

    def sa(*a, backend_override=None, **kw):
        return lambda backend: mate.qsa_sparse_attention(*a, **kw, return_lse=True, backend=backend_override or backend)

    paged = dict(block_table=table)
    c = [
        Case("qsa padded", sa(q, k, v, tok)),
        Case("qsa paged", sa(q, kp, vp, tok.clamp_max(11), **paged)),
        Case("qsa cu_seqlens paged", sa(qf, kp, vp, tokf, cu_seqlens_q=cu, **paged)),
        Case("qsa token_to_req paged", sa(qf, kp, vp, tokf, token_to_req=i32([0, 1, 1, -1, 5], dev), num_requests=2, **paged)),
        Case("qsa physical", sa(qf, kflat, vflat, selected_kv_indices=ids)),
        Case("qsa hint", sa(q, k, v, hint_tok, block_indices=blocks)),
        Case("qsa splits", sa(qf, kp, vp, tokf, cu_seqlens_q=cu, num_splits=3, **paged)),
        Case("qsa gate", sa(q, k, v, tok, gate=rnd(B, Q, hq, device=dev))),
        # hostile index values: masked, documented
        Case("qsa all -1", sa(q, k, v, torch.full_like(tok, -1)), check=empty_attention),
        Case("qsa INT32_MAX ids", sa(q, k, v, torch.full_like(tok, IMAX)), check=empty_attention),
        Case("qsa INT32_MIN ids", sa(q, k, v, torch.full_like(tok, IMIN)), check=empty_attention),
        Case("qsa width 0", sa(q, k, v, tok[..., :0]), check=empty_attention),
        Case("qsa 0 rows", sa(q[:, :0], k, v, tok[:, :0]), check=is_empty),
        Case("qsa 0 requests flattened", sa(qf[:0], kp, vp, tokf[:0], cu_seqlens_q=i32([0], dev)[:1].repeat(2), block_table=table[:1]),
             check=is_empty),
        Case("qsa 0-column page table", sa(q, kp, vp, tok, block_table=table[:, :0]), check=empty_attention),
        Case("qsa empty pool", sa(q, kp[:0], vp[:0], tok, **paged), check=empty_attention),
        Case("qsa pages past the pool", sa(q, kp, vp, tok, block_table=torch.full_like(table, pages)), check=empty_attention),
        Case("qsa INT32_MAX pages", sa(q, kp, vp, tok, block_table=torch.full_like(table, IMAX)), check=empty_attention),
        Case("qsa seq_lens_k 0", sa(q, k, v, tok, seq_lens_k=i32([0, 0], dev)), check=empty_attention),
        Case("qsa seq_lens_k INT32_MAX", sa(q, k, v, tok, seq_lens_k=i32([IMAX, 3], dev))),
        Case("qsa seq_lens_k negative", sa(q, k, v, tok, seq_lens_k=i32([-5, IMIN], dev)), check=empty_attention),
        Case("qsa seq_lens_q 0", sa(q, k, v, tok, seq_lens_q=i32([0, 0], dev)), check=empty_attention),
        Case("qsa positions INT32_MIN", sa(q, k, v, tok, query_positions=torch.full((B, Q), IMIN, dtype=I32, device=dev)), check=empty_attention),
        Case("qsa positions INT32_MAX", sa(q, k, v, tok, query_positions=torch.full((B, Q), IMAX, dtype=I32, device=dev))),
        Case("qsa physical all past the pool", sa(qf, kflat, vflat, selected_kv_indices=torch.full_like(ids, 40)), check=empty_attention),
        Case("qsa huge q", sa(q * 1e30, k, v, tok), finite=False),
        Case("qsa NaN q", sa(q * float("nan"), k, v, tok), finite=False),
        # contracts the native path trusts
        Case("qsa cu_seqlens decreasing", sa(qf, kp, vp, tokf, cu_seqlens_q=i32([0, 4, 2], dev), **paged), "trusted", "cu_seqlens_q"),
        Case("qsa cu_seqlens past the rows", sa(qf, kp, vp, tokf, cu_seqlens_q=i32([0, 2, 9], dev), **paged), "trusted", "cu_seqlens_q"),
        Case("qsa hint disagrees", sa(q, k, v, hint_tok, block_indices=(blocks + 1).clamp_max(2)), "trusted", "block_indices"),
        Case("qsa compact hint with a gap", sa(q, k, v, expand(gap), block_indices=gap, assume_compact_blocks=True),
             "trusted", "assume_compact_blocks"),
    ]
    # wrong types, dtypes, ranks, shapes, scalars, buffers
    err = lambda name, arg, *a, **kw: Case(name, sa(*a, **kw), "error", arg)  # noqa: E731
    c += [
        err("qsa query list", "query", [[0.0]], k, v, tok),
        err("qsa key int", "key", q, k.to(torch.int32), v, tok),
        err("qsa value rank 2", "value", q, k, v[0, 0], tok),
        err("qsa value shape", "value", q, k, v[:, :5], tok),
        err("qsa dtypes differ", "dtype", q, k.half(), v, tok),
        err("qsa fp8 query", "FP8 queries", q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), tok),
        err("qsa fp8 kinds differ", "FP8", q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e5m2), tok),
        err("qsa fp8 k_scale NaN", "k_scale", q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), tok, k_scale=float("nan")),
        err("qsa feature dims", "feature dim", q, k[..., :128], v[..., :128], tok),
        err("qsa heads", "heads", q, rnd(B, S, 3, D, device=dev), rnd(B, S, 3, D, device=dev), tok),
        err("qsa token_indices int64", "token_indices", q, k, v, tok.long()),
        err("qsa token_indices float", "token_indices", q, k, v, tok.float()),
        err("qsa token_indices rank", "token_indices", q, k, v, tok[0]),
        err("qsa token_indices rows", "token_indices", q, k, v, tok[:, :2]),
        err("qsa no indices", "token_indices", q, k, v),
        err("qsa block hint width", "token_indices width", q, k, v, tok, block_indices=blocks[..., :1]),
        err("qsa block hint int64", "block_indices", q, k, v, hint_tok, block_indices=blocks.long()),
        err("qsa compact without hint", "assume_compact_blocks", q, k, v, tok, assume_compact_blocks=True),
        err("qsa cu_seqlens int64", "cu_seqlens_q", qf, kp, vp, tokf, cu_seqlens_q=cu.long(), **paged),
        err("qsa cu_seqlens 1 entry", "cu_seqlens_q", qf, kp, vp, tokf, cu_seqlens_q=cu[:1], **paged),
        err("qsa cu and token_to_req", "exactly one", qf, kp, vp, tokf, cu_seqlens_q=cu, token_to_req=i32([0] * 5, dev), **paged),
        err("qsa token_to_req no num_requests", "num_requests", qf, kp, vp, tokf, token_to_req=i32([0] * 5, dev), **paged),
        err("qsa num_requests 0", "num_requests", qf, kp, vp, tokf, token_to_req=i32([0] * 5, dev), num_requests=0, **paged),
        err("qsa table int64", "block_table", q, kp, vp, tok, block_table=table.long()),
        err("qsa table rows", "block_table", q, kp, vp, tok, block_table=table[:1]),
        err("qsa page_size mismatch", "page_size", q, kp, vp, tok, page_size=8, **paged),
        err("qsa page_size 0 pages", "page size", q, kp[:, :0], vp[:, :0], tok, **paged),
        err("qsa table and cu_k", "cu_seqlens_k", q, kp, vp, tok, cu_seqlens_k=i32([0, 1, 2], dev), **paged),
        err("qsa seq_lens_k shape", "seq_lens_k", q, k, v, tok, seq_lens_k=i32([1, 2, 3], dev)),
        err("qsa seq_lens_q int64", "seq_lens_q", q, k, v, tok, seq_lens_q=torch.zeros(B, dtype=torch.int64, device=dev)),
        err("qsa positions shape", "query_positions", q, k, v, tok, query_positions=i32([0], dev)),
        err("qsa gate shape", "gate", q, k, v, tok, gate=rnd(B, Q, device=dev)),
        err("qsa gate int", "gate", q, k, v, tok, gate=torch.zeros(B, Q, hq, dtype=I32, device=dev)),
        err("qsa scale 0", "scale", q, k, v, tok, scale=0.0),
        err("qsa scale nan", "scale", q, k, v, tok, scale=float("nan")),
        err("qsa scale str", "scale", q, k, v, tok, scale="1"),
        err("qsa two scales", "softmax_scale", q, k, v, tok, scale=0.1, softmax_scale=0.1),
        err("qsa num_splits 0", "num_splits", q, k, v, tok, num_splits=0),
        err("qsa num_splits float", "num_splits", q, k, v, tok, num_splits=2.0),
        err("qsa k_scale", "k_scale", q, k, v, tok, k_scale=2.0),
        err("qsa compute_dtype other", "compute_dtype", q, k, v, tok, compute_dtype=torch.float16),
        err("qsa compute_dtype str", "compute_dtype", q, k, v, tok, compute_dtype="bf16"),
        err("qsa backend auto", "backend", q, k, v, tok, backend_override="auto"),
        err("qsa out shape", "out", q, k, v, tok, out=torch.empty(1, device=dev)),
        err("qsa out dtype", "out", q, k, v, tok, out=torch.empty(q.shape, device=dev)),
        err("qsa out overlaps query", "out", q, k, v, tok, out=q),
        err("qsa physical with token_indices", "token_indices", qf, kflat, vflat, tokf, selected_kv_indices=ids),
        err("qsa physical rows", "selected_kv_indices", qf, kflat, vflat, selected_kv_indices=ids[:2]),
        err("qsa physical padded key", "selected_kv_indices", qf, k, v, selected_kv_indices=ids),
        err("qsa lse on logical", "lse", q, k, v, tok, lse=torch.empty(B, Q, hq, device=dev)),
    ]
    return c


def mqa_cases(dev):
    B, Q, N = 2, 5, 12
    q, kk = rnd(B, Q, 4, 128, device=dev), rnd(B, N, 128, device=dev)
    rows, keys = 6, 20
    qp, kp = rnd(rows, 4, 128, device=dev), rnd(keys, 128, device=dev)
    st, en = torch.randint(-2, keys, (rows,), dtype=I32).to(dev), torch.randint(0, keys + 3, (rows,), dtype=I32).to(dev)
    pages, ps = 6, 16
    qd, cache = rnd(3, 4, 128, device=dev), rnd(pages, ps, 1, 128, device=dev)
    table = i32([[0, 1], [2, -1], [5, 4]], dev)
    ctx = i32([20, 7, 32], dev)
    qv = rnd(7, 4, 128, device=dev)
    pcache = rnd(pages, 4, 128, device=dev)
    ptable = i32([[0, 1], [3, -1]], dev)

    def score(*a, **kw):
        return lambda backend: mate.qsa_indexer_mqa_score(*a, **kw, backend=backend)

    def prefill(*a, **kw):
        return lambda backend: mate.qsa_mqa_prefill(*a, **kw, backend=backend)

    def decode(*a, **kw):
        return lambda backend: mate.qsa_mqa_decode(*a, **kw, backend=backend)

    err = lambda name, arg, f: Case(name, f, "error", arg)  # noqa: E731
    return [
        Case("score padded", score(q, kk)),
        Case("score positions INT32_MIN", score(q, kk, query_positions=torch.full((B, Q), IMIN, dtype=I32, device=dev)), check=all_neg_inf),
        Case("score positions INT32_MAX", score(q, kk, query_positions=torch.full((B, Q), IMAX, dtype=I32, device=dev))),
        Case("score seq_lens_q 0", score(q, kk, seq_lens_q=i32([0, 0], dev)), check=all_neg_inf),
        Case("score seq_lens_q INT32_MIN", score(q, kk, seq_lens_q=i32([IMIN, 0], dev)), check=all_neg_inf),
        Case("score 0 keys", score(q, kk[:, :0]), check=is_empty),
        Case("score 0 rows", score(q[:, :0], kk), check=is_empty),
        Case("score huge", score(q * 1e30, kk * 1e30), finite=False),
        Case("score varlen", score(qv, pcache, cu_seqlens_q=i32([0, 3, 7], dev), block_table=ptable), native=False),
        Case("score paged empty pool", score(qv, pcache[:0], cu_seqlens_q=i32([0, 3, 7], dev), block_table=ptable), check=all_neg_inf, native=False),
        Case("score paged 0-column table", score(qv, pcache, cu_seqlens_q=i32([0, 3, 7], dev), block_table=ptable[:, :0]), check=is_empty, native=False),
        Case("score cu decreasing", score(qv, pcache, cu_seqlens_q=i32([0, 5, 3], dev), block_table=ptable), "trusted", "cu_seqlens_q"),
        Case("score cu past the rows", score(qv, pcache, cu_seqlens_q=i32([0, 3, 9], dev), block_table=ptable), "error", "cu_seqlens_q"),
        Case("score token_to_req out of range", score(qv, pcache, token_to_req=i32([0, 1, 9, -4, 0, 1, 1], dev), num_requests=2,
                                                      block_table=ptable), "trusted", "token_to_req"),
        Case("score pages INT32_MAX", score(qv, pcache, cu_seqlens_q=i32([0, 3, 7], dev), block_table=torch.full_like(ptable, IMAX)),
             check=all_neg_inf, native=False),
        err("score q list", "q_idx", score([1.0], kk)),
        err("score keys int", "block_keys", score(q, kk.to(I32))),
        err("score dtypes", "dtype", score(q, kk.half())),
        err("score keys batch", "block_keys", score(q, kk[:1])),
        err("score dims", "feature dim", score(q, kk[..., :64])),
        err("score positions int64", "query_positions", score(q, kk, query_positions=torch.zeros(B, Q, dtype=torch.int64, device=dev))),
        err("score positions shape", "query_positions", score(q, kk, query_positions=i32([0], dev))),
        err("score seq_lens_q shape", "seq_lens_q", score(q, kk, seq_lens_q=i32([0], dev))),
        err("score two scales", "score_scale", score(q, kk, scale=1.0, score_scale=1.0)),
        err("score scale -1", "scale", score(q, kk, scale=-1.0)),
        err("score block_size 0", "block_size", score(q, kk, block_size=0)),
        err("score cu on padded", "cu_seqlens_q", score(q, kk, cu_seqlens_q=i32([0, 5], dev))),
        err("score page_size mismatch", "page_size", score(qv, pcache, cu_seqlens_q=i32([0, 3, 7], dev), block_table=ptable, page_size=3)),
        err("score table int64", "block_table", score(qv, pcache, cu_seqlens_q=i32([0, 3, 7], dev), block_table=ptable.long())),
        Case("prefill", prefill(qp, kp, st, en)),
        Case("prefill INT32 extremes", prefill(qp, kp, torch.full_like(st, IMIN), torch.full_like(en, IMAX))),
        Case("prefill inverted", prefill(qp, kp, torch.full_like(st, 10), torch.full_like(en, 3)), check=all_neg_inf),
        Case("prefill 0 keys", prefill(qp, kp[:0], st, en), check=is_empty),
        Case("prefill 0 rows", prefill(qp[:0], kp, st[:0], en[:0]), check=is_empty),
        err("prefill starts int64", "row_starts", prefill(qp, kp, st.long(), en)),
        err("prefill ends shape", "row_ends", prefill(qp, kp, st, en[:2])),
        err("prefill k rank", "k", prefill(qp, kp[0], st, en)),
        err("prefill k 3-d", "k", prefill(qp, kp.view(keys, 2, 64), st, en)),
        err("prefill score_scale 0", "score_scale", prefill(qp, kp, st, en, 0.0)),
        Case("decode", decode(qd, cache, table, ctx, 40)),
        Case("decode empty pool", decode(qd, cache[:0], table, ctx, 40), check=all_neg_inf),
        Case("decode 0-column table", decode(qd, cache, table[:, :0], ctx, 40), check=all_neg_inf),
        Case("decode pages INT32 extremes", decode(qd, cache, i32([[IMAX, IMIN], [-1, 6], [7, -2]], dev), ctx, 40), check=all_neg_inf),
        Case("decode context 0", decode(qd, cache, table, torch.zeros_like(ctx), 40), check=all_neg_inf),
        Case("decode context INT32 extremes", decode(qd, cache, table, i32([IMAX, IMIN, 0], dev), 40)),
        Case("decode 0 requests", decode(qd[:0], cache, table[:0], ctx[:0], 40), check=is_empty),
        err("decode q rank", "q", decode(qd[0], cache, table, ctx, 40)),
        err("decode cache heads", "k_cache", decode(qd, cache.expand(pages, ps, 2, 128), table, ctx, 40)),
        err("decode page size 0", "page size", decode(qd, cache[:, :0], table, ctx, 40)),
        err("decode table int64", "page_table", decode(qd, cache, table.long(), ctx, 40)),
        err("decode table rows", "page_table", decode(qd, cache, table[:1], ctx, 40)),
        err("decode ctx shape", "context_lens", decode(qd, cache, table, ctx[:1], 40)),
        err("decode max_model_len 0", "max_model_len", decode(qd, cache, table, ctx, 0)),
        err("decode max_model_len float", "max_model_len", decode(qd, cache, table, ctx, 40.0)),
    ]


def nsa_cases(dev):
    B, M, N, G, hpg, D, T, bs = 1, 17, 100, 2, 2, 64, 4, 32
    q, k, v = rnd(B, M, G * hpg, D, device=dev), rnd(B, N, G, D, device=dev), rnd(B, N, G, D, device=dev)
    idx = torch.randint(-1, 4, (B, M, G, T), dtype=I32).to(dev)

    def f(*a, block_size=bs, **kw):
        return lambda backend: mate.nsa_selection_attention(*a, **kw, block_size=block_size, backend=backend)

    def lse_t(res):  # nsa returns lse [B, H, M]; empty_attention wants (out, lse)
        return empty_attention(res)

    err = lambda name, arg, fn: Case(name, fn, "error", arg)  # noqa: E731
    return [
        Case("nsa", f(q, k, v, idx)),
        Case("nsa all -1", f(q, k, v, torch.full_like(idx, -1)), check=lse_t),
        Case("nsa INT32 extremes", f(q, k, v, torch.where(idx >= 0, IMAX, IMIN).to(I32)), check=lse_t),
        Case("nsa counts 0", f(q, k, v, idx, block_counts=torch.zeros(B, M, G, dtype=I32, device=dev)), check=lse_t),
        Case("nsa counts INT32 extremes", f(q, k, v, idx, block_counts=torch.full((B, M, G), IMAX, dtype=I32, device=dev))),
        Case("nsa counts negative", f(q, k, v, idx, block_counts=torch.full((B, M, G), IMIN, dtype=I32, device=dev)), check=lse_t),
        Case("nsa 0 keys", f(q, k[:, :0], v[:, :0], idx), check=lse_t),
        Case("nsa 0 slots", f(q, k, v, idx[..., :0]), check=lse_t),
        Case("nsa 0 queries", f(q[:, :0], k, v, idx[:, :0]), check=is_empty),
        Case("nsa huge", f(q * 1e30, k * 1e30, v, idx), finite=False),
        Case("nsa ids past the keys", f(q, k, v, torch.full_like(idx, 4)), "trusted", "block_indices"),
        err("nsa q list", "q", f([0.0], k, v, idx)),
        err("nsa v int", "v", f(q, k, v.to(I32), idx)),
        err("nsa dtypes", "dtype", f(q, k, v.half(), idx)),
        err("nsa k batch", "k", f(q, k.expand(2, N, G, D), v, idx)),
        err("nsa groups", "groups", f(q, rnd(B, N, 3, D, device=dev), rnd(B, N, 3, D, device=dev), idx)),
        err("nsa idx int64", "block_indices", f(q, k, v, idx.long())),
        err("nsa idx shape", "block_indices", f(q, k, v, idx[:, :3])),
        err("nsa counts shape", "block_counts", f(q, k, v, idx, block_counts=i32([1], dev))),
        err("nsa block_size 0", "block_size", f(q, k, v, idx, block_size=0)),
        err("nsa scale inf", "scale", f(q, k, v, idx, scale=float("inf"))),
        err("nsa out dtype", "out", f(q, k, v, idx, out=torch.empty(q.shape, device=dev))),
        err("nsa lse shape", "lse", f(q, k, v, idx, lse=torch.empty(1, device=dev))),
        err("nsa out overlaps q", "out", f(q, k, v, idx, out=q)),
    ]


def gqa_cases(dev):
    B, Sq, Sk, H, Hkv, D = 2, 40, 70, 4, 2, 64
    q, k, v = rnd(B, Sq, H, D, device=dev), rnd(B, Sk, Hkv, D, device=dev), rnd(B, Sk, Hkv, D, device=dev)

    def f(*a, **kw):
        return lambda backend: mate.gqa_attention(*a, **kw, return_lse=True, backend=backend)

    def rows_empty_where_no_key(res):
        out, lse = res
        empty = torch.isneginf(lse).permute(0, 2, 1)
        return None if bool((out[empty] == 0).all()) else "rows that see nothing must be 0"

    err = lambda name, arg, fn: Case(name, fn, "error", arg)  # noqa: E731
    return [
        Case("gqa full", f(q, k, v)),
        Case("gqa causal", f(q, k, v, sliding_window=(-1, 0))),
        Case("gqa window past everything", f(q, k, v, sliding_window=(0, 0)), check=rows_empty_where_no_key),
        Case("gqa Sq > Sk", f(rnd(B, 90, H, D, device=dev), k, v, sliding_window=(3, 0)), check=rows_empty_where_no_key),
        Case("gqa huge window", f(q, k, v, sliding_window=(IMAX, IMAX))),
        Case("gqa 0 keys", f(q, k[:, :0], v[:, :0]), check=empty_attention),
        Case("gqa 0 queries", f(q[:, :0], k, v), check=is_empty),
        Case("gqa huge", f(q * 1e30, k * 1e30, v), finite=False),
        Case("gqa Inf v", f(q, k, v * float("inf")), finite=False),
        err("gqa q list", "q", f([0.0], k, v)),
        err("gqa k int", "k", f(q, k.to(I32), v)),
        err("gqa v shape", "v", f(q, k, v[:, :3])),
        err("gqa heads", "H_kv", f(q, rnd(B, Sk, 3, D, device=dev), rnd(B, Sk, 3, D, device=dev))),
        err("gqa window -2", "LEFT", f(q, k, v, sliding_window=(-2, 0))),
        err("gqa window 3 values", "sliding_window", f(q, k, v, sliding_window=(1, 2, 3))),
        err("gqa window float", "sliding_window", f(q, k, v, sliding_window=(1.0, 0))),
        err("gqa window int", "sliding_window", f(q, k, v, sliding_window=128)),
        err("gqa scale 0", "scale", f(q, k, v, scale=0)),
        err("gqa out shape", "out", f(q, k, v, out=torch.empty(1, device=dev))),
        err("gqa out overlaps q", "out", f(q, k, v, out=q)),
        err("gqa return_lse int", "return_lse", lambda backend: mate.gqa_attention(q, k, v, return_lse=1, backend=backend)),
        err("gqa launcher D", "ATTN_D", lambda backend: mate.build_gqa_attn(1, 4, 2, 96)),
        err("gqa launcher H", "ATTN_H", lambda backend: mate.build_gqa_attn(1, 3, 2, 64)),
    ]


def merge_cases(dev):
    S, R, H, D = 3, 4, 2, 64
    po, pl = torch.randn(S, R, H, D, device=dev), torch.randn(S, R, H, device=dev)

    def f(*a, **kw):
        return lambda backend: mate.merge_attention_states(*a, **kw, backend=backend)

    err = lambda name, arg, fn: Case(name, fn, "error", arg)  # noqa: E731
    return [
        Case("merge", f(po, pl)),
        Case("merge all -inf", f(torch.full_like(po, float("nan")), torch.full_like(pl, float("-inf"))), check=empty_attention),
        Case("merge 0 splits", f(po[:0], pl[:0]), check=empty_attention),
        err("merge lse shape", "partial_lse", f(po, pl[:, :1])),
        err("merge po list", "partial_out", f([0.0], pl)),
    ]


ALL = (qsa_cases, mqa_cases, nsa_cases, gqa_cases, merge_cases)


# ---------------------------------------------------------------- the probe


def _call(case, backend):
    fn = case.fn
    return fn(backend)


def _names(e: Exception, arg: str) -> bool:
    return arg.lower() in str(e).lower()


def _compare(got, ref) -> str | None:
    for g, r in zip(tensors(got), tensors(ref)):
        g, r = g.float().cpu(), r.float().cpu()
        if g.shape != r.shape:
            return f"shape {tuple(g.shape)} vs reference {tuple(r.shape)}"
        if not torch.equal(torch.isneginf(g), torch.isneginf(r)):
            return "-inf pattern differs from the reference"
        fin = torch.isfinite(r)
        if fin.any():
            err = (g[fin] - r[fin]).norm() / r[fin].norm().clamp_min(1e-30)
            if not err < 2e-2:
                return f"relative error {float(err):.2e} against the reference"
    return None


def run(device: str = "cpu", verbose: bool = False) -> Tally:
    torch.manual_seed(0)
    tally = Tally()
    native = device != "cpu"
    for make in ALL:
        for case in make(device):
            ref = None
            for backend in BACKENDS:
                try:
                    res = _call(case, backend)
                    if device == "cuda":
                        torch.cuda.synchronize()
                except (ValueError, TypeError) as e:
                    # the native backend refusing what it does not run (no GPU, a reference-only layout) is clear
                    refused = backend == "tilelang" and "backend='reference'" in str(e)
                    if case.expect == "ok" and not (refused and (not native or not case.native)):
                        tally.bad("crash_or_stray", case, backend, f"unexpected {type(e).__name__}: {e}")
                    elif case.expect != "ok" and not (_names(e, case.arg) or refused):
                        tally.bad("crash_or_stray", case, backend, f"{type(e).__name__} does not name {case.arg!r}: {e}")
                    else:
                        tally.counts["clear_error"] += 1
                    continue
                except Exception as e:  # noqa: BLE001  (anything else is a stray exception)
                    tally.bad("crash_or_stray", case, backend, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                    continue
                if case.expect == "error":
                    tally.bad("silently_wrong", case, backend, f"returned instead of raising about {case.arg!r}")
                    continue
                if case.expect == "ok" and backend == "tilelang" and not case.native:
                    tally.bad("silently_wrong", case, backend, "ran natively a layout documented as reference-only")
                    continue
                if case.expect == "trusted":
                    try:
                        with mate.debug_checks():
                            _call(case, backend)
                        tally.bad("silently_wrong", case, backend, f"debug checks did not catch {case.arg!r}")
                    except ValueError as e:
                        if _names(e, case.arg):
                            tally.counts["ok"] += 1
                        else:
                            tally.bad("crash_or_stray", case, backend, f"debug error does not name {case.arg!r}: {e}")
                    continue
                msg = None
                if case.finite and any(bool(torch.isnan(t).any()) for t in tensors(res)):
                    msg = "NaN in the result of finite inputs"
                elif case.check is not None:
                    msg = case.check(res)
                if msg is None and backend == "tilelang" and ref is not None and case.finite:
                    msg = _compare(res, ref)
                if msg:
                    tally.bad("silently_wrong", case, backend, msg)
                else:
                    tally.counts["ok"] += 1
                if backend == "reference":
                    ref = res
            if verbose:
                print(case.name, flush=True)
    return tally


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    tally = run(a.device, a.verbose)
    n = sum(len(make(a.device)) for make in ALL)
    print(f"{n} cases x {len(BACKENDS)} backends on {a.device}: {tally.counts}")
    for f in tally.failures:
        print(" ", f)
    return tally


if __name__ == "__main__":
    main()
