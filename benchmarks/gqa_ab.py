"""The GQA kernel against another version of its source, in one process on the same data.

    git show REV:mate/swa/kernels/gqa.py > /tmp/old_gqa.py
    python benchmarks/gqa_ab.py --against /tmp/old_gqa.py [--out FILE]

Per case (window, head dim, length; B 1, H 64, H_kv 8, BF16, the shipped tiles of
configs/sm90.yaml), both programs are compiled with the same tiles, run on the same
inputs through the public API (mate.testing.program_variants switches the program),
compared with each other (max abs difference) and timed in three interleaved rounds of
do_bench medians (CUDA-graph replays, benchmarks/common.py); the middle round is
reported. The other source must define `gqa_fwd` with the same signature.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import RESULTS, graph_ms, write_json  # noqa: E402
import mate  # noqa: E402
from mate.testing import program_variants  # noqa: E402

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
    diff = (outs["current"][0].float() - outs["other"][0].float()).abs().max().item()
    rounds = {name: [] for name in names}
    for _ in range(3):
        for name in names:
            use(name)  # the capture in graph_ms goes through the dispatcher: it must find this version's kernel
            rounds[name].append(graph_ms(calls[name], target_ms=20))
    ms = {name: sorted(r)[1] for name, r in rounds.items()}
    return dict(window=list(window), dim=dim, seq=s, ms=ms, rounds=rounds, ratio=ms["current"] / ms["other"], max_abs_diff=diff)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, required=True, help="the other version of mate/swa/kernels/gqa.py")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    sources = {"current": None, "other": a.against}
    torch.manual_seed(0)
    res = dict(gpu=torch.cuda.get_device_name(), against=str(a.against), rows=[])
    print(f"{'window':>10} {'D':>4} {'S':>6} {'current ms':>10} {'other ms':>9} {'ratio':>6} {'max diff':>9}")
    with program_variants("gqa_fwd", sources) as use:
        for window, dim, s in CASES:
            r = run_case(use, sources, window, dim, s)
            res["rows"].append(r)
            print(f"{str(window):>10} {dim:>4} {s:>6} {r['ms']['current']:>10.3f} {r['ms']['other']:>9.3f} {r['ratio']:>6.3f} "
                  f"{r['max_abs_diff']:>9.2e}", flush=True)
    out = write_json(a.out or RESULTS / "gqa_ab.json", res)
    print(f"-> {out}")
    return res


if __name__ == "__main__":
    main()
