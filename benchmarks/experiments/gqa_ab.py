"""The GQA kernel against another version of its source, in one process on the same data.

    git show REV:mate/swa/kernels/gqa.py > /tmp/old_gqa.py
    python benchmarks/experiments/gqa_ab.py --against /tmp/old_gqa.py [--out FILE]

Per case (window, head dim, length; B 1, H 64, H_kv 8, BF16, the shipped tiles of
configs/sm90.yaml), both programs are compiled with the same tiles, run on the same
inputs through the public API (overrides.program_variants switches the program),
compared with each other (max abs difference) and timed in three interleaved rounds of
do_bench medians (CUDA-graph replays, benchmarks/common.py); the middle round is
reported. The other source must define `gqa_fwd` with the same signature. `--case=L,R,D,S`
(repeatable) runs those cases instead, window (L, R), head dim D, length S (L -1: causal).
`--also FILE` (repeatable) times more versions in the same rounds, each named by its file's stem
(its ratio is current / that version, its max diff against the current one).

    git show REV:mate/swa/kernels/gqa_decode.py > /tmp/old_gqa_decode.py
    python benchmarks/experiments/gqa_ab.py --decode --against /tmp/old_gqa_decode.py [--tiles 64,64,128,2 ...] [--other-tiles ...] [--out FILE]

--decode does the same for the split-KV kernel (gqa_decode) on bench_gqa's decode shape (B 64 x 8192
keys in a paged cache, pages in random order, H 64 / 8, D 128, BF16; 1 and 4 query rows, dense causal
and (4096, 0)): the current program at the shipped tiles and each --tiles (block_m,block_n,threads,
num_stages), the other at the shipped tiles and each --other-tiles, all compiled first in parallel
processes (TileLang's disk cache), then switched by handing the dispatcher the kernel and the tiles
(the split count follows the tiles). Each row gives TB/s of the bytes
bench_gqa.decode_bytes counts, mate's relative error against the reference on 8 sequences, and torch
SDPA (cuDNN) on the same keys laid out dense for one-row steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

from common import PEAK_BYTES, RESULTS, graph_ms, rel_err, write_json  # noqa: E402
import mate  # noqa: E402
from overrides import program_variants  # noqa: E402

B, H, HKV = 1, 64, 8
CASES = [((-1, 0), 128, 16384), ((512, 0), 128, 16384), ((-1, 0), 64, 16384), ((1024, 0), 64, 16384), ((31, 5), 128, 16384)]


def run_case(use, names, window, dim, s) -> dict:
    q = torch.randn(B, s, H, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, s, HKV, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, s, HKV, dim, device="cuda", dtype=torch.bfloat16)
    outs, calls = {}, {}
    for name in names:
        use(name)
        o = torch.empty_like(q)
        calls[name] = lambda o=o: mate.gqa_attention(q, k, v, sliding_window=window, out=o, return_lse=True)
        outs[name] = calls[name]()
    torch.cuda.synchronize()
    diffs = {name: (outs["current"][0].float() - outs[name][0].float()).abs().max().item() for name in names if name != "current"}
    rounds = {name: [] for name in names}
    for _ in range(3):
        for name in names:
            use(name)  # the capture in graph_ms goes through the dispatcher: it must find this version's kernel
            rounds[name].append(graph_ms(calls[name], target_ms=20))
    ms = {name: sorted(r)[1] for name, r in rounds.items()}
    more = {name: dict(ratio=ms["current"] / ms[name], max_abs_diff=diffs[name]) for name in names if name not in ("current", "other")}
    return dict(window=list(window), dim=dim, seq=s, ms=ms, rounds=rounds, ratio=ms["current"] / ms["other"], max_abs_diff=diffs["other"],
                **({"also": more} if more else {}))


DECODE_KEY = dict(dtype="bfloat16", dim=128)
DECODE_WINDOWS = {(-1, 0): "causal", (4096, 0): "local"}
# (query rows, page size) per sequence; the windows of DECODE_WINDOWS each
DECODE_CASES = [(1, 64), (4, 64)]


def decode_main(a) -> dict:
    from bench_gqa import decode_bytes, first_sdpa
    from common import environment
    from overrides import compile_variants, shipped_tiles, using_kernel

    shipped = {w: shipped_tiles("sm90", "gqa_decode", f"dtype=bfloat16,dim=128,window={w}") for w in DECODE_WINDOWS.values()}
    names = {"current": None, "other": str(a.against)}
    more = {"current": a.tiles, "other": a.other_tiles}
    variants = [(name, w, shipped[w] if t is None else t) for name in names for w in DECODE_WINDOWS.values() for t in [None, *more[name]]]
    variants = list(dict.fromkeys((n, w, tuple(t.items())) for n, w, t in variants))
    jobs = [("gqa_decode", dict(DECODE_KEY, window=w), dict(t), names[n]) for n, w, t in variants]
    kernels = dict(zip(variants, compile_variants(jobs, 16)))
    res = {**environment(), "against": str(a.against), "timing": "CUDA-Graph replay, median of do_bench; 3 interleaved rounds, the middle",
           "bytes": "bench_gqa.decode_bytes: the K/V rows the query rows see, q, out, block_table, seq_lens_k", "rows": []}
    nd, ctx, D = 64, 8192, 128
    lens = torch.full((nd,), ctx, dtype=torch.int32, device="cuda")
    for sq, ps in DECODE_CASES:
        pages = nd * ctx // ps
        kc, vc = (torch.randn(pages, ps, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(pages, device="cuda").int().view(nd, -1)
        q = torch.randn(nd, sq, H, D, device="cuda", dtype=torch.bfloat16)
        for window, wclass in DECODE_WINDOWS.items():
            kw = dict(block_table=table, seq_lens_k=lens, sliding_window=window)
            ref = mate.gqa_attention(q[:8], kc, vc, **{**kw, "block_table": table[:8], "seq_lens_k": lens[:8]}, backend="reference")
            nbytes = decode_bytes(q, table, lens, ctx, window)
            mine = [v for v in variants if v[1] == wclass]
            outs, rounds = {}, {v: [] for v in mine}
            for v in mine:
                outs[v] = torch.empty_like(q)
                with using_kernel("gqa_decode", dict(DECODE_KEY, window=wclass), kernels[v], dict(v[2])):
                    mate.gqa_attention(q, kc, vc, out=outs[v], **kw)
            for _ in range(3):
                for v in mine:
                    with using_kernel("gqa_decode", dict(DECODE_KEY, window=wclass), kernels[v], dict(v[2])):
                        rounds[v].append(graph_ms(lambda v=v: mate.gqa_attention(q, kc, vc, out=outs[v], **kw), target_ms=20))
            row = dict(case=f"paged decode {nd} x {sq} rows x {ctx} keys, page {ps}", window=list(window), bytes=nbytes, variants=[])
            base = outs[("other", wclass, tuple(shipped[wclass].items()))]
            for v in mine:
                ms = sorted(rounds[v])[1]
                row["variants"].append(dict(program=v[0], tiles=dict(v[2]), ms=ms, rounds=rounds[v], TB_s=nbytes / ms / 1e9,
                                            of_peak_bandwidth=nbytes / ms / 1e-3 / PEAK_BYTES, err_vs_reference=rel_err(outs[v][:8], ref),
                                            max_abs_diff_vs_other_shipped=(outs[v].float() - base.float()).abs().max().item()))
                print(f"{row['case']:>44} {str(window):>10} {v[0]:>8} {str(tuple(dict(v[2]).values())):>18} {ms:8.4f} ms "
                      f"{nbytes / ms / 1e9:5.2f} TB/s err {row['variants'][-1]['err_vs_reference']:.1e}", flush=True)
            if sq == 1 and ps == 64:  # the same keys, dense and contiguous per sequence: an easier problem
                keys = ctx if window[0] < 0 else window[0] + 1
                kd, vd = (x[table.long()].view(nd, ctx, HKV, D)[:, ctx - keys :].transpose(1, 2) for x in (kc, vc))
                name, fn = first_sdpa(q.transpose(1, 2), kd, vd)
                if fn is not None:
                    bms = graph_ms(fn, target_ms=20)
                    row.update(baseline=f"torch SDPA {name} on the dense visible K/V", baseline_ms=bms, baseline_TB_s=nbytes / bms / 1e9)
                    print(f"{name + ' (dense keys)':>44} {str(window):>10} {bms:8.4f} ms {nbytes / bms / 1e9:5.2f} TB/s", flush=True)
                del kd, vd
            res["rows"].append(row)
            write_json(a.out or RESULTS / "gqa_decode_ab.json", res)
        del kc, vc
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, required=True, help="the other version of mate/swa/kernels/gqa.py (--decode: gqa_decode.py)")
    ap.add_argument("--decode", action="store_true", help="A/B the split-KV decode kernel instead")
    ap.add_argument("--tiles", type=str, action="append", default=[],
                    help="--decode: also time the current program at these tiles, block_m,block_n,threads,num_stages")
    ap.add_argument("--other-tiles", type=str, action="append", default=[], help="--decode: the other program at these tiles")
    ap.add_argument("--case", type=str, action="append", default=[],
                    help="instead of the default cases: window left,right, head dim, length, e.g. --case=-1,0,128,16384 (with =: it starts with -)")
    ap.add_argument("--also", type=Path, action="append", default=[], help="more versions of gqa.py, timed in the same rounds")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    for name in ("tiles", "other_tiles"):
        setattr(a, name, [dict(zip(("block_m", "block_n", "threads", "num_stages"), map(int, t.split(",")))) for t in getattr(a, name)])
    if a.decode:
        return decode_main(a)
    sources = {"current": None, "other": a.against, **{f.stem: f for f in a.also}}
    assert len(sources) == 2 + len(a.also), "--also: file stems must differ from each other and from current/other"
    torch.manual_seed(0)
    res = dict(gpu=torch.cuda.get_device_name(), against=str(a.against), also=[str(f) for f in a.also], rows=[])
    print(f"{'window':>10} {'D':>4} {'S':>6} {'current ms':>10} {'other ms':>9} {'ratio':>6} {'max diff':>9}"
          + "".join(f" {f.stem[:16]:>16} ms" for f in a.also))
    with program_variants("gqa_fwd", sources) as use:
        for window, dim, s in [((c[0], c[1]), c[2], c[3]) for c in (tuple(map(int, c.split(","))) for c in a.case)] or CASES:
            r = run_case(use, sources, window, dim, s)
            res["rows"].append(r)
            print(f"{str(window):>10} {dim:>4} {s:>6} {r['ms']['current']:>10.3f} {r['ms']['other']:>9.3f} {r['ratio']:>6.3f} "
                  f"{r['max_abs_diff']:>9.2e}" + "".join(f" {r['ms'][f.stem]:>19.3f}" for f in a.also), flush=True)
    out = write_json(a.out or RESULTS / "gqa_ab.json", res)
    print(f"-> {out}")
    return res


if __name__ == "__main__":
    main()
