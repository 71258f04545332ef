"""Input generators, timing and tile overrides that the tests, the benchmarks and the tuner share.

Everything random comes from a CPU `torch.Generator` passed in (so a problem is the
same on every device) unless the generator draws on the GPU for speed
(`draw_block_indices`, the serving problems). Values are never all zeros: edge cases
(-1 pads, ids past the capacity, duplicates, empty rows) are part of the draws.
The timing (`median_ms`, `graph_ms`, `capture_graph`) and run metadata (`environment`) are
one measurement for the tuner and the benchmarks, so a tuned time and a benchmarked time
agree; `using_tiles` runs the dispatcher with candidate tiles, `program_variants` with
another version of a stage's program source (the A/B benchmarks), `shipped_tiles` reads
an entry of the config; `nsa_backward_parts` splits NSA's backward for a profile. The
tuner's workloads (`<stage>_workload`) are here, named by the stages' cards. Importing
this module loads no TileLang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import yaml

import mate
from mate import _dispatch
from mate.qsa.kernels import mqa_card, sparse_card

I32 = torch.int32
BF16 = torch.bfloat16


def randn(gen, *shape, device, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def randint(gen, lo, hi, shape, device="cpu"):
    return torch.randint(lo, hi, shape, generator=gen, dtype=I32).to(device)


def tail_view(gen, shape, *, device, pad_rows=3, pad_cols=0, dtype=BF16):
    """A view of `shape` at a storage offset (pad_rows leading rows, pad_cols leading features), ending where its base ends."""
    base = randn(gen, shape[0] + pad_rows, *shape[1:-1], shape[-1] + pad_cols, device=device, dtype=dtype)
    return base[pad_rows:, ..., pad_cols:]


# ---------------------------------------------------------------- NSA selection


def nsa_indices(gen, B, M, G, T, N, block_size, device="cpu"):
    """[B, M, G, T] block ids: visible, future and past-the-end blocks, -1 pads, other negatives, duplicates, INT32_MAX."""
    n_blocks = math.ceil(N / block_size)
    idx = torch.randint(-2, n_blocks + 3, (B, M, G, T), generator=gen, dtype=I32)
    idx[..., 0] = torch.randint(0, max(1, n_blocks // 2), (B, M, G), generator=gen, dtype=I32)
    if T > 2:
        idx[..., 2] = idx[..., 0]  # a duplicate
    if T > 3:
        idx[..., 3] = -1
    if T > 4:
        idx[0, 0, 0, 4] = 2**31 - 1
    return idx.to(device)


def draw_block_indices(B, M, N, G, T, bs, hot=False, chunk=4096, device="cuda"):
    """T distinct random causally visible blocks per (query, group), sorted, -1 where fewer exist (bottom-right aligned).

    `hot` draws from the first T blocks only, so every query reads the same blocks (a benchmark probe).
    """
    n_blocks = -(-N // bs)
    idx = torch.empty(B, M, G, T, dtype=torch.int32, device=device)
    blocks = torch.arange(n_blocks, device=device)
    for m0 in range(0, M, chunk):
        m1 = min(M, m0 + chunk)
        pos = N - M + torch.arange(m0, m1, device=device)
        visible = blocks.view(1, -1) <= (pos // bs).view(-1, 1)
        if hot:
            visible &= blocks.view(1, -1) < T
        r = torch.rand(B, m1 - m0, G, n_blocks, device=device)
        r = torch.where(visible.view(1, m1 - m0, 1, n_blocks), r, -1.0)
        val, sel = r.topk(min(T, n_blocks), dim=-1)
        sel = torch.where(val >= 0, sel, n_blocks + 1).sort(-1).values
        sel = torch.where(sel > n_blocks, -1, sel)
        if T > n_blocks:
            sel = torch.cat([sel, sel.new_full((*sel.shape[:-1], T - n_blocks), -1)], -1)
        idx[:, m0:m1] = sel.to(torch.int32)
    return idx


def _nsa_problem(spec, shape, device):
    """q, k, v [1, seq, heads or kv_heads, dim] and random visible blocks of the tuner's NSA shapes."""
    L, H, G, T, d = shape["seq"], shape["heads"], shape["kv_heads"], shape["selected"], spec["dim"]
    dt = getattr(torch, spec["dtype"])
    q = torch.randn(1, L, H, d, device=device).to(dt)
    k = torch.randn(1, L, G, d, device=device).to(dt)
    v = torch.randn(1, L, G, d, device=device).to(dt)
    return q, k, v, draw_block_indices(1, L, L, G, T, spec["block_size"], device=device)


# The NSA reference is dense over the keys (M x N x H scores in FP32), too slow for the whole timed shape
# where a slice will do: the last rows, which keep their positions (bottom-right aligned) and select the
# most blocks, and whose outputs and dq do not depend on the other rows.
NSA_TAIL = 128


def nsa_selection_workload(spec, shape):
    """The tuner's NSA selection workload (also nsa_ab's): spec (dtype, dim, block_size), shape (seq, heads,
    kv_heads, selected) -> (native call, reference call, pick), B 1, random visible blocks (CUDA)."""
    bs = spec["block_size"]
    q, k, v, idx = _nsa_problem(spec, shape, "cuda")
    tail = min(shape["seq"], NSA_TAIL)
    return (lambda: mate.nsa_selection_attention(q, k, v, idx, block_size=bs),
            lambda: mate.nsa_selection_attention(q[:, -tail:], k, v, idx[:, -tail:], block_size=bs, backend="reference"),
            lambda out: (out[0][:, -tail:], out[1][:, :, -tail:]))


def nsa_reference_grads(q, k, v, block_indices, do, *, block_size: int) -> tuple:
    """dq, dk, dv of the reference backend: a forward and a backward through the public API, with grads."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o, _ = mate.nsa_selection_attention(q, k, v, block_indices, block_size=block_size, backend="reference")
    return torch.autograd.grad(o, (q, k, v), do)


def _nsa_backward_problem(spec, shape, device):
    """The tuner's NSA problem with an output gradient: its native backward split into steps, and
    `reference(rows)`, the reference backend's gradients of the problem cut to those query rows."""
    q, k, v, idx = _nsa_problem(spec, shape, device)
    do = torch.randn(q.shape, device=device).to(q.dtype)
    parts = nsa_backward_parts(q, k, v, idx, do, block_size=spec["block_size"])

    def reference(rows=slice(None)):
        return nsa_reference_grads(q[:, rows], k, v, idx[:, rows], do[:, rows], block_size=spec["block_size"])

    return parts, reference


def nsa_selection_bwd_dq_workload(spec, shape, device="cuda"):
    """The dq step of NSA's native backward (the delta pre-pass and dq, one kernel), timed alone
    (nsa_backward_parts), checked against the reference's dq of the last rows. dq is poisoned (NaN)
    before each launch, so a candidate that skips an element is caught (the memset is timed with the step,
    the same for every candidate)."""
    parts, reference = _nsa_backward_problem(spec, shape, device)
    dq = parts.grads[0]
    tail = min(shape["seq"], NSA_TAIL)

    def native():
        dq.fill_(float("nan"))
        parts.dq()
        return dq

    return native, lambda: reference(slice(-tail, None))[0], lambda out: out[:, -tail:]


def nsa_selection_bwd_dkv_workload(spec, shape, device="cuda"):
    """The dk/dv step of NSA's native backward, timed alone (nsa_backward_parts; the dq step runs once
    before, for the delta it reads), checked against the reference's dk and dv of the whole problem (every
    query row contributes). dk and dv are zeroed before each launch (rows no block covers stay the
    caller's zeros), so a candidate that skips a block is caught."""
    parts, reference = _nsa_backward_problem(spec, shape, device)
    dk, dv = parts.grads[1:]
    parts.dq()

    def native():
        dk.zero_()
        dv.zero_()
        parts.dkv()
        return dk, dv

    return native, lambda: reference()[1:]


class NsaBackwardParts(NamedTuple):
    """NSA selection's native backward as its three device steps (see nsa_backward_parts)."""

    grads: tuple  # (dq, dk, dv), written by dq() and dkv()
    prep: Callable[[], object]  # the per-row metadata and the sort of the used slots (its result is dropped)
    dq: Callable[[], None]  # delta = rowsum(dO * O), then dq
    dkv: Callable[[], None]  # dk and dv (rows no block covers stay zero)


def nsa_backward_parts(q, k, v, block_indices, do, *, block_size: int) -> NsaBackwardParts:
    """The backward of a native nsa_selection_attention call (padded, every block counted, default scale)
    split into the steps autograd runs together, for a profile (bench_nsa --probe). The forward runs once
    here; dq() and dkv() take the dispatcher's tiles at each call, so using_tiles around one times others.
    The one place outside mate/nsa that reaches into mate.nsa.selection: its steps have no public API."""
    from mate.nsa import selection

    p = selection._resolve(q, k, v, block_indices, block_size=block_size, block_counts=None, cu_seqlens=None, scale=None,
                           out=None, lse=None, backend="tilelang")
    o, lse = selection._forward(p)
    grads = selection._backward_buffers(p)
    a = selection._backward_args(p, o, lse, do, *grads)
    return NsaBackwardParts(tuple(grads), lambda: selection._backward_args(p, o, lse, do, *grads),
                            lambda: selection.launch_dq(p, a), lambda: selection.launch_dkv(p, a))


def compile_kernels(jobs: list[tuple], workers: int, target: str = "sm90"):
    """Compile kernels of other tiles than the config's into TileLang's disk cache before a timed run, in
    `workers` processes: mate.precompile's pool, for a benchmark's variants. `jobs` are (stage, key,
    tiles or None, full); yields (job, (source, error)) as each ends."""
    from mate.precompile import build_all

    yield from build_all(jobs, target, workers)


# ---------------------------------------------------------------- QSA sparse attention: logical problems in every layout


def qsa_token_rows(gen, n, width, cap, device="cpu"):
    """Request-local token ids: valid ones, -1 anywhere (the middle too), duplicates, ids past the cache, empty rows."""
    t = torch.randint(-1, cap + 3, (n, width), generator=gen, dtype=torch.int32)
    if width >= 3:
        t[:, width // 2] = -1  # a pad in the middle of every row
        t[:, -1] = t[:, 0]  # a duplicate
    if n:
        t[0] = -1  # a row with nothing selected
    return t.to(device)


def qsa_requests(gen, *, n_req=3, hq=4, hkv=2, d=16, width=7, dtype=torch.float32):
    """A logical problem: per request its cache length, real query rows, K/V and token lists."""
    caps = torch.randint(1, 12, (n_req,), generator=gen).tolist()
    caps[-1] = 13
    caps[0] = max(caps[0], 4)
    rows = torch.randint(0, 5, (n_req,), generator=gen).tolist()
    rows[0] = max(rows[0], 2)
    reqs = []
    for b in range(n_req):
        reqs.append(dict(
            rows=rows[b], cap=caps[b], seq_k=max(0, caps[b] - int(torch.randint(0, 3, (1,), generator=gen))),
            q=torch.randn(rows[b], hq, d, generator=gen).to(dtype),
            k=torch.randn(caps[b], hkv, d, generator=gen).to(dtype),
            v=torch.randn(caps[b], hkv, d, generator=gen).to(dtype),
            tok=qsa_token_rows(gen, rows[b], width, caps[b]),
            pos=torch.randint(-2, caps[b] + 2, (rows[b],), generator=gen, dtype=torch.int32),
            gate=torch.randn(rows[b], hq, d, generator=gen).to(dtype),
        ))
    # row 1 of request 0 sees token 0 under every option, so no problem is all-empty
    reqs[0]["seq_k"] = caps[0]
    reqs[0]["tok"][1, 0] = 0
    reqs[0]["pos"][1] = caps[0] - 1
    return reqs


def qsa_padded(reqs, field, fill, gen=None):
    """[B, Q, ...] with one padded row or more per request, filled with `fill` (random values when gen is given)."""
    qmax = max(r["rows"] for r in reqs) + 1
    like = reqs[0][field]
    shape = (len(reqs), qmax, *like.shape[1:])
    x = torch.randn(shape, generator=gen).to(like.dtype) if gen is not None else torch.full(shape, fill, dtype=like.dtype)
    for b, r in enumerate(reqs):
        x[b, : r["rows"]] = r[field]
    return x


def qsa_query_layout(reqs, form, gen):
    """Query-side tensors of a layout: padded [B, Q, ...] or flattened (cu_seqlens_q, or token_to_req with
    the requests' rows interleaved). Also returns where each real row, in request order, lands."""
    fields = dict(query="q", token_indices="tok", query_positions="pos", gate="gate")
    if form == "padded":
        t = dict(query=qsa_padded(reqs, "q", 0, gen), token_indices=qsa_padded(reqs, "tok", 1),  # padded rows select a real token: must still give 0
                 query_positions=qsa_padded(reqs, "pos", 0), gate=qsa_padded(reqs, "gate", 0, gen))
        qmax = t["query"].shape[1]
        return t, {}, torch.cat([torch.arange(r["rows"]) + b * qmax for b, r in enumerate(reqs)])
    t = {name: torch.cat([r[f] for r in reqs]) for name, f in fields.items()}
    lens = torch.tensor([r["rows"] for r in reqs])
    if form == "cu_seqlens":
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        return t, dict(cu_seqlens_q=cu), torch.arange(int(lens.sum()))
    # interleave the requests at random, each request's rows keeping their order
    req = torch.repeat_interleave(torch.arange(len(reqs)), lens)
    shuffled = req[torch.randperm(req.numel(), generator=gen)]
    perm = torch.empty_like(req)
    where = torch.empty_like(req)
    for b in range(len(reqs)):
        slots, rows = torch.nonzero(shuffled == b).flatten(), torch.nonzero(req == b).flatten()
        perm[slots], where[rows] = rows, slots
    t = {name: x[perm] for name, x in t.items()}
    return t, dict(token_to_req=shuffled.to(torch.int32), num_requests=len(reqs)), where


def qsa_kv_layout(reqs, form, gen, page_size=4):
    """Key/value of a layout: padded [B, S, ...], paged with block_table, or flattened varlen with cu_seqlens_k."""
    hkv, d = reqs[0]["k"].shape[1:]
    dtype = reqs[0]["k"].dtype
    if form == "padded":
        smax = max(r["cap"] for r in reqs) + 2
        k = torch.randn(len(reqs), smax, hkv, d, generator=gen).to(dtype)
        v = torch.randn(len(reqs), smax, hkv, d, generator=gen).to(dtype)
        for b, r in enumerate(reqs):
            k[b, : r["cap"]], v[b, : r["cap"]] = r["k"], r["v"]
        return k, v, {}
    if form == "varlen":
        lens = torch.tensor([r["cap"] for r in reqs])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        return torch.cat([r["k"] for r in reqs]), torch.cat([r["v"] for r in reqs]), dict(cu_seqlens_k=cu)
    # paged: pages scattered through a pool with spare pages; unused table entries -1 or past the pool
    need = [-(-r["cap"] // page_size) for r in reqs]
    max_pages = max(need) + 1
    pool = sum(need) + 3
    ids = torch.randperm(pool, generator=gen).tolist()
    k = torch.randn(pool, page_size, hkv, d, generator=gen).to(dtype)
    v = torch.randn(pool, page_size, hkv, d, generator=gen).to(dtype)
    table = torch.full((len(reqs), max_pages), -1, dtype=torch.int32)
    for b, r in enumerate(reqs):
        for c in range(need[b]):
            page = ids.pop()
            table[b, c] = page
            n = min(page_size, r["cap"] - c * page_size)
            k[page, :n], v[page, :n] = r["k"][c * page_size : c * page_size + n], r["v"][c * page_size : c * page_size + n]
        table[b, need[b]] = pool + 5 if b % 2 else -1  # a missing page right after the last real one
    return k, v, dict(block_table=table, page_size=page_size)


def qsa_physical_layout(reqs, kw_logical):
    """The same problem as physical ids: the caller's causal filtering and page translation, done here."""
    q = torch.cat([r["q"] for r in reqs])
    k, v = torch.cat([r["k"] for r in reqs]), torch.cat([r["v"] for r in reqs])
    start = 0
    ids = []
    for b, r in enumerate(reqs):
        sk = r["seq_k"]
        for i in range(r["rows"]):
            p = sk - r["rows"] + i
            row = [start + t if 0 <= t < min(sk, r["cap"]) and t <= p else (-1 if t % 2 else k.shape[0] + t) for t in r["tok"][i].tolist()]
            ids.append(row)
        start += r["cap"]
    return q, k, v, torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- QSA sparse attention: issue #16's serving inputs (CUDA)

SERVING_HQ, SERVING_HKV, SERVING_D, SERVING_PAGE, SERVING_CONTEXT, SERVING_BLOCKS, SERVING_SHARED_POOL = 24, 2, 256, 64, 32768, 512, 512


def qsa_serving_selection(gen, positions):
    """[rows, 2051] token ids and [rows, 512] block ids (issue #16): 512 distinct complete causal 4-token blocks
    in random order, expanded, then the tokens of the row's own incomplete tail block (-1 where absent)."""
    tokens, blocks = [], []
    for p in positions.tolist():
        full = (p + 1) // 4  # blocks j with 4j + 3 <= p
        blk = torch.randperm(full, generator=gen)[:SERVING_BLOCKS]
        tail = torch.arange(4 * full, 4 * full + 3)
        tokens.append(torch.cat([(blk[:, None] * 4 + torch.arange(4)).flatten(), torch.where(tail <= p, tail, -1)]))
        blocks.append(blk)
    return torch.stack(tokens).to(torch.int32), torch.stack(blocks).to(torch.int32)


def qsa_serving_problem(gen, batch, rows_per_req):
    """Issue #16's inputs. Decode (rows_per_req 1): request r holds 32768 - 1 - (r mod 4) tokens, one row at its
    last position, its pages a random draw from the pool (batch 256: a 512-page pool the requests share, else
    pages of its own). Prefill: the last rows_per_req positions of one 32768-token request. Per-head BF16 gate."""
    pages = SERVING_CONTEXT // SERVING_PAGE
    if rows_per_req == 1:
        seq = torch.tensor([SERVING_CONTEXT - 1 - r % 4 for r in range(batch)])
        pool = SERVING_SHARED_POOL if batch >= 256 else batch * pages
        perm = [torch.randperm(pool, generator=gen) for _ in range(batch)] if pool == SERVING_SHARED_POOL else \
            list(torch.randperm(pool, generator=gen).view(batch, pages))
        table = torch.stack([t[:pages] for t in perm])
        positions = seq - 1
    else:
        seq = torch.full((batch,), SERVING_CONTEXT)
        pool = batch * pages
        table = torch.randperm(pool, generator=gen).view(batch, pages)
        positions = torch.arange(SERVING_CONTEXT - rows_per_req, SERVING_CONTEXT).repeat(batch)
    rows = batch * rows_per_req
    k = torch.randn(pool, SERVING_PAGE, SERVING_HKV, SERVING_D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(pool, SERVING_PAGE, SERVING_HKV, SERVING_D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(rows, SERVING_HQ, SERVING_D, generator=gen).to(torch.bfloat16).cuda()
    ti, bi = qsa_serving_selection(gen, positions)
    cu = torch.arange(batch + 1, dtype=torch.int32) * rows_per_req
    return dict(query=q, key=k, value=v, token_indices=ti.cuda(), block_table=table.to(torch.int32).cuda(),
                cu_seqlens_q=cu.cuda(), seq_lens_k=seq.to(torch.int32).cuda(),
                gate=torch.randn(rows, SERVING_HQ, generator=gen).to(torch.bfloat16).cuda()), bi.cuda()


# ---------------------------------------------------------------- the tuner's workloads (CUDA)
# Each stage's card names its workload here (mate._stage.Stage): (spec, shape) -> (native call, reference call[, pick]).


def mqa_logits_workload(spec, shape):
    """The last `rows` token positions of a request of 4 * keys tokens, each seeing its complete blocks."""
    rows, keys = shape["rows"], shape["keys"]
    keys += keys % 2 != (spec["even_keys"] == 0)  # the key count's parity picks the specialization: make it match
    dt = getattr(torch, spec["dtype"])
    q = torch.randn(rows, mqa_card.HEADS, mqa_card.DIM, device="cuda").to(dt)
    k = torch.randn(keys, mqa_card.DIM, device="cuda").to(dt)
    pos = torch.arange(4 * keys - rows, 4 * keys, device="cuda")
    lo = torch.zeros(rows, device="cuda", dtype=torch.int32)
    hi = ((pos + 1) // 4).to(torch.int32)
    return (lambda: mate.qsa_mqa_prefill(q, k, lo, hi), lambda: mate.qsa_mqa_prefill(q, k, lo, hi, backend="reference"))


def mqa_decode_workload(spec, shape):
    """`batch` requests of `keys` keys each, their pages in random order through one pool."""
    batch, keys, page = shape["batch"], shape["keys"], spec["page_size"]
    pages = keys // page
    dt = getattr(torch, spec["dtype"])
    cache = torch.randn(batch * pages, page, 1, mqa_card.DIM, device="cuda").to(dt)
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    q = torch.randn(batch, mqa_card.HEADS, mqa_card.DIM, device="cuda").to(dt)
    ctx = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    return (lambda: mate.qsa_mqa_decode(q, cache, table, ctx, keys),
            lambda: mate.qsa_mqa_decode(q, cache, table, ctx, keys, backend="reference"))


def _gqa_window(spec, shape):
    """The sliding_window of a GQA workload: its config key's window class (`local`: the shape's window,
    default (4096, 0))."""
    return {"none": None, "causal": (-1, 0), "local": tuple(shape.get("window", (4096, 0)))}[spec["window"]]


def gqa_fwd_workload(spec, shape):
    """B 1, `seq` queries and keys, the key's window (_gqa_window), with the LSE."""
    S, H, Hkv, d = shape["seq"], shape["heads"], shape["kv_heads"], spec["dim"]
    window = _gqa_window(spec, shape)
    dt = getattr(torch, spec["dtype"])
    q = torch.randn(1, S, H, d, device="cuda").to(dt)
    k = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    v = torch.randn(1, S, Hkv, d, device="cuda").to(dt)
    return (lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True),
            lambda: mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference"))


def gqa_decode_workload(spec, shape):
    """`batch` sequences of `rows` query rows at the end of `context` keys in a paged cache (`page`-token
    pages in random order), the key's window (_gqa_window); the reference reads the same cache."""
    B, ctx, rows, ps, H, Hkv = (shape[n] for n in ("batch", "context", "rows", "page", "heads", "kv_heads"))
    d = spec["dim"]
    window = _gqa_window(spec, shape)
    dt = getattr(torch, spec["dtype"])
    pages = B * -(-ctx // ps)
    kc, vc = (torch.randn(pages, ps, Hkv, d, device="cuda").to(dt) for _ in range(2))
    kw = dict(block_table=torch.randperm(pages, device="cuda").int().view(B, -1), sliding_window=window,
              seq_lens_k=torch.full((B,), ctx, dtype=torch.int32, device="cuda"), return_lse=True)
    q = torch.randn(B, rows, H, d, device="cuda").to(dt)
    return (lambda: mate.gqa_attention(q, kc, vc, **kw), lambda: mate.gqa_attention(q, kc, vc, **kw, backend="reference"))


def qsa_attention_workload(spec, shape):
    """Paged decode rows: `batch` requests of `context` tokens, each with `width` random tokens of its own pages.

    The key's `wide` picks the grid size (two CTAs per SM or more, or fewer): the batch is scaled to match.
    """
    hq, hkv, d = sparse_card.CANONICAL_GEOMETRY
    splits = 4 if spec["split"] else 1
    batch = shape["batch"] if spec["wide"] else max(1, shape["batch"] // 16)
    context, width, page = shape["context"], shape["width"], 64
    dt = getattr(torch, spec["dtype"])
    pages = context // page
    k = torch.randn(batch * pages, page, hkv, d, device="cuda").to(dt)
    v = torch.randn_like(k)
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    q = torch.randn(batch, hq, d, device="cuda").to(dt)
    tokens = torch.randint(0, context, (batch, width), device="cuda", dtype=torch.int32)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    kw = dict(block_table=table, cu_seqlens_q=cu, num_splits=splits, return_lse=True)
    return (lambda: mate.qsa_sparse_attention(q, k, v, tokens, **kw),
            lambda: mate.qsa_sparse_attention(q, k, v, tokens, **kw, backend="reference"))


def qsa_merge_workload(spec, shape):
    """`splits` partials of `rows` rows in the canonical QSA geometry."""
    hq, _, d = sparse_card.CANONICAL_GEOMETRY
    splits, rows = shape["splits"], shape["rows"]
    po = torch.randn(splits, rows, hq, d, device="cuda").to(getattr(torch, spec["pdtype"]))
    pl = torch.randn(splits, rows, hq, device="cuda")
    odt = getattr(torch, spec["odtype"])
    return (lambda: mate.merge_attention_states(po, pl, out_dtype=odt),
            lambda: mate.merge_attention_states(po, pl, out_dtype=odt, backend="reference"))


# ---------------------------------------------------------------- timing and run metadata (GPU)

ROOT = Path(__file__).resolve().parent.parent


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median of triton.testing.do_bench (warm-up and repetitions in ms of GPU time)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture_graph(fn, calls: int = 1):
    """Warm `fn` up on a side stream, then capture `calls` back-to-back calls in a CUDA graph; (graph, last result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            result = fn()
    return graph, result


def graph_ms(fn, target_ms: float = 0.5, warmup: int = 25, rep: int = 100) -> float:
    """Per-call median of CUDA-graph replays of back-to-back calls: kernel time without the host launch cost.

    Enough calls go into one graph that a replay lasts about `target_ms`, so
    microsecond kernels are not timed against the event resolution.
    """
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    est = max(start.elapsed_time(stop), 1e-3)
    calls = max(1, min(200, math.ceil(target_ms / est)))
    graph, _ = capture_graph(fn, calls)
    # At least 7 replays however long one lasts: the median of fewer is not worth its name.
    return median_ms(graph.replay, warmup, max(rep, 7 * calls * est)) / calls


def commit() -> str:
    """The source commit: MATE_COMMIT (set it where the tree has no .git), else git's HEAD, '+dirty' if mate/ or configs/ differ."""
    if os.environ.get("MATE_COMMIT"):
        return os.environ["MATE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mate", "configs"], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return "unknown"
    return (sha + ("+dirty" if dirty.stdout.strip() else "")) if sha else "unknown"


def environment() -> dict:
    """What a result needs to be reproduced: GPU, commit, date, versions and the command line (tilelang None
    where it is not installed: a baseline's run on a GPU host without TileLang's bundle)."""
    try:
        import tilelang
    except ImportError:
        tilelang = None
    return dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        tilelang=tilelang and tilelang.__version__,
    )


# ---------------------------------------------------------------- tile overrides


@contextlib.contextmanager
def without_cluster_launches():
    """QSA split decode in two launches (attention, then merge) only: the GPU probe answers that no cluster
    fits (mate._hopper.whole_sm_clusters), so mate.qsa.attention.cluster_splits never picks one. For A/Bs."""
    from mate import _hopper

    probe = _hopper.whole_sm_clusters
    _hopper.whole_sm_clusters = lambda index, cluster: 0
    try:
        yield
    finally:
        _hopper.whole_sm_clusters = probe


@contextlib.contextmanager
def gqa_decode_splits(splits: int | None, seen: list | None = None):
    """gqa_attention's split-KV kernel with `splits` key splits (1: one split, which writes the output itself),
    or None: the shipped choice (mate.swa.attention._num_splits); `seen` (a list) collects each call's count.
    For A/Bs of the split choice and tests of both output paths."""
    from mate.swa import attention

    choose = attention._num_splits

    def forced(*args):
        n = choose(*args) if splits is None else splits
        if seen is not None:
            seen.append(n)
        return n

    attention._num_splits = forced
    try:
        yield
    finally:
        attention._num_splits = choose


@contextlib.contextmanager
def using_tiles(target: str, stage: str, key: str, tiles: dict, base: dict | None = None):
    """Run the dispatcher with `tiles` as the entry of (stage, key), through a patched copy of `base`
    (default: the target's config as the dispatcher reads it).

    The API wrappers read tile values too (grid sizes, limits), so the whole
    dispatch path, not only the kernel, must see the candidate.
    """
    cfg = {s: dict(e) for s, e in (base or _dispatch.load_config(target)).items()}
    cfg.setdefault(stage, {})[key] = dict(tiles)
    saved = os.environ.get("MATE_CONFIG_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / f"{target}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.environ["MATE_CONFIG_DIR"] = tmp
        _dispatch.clear_caches()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("MATE_CONFIG_DIR", None)
            else:
                os.environ["MATE_CONFIG_DIR"] = saved
            _dispatch.clear_caches()


def gqa_config_key(dtype: torch.dtype, dim: int, sliding_window) -> str:
    """The gqa_fwd config key a padded gqa_attention call of this dtype, head dim and window runs under."""
    from mate.swa import attention

    return _dispatch.spec_key(attention._spec(dtype, dim, *attention.parse_window(sliding_window)))


def shipped_tiles(target: str, stage: str, key: str | dict) -> dict:
    """The tile parameters of config entry `key` (`dtype=bfloat16,dim=128,...`, or its spec as a dict) of `stage`, as
    the dispatcher reads them."""
    return _dispatch.tiles(stage, key if isinstance(key, dict) else _dispatch.parse_key(key), target)


def config_specs(target: str, stage: str) -> list[dict]:
    """The specializations (`dict(dtype=..., dim=..., ...)`) of the entries of `stage` in the target's config."""
    return [_dispatch.parse_key(key) for key in _dispatch.load_config(target).get(stage, {})]


def stage_kernels(stage: str) -> dict:
    """The kernels of `stage` the dispatcher holds now, by (spec items, target, option items): what the calls so far
    compiled or loaded (inside program_variants, the active version's)."""
    return {k[1:]: v for k, v in _dispatch._kernels.items() if k[0] == stage}


def _variant_card(card, name: str, source: Path):
    """`card` with its program taken from the file `source` (registered as module `name`: the card names its
    program by module); the card's pass options where that file defines them, else none."""
    spec = importlib.util.spec_from_file_location(name, source)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    passes = card.pass_configs if card.pass_configs and hasattr(module, card.pass_configs) else None
    return dataclasses.replace(card, module=name, pass_configs=passes)


def compile_variant(stage: str, spec: dict, tiles: dict, source=None, target: str = "sm90"):
    """The kernel of `stage` for `spec` at `tiles`: the shipped program, or the one in the file `source` (another
    version of its module, as in program_variants). Run in worker processes first, it fills TileLang's disk
    cache, so the benchmark's own compile of the same kernel is a load."""
    card = None if source is None else _variant_card(_dispatch.STAGES[stage], f"mate_variant_{stage}_{Path(source).stem}", Path(source))
    return _dispatch.compile_program(stage, spec, target, tiles, card)


def _cache_variant(job) -> str | None:
    from mate.precompile import error_line

    try:
        compile_variant(*job)  # a worker's kernel stays in the disk cache (it does not pickle)
        return None
    except Exception as e:
        return error_line(e)


def cache_variants(jobs: list[tuple], workers: int) -> list:
    """compile_variant(*job) for each job (stage, spec, tiles, source) in `workers` processes, into the disk
    cache (a benchmark's variants in parallel); each job's error line (mate.precompile.error_line) or None."""
    import concurrent.futures as cf
    import multiprocessing

    # spawn: TileLang and torch hold threads that a forked child would inherit broken.
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_cache_variant, jobs))


def compile_variants(jobs: list[tuple], workers: int) -> list:
    """The kernels of compile_variant(*job) for each job, in order: first cache_variants, then here from the
    cache. A job that does not compile raises."""
    failed = [(job, error) for job, error in zip(jobs, cache_variants(jobs, workers)) if error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(jobs)} variants did not compile; the first: {failed[0]}")
    return [compile_variant(*job) for job in jobs]


@contextlib.contextmanager
def using_kernel(stage: str, spec: dict, kernel, tiles: dict, target: str = "sm90"):
    """Inside, the dispatcher runs `kernel` (compile_variant's) for (stage, spec) and gives `tiles` as that
    entry's tiles to everyone who asks (the wrappers size grids from them). No config file is written and no
    other kernel forgotten, so switching between variants costs nothing (interleaved timing)."""
    key = (stage, tuple(spec.items()), target, ())
    real, saved = _dispatch.tiles, _dispatch._kernels.get(key)

    def tiles_of(s, sp, tg):
        return dict(tiles) if (s, tuple(sp.items()), tg) == key[:3] else real(s, sp, tg)

    _dispatch.tiles, _dispatch._kernels[key] = tiles_of, kernel
    try:
        yield
    finally:
        _dispatch.tiles = real
        _dispatch._kernels.pop(key)
        if saved is not None:
            _dispatch._kernels[key] = saved


@contextlib.contextmanager
def program_variants(stage: str, sources: dict):
    """Run `stage` with one of several versions of its program source, switched by name; yields `use(name)`.

    `sources` maps a name to a file (another version of the stage's kernel module, defining the
    card's program with the same signature) or to None (the shipped module). After `use(name)`,
    the public API runs that version: the dispatcher builds the program from its file with the
    config's tiles and the card's pass options, compiles it at its first call and keeps each
    version's compiled kernels apart, so switching back costs nothing (interleaved timing).
    Every kernel the dispatcher compiles for the stage switches (`_dispatch.kernel`, GQA's option
    variants, varlen, sinks and softcap, included: a version's program takes those arguments too);
    the API still reads flags and constants from the shipped module. Change tiles around this, not inside.
    On exit the shipped card and the kernels compiled before are back.
    """
    shipped = _dispatch.STAGES[stage]
    cards = {name: shipped if src is None else _variant_card(shipped, f"mate_variant_{stage}_{name}", Path(src))
             for name, src in sources.items()}
    held = {name: {} for name in cards}

    def take() -> dict:
        return {k: _dispatch._kernels.pop(k) for k in [k for k in _dispatch._kernels if k[0] == stage]}

    before = take()
    active = []

    def use(name: str) -> None:
        if active:
            held[active.pop()] = take()
        _dispatch.STAGES[stage] = cards[name]
        _dispatch._kernels.update(held[name])
        active.append(name)

    try:
        yield use
    finally:
        take()
        _dispatch.STAGES[stage] = shipped
        _dispatch._kernels.update(before)
