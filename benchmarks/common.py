"""Shared code of the benchmark scripts: timing, run metadata, issue #16's QSA serving inputs, result files and plots.

Timing and metadata are the tuner's (mate/tuning/measure.py), so a tuned time and a
benchmarked time are the same measurement. A benchmark script that takes part
in the report (benchmarks/run.py) defines:

  REPORT = dict(stage=..., quick=[argv...], full=[argv...])   # its arguments per preset
  main(argv) -> result dict                                   # also writes it to --out
  figures(result) -> [figure(...), ...]                       # what to plot from it
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mate.tuning.measure import capture_graph, environment, graph_ms, median_ms  # noqa: F401  (re-exported)

RESULTS = Path(__file__).resolve().parent / "results"
# The ceilings measured on one H200 (docs/performance.md, "How it is measured"): the dense bf16 matrix rate on
# random data and the device-to-device copy bandwidth. Other GPUs need their own.
PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12


def few_ms(fn, reps=3) -> float:
    """Median of a few event-timed calls after one warm-up, for baselines too long for do_bench's repetitions."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def cold_graph_us(fn, warmup: int = 25, rep: int = 200) -> float:
    """One call per CUDA-graph replay, do_bench median in us; triton's do_bench flushes L2 before each replay
    (issue 16's measurement)."""
    import triton

    graph, _ = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3


def rel_err(out, ref) -> float:
    """Relative L2 error over the finite reference values; the -inf patterns must agree."""
    out, ref = out.double(), ref.double()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)), "-inf pattern differs"
    return float((out[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30))


# ---------------------------------------------------------------- QSA sparse attention: issue #16's serving inputs (CUDA)
# (bench_qsa_attention, experiments/triton_qsa, and the GPU tests at the same shapes)

SERVING_HQ, SERVING_HKV, SERVING_D, SERVING_PAGE, SERVING_CONTEXT, SERVING_BLOCKS, SERVING_SHARED_POOL = 24, 2, 256, 64, 32768, 512, 512


def qsa_serving_selection(gen, positions):
    """[rows, 2051] token ids and [rows, 512] block ids (issue #16): 512 distinct complete causal 4-token blocks
    in random order, expanded, then the tokens of the row's own incomplete tail block (-1 where absent)."""
    tokens, blocks = [], []
    for p in positions.tolist():
        full = (p + 1) // 4  # blocks j with 4j + 3 <= p
        blk = torch.randperm(full, generator=gen)[:SERVING_BLOCKS]
        tail = torch.arange(4 * full, 4 * full + 3)
        tokens.append(torch.cat([(blk[:, None] * 4 + torch.arange(4)).flatten(), torch.where(tail <= p, tail, -1)]))
        blocks.append(blk)
    return torch.stack(tokens).to(torch.int32), torch.stack(blocks).to(torch.int32)


def qsa_serving_problem(gen, batch, rows_per_req, *, pool=None, gate="head"):
    """Issue #16's inputs (issue #37's with pool and gate="element"). Decode (rows_per_req 1): request r holds
    32768 - 1 - (r mod 4) tokens, one row at its last position, its pages a random draw from the pool: `pool`
    pages shared by the requests (default: 512 from batch 256 on, else pages of its own). Prefill: the last
    rows_per_req positions of one 32768-token request. A BF16 gate per head ("head"), per element ("element",
    [rows, 24, 256], what vLLM's output_gate takes) or none. Pools past a few pages are drawn on the GPU."""
    pages = SERVING_CONTEXT // SERVING_PAGE
    if rows_per_req == 1:
        seq = torch.tensor([SERVING_CONTEXT - 1 - r % 4 for r in range(batch)])
        pool = pool or (SERVING_SHARED_POOL if batch >= 256 else None)
        if pool:
            table = torch.stack([torch.randperm(pool, generator=gen)[:pages] for _ in range(batch)])
        else:
            pool = batch * pages
            table = torch.randperm(pool, generator=gen).view(batch, pages)
        positions = seq - 1
    else:
        seq = torch.full((batch,), SERVING_CONTEXT)
        pool = batch * pages
        table = torch.randperm(pool, generator=gen).view(batch, pages)
        positions = torch.arange(SERVING_CONTEXT - rows_per_req, SERVING_CONTEXT).repeat(batch)
    rows = batch * rows_per_req
    dev = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    k = torch.randn(pool, SERVING_PAGE, SERVING_HKV, SERVING_D, generator=dev, device="cuda").to(torch.bfloat16)
    v = torch.randn(pool, SERVING_PAGE, SERVING_HKV, SERVING_D, generator=dev, device="cuda").to(torch.bfloat16)
    q = torch.randn(rows, SERVING_HQ, SERVING_D, generator=gen).to(torch.bfloat16).cuda()
    ti, bi = qsa_serving_selection(gen, positions)
    cu = torch.arange(batch + 1, dtype=torch.int32) * rows_per_req
    g = None if gate is None else torch.randn(rows, SERVING_HQ, *((SERVING_D,) if gate == "element" else ()), generator=gen)
    return dict(query=q, key=k, value=v, token_indices=ti.cuda(), block_table=table.to(torch.int32).cuda(),
                cu_seqlens_q=cu.cuda(), seq_lens_k=seq.to(torch.int32).cuda(),
                gate=None if g is None else g.to(torch.bfloat16).cuda()), bi.cuda()


def write_json(path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def figure(title, xlabel, ylabel, lines, logx=True, logy=False) -> dict:
    """One plot: `lines` maps an implementation to its [(x, y), ...]; a line named 'roofline' is drawn dashed."""
    return dict(title=title, xlabel=xlabel, ylabel=ylabel, logx=logx, logy=logy,
                lines={k: sorted(v) for k, v in lines.items() if v})


def plot(figures: list[dict], path, suptitle="") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(figures))
    rows = -(-len(figures) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, f in zip(axes.flat, figures):
        for name, pts in f["lines"].items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "--" if name == "roofline" else "-o", label=name, color="gray" if name == "roofline" else None)
        ax.set(title=f["title"], xlabel=f["xlabel"], ylabel=f["ylabel"])
        if f["logx"]:
            ax.set_xscale("log", base=2)
        if f["logy"]:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(figures):]:
        ax.axis("off")
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
