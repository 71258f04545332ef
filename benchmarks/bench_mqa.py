"""MQA indexer benchmark: native TileLang vs the mate reference vs a plain torch einsum+relu.

Shapes (issue 2):
  prefill - 8192 query rows at positions 24576..32767 of a 32768-token request
            against its 8192 compressed keys, row_start = 0, row_end = (pos+1)//4;
  decode  - batch 1 and 64, 8192 compressed keys per request, page size 16,
            distinct pages per request.

FLOPs count visible scores only (4 heads x 128 x 2 per visible (row, key));
bytes are each input read once plus the FP32 output written once. The roofline
is max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s), the bf16 matrix rate and copy
bandwidth measured on an H200 here. Times are medians of
triton.testing.do_bench; decode is also timed as CUDA-Graph replays, which
removes the host launch cost. Decode inputs rotate over several copies so the
keys do not sit in L2 between runs.

  python benchmarks/bench_mqa.py [--sweep] [--out benchmarks/results/mqa.json]

--sweep also times candidate tile configs (each checked against the reference
first) by pointing MATE_CONFIG_DIR at a patched copy of configs/sm90.yaml.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import yaml

import mate
from mate import _dispatch

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12
H, D = 4, 128


def median_ms(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def graph_ms(fn):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_ms(g.replay)


def torch_scores(q, k, lo, hi, scale):
    """The plain torch formulation: one bf16 einsum, ReLU and head-sum in FP32, masked."""
    s = torch.einsum("rhd,nd->rhn", q, k).float().relu_().sum(1).mul_(scale)
    j = torch.arange(k.shape[0], device=q.device)
    return s.masked_fill_((j < lo[:, None]) | (j >= hi[:, None]), float("-inf"))


def max_rel_err(out, ref):
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)), "-inf pattern differs"
    return ((out[fin] - ref[fin]).norm() / ref[fin].norm()).item()


def prefill_case(dtype):
    rows, keys = 8192, 8192
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
    return dict(name="prefill", shape=f"rows={rows} keys={keys}", flops=flops, bytes=nbytes, impls=impls,
                check=lambda: max_rel_err(impls["mate"](), impls["reference"]()))


def decode_case(dtype, batch, keys=8192, page_size=16):
    pages_per_req = keys // page_size
    per_set = batch * keys * D * 2
    sets = max(1, min(32, math.ceil(512e6 / per_set)))
    data = []
    for _ in range(sets):
        cache = torch.randn(batch * pages_per_req, page_size, 1, D, device="cuda").to(dtype)
        table = torch.randperm(batch * pages_per_req, device="cuda").to(torch.int32).view(batch, pages_per_req)
        q = torch.randn(batch, H, D, device="cuda").to(dtype)
        data.append((q, cache, table))
    ctx = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    flops = batch * keys * H * D * 2.0
    nbytes = per_set + batch * H * D * 2 + batch * keys * 4 + batch * pages_per_req * 4 + batch * 4
    it = [0]

    def rotating(backend):
        def call():
            q, cache, table = data[it[0] % sets]
            it[0] += 1
            return mate.qsa_mqa_decode(q, cache, table, ctx, keys, backend=backend)

        return call

    def torch_decode():
        q, cache, table = data[it[0] % sets]
        it[0] += 1
        kv = cache[table.long()].view(batch, keys, D)
        return torch.einsum("bhd,bnd->bhn", q, kv).float().relu_().sum(1).mul_(1 / math.sqrt(D))

    impls = {"mate": rotating("tilelang"), "torch": torch_decode, "reference": rotating("reference")}

    def check():
        q, cache, table = data[0]
        out = mate.qsa_mqa_decode(q, cache, table, ctx, keys)
        return max_rel_err(out, mate.qsa_mqa_decode(q, cache, table, ctx, keys, backend="reference"))

    return dict(name=f"decode b={batch}", shape=f"batch={batch} keys={keys} page={page_size} sets={sets}", flops=flops,
                bytes=nbytes, impls=impls, check=check, graph=True)


def run_case(case, with_reference=True):
    err = case["check"]()
    roof_ms = max(case["flops"] / PEAK_FLOPS, case["bytes"] / PEAK_BYTES) * 1e3
    row = dict(case=case["name"], shape=case["shape"], flops=case["flops"], bytes=case["bytes"], roofline_us=roof_ms * 1e3,
               rel_err=err, us={})
    for name, fn in case["impls"].items():
        if name == "reference" and not with_reference:
            continue
        row["us"][name] = median_ms(fn) * 1e3
    if case.get("graph"):
        row["us"]["mate (graph)"] = graph_ms(case["impls"]["mate"]) * 1e3
    t = min(v for k, v in row["us"].items() if k.startswith("mate"))
    row["tflops"] = case["flops"] / t / 1e6
    row["tbps"] = case["bytes"] / t / 1e6
    row["x_roofline"] = t / row["roofline_us"]
    return row


SWEEP = {
    "mqa_logits": [
        {"block_rows": 64, "block_keys": 128, "threads": 128, "num_stages": 2},
        {"block_rows": 64, "block_keys": 256, "threads": 128, "num_stages": 2},
        {"block_rows": 128, "block_keys": 128, "threads": 256, "num_stages": 2},
        {"block_rows": 64, "block_keys": 64, "threads": 128, "num_stages": 3},
    ],
    "mqa_decode": [
        {"block_keys": 64, "threads": 128},
        {"block_keys": 128, "threads": 256},
        {"block_keys": 64, "threads": 64},
    ],
}


def sweep(dtype):
    base = yaml.safe_load((_dispatch.config_dir() / "sm90.yaml").read_text())
    key_of = {"mqa_logits": f"dtype={dtype_name(dtype)},even_keys=1", "mqa_decode": f"dtype={dtype_name(dtype)},page_size=16"}
    cases = {"mqa_logits": [prefill_case(dtype)], "mqa_decode": [decode_case(dtype, 1), decode_case(dtype, 64)]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage, candidates in SWEEP.items():
            for tiles in candidates:
                cfg = {s: dict(e) for s, e in base.items()}
                cfg[stage][key_of[stage]] = tiles
                (Path(tmp) / "sm90.yaml").write_text(yaml.safe_dump(cfg))
                os.environ["MATE_CONFIG_DIR"] = tmp
                _dispatch.clear_caches()
                for case in cases[stage]:
                    try:
                        r = run_case(case, with_reference=False)
                        rows.append(dict(stage=stage, tiles=tiles, case=r["case"], rel_err=r["rel_err"],
                                         us=min(v for k, v in r["us"].items() if k.startswith("mate"))))
                    except Exception as e:  # a failing candidate is reported, never chosen
                        rows.append(dict(stage=stage, tiles=tiles, case=case["name"], error=repr(e)[:200]))
                    print("sweep", rows[-1], flush=True)
    os.environ.pop("MATE_CONFIG_DIR", None)
    _dispatch.clear_caches()
    return rows


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/mqa-<gpu>-<date>.json)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    commit = os.environ.get("MATE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    rows = [run_case(c) for c in (prefill_case(dtype), decode_case(dtype, 1), decode_case(dtype, 64))]
    result = dict(gpu=gpu, commit=commit, date=datetime.date.today().isoformat(), dtype=args.dtype,
                  command="python benchmarks/bench_mqa.py" + (" --sweep" if args.sweep else ""),
                  peaks=dict(flops=PEAK_FLOPS, bytes_per_s=PEAK_BYTES), rows=rows)
    if args.sweep:
        result["sweep"] = sweep(dtype)
    out = Path(args.out or f"benchmarks/results/mqa-{gpu.replace(' ', '_')}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{gpu}, commit {commit}, {args.dtype}; roofline = max(FLOPs/790T, bytes/4.3T)")
    print(f"{'case':<14}{'impl':<14}{'us':>10}{'TFLOP/s':>9}{'TB/s':>7}{'x roof':>8}")
    for r in rows:
        for name, us in r["us"].items():
            print(f"{r['case']:<14}{name:<14}{us:>10.1f}{r['flops'] / us / 1e6:>9.1f}{r['bytes'] / us / 1e6:>7.2f}{us / r['roofline_us']:>8.2f}")
        print(f"{'':<14}{'roofline':<14}{r['roofline_us']:>10.1f}   rel err vs reference {r['rel_err']:.1e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
