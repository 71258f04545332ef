"""The tests' input builders: random tensors and views at storage offsets, NSA block ids and QSA problems in
every layout (one logical problem, then its padded, flattened, paged, varlen and physical forms).

Everything random comes from a CPU `torch.Generator` passed in, so a problem is the same on every device.
Values are never all zeros: edge cases (-1 pads, ids past the capacity, duplicates, empty rows) are part of
the draws.
"""

from __future__ import annotations

import math

import torch

I32 = torch.int32
BF16 = torch.bfloat16


def randn(gen, *shape, device, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def fp8_cache(gen, *shape, device, dtype):
    """An FP8 (torch.float8_e4m3fn / float8_e5m2) tensor whose values span the format: magnitudes from below its
    smallest subnormal (flushed to 0) to its largest finite value, both signs, so that an upcast that is not exact
    anywhere in the range shows up."""
    mag = torch.exp2(torch.empty(*shape).uniform_(-18, 10, generator=gen))
    x = torch.randn(*shape, generator=gen) * mag
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype).to(device)  # clamped: e4m3fn has no inf, an overflow would be NaN


FP8_KV = (torch.float8_e4m3fn, torch.float8_e5m2)
K_SCALE, V_SCALE = 0.02, 0.03  # issue 38's; K/V of unit scale quantize to values up to ~250 (e4m3's max: 448)


def fp8_quantized(x, kv_dtype, scale):
    """x / scale (in x's dtype) in FP8, finite values clamped to the format's range (e4m3fn has no Inf: an overflow
    would be NaN); NaN garbage stays NaN, +-Inf becomes NaN (e4m3fn) or stays Inf (e5m2)."""
    y = x / scale
    fmax = torch.finfo(kv_dtype).max
    return torch.where(torch.isfinite(y), y.clamp(-fmax, fmax), y).to(kv_dtype)


def fp8_scales(tensor_scale, device):
    """An FP8 call's scale keywords: K_SCALE / V_SCALE as floats, or one-element FP32 tensors of the device (a 0-dim
    one at a storage offset for k_scale)."""
    if tensor_scale:
        return dict(k_scale=torch.tensor([0.0, K_SCALE], device=device)[1], v_scale=torch.tensor([V_SCALE], device=device))
    return dict(k_scale=K_SCALE, v_scale=V_SCALE)


def fp8_kv(k, v, kv_dtype, tensor_scale):
    """K/V quantized at K_SCALE / V_SCALE, and the call's scale keywords (fp8_scales)."""
    return fp8_quantized(k, kv_dtype, K_SCALE), fp8_quantized(v, kv_dtype, V_SCALE), fp8_scales(tensor_scale, k.device)


def randint(gen, lo, hi, shape, device="cpu"):
    return torch.randint(lo, hi, shape, generator=gen, dtype=I32).to(device)


def tail_view(gen, shape, *, device, pad_rows=3, pad_cols=0, dtype=BF16):
    """A view of `shape` at a storage offset (pad_rows leading rows, pad_cols leading features), ending where its base ends."""
    base = randn(gen, shape[0] + pad_rows, *shape[1:-1], shape[-1] + pad_cols, device=device, dtype=dtype)
    return base[pad_rows:, ..., pad_cols:]


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
