"""MQA indexer benchmark: native TileLang vs the mate reference vs a plain torch einsum+relu.

Shapes (issue 2):
  prefill - R query rows (--rows; the issue's case is 8192) at the last R positions
            of a 32768-token request against its 8192 compressed keys,
            row_start = 0, row_end = (pos+1)//4;
  decode  - batches --batches (the issue's are 1 and 64), 8192 compressed keys per
            request, page size 16, distinct pages per request.

FLOPs count visible scores only (4 heads x 128 x 2 per visible (row, key));
bytes are each input read once plus the FP32 output written once. The roofline
is max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s), the bf16 matrix rate and copy
bandwidth measured on an H200 here. Times are medians of
triton.testing.do_bench; decode is also timed as CUDA-Graph replays, which
removes the host launch cost (benchmarks/common.py). Decode inputs rotate over several copies so the
keys do not sit in L2 between runs. `mate (cold graph)` is issue 16's measurement: one call per
CUDA-graph replay with L2 flushed before each (common.cold_graph_us); the sweep ranks tiles by it.

  python benchmarks/bench_mqa.py [--rows 8192] [--batches 1 64] [--kv-dtype float8_e4m3fn] [--sweep] [--out benchmarks/results/mqa.json]

--kv-dtype times decode on an FP8 key cache (issue 38) quantized from the BF16 one with a per-tensor scale, as a
float (`mate`) and as a device tensor (`mate k_scale tensor`); its rows also give the error against the BF16
cache's scores (what the quantization costs). Bytes count the FP8 cache.

--sweep also times candidate tile configs (each checked against the reference
first) through a patched copy of configs/sm90.yaml; `mate-tune` searches the
whole space.
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch
from common import PEAK_BYTES, PEAK_FLOPS, RESULTS, cold_graph_us, environment, figure, graph_ms, median_ms, rel_err, write_json

import mate
from mate.tuning.measure import using_tiles

H, D = 4, 128
REPORT = dict(stage="mqa", quick=["--rows", "2048", "8192", "--batches", "1", "16", "64"],
              full=["--rows", "1024", "2048", "4096", "8192", "--batches", "1", "4", "16", "64", "128"])


def torch_scores(q, k, lo, hi, scale):
    """The plain torch formulation: one bf16 einsum, ReLU and head-sum in FP32, masked."""
    s = torch.einsum("rhd,nd->rhn", q, k).float().relu_().sum(1).mul_(scale)
    j = torch.arange(k.shape[0], device=q.device)
    return s.masked_fill_((j < lo[:, None]) | (j >= hi[:, None]), float("-inf"))


def prefill_case(dtype, rows=8192):
    keys = 8192
    pos = torch.arange(32768 - rows, 32768, device="cuda")
    q = torch.randn(rows, H, D, device="cuda").to(dtype)
    k = torch.randn(keys, D, device="cuda").to(dtype)
    lo = torch.zeros(rows, device="cuda", dtype=torch.int32)
    hi = ((pos + 1) // 4).to(torch.int32)
    flops = float((hi - lo).sum()) * H * D * 2
    nbytes = q.numel() * q.element_size() + k.numel() * k.element_size() + rows * keys * 4 + 2 * rows * 4
    scale = 1 / math.sqrt(D)
    impls = {
        "mate": lambda: mate.qsa_mqa_prefill(q, k, lo, hi),
        "torch": lambda: torch_scores(q, k, lo, hi, scale),
        "reference": lambda: mate.qsa_mqa_prefill(q, k, lo, hi, backend="reference"),
    }
    return dict(name=f"prefill r={rows}", kind="prefill", size=rows, shape=f"rows={rows} keys={keys}", flops=flops, bytes=nbytes,
                impls=impls, check=lambda: rel_err(impls["mate"](), impls["reference"]()))


def quantize(x, kv_dtype):
    """x in kv_dtype with one per-tensor dequant scale, as a server stores its cache: x ~ stored * scale, the
    largest |x| at the format's largest finite value."""
    scale = float(x.float().abs().amax()) / torch.finfo(kv_dtype).max
    return (x.float() / scale).to(kv_dtype), scale


def decode_case(dtype, batch, keys=8192, page_size=16, kv_dtype=None):
    """kv_dtype: an FP8 key cache (issue 38), quantized from the BF16 one with a float k_scale; also timed with the
    scale as a device tensor, and checked against the reference on the same FP8 cache and against the BF16 cache
    it was quantized from (the quantization's own error)."""
    pages_per_req = keys // page_size
    per_set = batch * keys * D * (1 if kv_dtype else 2)
    sets = max(1, min(32, math.ceil(512e6 / per_set)))
    data, unquantized = [], None
    for i in range(sets):
        cache = torch.randn(batch * pages_per_req, page_size, 1, D, device="cuda").to(dtype)
        table = torch.randperm(batch * pages_per_req, device="cuda").to(torch.int32).view(batch, pages_per_req)
        q = torch.randn(batch, H, D, device="cuda").to(dtype)
        if kv_dtype is None:
            data.append((q, cache, table, {}))
            continue
        if i == 0:
            unquantized = cache
        stored, k_scale = quantize(cache, kv_dtype)
        data.append((q, stored, table, dict(k_scale=k_scale)))
    ctx = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    flops = batch * keys * H * D * 2.0
    nbytes = per_set + batch * H * D * 2 + batch * keys * 4 + batch * pages_per_req * 4 + batch * 4
    it = [0]

    def rotating(backend, tensor_scale=False):
        kws = [dict(k_scale=torch.tensor(kw["k_scale"], device="cuda")) if tensor_scale else kw for *_, kw in data]

        def call():
            q, cache, table, _ = data[it[0] % sets]
            kw = kws[it[0] % sets]
            it[0] += 1
            return mate.qsa_mqa_decode(q, cache, table, ctx, keys, **kw, backend=backend)

        return call

    def torch_decode():
        q, cache, table, kw = data[it[0] % sets]
        it[0] += 1
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # an FP8 gather as bytes (index ops lack FP8)
        kv = raw[table.long()].view(cache.dtype).view(batch, keys, D).to(q.dtype)
        return torch.einsum("bhd,bnd->bhn", q, kv).float().relu_().sum(1).mul_(kw.get("k_scale", 1.0) / math.sqrt(D))

    impls = {"mate": rotating("tilelang")}
    if kv_dtype is not None:
        impls["mate k_scale tensor"] = rotating("tilelang", tensor_scale=True)
    impls.update(torch=torch_decode, reference=rotating("reference"))

    def check():
        q, cache, table, kw = data[0]
        out = mate.qsa_mqa_decode(q, cache, table, ctx, keys, **kw)
        err = rel_err(out, mate.qsa_mqa_decode(q, cache, table, ctx, keys, **kw, backend="reference"))
        if kv_dtype is None:
            return err, None
        dev = mate.qsa_mqa_decode(q, cache, table, ctx, keys, k_scale=torch.tensor(kw["k_scale"], device="cuda"))
        err = max(err, rel_err(dev, mate.qsa_mqa_decode(q, cache, table, ctx, keys, **kw, backend="reference")))
        return err, rel_err(out, mate.qsa_mqa_decode(q, unquantized, table, ctx, keys, backend="reference"))

    kv = f" kv={str(kv_dtype).removeprefix('torch.')}" if kv_dtype else ""
    return dict(name=f"decode b={batch}", kind="decode", size=batch, shape=f"batch={batch} keys={keys} page={page_size}{kv} sets={sets}",
                flops=flops, bytes=nbytes, impls=impls, check=check, graph=True)


def run_case(case, with_reference=True):
    err = case["check"]()
    err, quant_err = err if isinstance(err, tuple) else (err, None)
    roof_ms = max(case["flops"] / PEAK_FLOPS, case["bytes"] / PEAK_BYTES) * 1e3
    row = dict(case=case["name"], kind=case["kind"], size=case["size"], shape=case["shape"], flops=case["flops"], bytes=case["bytes"], roofline_us=roof_ms * 1e3,
               rel_err=err, us={})
    if quant_err is not None:
        row["err_vs_bf16"] = quant_err  # an FP8 cache's scores against those of the BF16 cache it was quantized from
    for name, fn in case["impls"].items():
        if name == "reference" and not with_reference:
            continue
        row["us"][name] = median_ms(fn) * 1e3
    for name in [n for n in case["impls"] if n.startswith("mate")]:
        if case.get("graph"):
            row["us"][f"{name} (graph)"] = graph_ms(case["impls"][name]) * 1e3
        row["us"][f"{name} (cold graph)"] = cold_graph_us(case["impls"][name])
    t = min(v for k, v in row["us"].items() if k.startswith("mate"))
    row["tflops"] = case["flops"] / t / 1e6
    row["tbps"] = case["bytes"] / t / 1e6
    row["x_roofline"] = t / row["roofline_us"]
    return row


SWEEP = {
    "mqa_logits": [
        {"block_rows": 64, "block_keys": 128, "threads": 128, "num_stages": 1, "min_blocks": 2},
        {"block_rows": 64, "block_keys": 128, "threads": 128, "num_stages": 2, "min_blocks": 1},
        {"block_rows": 128, "block_keys": 128, "threads": 256, "num_stages": 2, "min_blocks": 1},
        {"block_rows": 64, "block_keys": 64, "threads": 128, "num_stages": 3, "min_blocks": 1},
    ],
    "mqa_decode": [
        {"block_keys": 64, "threads": 128},
        {"block_keys": 128, "threads": 256},
        {"block_keys": 64, "threads": 64},
    ],
}


def sweep(dtype):
    key_of = {"mqa_logits": f"dtype={dtype_name(dtype)},even_keys=1", "mqa_decode": f"dtype={dtype_name(dtype)},page_size=16"}
    cases = {"mqa_logits": [prefill_case(dtype)], "mqa_decode": [decode_case(dtype, 1), decode_case(dtype, 64)]}
    rows = []
    for stage, candidates in SWEEP.items():
        for tiles in candidates:
            with using_tiles("sm90", stage, key_of[stage], tiles):
                for case in cases[stage]:
                    try:
                        r = run_case(case, with_reference=False)
                        rows.append(dict(stage=stage, tiles=tiles, case=r["case"], rel_err=r["rel_err"],
                                         us=r["us"]["mate (cold graph)"]))
                    except Exception as e:  # a failing candidate is reported, never chosen
                        rows.append(dict(stage=stage, tiles=tiles, case=case["name"], error=repr(e)[:200]))
                    print("sweep", rows[-1], flush=True)
    return rows


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def figures(result):
    rows = result["rows"]
    prefill = [r for r in rows if r["kind"] == "prefill"]
    decode = [r for r in rows if r["kind"] == "decode"]

    def lines(rs, y):
        impls = {k for r in rs for k in r["us"]}
        out = {k: [(r["size"], y(r, r["us"][k])) for r in rs if k in r["us"]] for k in sorted(impls)}
        out["roofline"] = [(r["size"], y(r, r["roofline_us"])) for r in rs]
        return out

    return [
        figure("MQA prefill, 8192 keys", "query rows", "TFLOP/s", lines(prefill, lambda r, us: r["flops"] / us / 1e6)),
        figure("MQA decode, 8192 keys, page 16", "batch", "TB/s", lines(decode, lambda r, us: r["bytes"] / us / 1e6)),
        figure("MQA decode, 8192 keys, page 16", "batch", "time (us)", lines(decode, lambda r, us: us), logy=True),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rows", type=int, nargs="*", default=[8192], help="prefill query rows")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64], help="decode batches")
    ap.add_argument("--kv-dtype", default=None, choices=["float8_e4m3fn", "float8_e5m2"],
                    help="decode on an FP8 key cache quantized from the BF16 one (per-tensor k_scale)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/mqa-<gpu>-<date>.json)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    env = environment()
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else None
    cases = [prefill_case(dtype, r) for r in args.rows] + [decode_case(dtype, b, kv_dtype=kv_dtype) for b in args.batches]
    rows = [run_case(c) for c in cases]
    result = dict(env, dtype=args.dtype, kv_dtype=args.kv_dtype, peaks=dict(flops=PEAK_FLOPS, bytes_per_s=PEAK_BYTES), rows=rows)
    if args.sweep:
        result["sweep"] = sweep(dtype)
    out = write_json(args.out or RESULTS / f"mqa-{env['gpu'].replace(' ', '_')}-{datetime.date.today()}.json", result)
    print(f"\n{env['gpu']}, commit {env['commit']}, {args.dtype}; roofline = max(FLOPs/790T, bytes/4.3T)")
    print(f"{'case':<16}{'impl':<34}{'us':>10}{'TFLOP/s':>9}{'TB/s':>7}{'x roof':>8}")
    for r in rows:
        for name, us in r["us"].items():
            print(f"{r['case']:<16}{name:<34}{us:>10.1f}{r['flops'] / us / 1e6:>9.1f}{r['bytes'] / us / 1e6:>7.2f}{us / r['roofline_us']:>8.2f}")
        quant = f", vs the unquantized BF16 cache {r['err_vs_bf16']:.1e}" if "err_vs_bf16" in r else ""
        print(f"{'':<16}{'roofline':<34}{r['roofline_us']:>10.1f}   rel err vs reference {r['rel_err']:.1e}{quant}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
