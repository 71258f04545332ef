"""GQA paged decode's key-split count: the shipped choice beside forced counts, on bench_gqa --decode's shape.

    python benchmarks/experiments/gqa_decode_splits.py [--batches 16 24 32 40 48 56 64] [--dims 128 64] [--pages 64 16]
                                           [--rows 1 8] [--splits 1 2 3 4 6 9] [--out FILE]

B sequences x 8192 keys in a paged cache (pages in random order), H 64 / H_kv 8, BF16, dense causal and (4096, 0).
Per (B, D, page size, rows, window): the shipped split count (overrides.gqa_decode_splits records what
gqa_attention chose) and each forced count, each checked against the reference on 8 sequences, then timed as
bench_gqa.py times (CUDA-graph replay of back-to-back calls, median per call), with the percentage of 4.3 TB/s
over bench_gqa.decode_bytes. One split writes the output itself; more write FP32 partials and run the merge.
H200 results: benchmarks/results/NVIDIA_H200-2026-12-02-decode-splits.md.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, overrides, bench_*

import mate  # noqa: E402
from bench_gqa import H, HKV, decode_bytes, rnd, timed_ms  # noqa: E402
from common import PEAK_BYTES, RESULTS, environment, rel_err, write_json  # noqa: E402
from overrides import gqa_decode_splits  # noqa: E402

CTX = 8192


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 24, 32, 40, 48, 56, 64])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--pages", type=int, nargs="+", default=[64], help="page sizes")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="query rows a sequence")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 9], help="forced split counts")
    ap.add_argument("--out", type=str, default=str(RESULTS / "gqa_decode_splits.json"))
    args = ap.parse_args(argv)
    meta = {**environment(), "timing": "CUDA-Graph replay of back-to-back calls, median per call",
            "shape": {"context": CTX, "H": H, "H_kv": HKV, "dtype": "bfloat16"}, "rows": []}
    for nd, D, ps in itertools.product(args.batches, args.dims, args.pages):
        pages = nd * CTX // ps
        kc, vc = rnd(pages, ps, HKV, D), rnd(pages, ps, HKV, D)
        table = torch.randperm(pages, device="cuda").int().view(nd, CTX // ps)
        lens = torch.full((nd,), CTX, dtype=torch.int32, device="cuda")
        for sq, window in itertools.product(args.rows, [(-1, 0), (4096, 0)]):
            q = rnd(nd, sq, H, D)
            out = torch.empty_like(q)
            kw = dict(block_table=table, seq_lens_k=lens, sliding_window=window)
            ref = mate.gqa_attention(q[:8], kc, vc, **{**kw, "block_table": table[:8], "seq_lens_k": lens[:8]}, backend="reference")
            nbytes = decode_bytes(q, table, lens, CTX, window)
            for forced in [None, *args.splits]:
                seen = []
                with gqa_decode_splits(forced, seen):
                    out.fill_(float("nan"))
                    mate.gqa_attention(q, kc, vc, out=out, **kw)
                    err = rel_err(out[:8], ref)
                    ms = timed_ms(lambda: mate.gqa_attention(q, kc, vc, out=out, **kw))
                row = dict(B=nd, D=D, page=ps, rows=sq, window=list(window), forced=forced, splits=seen[0], ms=ms,
                           of_peak_bandwidth=nbytes / ms / 1e-3 / PEAK_BYTES, err_vs_reference=err)
                meta["rows"].append(row)
                print(f"B {nd} D {D} page {ps} rows {sq} {str(window):10s} {'shipped' if forced is None else 'forced':7s} "
                      f"{seen[0]:2d} splits: {ms * 1e3:7.1f} us {100 * row['of_peak_bandwidth']:5.1f}% err {err:.1e}", flush=True)
                write_json(args.out, meta)
        del kc, vc
        torch.cuda.empty_cache()
    return meta


if __name__ == "__main__":
    main()
