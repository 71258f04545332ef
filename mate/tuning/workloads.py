"""The tuner's workloads: per stage card, `<stage>_workload(spec, shape)` builds inputs on the GPU and returns
(native call, reference call[, pick]) (mate._stage.Stage says how the card names it). The tuner runs the
native call under each candidate's tiles and checks it against the reference; the benchmarks and the GPU
stress test run the same workloads. Also the NSA pieces those workloads build on: random visible blocks
(`draw_block_indices`) and the native backward split into its steps (`nsa_backward_parts`).
Importing this module loads no TileLang.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import mate
from mate.qsa.kernels import mqa_card, sparse_card, topk_card


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


def qsa_attention_warp_workload(spec, shape):
    """qsa_attention_workload for the small-CTA family: `batch` rows, 4 splits where the key splits."""
    return qsa_attention_workload({**spec, "wide": 1}, shape)


def qsa_merge_workload(spec, shape):
    """`splits` partials of `rows` rows in the canonical QSA geometry."""
    hq, _, d = sparse_card.CANONICAL_GEOMETRY
    splits, rows = shape["splits"], shape["rows"]
    po = torch.randn(splits, rows, hq, d, device="cuda").to(getattr(torch, spec["pdtype"]))
    pl = torch.randn(splits, rows, hq, device="cuda")
    odt = getattr(torch, spec["odtype"])
    return (lambda: mate.merge_attention_states(po, pl, out_dtype=odt),
            lambda: mate.merge_attention_states(po, pl, out_dtype=odt, backend="reference"))


def indexer_like_scores(gen, rows, keys, *, device, visible=None, nan=1e-3):
    """FP32 [rows, keys] scores as the indexer gives them: sums of ReLUs (so exact zeros tie), -inf past each
    row's `visible` keys (int [rows]; default: random lengths from 0 to keys), a fraction `nan` NaN (garbage)."""
    s = (torch.randn(rows, keys, 4, generator=gen).clamp_min(0).sum(-1) * 0.3)
    if visible is None:
        visible = torch.randint(0, keys + 1, (rows,), generator=gen)
    s = s.masked_fill(torch.arange(keys) >= visible.view(-1, 1), float("-inf"))
    s[torch.rand(rows, keys, generator=gen) < nan] = float("nan")
    return s.to(device)


def qsa_topk_workload(spec, shape):
    """Top-k and the expansion of `rows` rows of `keys` indexer-like scores, moved into the key's bucket (the
    bucket's full width where `keys` is in another) and row class (wide: more rows than SMs)."""
    buckets = (0, *topk_card.KEY_BUCKETS)
    keys = shape["keys"]
    if not buckets[buckets.index(spec["max_keys"]) - 1] < keys <= spec["max_keys"]:
        keys = spec["max_keys"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = shape["rows"]
    if (rows > sms) != bool(spec["wide"]):
        rows = 2 * sms if spec["wide"] else sms // 2
    k = min(shape["k"], keys)
    gen = torch.Generator().manual_seed(0)
    scores = indexer_like_scores(gen, rows, keys, device="cuda", visible=torch.randint(keys // 2, keys + 1, (rows,), generator=gen))
    pos = torch.randint(0, 4 * keys, (rows,), generator=gen, dtype=torch.int32).cuda()
    return (lambda: mate.qsa_topk_tokens(scores, k, pos), lambda: mate.qsa_topk_tokens(scores, k, pos, backend="reference"))


def qsa_expand_workload(spec, shape):
    """The expansion of `rows` x `k` random block ids (-1 pads among them) at random positions."""
    gen = torch.Generator().manual_seed(0)
    rows, k = shape["rows"], shape["k"]
    blocks = torch.randint(-1, 8192, (rows, k), generator=gen, dtype=torch.int32).cuda()
    pos = torch.randint(-2, 4 * 8192, (rows,), generator=gen, dtype=torch.int32).cuda()
    return (lambda: mate.qsa_expand_blocks(blocks, pos), lambda: mate.qsa_expand_blocks(blocks, pos, backend="reference"))
