"""GQA attention benchmark: mate (TileLang) vs compiled FlexAttention (sliding-window block mask) and cuDNN SDPA.

Shapes (issue 6): B = 1, H = 64, H_kv = 8, BF16, D = 128 and 64, Sq = Sk in
{4096, 16384, 65536}, windows (512, 0), (1024, 0), (4096, 0), (8192, 0) and
dense causal (-1, 0). FLOPs are counted exactly: 4 * B * H * D * (number of
visible (query, key) pairs). cuDNN (torch SDPA, CUDNN_ATTENTION backend) runs
dense causal only; FlexAttention runs every window, compiled once per (D, S)
with the window as a captured tensor, its BlockMask built exactly from the
band (partial and full 128x128 blocks).

Each implementation is timed as CUDA-Graph replays of back-to-back calls
(about 40 ms a replay; host launch cost excluded, the same for all three),
median of triton.testing.do_bench (benchmarks/common.py). Every row also records mate's relative error against
FlexAttention's output (and cuDNN's), as a sanity check of the timed code.

  python benchmarks/bench_gqa.py [--dims 128 64] [--lengths 4096 16384 65536] [--depths]
                                 [--out benchmarks/results/gqa_h200.json]
  python benchmarks/bench_gqa.py --options [--no-flex] [--out ...]
  python benchmarks/bench_gqa.py --decode [--tiles 64,128,128,3 ...] [--kv-dtype e4m3 e5m2] [--out ...]

--options times issue 17's options instead (D 128, BF16, H 64/8): sinks, softcap and both
against the plain kernel at 16k (dense causal and window (4096, 0)), and varlen 16 x 1024 causal
against the padded [16, 1024] call, cuDNN SDPA on the padded batch and FlexAttention with a
document mask on the packed one. FlashAttention-3 is not in these runs (its fa3-fwd wheel, 27 MB, fits beside
scripts/gpu-bundle.sh's 34 MB bundle since 2026-12-04; benchmarks/experiments/sustained.py --impls mate fa3 times
both in one process).

--decode times issue 17's decode instead (BF16, H 64/8, D of --dims): 64 sequences of --rows query rows (1, 4, 8)
against 8192 keys each in a paged cache (pages of 16 and 64 in random order), dense causal and window
(4096, 0), in TB/s of the K/V rows read (bytes counted exactly, see the JSON); beside it, in the same
run, mate's padded call on the same keys and torch SDPA (cuDNN, else FlashAttention) on the dense
visible K/V of one-row steps. --kv-dtype also times each row on the same cache quantized to FP8 (issue 38:
k_scale 0.02, v_scale 0.03), beside the BF16 time: its bytes (half the K/V), its error against the reference
on the same FP8 inputs and against the BF16 call (the quantization's own cost).

--depths also times the other consumer schedule (mma_depth 1 vs 2) of the
mate kernel. The JSON is rewritten after every row, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback

import torch
from common import PEAK_BYTES, PEAK_FLOPS, RESULTS, environment, figure, graph_ms, rel_err, write_json

import mate
from mate.tuning.measure import using_tiles
from overrides import compile_kernels, gqa_config_key, shipped_tiles

B, H, HKV = 1, 64, 8
WINDOWS = [(512, 0), (1024, 0), (4096, 0), (8192, 0), (-1, 0)]
BLOCK = 128


def visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Exact count of (query, key) pairs with p - left <= j <= p + right, 0 <= j < sk, p = i + sk - sq."""
    p = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = torch.clamp(p - left, min=0) if left >= 0 else torch.zeros_like(p)
    hi = torch.clamp(p + right, max=sk - 1) if right >= 0 else torch.full_like(p, sk - 1)
    return int(torch.clamp(hi - lo + 1, min=0).sum())


def band_block_mask(s: int, left: int, right: int, mask_mod, device):
    """FlexAttention BlockMask of a (left, right) band over s x s, 128x128 blocks, built from the band's geometry."""
    from torch.nn.attention.flex_attention import BlockMask

    assert s % BLOCK == 0
    n = s // BLOCK
    qb = torch.arange(n, device=device).unsqueeze(1)
    kb = torch.arange(n, device=device).unsqueeze(0)
    p_first, p_last = qb * BLOCK, qb * BLOCK + BLOCK - 1
    j_first, j_last = kb * BLOCK, kb * BLOCK + BLOCK - 1
    big = 1 << 40
    L = left if left >= 0 else big
    R = right if right >= 0 else big
    any_ = (j_first <= p_last + R) & (j_last >= p_first - L)
    full = (j_first >= p_last - L) & (j_last <= p_first + R)
    partial = any_ & ~full

    def indices(m):
        num = m.sum(-1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None], idx[None, None].contiguous()

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod)


def timed_ms(fn) -> float:
    return graph_ms(fn, target_ms=40)


REPORT = dict(stage="gqa_fwd", quick=["--dims", "128", "--lengths", "4096", "16384", "--windows", "4096,0", "causal"], full=[])


def figures(result):
    figs = []
    rows = [r for r in result["rows"] if "mate_ms" in r]
    for dim, window in sorted({(r["dim"], tuple(r["window"])) for r in rows}):
        rs = [r for r in rows if (r["dim"], tuple(r["window"])) == (dim, window)]
        lines = {"mate": [(r["seq"], r["mate_tflops"]) for r in rs],
                 "FlexAttention": [(r["seq"], r["flex_tflops"]) for r in rs if "flex_tflops" in r],
                 "cuDNN SDPA": [(r["seq"], r["cudnn_tflops"]) for r in rs if "cudnn_tflops" in r],
                 "roofline": [(r["seq"], PEAK_FLOPS / 1e12) for r in rs]}
        name = "causal" if window == (-1, 0) else f"window {window}"
        figs.append(figure(f"GQA H=64/8, D={dim}, {name}", "tokens (Sq = Sk)", "TFLOP/s", lines))
    return figs


def rnd(*shape):
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


def _row_writer(args, meta):
    """add(row): append a result row, rewrite the JSON (a run cut short keeps its rows), print it."""

    def add(row):
        meta["rows"].append(row)
        write_json(args.out, meta)
        print(json.dumps(row), flush=True)

    return add


def options(args) -> dict:
    """Issue 17's option rows (see the module docstring); every row checks mate against the reference."""
    dev = torch.device("cuda")
    meta = {**environment(), "timing": "CUDA-Graph replay of back-to-back calls, median per call", "rows": []}
    D = 128
    add = _row_writer(args, meta)

    s = 16384
    q, k, v = rnd(1, s, H, D), rnd(1, s, HKV, D), rnd(1, s, HKV, D)
    out = torch.empty_like(q)
    sinks = torch.randn(H, device=dev)
    for window in [(-1, 0), (4096, 0)]:
        flops = 4.0 * H * D * visible_pairs(s, s, *window)
        plain = None
        for name, kw in [("plain", {}), ("sinks", dict(sinks=sinks)), ("softcap", dict(softcap=30.0)),
                         ("sinks+softcap", dict(sinks=sinks, softcap=30.0))]:
            ms = timed_ms(lambda: mate.gqa_attention(q, k, v, sliding_window=window, out=out, **kw))
            plain = plain or ms
            ref = mate.gqa_attention(q[:, -512:], k, v, sliding_window=window, backend="reference", **kw)  # the last rows only
            add(dict(case=f"{name} 16k", window=list(window), ms=ms, tflops=flops / ms / 1e9, vs_plain=ms / plain,
                     err_vs_reference=rel_err(out[:, -512:], ref)))

    n, s = 16, 1024
    flops = 4.0 * H * D * n * visible_pairs(s, s, -1, 0)
    qp, kp, vp = rnd(n, s, H, D), rnd(n, s, HKV, D), rnd(n, s, HKV, D)
    outp = torch.empty_like(qp)
    padded = timed_ms(lambda: mate.gqa_attention(qp, kp, vp, sliding_window=(-1, 0), out=outp))
    add(dict(case="padded 16 x 1024 causal", ms=padded, tflops=flops / padded / 1e9))
    qv, kv, vv = qp.flatten(0, 1), kp.flatten(0, 1), vp.flatten(0, 1)  # the same tokens, packed
    cu = torch.arange(0, n * s + 1, s, device=dev, dtype=torch.int32)
    outv = torch.empty_like(qv)
    varlen = timed_ms(lambda: mate.gqa_attention(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                                                 sliding_window=(-1, 0), out=outv))
    add(dict(case="varlen 16 x 1024 causal", ms=varlen, tflops=flops / varlen / 1e9, vs_padded=varlen / padded,
             err_vs_padded=rel_err(outv.view_as(outp), outp)))
    qt, kt, vt = (x.transpose(1, 2) for x in (qp, kp, vp))

    def run_cudnn():
        return cudnn_causal(qt, kt, vt)

    try:
        cms = timed_ms(run_cudnn)
        add(dict(case="cuDNN SDPA padded 16 x 1024 causal", ms=cms, tflops=flops / cms / 1e9, mate_varlen_speedup=cms / varlen,
                 err_vs_mate=rel_err(outp, run_cudnn().transpose(1, 2))))
    except RuntimeError as e:
        add(dict(case="cuDNN SDPA padded 16 x 1024 causal", error=str(e)[:200]))

    # Decode through the varlen prefill kernel (varlen k; --decode times the split-KV kernel): 64 sequences of one row against 8192 keys;
    # the bandwidth counts each sequence's visible K and V once (the ceiling: PEAK_BYTES).
    nd, ctx = 64, 8192
    qd, kd, vd = rnd(nd, H, D), rnd(nd * ctx, HKV, D), rnd(nd * ctx, HKV, D)
    outd = torch.empty_like(qd)
    cu_q = torch.arange(0, nd + 1, device=dev, dtype=torch.int32)
    cu_k = torch.arange(0, nd * ctx + 1, ctx, device=dev, dtype=torch.int32)
    for window in [(-1, 0), (4096, 0)]:
        seen = min(ctx, window[0] + 1) if window[0] >= 0 else ctx
        ms = timed_ms(lambda: mate.gqa_attention(qd, kd, vd, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=ctx,
                                                 sliding_window=window, out=outd))
        gbs = nd * seen * HKV * D * 2 * 2 / ms / 1e6
        add(dict(case=f"decode (varlen prefill kernel) {nd} x 1 row x {ctx} keys", window=list(window), ms=ms, GB_s=gbs,
                 of_peak_bandwidth=gbs * 1e9 / PEAK_BYTES))

    if not args.no_flex:  # last: its compile takes the longest
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.arange(n * s, device=dev) // s

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        bm = create_block_mask(document_causal, 1, 1, n * s, n * s, device=dev)
        flex = torch.compile(flex_attention, dynamic=False)
        q1, k1, v1 = (x.unsqueeze(0).transpose(1, 2) for x in (qv, kv, vv))
        fms = timed_ms(lambda: flex(q1, k1, v1, block_mask=bm, enable_gqa=True))
        add(dict(case="FlexAttention document mask 16 x 1024 causal", ms=fms, tflops=flops / fms / 1e9, mate_varlen_speedup=fms / varlen,
                 err_vs_mate=rel_err(outv, flex(q1, k1, v1, block_mask=bm, enable_gqa=True).transpose(1, 2)[0])))
    return meta


def decode_bytes(q, table, lens, ctx: int, window) -> int:
    """The bytes a decode step must move: the K and V rows its query rows see (each KV group's once: every
    sequence has ctx keys), q read and out written (16-bit), block_table and seq_lens_k."""
    nd, sq, _, d = q.shape
    keys = ctx if window[0] < 0 else min(ctx, window[0] + sq)
    return nd * HKV * keys * d * 2 * 2 + 2 * q.numel() * 2 + table.numel() * 4 + lens.numel() * 4


def cudnn_causal(qt, kt, vt, gqa: bool = True):
    """Causal torch SDPA with the cuDNN backend only, over [B, H, S, D] (gqa: K/V with fewer heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)


def first_sdpa(qt, kt, vt):
    """(name, call) of the first torch SDPA backend of cuDNN, flash, efficient that runs GQA attention of qt over
    kt, vt ([B, H, S, D]), or (None, None); the call enters that backend's context itself, so a timing of it
    times the backend named."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def call_with(backend):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            call_with(backend)
            return backend.name, lambda b=backend: call_with(b)
        except RuntimeError:
            continue
    return None, None


K_SCALE, V_SCALE = 0.02, 0.03  # issue 38's
FP8_KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(x, kv_dtype, scale):
    """x / scale in FP8, in slices (no FP32 copy of a whole pool)."""
    out = torch.empty(x.shape, dtype=kv_dtype, device=x.device)
    for i in range(0, x.shape[0], 4096):
        out[i : i + 4096] = (x[i : i + 4096].float() / scale).to(kv_dtype)
    return out


def decode(args) -> dict:
    """Issue 17's decode rows (see the module docstring); every row checks mate against the reference on 8 sequences."""
    dev = torch.device("cuda")
    nd, ctx = 64, 8192
    meta = {**environment(), "timing": "CUDA-Graph replay of back-to-back calls, median per call",
            "shape": {"B": nd, "context": ctx, "H": H, "H_kv": HKV, "D": args.dims, "rows": args.rows, "dtype": "bfloat16"},
            "bytes": "K and V rows each sequence's query rows see (B * H_kv * visible * D * 2 B * 2), plus q, out, "
                     "block_table and seq_lens_k; mate's FP32 split partials (written, then read by the merge) are not counted",
            "rows": []}
    add = _row_writer(args, meta)

    lens = torch.full((nd,), ctx, dtype=torch.int32, device=dev)
    if args.tiles:  # compile the other tiles in parallel first (one after another at first use: minutes)
        keys = {gqa_config_key(torch.bfloat16, D, w) for w in [(-1, 0), (4096, 0)] for D in args.dims}
        jobs = [("gqa_decode", key, tiles, True) for key in keys for tiles in args.tiles]
        for job, (_, error) in compile_kernels(jobs, 16):
            assert error is None, (job, error)
    for D, ps in itertools.product(args.dims, (16, 64)):
        pages = nd * ctx // ps
        kc, vc = rnd(pages, ps, HKV, D), rnd(pages, ps, HKV, D)
        table = torch.randperm(pages, device=dev).int().view(nd, ctx // ps)  # pages in random order
        kd, vd = (x[table.long()].view(nd, ctx, HKV, D) for x in (kc, vc))  # the same keys, dense
        # the same cache in each FP8 kind (--kv-dtype), quantized once for every row of this (D, page size)
        fp8 = {name: tuple(quantize(x, FP8_KINDS[name], s) for x, s in ((kc, K_SCALE), (vc, V_SCALE))) for name in args.kv_dtype}
        scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
        for sq in args.rows:
            q = rnd(nd, sq, H, D)
            out = torch.empty_like(q)
            for window in [(-1, 0), (4096, 0)]:
                seen = visible_pairs(sq, ctx, *window)  # (row, key) pairs of one sequence; K/V rows read once per group
                nbytes = decode_bytes(q, table, lens, ctx, window)
                keys = ctx if window[0] < 0 else min(ctx, window[0] + sq)
                kw = dict(block_table=table, seq_lens_k=lens, sliding_window=window)
                ms = timed_ms(lambda: mate.gqa_attention(q, kc, vc, out=out, **kw))
                alt = []
                for tiles in args.tiles if sq == 1 else ():
                    with using_tiles("sm90", "gqa_decode", gqa_config_key(torch.bfloat16, D, window), tiles):
                        alt_ms = timed_ms(lambda: mate.gqa_attention(q, kc, vc, out=out, **kw))
                    alt.append(dict(tiles=tiles, ms=alt_ms, TB_s=nbytes / alt_ms / 1e9))
                ref = mate.gqa_attention(q[:8], kc, vc, **{**kw, "block_table": table[:8], "seq_lens_k": lens[:8]}, backend="reference")
                row = dict(case=f"paged decode {nd} x {sq} rows x {ctx} keys, page {ps}, D {D}", window=list(window), ms=ms,
                           bytes=nbytes, TB_s=nbytes / ms / 1e9, of_peak_bandwidth=nbytes / ms / 1e-3 / PEAK_BYTES,
                           tflops=4.0 * nd * H * D * seen / ms / 1e9, err_vs_reference=rel_err(out[:8], ref),
                           tiles=shipped_tiles("sm90", "gqa_decode", gqa_config_key(torch.bfloat16, D, window)), other_tiles=alt)
                for name, (k8, v8) in fp8.items():
                    out8 = torch.empty_like(q)
                    ms8 = timed_ms(lambda: mate.gqa_attention(q, k8, v8, out=out8, **kw, **scales))
                    ref8 = mate.gqa_attention(q[:8], k8, v8, **{**kw, "block_table": table[:8], "seq_lens_k": lens[:8]},
                                              **scales, backend="reference")
                    bytes8 = nbytes - nd * HKV * keys * D * 2  # K and V at one byte an element
                    row[name] = dict(ms=ms8, bytes=bytes8, TB_s=bytes8 / ms8 / 1e9, of_bf16_time=ms8 / ms,
                                     err_vs_reference=rel_err(out8[:8], ref8), err_vs_bf16=rel_err(out8, out))
                if ps == 64:  # the padded call and the baseline on the dense visible keys, once per shape
                    outp = torch.empty_like(q)
                    row["mate_padded_ms"] = timed_ms(lambda: mate.gqa_attention(q, kd, vd, sliding_window=window, out=outp))
                    qt, kt, vt = q.transpose(1, 2), kd[:, ctx - keys :].transpose(1, 2), vd[:, ctx - keys :].transpose(1, 2)
                    if sq == 1:  # one row sees every kept key (several would need the band as a mask)
                        name, fn = first_sdpa(qt, kt, vt)
                        if fn is not None:
                            bms = timed_ms(fn)
                            row.update(baseline=f"torch SDPA {name} on the dense visible K/V", baseline_ms=bms,
                                       baseline_TB_s=nbytes / bms / 1e9, speedup_vs_baseline=bms / ms,
                                       err_vs_baseline=rel_err(out, fn().transpose(1, 2)))
                add(row)
        del kc, vc, kd, vd, fp8
        torch.cuda.empty_cache()
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--windows", type=str, nargs="+", default=None, help="left,right pairs or 'causal' (= -1,0), e.g. 512,0 causal")
    ap.add_argument("--depths", action="store_true", help="also time the other mma_depth schedule")
    ap.add_argument("--extra", type=str, action="append", default=[],
                    help="DIM:key=value,... also time these tile overrides for head dim DIM, e.g. 64:block_m=192,threads=384")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--options", action="store_true", help="time issue 17's options (varlen, sinks, softcap) instead")
    ap.add_argument("--decode", action="store_true", help="time issue 17's paged decode instead")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="--decode: query rows a sequence")
    ap.add_argument("--tiles", type=str, action="append", default=[],
                    help="--decode: also time these gqa_decode tiles on the one-row steps, block_m,block_n,threads,num_stages (repeatable)")
    ap.add_argument("--kv-dtype", type=str, nargs="*", default=[], choices=sorted(FP8_KINDS),
                    help="--decode: also time each row on the cache in these FP8 kinds (issue 38)")
    ap.add_argument("--out", type=str, default=None, help="default benchmarks/results/gqa_h200.json (--options: gqa_options_h200.json)")
    args = ap.parse_args(argv)
    args.tiles = [dict(zip(("block_m", "block_n", "threads", "num_stages"), map(int, t.split(",")))) for t in args.tiles]
    args.out = args.out or str(RESULTS / ("gqa_options_h200.json" if args.options else "gqa_decode_h200.json" if args.decode else "gqa_h200.json"))
    if args.options:
        return options(args)
    if args.decode:
        return decode(args)
    # argparse takes "-1,0" for an option, so the causal window is also spelled "causal".
    windows = WINDOWS if args.windows is None else [(-1, 0) if w == "causal" else tuple(int(x) for x in w.split(",")) for w in args.windows]

    torch.manual_seed(0)
    dev = torch.device("cuda")
    meta = {
        **environment(),
        "shape": {"B": B, "H": H, "H_kv": HKV, "dtype": "bfloat16", "layout": "BSHD"},
        "flops": "4 * B * H * D * visible (query, key) pairs",
        "timing": "CUDA-Graph replay of back-to-back calls, median per call",
        "config": {},
        "rows": [],
    }

    def save():
        write_json(args.out, meta)

    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 64  # one compile per (D, S)
        torch._dynamo.config.accumulated_cache_size_limit = 256
        flex = torch.compile(flex_attention, dynamic=False)

    for dim in args.dims:
        for s in args.lengths:
            q = torch.randn(B, s, H, dim, device=dev).to(torch.bfloat16)
            k = torch.randn(B, s, HKV, dim, device=dev).to(torch.bfloat16)
            v = torch.randn(B, s, HKV, dim, device=dev).to(torch.bfloat16)
            out = torch.empty_like(q)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views for torch
            window_t = torch.tensor(0, device=dev, dtype=torch.int64)

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx - kv_idx <= window_t)

            for left, right in windows:
                row = {"dim": dim, "seq": s, "window": [left, right]}
                t0 = time.time()
                try:
                    pairs = visible_pairs(s, s, left, right)
                    flops = 4.0 * B * H * dim * pairs
                    row.update(pairs=pairs, flops=flops)
                    key = gqa_config_key(q.dtype, dim, (left, right))
                    tiles = shipped_tiles("sm90", "gqa_fwd", key)
                    meta["config"][key] = tiles

                    def run_mate():
                        return mate.gqa_attention(q, k, v, sliding_window=(left, right), out=out)

                    ms = timed_ms(run_mate)
                    row.update(mate_ms=ms, mate_tflops=flops / ms / 1e9, mma_depth=tiles["mma_depth"])
                    mate_out = out.clone()

                    if args.depths:
                        other = dict(tiles, mma_depth=3 - tiles["mma_depth"])
                        out2 = torch.empty_like(q)
                        with using_tiles("sm90", "gqa_fwd", key, other):
                            ms2 = timed_ms(lambda: mate.gqa_attention(q, k, v, sliding_window=(left, right), out=out2))
                        row["other_depth"] = {"mma_depth": other["mma_depth"], "ms": ms2, "tflops": flops / ms2 / 1e9,
                                              "err_vs_mate": rel_err(out2, mate_out)}

                    for extra in args.extra:
                        d, _, kv = extra.partition(":")
                        if int(d) != dim:
                            continue
                        over = {a: int(b) for a, b in (x.split("=") for x in kv.split(","))}
                        out3 = torch.empty_like(q)
                        with using_tiles("sm90", "gqa_fwd", key, dict(tiles, **over)):
                            ms3 = timed_ms(lambda: mate.gqa_attention(q, k, v, sliding_window=(left, right), out=out3))
                        row.setdefault("extra", []).append({"tiles": dict(tiles, **over), "ms": ms3, "tflops": flops / ms3 / 1e9,
                                                            "err_vs_mate": rel_err(out3, mate_out)})

                    if flex is not None:
                        window_t.fill_(left if left >= 0 else s)
                        bm = band_block_mask(s, left if left >= 0 else s, right, mask_mod, dev)

                        def run_flex():
                            return flex(qt, kt, vt, block_mask=bm, enable_gqa=True)

                        tc = time.time()
                        ref = run_flex()
                        torch.cuda.synchronize()
                        row["flex_first_call_s"] = time.time() - tc
                        fms = timed_ms(run_flex)
                        row.update(flex_ms=fms, flex_tflops=flops / fms / 1e9, speedup_vs_flex=fms / ms,
                                   err_vs_flex=rel_err(mate_out, ref.transpose(1, 2)))

                    if (left, right) == (-1, 0):
                        kx, vx = kt, vt
                        gqa = True

                        def run_cudnn():
                            return cudnn_causal(qt, kx, vx, gqa)

                        try:
                            ref = run_cudnn()
                        except RuntimeError:
                            gqa = False  # cuDNN without native GQA: give it the expanded K/V
                            kx = kt.repeat_interleave(H // HKV, dim=1)
                            vx = vt.repeat_interleave(H // HKV, dim=1)
                            ref = run_cudnn()
                        cms = timed_ms(run_cudnn)
                        row.update(cudnn_ms=cms, cudnn_tflops=flops / cms / 1e9, cudnn_native_gqa=gqa,
                                   speedup_vs_cudnn=cms / ms, err_vs_cudnn=rel_err(mate_out, ref.transpose(1, 2)))
                except Exception as e:  # keep measuring the other rows
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                row["wall_s"] = round(time.time() - t0, 1)
                meta["rows"].append(row)
                save()
                print(json.dumps(row), flush=True)
            del q, k, v, out, qt, kt, vt
            torch.cuda.empty_cache()

    print()
    hdr = f"{'D':>4} {'seq':>6} {'window':>10} | {'mate ms':>8} {'TFLOP/s':>7} {'d':>1} | {'alt ms':>8} {'TF':>5} | {'flex ms':>8} {'TF':>5} {'x flex':>6} | {'cudnn ms':>8} {'TF':>5} {'x cudnn':>7} | err"
    print(hdr)
    for r in meta["rows"]:
        w = f"({r['window'][0]},{r['window'][1]})"
        if "mate_ms" not in r:
            print(f"{r['dim']:>4} {r['seq']:>6} {w:>10} | {r.get('error', '?')[:80]}")
            continue
        alt = r.get("other_depth", {})
        line = f"{r['dim']:>4} {r['seq']:>6} {w:>10} | {r['mate_ms']:8.3f} {r['mate_tflops']:7.1f} {r['mma_depth']:>1} | "
        line += f"{alt.get('ms', float('nan')):8.3f} {alt.get('tflops', float('nan')):5.0f} | "
        line += f"{r.get('flex_ms', float('nan')):8.3f} {r.get('flex_tflops', float('nan')):5.0f} {r.get('speedup_vs_flex', float('nan')):6.2f} | "
        line += f"{r.get('cudnn_ms', float('nan')):8.3f} {r.get('cudnn_tflops', float('nan')):5.0f} {r.get('speedup_vs_cudnn', float('nan')):7.2f} | "
        line += f"{r.get('err_vs_flex', float('nan')):.1e}"
        for e in r.get("extra", []):
            line += f" | extra {e['tiles']['block_m']}x{e['tiles']['block_n']} t{e['tiles']['threads']} d{e['tiles']['mma_depth']}: {e['ms']:.3f} ms {e['tflops']:.0f} TF"
        if "error" in r:
            line += " ERR " + r["error"][:60]
        print(line)
    return meta


if __name__ == "__main__":
    main()
