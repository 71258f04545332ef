"""Where does one CTA of QSA sparse attention's small-CTA program spend its time at decode (issue 37: rows 1 and 8)?

  python benchmarks/experiments/qsa_latency_probe.py [--rows 1 8] [--tiles 16/2 16/5 32/3 64/2/4] [--splits 33 65 129]
                                                     [--trials 20] [--compile-only] [--out FILE]

The shipped program (mate/qsa/kernels/sparse_warp.py) rebuilt with timestamps: thread 0 of every CTA reads
%globaltimer (ns, one clock for the GPU) and %clock64 (its SM's cycles) at seven points and stores them, so the
call's output is wrong and only the times count. The points (the program is rewritten from the shipped source
at fixed anchors, so it follows every change; an anchor that moved is an error):

  0 entry              the CTA starts (before the PDL trigger and the L2 prefetch of its metadata)
  1 metadata           the row's request, keys and share of the token list are known (their loads consumed)
  2 pages              chunk 0's K/V row offsets published: its token ids and then its pages have arrived
  3 first tile         the ring's first tile is in shared memory (its cp.async group waited for)
  4 first math         the first tile's online-softmax step and P.V issued (the next wait is the second tile)
  5 last math          the last tile's step issued
  6 end                the epilogue's stores issued (partials and LSE, or the output)

The timestamps go out through the gate tensor (an FP32 per-element gate [rows, 24, 256], which the split path's
attention kernel never reads: only the merge does), 16 bytes a point and CTA, read back after the call. Inputs:
issue 37's (benchmarks/common.qsa_serving_problem: 24 / 2 heads, D 256, 64-token pages of a pool far larger
than L2, 2051 token slots a row). Every trial flushes L2 first (a 256 MB write), then runs the call once
eagerly on the small-CTA family (benchmarks/overrides.qsa_family) at the given tiles and split count. Reported
per (rows, tiles, splits): medians over trials of each phase's median over CTAs (ns, from the CTA's own entry),
the spread of the CTAs' entry times (launch skew) and of their ends, the first CTA's entry to the last CTA's
end (the attention launch's span), and the call's cold CUDA-graph time beside it (common.cold_graph_us, the
shipped program). Per-tile cost: (last math - first math) / (tiles - 1).

--compile-only lowers and compiles the probe programs into the TileLang cache (no GPU needed), so that a
device call can carry the cache.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, cold_graph_us, environment, qsa_serving_problem, write_json  # noqa: E402
from overrides import compile_kernels, program_variants, qsa_family, qsa_splits_run, qsa_warp_tiles, qsa_warp_tiles_arg  # noqa: E402

import mate  # noqa: E402

POINTS = ("entry", "metadata", "pages", "first tile", "first math", "last math", "end")
SHIPPED = Path(__file__).resolve().parents[2] / "mate" / "qsa" / "kernels" / "sparse_warp.py"

PROBE = '''

PROBE_SOURCE = r"""
__device__ __forceinline__ void mate_probe(float* base, long long slot) {
  unsigned long long t, c;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory");
  reinterpret_cast<unsigned long long*>(base)[2 * slot] = t;
  reinterpret_cast<unsigned long long*>(base)[2 * slot + 1] = c;
}
"""


@T.macro
def _probe(G, row, kvh, sp, tx, point, R, HKV):
    if tx == 0:
        T.evaluate(T.call_extern("handle", "mate_probe", T.address_of(G[0, 0, 0]),
                                 T.Cast("int64", (sp * HKV + kvh) * R + row) * 7 + point))
'''

# (anchor in the shipped source, text put after it); each anchor must occur once
EDITS = (
    ("    sources = FENCE_SOURCE + SPLIT_SOURCE if split else FENCE_SOURCE\n",
     "    sources = sources + PROBE_SOURCE\n"),
    ("            tx = T.get_thread_binding()\n",
     "            _probe(G, row, kvh, sp, tx, 0, R, HKV)\n"),
    ("            n_tiles = T.ceildiv(T.max(last - first, 0), block_n)\n",
     "            _probe(G, row, kvh, sp, tx, 1, R, HKV)\n"),
    ("                        _publish(ko, vo, pg, sl, c, tx, kvh, P, strides, vec, threads)\n",
     "                        if c == 0:\n                            _probe(G, row, kvh, sp, tx, 2, R, HKV)\n"),
    ("                    st = (i - num_stages + 1) % num_stages\n",
     "                    if i == num_stages - 1:\n                        _probe(G, row, kvh, sp, tx, 3, R, HKV)\n"),
    ("                            i - num_stages + 1, scale_log2, block_n, warps)\n",
     "                    if i == num_stages - 1:\n                        _probe(G, row, kvh, sp, tx, 4, R, HKV)\n"
     "                    if i == n_tiles + num_stages - 2:\n                        _probe(G, row, kvh, sp, tx, 5, R, HKV)\n"),
    ("            _finish(O, LSE, G, GH, acc, rowsum, l_sum, alpha, m_cur, row, sp, h0, group, qk_scale, norm, flags, split)\n",
     "            _probe(G, row, kvh, sp, tx, 6, R, HKV)\n"),
)


def probe_source() -> str:
    """The shipped program with the probe points (see the docstring)."""
    src = SHIPPED.read_text()
    marker = "\n\ndef sparse_attention_warp("
    assert src.count(marker) == 1, "the program's definition moved: update the probe"
    src = src.replace(marker, PROBE + marker)
    for anchor, extra in EDITS:
        assert src.count(anchor) == 1, f"probe anchor not found once in sparse_warp.py: {anchor.strip()!r}"
        src = src.replace(anchor, anchor + extra)
    return src


def padded_gate(gate: torch.Tensor, ctas: int) -> torch.Tensor:
    """The FP32 gate as a view at the start of a buffer large enough for every CTA's timestamps (its D axis
    padded): the kernel indexes the gate from its first element, so the probe's stores land in the padding."""
    rows, heads, dim = gate.shape
    pad = max(1, -(-ctas * 7 * 4 // (rows * heads * dim)))
    store = torch.zeros(rows, heads, dim * pad, dtype=torch.float32, device="cuda")
    view = store[..., :dim]
    view.copy_(gate)
    return view


def probe_case(p, asked: int, splits: int, trials: int) -> dict:
    """The probe's phases at num_splits=asked (which runs `splits` splits)."""
    rows = p["query"].shape[0]
    ctas = rows * p["key"].shape[-2] * splits
    store = p["gate"]._base  # the probe writes from the gate view's first element on (see padded_gate)
    assert store is not None and store.numel() * 4 >= ctas * 7 * 16, "the gate's storage is too small for the probe"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    per_trial = []
    for _ in range(trials + 2):  # the first two warm up
        flush.zero_()
        store.zero_()
        torch.cuda.synchronize()
        mate.qsa_sparse_attention(**p, num_splits=asked)
        torch.cuda.synchronize()
        ts = store.view(-1).view(torch.int64)[: ctas * 14].view(ctas, 7, 2).cpu()
        per_trial.append(ts)
    phases, spans, skews, ends, cycles = {n: [] for n in POINTS[1:]}, [], [], [], []
    for ts in per_trial[2:]:
        ns, clk = ts[..., 0], ts[..., 1]
        if (ns == 0).any():
            raise RuntimeError("a CTA left a probe point unwritten (fewer CTAs than expected, or a skipped point)")
        start = ns[:, 0]
        for j, name in enumerate(POINTS[1:], 1):
            phases[name].append(float((ns[:, j] - start).median()))
        skews.append(float(start.max() - start.min()))
        ends.append(float(ns[:, 6].max() - ns[:, 6].min()))
        spans.append(float(ns[:, 6].max() - start.min()))
        cycles.append(float((clk[:, 6] - clk[:, 0]).median()))
    med = statistics.median
    return dict(splits_asked=asked, splits=splits, ctas=ctas, phase_ns={k: med(v) for k, v in phases.items()}, entry_skew_ns=med(skews),
                end_spread_ns=med(ends), launch_span_ns=med(spans), cta_cycles=med(cycles))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--tiles", nargs="*", default=["16/2", "16/5", "32/3"], metavar="BLOCK_N/STAGES[/WARPS]",
                    help="WARPS: the program's warps a tile (sparse_attention_warp's `warps`, default 1)")
    ap.add_argument("--splits", type=int, nargs="*", default=[16, 33, 65, 129])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tiles = [qsa_warp_tiles_arg(t) for t in args.tiles]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sparse_warp_probe.py"
        src.write_text(probe_source())
        with program_variants("qsa_attention_warp", {"probe": src, "shipped": None}) as use:
            use("probe")
            if args.compile_only:
                for version in ("probe", "shipped"):
                    use(version)  # in this process: the pool's workers would not see the probe's card
                    jobs = [("qsa_attention_warp", f"dtype=bfloat16,split={split}", t, True) for t, _ in tiles for split in (0, 1)]
                    for job, (_, err) in compile_kernels(jobs, 1):
                        print(f"{version} {job[2]} {job[1]}: {err or 'compiled'}", flush=True)
                return None
            result = dict(environment(), cases=[])
            gen = torch.Generator().manual_seed(0)
            for rows in args.rows:
                p, _ = qsa_serving_problem(gen, rows, 1, gate="element")
                width = p["token_indices"].shape[-1]
                gate = p["gate"].float().cuda()
                p["gate"] = padded_gate(gate, rows * p["key"].shape[-2] * -(-width // min(t["block_n"] for t, _ in tiles)))
                for t, label in tiles:
                    bn, ns = t["block_n"], t["num_stages"]
                    with qsa_warp_tiles(t), qsa_family("warp"):
                        tiles_total = -(-width // bn)
                        for s in args.splits:
                            if s > tiles_total:
                                continue
                            per, splits = qsa_splits_run(tiles_total, s)
                            use("probe")
                            r = probe_case(p, s, splits, args.trials)
                            use("shipped")
                            p["gate"].copy_(gate)  # the probe's timestamps overwrote it
                            r["cold_graph_us"] = cold_graph_us(lambda s=s: mate.qsa_sparse_attention(**p, num_splits=s))
                            r.update(rows=rows, block_n=bn, num_stages=ns, warps=t.get("warps", 1), tiles_per_split=per)
                            result["cases"].append(r)
                            ph = r["phase_ns"]
                            per_tile = (ph["last math"] - ph["first math"]) / max(r["tiles_per_split"] - 1, 1)
                            print(f"rows {rows} {label} splits {s} ({r['ctas']} CTAs): " + ", ".join(f"{k} {v:.0f}" for k, v in ph.items())
                                  + f" ns; per tile {per_tile:.0f} ns; entry skew {r['entry_skew_ns']:.0f}, end spread "
                                  f"{r['end_spread_ns']:.0f}, launch span {r['launch_span_ns']:.0f} ns; "
                                  f"cold graph {r['cold_graph_us']:.1f} us", flush=True)
    write_json(args.out or RESULTS / f"{environment()['gpu'].replace(' ', '_')}-{datetime.date.today()}-qsa-latency-probe.json", result)
    return result


if __name__ == "__main__":
    main()
