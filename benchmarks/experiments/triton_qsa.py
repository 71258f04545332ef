"""A Triton baseline for QSA sparse core attention in the design issue #16 gives for vLLM's sm90 kernel, written
here (vLLM's source is not on the GPU host): one small program per (row, KV head, split), the group's query
heads padded to BLOCK_M = 16, BLOCK_N selected tokens a step gathered through the block table, an online
softmax, then (splits > 1) a merge kernel; the per-head gate at the end.

  python benchmarks/experiments/triton_qsa.py [--batches 1 8 64 256] [--prefill-rows 4096] [--configs vllm sweep]

Each case times mate (num_splits=None) and every Triton config on the same inputs (common's
qsa_serving_problem, seed 0), one call per CUDA-graph replay with L2 flushed (common.cold_graph_us); every
result is checked against backend='reference' first. `vllm` is the issue's table of the anchor's sm90
choices (>= 2048 programs: 1 split, 32 tokens, 1 warp; <= 32 programs: 64 splits, 64 tokens, 2 warps;
<= 64: 16 splits; <= 256: 8; else 4); `sweep` adds neighbours (tokens a step, warps, pipeline stages, splits).
The request and causal position of each row are computed once, outside the timed call (vLLM's metadata
is built per batch); mate derives them in its kernel.
"""

from __future__ import annotations

import argparse
import math

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, overrides, bench_*

import mate  # noqa: E402
from common import (  # noqa: E402
    RESULTS, SERVING_D, SERVING_HKV, SERVING_HQ, SERVING_PAGE, cold_graph_us, environment, qsa_serving_problem, rel_err, write_json,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attention(Q, K, V, TI, BT, REQ, POS, SLK, G, O, PO, PL,
               sqr, sqh, skp, sks, skh, svp, svs, svh, sti, sbt, sgr, sor, soh,
               R, W, scale_log2,
               CHUNK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
               PAGE: tl.constexpr, HQ: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    b = tl.load(REQ + r)
    pos = tl.load(POS + r)
    slk = tl.load(SLK + b)
    hs = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    heads = kvh * GROUP + hs
    q = tl.load(Q + r * sqr + heads[:, None] * sqh + d[None, :], mask=(hs < GROUP)[:, None], other=0.0)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = sp * CHUNK
    # chunk is a multiple of BLOCK_N; the last split's steps past W are masked
    for i in tl.range(0, CHUNK // BLOCK_N, num_stages=STAGES):
        n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.load(TI + r * sti + n, mask=n < W, other=-1)
        ok = (t >= 0) & (t <= pos) & (t < slk)
        tc = tl.where(ok, t, 0)
        page = tl.load(BT + b * sbt + tc // PAGE, mask=ok, other=0).to(tl.int64)
        slot = (tc % PAGE).to(tl.int64)
        k = tl.load(K + (page * skp + slot * sks + kvh * skh)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + (page * svp + slot * svs + kvh * svh)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    hm = hs < GROUP
    inv = tl.where(l > 0, 1.0 / l, 0.0)
    if SPLIT:
        lse = tl.where(l > 0, (m + tl.log2(l)) * 0.6931471805599453, float("-inf"))
        tl.store(PO + ((sp * R + r) * HQ + heads)[:, None] * D + d[None, :], acc * inv[:, None], mask=hm[:, None])
        tl.store(PL + (sp * R + r) * HQ + heads, lse, mask=hm)
    else:
        g = tl.load(G + r * sgr + heads, mask=hm, other=0.0).to(tl.float32)
        o = acc * (inv / (1 + tl.exp(-g)))[:, None]
        tl.store(O + r * sor + heads[:, None] * soh + d[None, :], o.to(O.dtype.element_ty), mask=hm[:, None])


@triton.jit
def _merge(PO, PL, G, O, R, S, H: tl.constexpr, sgr, sor, soh, D: tl.constexpr, BLOCK_S: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ls = tl.load(PL + (s * R + r) * H + h, mask=s < S, other=float("-inf"))
    mx = tl.max(ls, 0)
    w = tl.where(ls > float("-inf"), tl.exp(ls - mx), 0.0)
    po = tl.load(PO + ((s * R + r) * H + h)[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0)
    tot = tl.sum(w, 0)
    g = tl.load(G + r * sgr + h).to(tl.float32)
    o = o * (tl.where(tot > 0, 1.0 / tot, 0.0) / (1 + tl.exp(-g)))
    tl.store(O + r * sor + h * soh + d, o.to(O.dtype.element_ty))


def vllm_config(programs):
    """(splits, tokens a step, warps) of the issue's table of the anchor's sm90 choices."""
    if programs >= 2048:
        return 1, 32, 1
    if programs <= 32:
        return 64, 64, 2
    return (16 if programs <= 64 else 8 if programs <= 256 else 4), 64, 2


def prepare(p):
    """Per-row request and causal position (once per batch, outside the timed call)."""
    cu = p["cu_seqlens_q"].long()
    rows = torch.arange(p["query"].shape[0], device=cu.device)
    req = torch.searchsorted(cu, rows, right=True) - 1
    pos = p["seq_lens_k"].long()[req] - (cu[req + 1] - cu[req]) + (rows - cu[req])
    return req.to(torch.int32), pos.to(torch.int32)


def triton_call(p, req, pos, splits, block_n, warps, stages):
    q, k, v, ti, bt, g = p["query"], p["key"], p["value"], p["token_indices"], p["block_table"], p["gate"]
    R, HQ, D = q.shape
    group = HQ // k.shape[2]
    W = ti.shape[1]
    chunk = triton.cdiv(triton.cdiv(W, splits), block_n) * block_n
    splits = triton.cdiv(W, chunk)
    out = torch.empty_like(q)
    po = torch.empty(splits, R, HQ, D, device=q.device, dtype=torch.float32) if splits > 1 else out
    pl = torch.empty(splits, R, HQ, device=q.device, dtype=torch.float32) if splits > 1 else out
    scale_log2 = LOG2E / math.sqrt(D)

    def call():
        _attention[(R, k.shape[2], splits)](
            q, k, v, ti, bt, req, pos, p["seq_lens_k"], g, out, po, pl,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            ti.stride(0), bt.stride(0), g.stride(0), out.stride(0), out.stride(1),
            R, W, scale_log2,
            CHUNK=chunk, GROUP=group, BLOCK_M=16, BLOCK_N=block_n, D=D, PAGE=k.shape[1], HQ=HQ, SPLIT=splits > 1, STAGES=stages,
            num_warps=warps, num_stages=stages)
        if splits > 1:
            _merge[(R, HQ)](po, pl, g, out, R, splits, HQ, g.stride(0), out.stride(0), out.stride(1), D=D,
                            BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
        return out

    return call


def configs(programs, mode, stages):
    """(splits, tokens a step, warps, stages) to time: the anchor's choice at every stage count of `stages`;
    with `sweep`, also half and twice its splits (decode) at 32 tokens with 1-2 warps and 64 with 1-4, at
    two stages (prefill: one split, every stage count)."""
    s0, n0, w0 = vllm_config(programs)
    found = [(s0, n0, w0, st) for st in stages]
    if mode == "sweep":
        for s in sorted({max(1, s0 // 2), s0, s0 * 2}) if s0 > 1 else [1]:
            for n, w in ((32, 1), (32, 2), (64, 1), (64, 2), (64, 4)):
                for st in stages if s0 == 1 else [2]:
                    if (s, n, w, st) not in found:
                        found.append((s, n, w, st))
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--prefill-rows", type=int, default=4096)
    ap.add_argument("--configs", choices=["vllm", "sweep"], default="sweep")
    ap.add_argument("--stages", type=int, nargs="*", default=[1, 2, 3])
    ap.add_argument("--out", default=str(RESULTS / "qsa_triton_baseline.json"))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    cases = [(f"decode b={b}", b, 1) for b in args.batches]
    if args.prefill_rows:
        cases.append((f"prefill rows={args.prefill_rows}", 1, args.prefill_rows))
    results = []
    for name, batch, rpr in cases:
        p, _ = qsa_serving_problem(gen, batch, rpr)
        ref = mate.qsa_sparse_attention(**p, backend="reference")
        res = dict(case=name, mate_err=rel_err(mate.qsa_sparse_attention(**p), ref),
                   mate_cold_us=cold_graph_us(lambda: mate.qsa_sparse_attention(**p)), triton={})
        print(f"{name}: mate {res['mate_cold_us']:.1f} us (rel err {res['mate_err']:.2e})", flush=True)
        req, pos = prepare(p)
        programs = p["query"].shape[0] * SERVING_HKV
        for splits, block_n, warps, stages in configs(programs, args.configs, args.stages):
            key = f"splits={splits},block_n={block_n},warps={warps},stages={stages}"
            try:
                call = triton_call(p, req, pos, splits, block_n, warps, stages)
                e = rel_err(call(), ref)
                if e > 1e-2:
                    raise AssertionError(f"relative error {e:.2e}")
                t = cold_graph_us(call)
            except Exception as ex:  # noqa: BLE001  (a config that does not compile or fit is reported, not fatal)
                res["triton"][key] = dict(error=f"{type(ex).__name__}: {str(ex)[:200]}")
                print(f"  triton {key}: {res['triton'][key]['error']}", flush=True)
                continue
            res["triton"][key] = dict(cold_us=t, rel_err=e)
            print(f"  triton {key}: {t:.1f} us (rel err {e:.2e})", flush=True)
        ok = {k: v["cold_us"] for k, v in res["triton"].items() if "cold_us" in v}
        if ok:
            best = min(ok, key=ok.get)
            res["triton_best"] = dict(config=best, cold_us=ok[best])
            print(f"{name}: mate {res['mate_cold_us']:.1f} us, best triton {ok[best]:.1f} us ({best})", flush=True)
        results.append(res)
        del p
        torch.cuda.empty_cache()
    write_json(args.out, dict(environment(), heads=(SERVING_HQ, SERVING_HKV), dim=SERVING_D, page=SERVING_PAGE, cases=results))


if __name__ == "__main__":
    main()
