"""QSA selection (issue 43): top-k of each row's FP32 block scores and the 4-token expansion, against torch.topk and
a torch expansion on the same inputs.

  python benchmarks/bench_topk.py [--rows 1 64 256 4096] [--keys 8192] [--k 512] [--sweep] [--step [BATCH ...]]
                                  [--prefill [ROWS ...]] [--out FILE]

Inputs: indexer-like scores (scale x a sum of 4 ReLUs, so exact zeros tie), every key visible and finite (torch.topk
would take NaN as the largest), the row's position past the last key. Each mate result is checked bit for bit against the reference first. Times are
the issue's measurement: one call per CUDA-graph replay with L2 flushed before each (do_bench median, us):

- torch.topk: the values and ids (its -1 fills, as examples/serving_step.py makes them, included in the next);
- torch select: torch.topk, -1 for non-finite scores, then the expansion in torch ops;
- mate topk: qsa_topk_blocks; mate topk + expand: qsa_topk_blocks then qsa_expand_blocks (two kernels);
- mate fused: qsa_topk_tokens (one kernel).

--sweep times other qsa_topk tiles (threads, min_blocks, sort_mult) for the rows' key, fused call, through a patched config.
--step times the whole decode step (issue 43): qsa_mqa_decode -> selection -> qsa_sparse_attention, one CUDA graph,
L2 flushed before each replay, with mate's fused selection (qsa_topk_tokens) and with the torch selection; each
stage alone beside it. Inputs: BATCH requests of 32768 tokens (8192 complete 4-token blocks, the query row at the
last position), 64-token pages in random pool order shared by the K/V cache (24 / 2 heads, D 256, BF16: 4.3 GB at
64 requests) and the indexer's cache (16 compressed keys a page, 4 heads of D 128), a per-element gate; top-k blocks
of the indexer's scores (2051 token slots at k 512). mate's selection is checked bit for bit against the
reference on the step's own scores, and its attention output against the one on the torch selection.
--prefill [ROWS ...] times the indexer's prefill with its selection (issue 43's fused prefill): the last ROWS query rows of
one request of --keys compressed keys (row r sees keys 0 .. keys - ROWS + r, causally; 4 heads of D 128, BF16),
qsa_mqa_prefill alone, qsa_mqa_prefill(topk=k) and qsa_mqa_prefill then the torch selection; the selection is checked
bit for bit against the reference on the call's own scores.
--variants NAME=FILE ... times other versions of mate/qsa/kernels/topk.py (`-`: the shipped one; same program
signatures; overrides.program_variants) in turn on the fused call, each checked (a probe that leaves out a
phase is timed though wrong).
Writes JSON (with the GPU, commit and command) and a markdown table to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime

import torch
from common import RESULTS, cold_graph_us, environment, figure, write_json
from overrides import program_variants, qsa_topk_key

import mate
from mate.tuning.measure import using_tiles
from mate.tuning.workloads import indexer_like_scores

REPORT = dict(stage="qsa_topk", quick=["--rows", "1", "64", "256", "4096"], full=["--rows", "1", "64", "256", "4096", "8192"])
# (threads, min_blocks, sort_mult): sort_mult 2 sorts twice k's power of two (fewer radix rounds), 1 k's power
SWEEP = {0: [dict(threads=t, min_blocks=1, sort_mult=m) for t, m in [(1024, 2), (1024, 1), (512, 2), (512, 1)]],
         1: [dict(threads=t, min_blocks=b, sort_mult=m) for t, b, m in [(256, 4, 2), (256, 4, 1), (512, 2, 2), (512, 2, 1),
                                                                        (1024, 1, 2)]]}


def torch_select(scores, k, pos, block_size=4):
    """examples/serving_step.py's selection: torch.topk, -1 where the score is not finite, the expansion."""
    top = scores.topk(k, dim=-1)
    blocks = torch.where(torch.isfinite(top.values), top.indices, -1).to(torch.int32)
    offs = torch.arange(block_size, device=scores.device, dtype=torch.int32)
    selected = torch.where(blocks[..., None] >= 0, blocks[..., None] * block_size + offs, -1).flatten(-2)
    tail = ((pos + 1) // block_size * block_size)[:, None] + offs[: block_size - 1]
    return blocks, torch.cat([selected, torch.where(tail <= pos[:, None], tail, -1)], -1)


def case(rows, keys, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = indexer_like_scores(gen, rows, keys, device="cuda", visible=torch.full((rows,), keys), nan=0.0)
    pos = torch.full((rows,), 4 * keys + 2, dtype=torch.int32, device="cuda")
    blocks, tokens = mate.qsa_topk_tokens(scores, k, pos)
    ref_blocks, ref_tokens = mate.qsa_topk_tokens(scores, k, pos, backend="reference")
    exact = bool(torch.equal(blocks, ref_blocks) and torch.equal(tokens, ref_tokens)
                 and torch.equal(mate.qsa_expand_blocks(mate.qsa_topk_blocks(scores, k), pos), ref_tokens))
    if not exact:
        print(f"rows {rows}: WRONG, native differs from the reference (timed anyway)", flush=True)
    # torch's order among equal scores is its own: the selected sets agree where no tie crosses the k-th score
    tb, _ = torch_select(scores, k, pos)
    same = float((tb.sort(-1).values == ref_blocks.sort(-1).values).all(-1).float().mean())
    impls = {
        "torch.topk": lambda: scores.topk(k, dim=-1),
        "torch select": lambda: torch_select(scores, k, pos),
        "mate topk": lambda: mate.qsa_topk_blocks(scores, k),
        "mate topk + expand": lambda: mate.qsa_expand_blocks(mate.qsa_topk_blocks(scores, k), pos),
        "mate fused": lambda: mate.qsa_topk_tokens(scores, k, pos),
    }
    return dict(rows=rows, keys=keys, k=k, exact=exact, same_set_as_torch=same, us={n: cold_graph_us(f) for n, f in impls.items()}), scores, pos


def sweep(rows, keys, k, scores, pos):
    key = qsa_topk_key(rows, keys)
    out = []
    for tiles in SWEEP[int(key.endswith("wide=1"))]:
        with using_tiles("sm90", "qsa_topk", key, tiles):
            blocks, tokens = mate.qsa_topk_tokens(scores, k, pos)
            ok = torch.equal(blocks, mate.qsa_topk_blocks(scores, k, backend="reference"))
            out.append(dict(key=key, tiles=tiles, ok=ok, us=cold_graph_us(lambda: mate.qsa_topk_tokens(scores, k, pos)) if ok else None))
            print(f"  sweep rows {rows} {key} {tiles}: " + (f"{out[-1]['us']:.2f} us" if ok else "wrong"), flush=True)
    return out


def compare(rows_list, keys, k, variants):
    sources = {n: None if f == "-" else f for n, f in (v.split("=", 1) for v in variants)}
    out = []
    with program_variants("qsa_topk", sources) as use:
        for rows in rows_list:
            gen = torch.Generator().manual_seed(0)
            scores = indexer_like_scores(gen, rows, keys, device="cuda", visible=torch.full((rows,), keys), nan=0.0)
            pos = torch.full((rows,), 4 * keys + 2, dtype=torch.int32, device="cuda")
            ref = mate.qsa_topk_blocks(scores, k, backend="reference")
            res = dict(rows=rows)
            for name in sources:
                use(name)
                ok = bool(torch.equal(mate.qsa_topk_tokens(scores, k, pos)[0], ref))
                res[name] = dict(exact=ok, us=cold_graph_us(lambda: mate.qsa_topk_tokens(scores, k, pos)))
                print(f"rows {rows} [{name}]: {res[name]['us']:.2f} us{'' if ok else ' (not exact)'}", flush=True)
            out.append(res)
    return out


STEP_TOKENS, STEP_PAGE, HQ, HKV, DIM, H_IDX, D_IDX = 32768, 64, 24, 2, 256, 4, 128


def step_case(batch, k, seed=0):
    """The decode step's inputs (see --step) and its three stages as functions of the selection."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = STEP_TOKENS // STEP_PAGE
    table = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    key, value = rand(batch * pages, STEP_PAGE, HKV, DIM), rand(batch * pages, STEP_PAGE, HKV, DIM)
    index_cache = rand(batch * pages, STEP_PAGE // 4, 1, D_IDX)
    q_idx, q, gate = rand(batch, H_IDX, D_IDX), rand(batch, 1, HQ, DIM), rand(batch, 1, HQ, DIM)
    seq_lens = torch.full((batch,), STEP_TOKENS, dtype=torch.int32, device="cuda")
    context = seq_lens // 4
    positions = seq_lens - 1  # the step's query positions, an input of the step as in a server (not timed)
    n_keys = pages * (STEP_PAGE // 4)

    def indexer():
        return mate.qsa_mqa_decode(q_idx, index_cache, table, context, n_keys)

    def attention(blocks, tokens):
        return mate.qsa_sparse_attention(q, key, value, tokens[:, None], block_indices=blocks[:, None], block_table=table,
                                         seq_lens_k=seq_lens, gate=gate)

    def mate_select(logits):
        return mate.qsa_topk_tokens(logits, k, positions)

    def torch_sel(logits):
        return torch_select(logits, k, positions)

    return indexer, mate_select, torch_sel, attention


def step(batch, k):
    indexer, mate_select, torch_sel, attention = step_case(batch, k)
    logits = indexer()
    blocks, tokens = mate_select(logits)
    ref_blocks, ref_tokens = mate.qsa_topk_tokens(logits, k, torch.full_like(logits[:, 0], STEP_TOKENS - 1, dtype=torch.int32),
                                                  backend="reference")
    exact = bool(torch.equal(blocks, ref_blocks) and torch.equal(tokens, ref_tokens))
    tb, tt = torch_sel(logits)
    # torch's order among equal scores is its own; the attention over the same token set agrees to rounding
    out, out_torch = attention(blocks, tokens), attention(tb, tt)
    err = float((out.float() - out_torch.float()).norm() / out_torch.float().norm())
    us = {
        "indexer": cold_graph_us(indexer),
        "mate selection": cold_graph_us(lambda: mate_select(logits)),
        "torch selection": cold_graph_us(lambda: torch_sel(logits)),
        "attention": cold_graph_us(lambda: attention(blocks, tokens)),
        "step, mate selection": cold_graph_us(lambda: attention(*mate_select(indexer()))),
        "step, torch selection": cold_graph_us(lambda: attention(*torch_sel(indexer()))),
    }
    if not exact:
        print(f"batch {batch}: WRONG, the selection differs from the reference (timed anyway)", flush=True)
    return dict(batch=batch, k=k, exact=exact, attention_rel_err_vs_torch_selection=err, us=us)


def prefill(rows, keys, k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, H_IDX, D_IDX, device="cuda", generator=gen).to(torch.bfloat16)
    kk = torch.randn(keys, D_IDX, device="cuda", generator=gen).to(torch.bfloat16)
    ends = torch.arange(keys - rows + 1, keys + 1, device="cuda", dtype=torch.int32)
    starts = torch.zeros_like(ends)
    positions = 4 * ends + 2  # each row's tail block holds 3 tokens

    def indexer():
        return mate.qsa_mqa_prefill(q, kk, starts, ends)

    logits = indexer()
    blocks, tokens = mate.qsa_mqa_prefill(q, kk, starts, ends, topk=k, query_positions=positions)
    ref_blocks, ref_tokens = mate.qsa_topk_tokens(logits, k, positions, backend="reference")
    exact = bool(torch.equal(blocks, ref_blocks) and torch.equal(tokens, ref_tokens))
    us = {
        "indexer": cold_graph_us(indexer),
        "indexer + mate selection (topk=)": cold_graph_us(lambda: mate.qsa_mqa_prefill(q, kk, starts, ends, topk=k, query_positions=positions)),
        "indexer + torch selection": cold_graph_us(lambda: torch_select(indexer(), k, positions)),
    }
    if not exact:
        print(f"prefill rows {rows}: WRONG, the selection differs from the reference (timed anyway)", flush=True)
    return dict(rows=rows, keys=keys, k=k, exact=exact, us=us)


def prefill_markdown(result) -> str:
    r0 = result["prefill"][0]
    note = (f"the last rows of one request of {r0['keys']} compressed keys (causal), top-{r0['k']}; exact: the selection "
            "bitwise equal to the reference on the call's own scores")
    return "\n".join(_table(result, "QSA indexer prefill with its selection", note, result["prefill"], "rows", ["exact"],
                            lambda r: ["yes" if r["exact"] else "NO"])) + "\n"


def step_markdown(result) -> str:
    k = result["steps"][0]["k"]
    note = (f"requests of {STEP_TOKENS} tokens, top-{k} of {STEP_TOKENS // 4} blocks; exact: mate's selection bitwise equal to "
            "the reference on the step's scores; err: attention output on mate's selection against on torch's (relative L2)")
    return "\n".join(_table(result, "QSA decode step", note, result["steps"], "batch", ["exact", "err"],
                            lambda r: ["yes" if r["exact"] else "NO", f"{r['attention_rel_err_vs_torch_selection']:.1e}"])) + "\n"

def figures(result):
    rows = result["rows"]
    impls = list(rows[0]["us"]) if rows else []
    return [figure(f"QSA selection, top-{rows[0]['k'] if rows else 0} of {rows[0]['keys'] if rows else 0}", "rows", "time (us)",
                   {n: [(r["rows"], r["us"][n]) for r in rows] for n in impls}, logy=True)]


def _table(result, title, note, records, axis, extra_names, extra) -> list:
    """The markdown lines of one run's table: a row per record (its `axis` value, its times, then `extra(record)`)."""
    names = list(records[0]["us"])
    lines = [f"{title} on {result['gpu']}, commit {result['commit']}, {result['date']}", "",
             f"`{result['command']}`; cold CUDA graph (L2 flushed), do_bench median, us; {note}", "",
             f"| {axis} | " + " | ".join(names + extra_names) + " |", "|---" * (len(names) + len(extra_names) + 1) + "|"]
    for r in records:
        lines.append(f"| {r[axis]} | " + " | ".join([f"{r['us'][n]:.2f}" for n in names] + extra(r)) + " |")
    return lines


def markdown(result) -> str:
    rows = result["rows"]
    note = (f"top-{rows[0]['k']} of {rows[0]['keys']} indexer-like FP32 scores; mate exact: bitwise equal to the reference "
            "(the fused call, and qsa_topk_blocks then qsa_expand_blocks)")
    lines = _table(result, "QSA selection", note, rows, "rows", ["mate exact", "same set as torch"],
                   lambda r: ["yes" if r["exact"] else "NO", f"{r['same_set_as_torch']:.2f}"])
    for s in result.get("sweep", []):
        lines.append(f"\nsweep rows {s['rows']}: " + "; ".join(
            f"{t['tiles']} {'wrong' if not t['ok'] else format(t['us'], '.2f')}" for t in s["results"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256, 4096])
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", nargs="*", default=[], metavar="NAME=FILE")
    ap.add_argument("--step", type=int, nargs="*", default=None, metavar="BATCH", help="time the whole decode step at these batches")
    ap.add_argument("--prefill", type=int, nargs="*", default=None, metavar="ROWS",
                    help="time the indexer's prefill with its selection at these row counts")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>-<date>-topk.json; .md beside it)")
    args = ap.parse_args(argv)
    env = environment()
    result = dict(env, rows=[], sweep=[])
    if args.variants:
        result["variants"] = compare(args.rows, args.keys, args.k, args.variants)
        write_json(args.out or RESULTS / f"{env['gpu'].replace(' ', '_')}-{datetime.date.today()}-topk-variants.json", result)
        return result
    def records(name, label, values, run, suffix, table):
        """result[name]: run(v) for each value (printed as it ends), then the JSON and its markdown table."""
        result[name] = []
        for v in values:
            result[name].append(run(v))
            print(f"{label} {v}: " + ", ".join(f"{n} {us:.2f}" for n, us in result[name][-1]["us"].items()) + " us", flush=True)
        out = write_json(args.out or RESULTS / f"{env['gpu'].replace(' ', '_')}-{datetime.date.today()}-{suffix}.json", result)
        out.with_suffix(".md").write_text(table(result))
        print(table(result))
        return result

    if args.prefill is not None:
        return records("prefill", "prefill rows", args.prefill or [4096, 8192], lambda r: prefill(r, args.keys, args.k),
                       "qsa-prefill-topk", prefill_markdown)
    if args.step is not None:
        return records("steps", "batch", args.step or [1, 64], lambda b: step(b, args.k), "qsa-step", step_markdown)
    for rows in args.rows:
        r, scores, pos = case(rows, args.keys, args.k)
        result["rows"].append(r)
        print(f"rows {rows}: " + ", ".join(f"{n} {us:.2f}" for n, us in r["us"].items()) + " us", flush=True)
        if args.sweep:
            result["sweep"].append(dict(rows=rows, results=sweep(rows, args.keys, args.k, scores, pos)))
    out = write_json(args.out or RESULTS / f"{env['gpu'].replace(' ', '_')}-{datetime.date.today()}-topk.json", result)
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
