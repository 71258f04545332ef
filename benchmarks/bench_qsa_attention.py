"""QSA sparse core attention on the canonical geometry: 24 Q / 2 KV heads, D 256, BF16, page size 64,
2051 selected tokens per row (512 random causal 4-token blocks, expanded, plus the 3 newest tokens).

  python benchmarks/bench_qsa_attention.py [--batches 1 8 64 256] [--prefill-rows 4096] [--splits 1 2 4 8 16 32]

Roofline: decode bytes / 4.3 TB/s (DRAM: every request on its own pages); prefill bytes /
20 TB/s (L2: 17 GB gathered from a 67 MB working set).

- decode: one query row per request at the end of a 32768-token context, every
  request on its own pages (no page shared between requests);
- prefill: one request, the last `--prefill-rows` rows of a 32768-token context.

Per case: mate (`num_splits=None`, eager with its host cost, and CUDA-graph
replays), a PyTorch gather + scaled_dot_product_attention baseline in the same
run, and for decode every split count of `--splits` (graph replays) for the
split heuristic. Bytes = rows x valid tokens x 2 KV heads x 256 x 2 tensors x 2
bytes (the K/V rows gathered); FLOPs = 4 x rows x 24 x valid tokens x 256.
Every mate result is checked against the reference first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import PEAK_BYTES, RESULTS, environment, few_ms, figure, graph_ms, median_ms, write_json

import mate

HQ, HKV, D, PAGE, CONTEXT, BLOCKS = 24, 2, 256, 64, 32768, 512
L2_BYTES = 20e12  # L2 gather bandwidth measured on the H200 (issue #4)
REPORT = dict(stage="qsa_attention", quick=["--batches", "1", "64", "--prefill-rows", "1024", "--splits", "1", "4"], full=[])


def selection(gen, positions):
    """[rows, 2051] token ids: 512 distinct random 4-token blocks wholly at or before each position, then the 3 newest tokens."""
    rows = []
    for p in positions.tolist():
        full = (p - 2) // 4  # blocks that end before the tail
        blocks = torch.randperm(full, generator=gen)[:BLOCKS].sort().values
        tokens = (blocks[:, None] * 4 + torch.arange(4)).flatten()
        rows.append(torch.cat([tokens, torch.arange(p - 2, p + 1)]))
    return torch.stack(rows).to(torch.int32)


def problem(gen, batch, rows_per_req):
    """Paged K/V with distinct pages per request, flattened queries, their token lists."""
    pages = CONTEXT // PAGE
    k = torch.randn(batch * pages, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32)
    positions = torch.arange(CONTEXT - rows_per_req, CONTEXT).repeat(batch)
    q = torch.randn(batch * rows_per_req, HQ, D, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32) * rows_per_req
    return dict(query=q, key=k, value=v, token_indices=selection(gen, positions).cuda(), block_table=table.cuda(),
                cu_seqlens_q=cu.cuda())


def torch_baseline(p, rows_per_req, chunk=256):
    """Gather each row's K/V, then SDPA (GQA) per row, a chunk of rows at a time."""
    k, v, ti, table = p["key"], p["value"], p["token_indices"].long(), p["block_table"].long()
    req = torch.arange(ti.shape[0], device="cuda") // rows_per_req
    out = torch.empty_like(p["query"])
    for s in range(0, ti.shape[0], chunk):
        t = ti[s : s + chunk]
        page = table[req[s : s + chunk, None], t // PAGE]
        ks, vs = k[page, t % PAGE].transpose(1, 2), v[page, t % PAGE].transpose(1, 2)  # [r, Hkv, T, D]
        q = p["query"][s : s + chunk].unsqueeze(2)  # [r, Hq, 1, D]
        out[s : s + chunk] = F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True).squeeze(2)
    return out


def measure(name, p, rows_per_req, splits):
    rows, width = p["token_indices"].shape
    gbytes = rows * width * HKV * D * 2 * 2 / 1e9
    gflop = 4 * rows * HQ * width * D / 1e9
    ref = mate.qsa_sparse_attention(**p, backend="reference")
    out = mate.qsa_sparse_attention(**p)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2, f"{name}: relative error {err:.2e} against the reference"

    def call():
        return mate.qsa_sparse_attention(**p)

    res = dict(case=name, rows=rows, tokens=width, gbytes=gbytes, gflop=gflop, rel_err=err,
               eager_us=median_ms(call) * 1e3, graph_us=graph_ms(call) * 1e3,
               torch_us=few_ms(lambda: torch_baseline(p, rows_per_req)) * 1e3)
    # decode gathers distinct pages from DRAM; prefill re-reads a 67 MB working set, so L2 bounds it
    res["roofline_us"] = gbytes * 1e9 / (PEAK_BYTES if rows_per_req == 1 else L2_BYTES) * 1e6
    res["tb_s"] = gbytes / res["graph_us"] * 1e3
    res["tflops"] = gflop / res["graph_us"] * 1e3
    res["splits_us"] = {
        s: graph_ms(lambda s=s: mate.qsa_sparse_attention(**p, num_splits=s)) * 1e3 for s in splits
    }
    print(f"{name}: eager {res['eager_us']:.1f} us, graph {res['graph_us']:.1f} us ({res['tb_s']:.2f} TB/s, "
          f"{res['tflops']:.0f} TFLOP/s), torch {res['torch_us']:.0f} us, roofline {res['roofline_us']:.1f} us, "
          f"splits {', '.join(f'{s}: {t:.1f}' for s, t in res['splits_us'].items())}", flush=True)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--prefill-rows", type=int, default=4096)
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--out", default=str(RESULTS / "qsa_attention_h200.json"))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for b in args.batches:
        cases.append(measure(f"decode b={b}", problem(gen, b, 1), 1, args.splits))
        torch.cuda.empty_cache()
    if args.prefill_rows:
        cases.append(measure(f"prefill rows={args.prefill_rows}", problem(gen, 1, args.prefill_rows), args.prefill_rows, [1]))
    result = dict(environment(), cases=cases)
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
