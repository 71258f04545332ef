"""QSA sparse core attention at issue #16's serving shapes: 24 Q / 2 KV heads, D 256, BF16, page size 64,
per-head BF16 gate, 2051-slot selections (512 random complete causal 4-token blocks in random order, expanded,
then the row's incomplete tail block, -1 where absent).

  python benchmarks/bench_qsa_attention.py [--batches 1 8 64 256] [--prefill-rows 4096] [--splits 1 2 4 8 16 32]
  python benchmarks/bench_qsa_attention.py --variants main=old_sparse.py new=- main_again=old_sparse.py
  python benchmarks/bench_qsa_attention.py --batches 1 8 --prefill-rows 0 --no-cluster

`--no-cluster` makes every split decode take the two launches (attention, then merge) instead of a
cluster launch (mate.qsa.attention.cluster_splits): run it beside a plain run for the A/B.

`--variants NAME=FILE ...` is the same-run A/B of attention and merge programs (FILE: another version of
mate/qsa/kernels/sparse.py with the same program signatures, `-` the shipped one; overrides.program_variants):
every case is checked and timed (cold and back-to-back graph) under each in turn, in the order given, and a
table closes the output. The baseline and the split sweep are skipped then. With `--profile`, each
variant's checked call runs once more between cudaProfilerStart/Stop instead of being timed, for
`ncu --profile-from-start off` (its kernels in the order variant by variant, case by case).

Roofline: decode bytes / 4.3 TB/s (DRAM); prefill bytes / 20 TB/s (L2: 17 GB gathered from a
67 MB working set).

- decode: request r holds 32768 - 1 - (r mod 4) tokens and one query row at its last position;
  its pages are a random draw from the pool (batch >= 256: a 512-page pool the requests share;
  otherwise each request has pages of its own);
- prefill: one request, the last `--prefill-rows` rows of a 32768-token context, timed also with the
  `block_indices` hint.

Per case: mate (`num_splits=None`) as one call per CUDA-graph replay with L2 flushed before each
(`cold_us`, the issue's measurement), eager with its host cost, and back-to-back graph replays
(`graph_us`, warm L2); a PyTorch gather + SDPA baseline in the same run; for decode every split
count of `--splits` (cold graph). Bytes = selected tokens that exist x 2 KV heads x 256 x 2 tensors
x 2 bytes (the K/V rows gathered); FLOPs = 4 x 24 x those tokens x 256. Every mate result is
checked against the reference first.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from common import PEAK_BYTES, RESULTS, cold_graph_us, environment, few_ms, figure, graph_ms, median_ms, write_json

import mate
from common import SERVING_D, SERVING_HKV, SERVING_HQ, SERVING_PAGE, qsa_serving_problem
from overrides import program_variants, without_cluster_launches

HQ, HKV, D, PAGE = SERVING_HQ, SERVING_HKV, SERVING_D, SERVING_PAGE
L2_BYTES = 20e12  # L2 gather bandwidth measured on the H200 (issue #4)
REPORT = dict(stage="qsa_attention", quick=["--batches", "1", "64", "--prefill-rows", "1024", "--splits", "1", "4"], full=[])


def torch_baseline(p, rows_per_req, chunk=256):
    """Gather each row's K/V, then SDPA (GQA) per row, a chunk of rows at a time."""
    k, v, ti, table = p["key"], p["value"], p["token_indices"].long(), p["block_table"].long()
    req = torch.arange(ti.shape[0], device="cuda") // rows_per_req
    out = torch.empty_like(p["query"])
    for s in range(0, ti.shape[0], chunk):
        t = ti[s : s + chunk]
        page = table[req[s : s + chunk, None], t.clamp_min(0) // PAGE]
        ks = k[page, t.clamp_min(0) % PAGE].transpose(1, 2)  # [r, Hkv, T, D]
        vs = v[page, t.clamp_min(0) % PAGE].transpose(1, 2)
        q = p["query"][s : s + chunk].unsqueeze(2)  # [r, Hq, 1, D]
        mask = (t >= 0)[:, None, None, :]
        o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True).squeeze(2)
        out[s : s + chunk] = o * torch.sigmoid(p["gate"][s : s + chunk].float()).unsqueeze(-1).to(o.dtype)
    return out


def checked_call(name, p):
    """The call to time, after a check of its result against the reference; (call, relative error)."""
    ref = mate.qsa_sparse_attention(**p, backend="reference")
    out = mate.qsa_sparse_attention(**p)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2, f"{name}: relative error {err:.2e} against the reference"
    return lambda: mate.qsa_sparse_attention(**p), err


def measure(name, p, rows_per_req, splits, hint=None):
    rows, width = p["token_indices"].shape
    valid = int((p["token_indices"] >= 0).sum())  # selected tokens that exist (the tail's -1 pads gather nothing)
    gbytes = valid * HKV * D * 2 * 2 / 1e9
    gflop = 4 * HQ * valid * D / 1e9
    call, err = checked_call(name, p)

    res = dict(case=name, rows=rows, tokens=width, gbytes=gbytes, gflop=gflop, rel_err=err,
               eager_us=median_ms(call) * 1e3, graph_us=graph_ms(call) * 1e3,
               torch_us=few_ms(lambda: torch_baseline(p, rows_per_req)) * 1e3)
    # decode gathers distinct pages from DRAM; prefill re-reads a 67 MB working set, so L2 bounds it
    res["roofline_us"] = gbytes * 1e9 / (PEAK_BYTES if rows_per_req == 1 else L2_BYTES) * 1e6
    res["tb_s"] = gbytes / res["graph_us"] * 1e3
    res["tflops"] = gflop / res["graph_us"] * 1e3
    res["cold_us"] = cold_graph_us(call)
    if hint is not None:
        res["hint_cold_us"] = cold_graph_us(lambda: mate.qsa_sparse_attention(**p, block_indices=hint))
    res["splits_us"] = {
        s: cold_graph_us(lambda s=s: mate.qsa_sparse_attention(**p, num_splits=s)) for s in splits
    }
    print(f"{name}: cold graph {res['cold_us']:.1f} us" + (f" (block hint {res['hint_cold_us']:.1f} us)" if hint is not None else "")
          + f", eager {res['eager_us']:.1f} us, back-to-back graph {res['graph_us']:.1f} us ({res['tb_s']:.2f} TB/s, "
          f"{res['tflops']:.0f} TFLOP/s), torch {res['torch_us']:.0f} us, roofline {res['roofline_us']:.1f} us, "
          f"cold graph by split count {', '.join(f'{s}: {t:.1f}' for s, t in res['splits_us'].items())}", flush=True)
    return res


def problems(args):
    """(name, inputs, rows per request, block hint or None) of each case the arguments ask for, built one at a time."""
    gen = torch.Generator().manual_seed(0)
    for b in args.batches:
        yield f"decode b={b}", qsa_serving_problem(gen, b, 1)[0], 1, None
        torch.cuda.empty_cache()
    if args.prefill_rows:
        p, hint = qsa_serving_problem(gen, 1, args.prefill_rows)
        yield f"prefill rows={args.prefill_rows}", p, args.prefill_rows, hint


def compare(args) -> list:
    """Every case under each program of --variants in turn: cold and back-to-back graph times (us)."""
    sources = dict(v.split("=", 1) for v in args.variants)
    sources = {k: None if f == "-" else f for k, f in sources.items()}
    cases = []
    with program_variants("qsa_attention", sources) as use, program_variants("qsa_merge", sources) as use_merge:
        for name, p, _, hint in problems(args):
            res = dict(case=name)
            for variant in sources:
                use(variant)
                use_merge(variant)
                call, err = checked_call(f"{name} ({variant})", p)
                if args.profile:
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    call()
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"{name} [{variant}]: profiled", flush=True)
                    continue
                res[variant] = dict(rel_err=err, cold_us=cold_graph_us(call), graph_us=graph_ms(call) * 1e3)
                if hint is not None:
                    res[variant]["hint_cold_us"] = cold_graph_us(lambda: mate.qsa_sparse_attention(**p, block_indices=hint))
                elif args.splits:
                    res[variant]["splits_us"] = {
                        s: cold_graph_us(lambda s=s: mate.qsa_sparse_attention(**p, num_splits=s)) for s in args.splits
                    }
                print(f"{name} [{variant}]: cold graph {res[variant]['cold_us']:.1f} us, back-to-back graph "
                      f"{res[variant]['graph_us']:.1f} us" + (f", block hint cold {res[variant]['hint_cold_us']:.1f} us"
                                                              if hint is not None else "")
                      + "".join(f", {s} splits {t:.1f}" for s, t in res[variant].get("splits_us", {}).items()), flush=True)
            cases.append(res)
    if args.profile:
        return cases
    print("case | " + " | ".join(f"{v} cold / warm" for v in sources))
    for c in cases:
        print(c["case"] + " | " + " | ".join(f"{c[v]['cold_us']:.1f} / {c[v]['graph_us']:.1f}" for v in sources))
    return cases


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--prefill-rows", type=int, default=4096)
    ap.add_argument("--splits", type=int, nargs="*", default=None,
                    help="decode split counts also timed (default 1 2 4 8 16 32; with --variants none unless given)")
    ap.add_argument("--variants", nargs="*", default=[], metavar="NAME=FILE")
    ap.add_argument("--profile", action="store_true", help="with --variants: one call each for ncu, no timing")
    ap.add_argument("--out", default=str(RESULTS / "qsa_attention_h200.json"))
    ap.add_argument("--no-cluster", action="store_true", help="split decode in two launches only (the A/B of cluster launches)")
    args = ap.parse_args(argv)
    with without_cluster_launches() if args.no_cluster else contextlib.nullcontext():
        if args.variants:
            cases = compare(args)
        else:
            splits = [1, 2, 4, 8, 16, 32] if args.splits is None else args.splits
            cases = [measure(name, p, rpr, splits if hint is None else [1], hint=hint) for name, p, rpr, hint in problems(args)]
    result = dict(environment(), cases=cases, variants=args.variants)
    write_json(args.out, result)
    return result


def figures(result):
    decode = [c for c in result["cases"] if c["case"].startswith("decode")]
    lines = {
        "mate (graph)": [(c["rows"], c["graph_us"]) for c in decode],
        "mate (eager)": [(c["rows"], c["eager_us"]) for c in decode],
        "torch gather + SDPA": [(c["rows"], c["torch_us"]) for c in decode],
        "roofline": [(c["rows"], c["roofline_us"]) for c in decode],
    }
    return [figure("QSA sparse attention decode (24/2/256, 2051 tokens)", "batch", "time (us)", lines, logy=True)]


if __name__ == "__main__":
    main()
