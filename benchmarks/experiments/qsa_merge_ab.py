"""The public SplitKV merge (mate.merge_attention_states) against another version of its program, in one process.

    git show REV:mate/qsa/kernels/sparse.py > /tmp/old_sparse.py
    python benchmarks/experiments/qsa_merge_ab.py --against /tmp/old_sparse.py [NAME=FILE ...] [--out FILE]

Per case (splits, rows, heads, D; FP32 partials with a third of the splits -inf, BF16 output, LSE written), both
programs run on the same inputs through the public API (overrides.program_variants switches the merge program),
are checked against the reference and timed as one call per CUDA-graph replay with L2 flushed (do_bench median),
in two interleaved rounds; the smaller is reported. Each other source ("other", or NAME=FILE) must define `merge`
with the same signature.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, overrides, bench_*
import mate  # noqa: E402
from common import RESULTS, cold_graph_us, environment, rel_err, write_json  # noqa: E402
from overrides import program_variants  # noqa: E402

# QSA's (24 heads, D 256) at the decode split counts and the public-merge shapes;
# GQA decode's (64 heads, D 128; B 64 x 1, 4 and 8 rows at 3 splits: bench_gqa --decode's)
CASES = [(11, 1, 24, 256), (7, 8, 24, 256), (4, 256, 24, 256), (8, 64, 24, 256), (16, 8, 64, 128), (4, 64, 64, 128),
         (3, 64, 64, 128), (3, 256, 64, 128), (3, 512, 64, 128)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", nargs="+", required=True,
                    help="other versions of mate/qsa/kernels/sparse.py: FILE (named other) or NAME=FILE")
    ap.add_argument("--out", type=Path, default=RESULTS / "qsa_merge_ab.json")
    a = ap.parse_args(argv)
    sources = {"current": None}
    for item in a.against:
        name, _, path = item.rpartition("=")
        sources[name or "other"] = Path(path)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with program_variants("qsa_merge", sources) as use:
        for splits, r, h, d in CASES:
            po = torch.randn(splits, r, h, d, generator=gen).cuda()
            pl = torch.randn(splits, r, h, generator=gen).cuda()
            pl[torch.rand(splits, r, h, generator=gen).cuda() < 0.3] = float("-inf")
            ref, ref_lse = mate.merge_attention_states(po, pl, out_dtype=torch.bfloat16, backend="reference")
            res = dict(splits=splits, rows=r, heads=h, dim=d, us={}, rel_err={})
            for _ in range(2):
                for name in sources:
                    use(name)
                    out, lse = mate.merge_attention_states(po, pl, out_dtype=torch.bfloat16)
                    try:
                        res["rel_err"][name] = max(rel_err(out, ref), rel_err(lse, ref_lse))
                    except AssertionError as e:  # a -inf pattern that differs
                        raise AssertionError(f"{name}: {e} ({res})") from None
                    assert res["rel_err"][name] < 1e-2, (name, res)
                    t = cold_graph_us(lambda: mate.merge_attention_states(po, pl, out_dtype=torch.bfloat16))
                    res["us"][name] = min(res["us"].get(name, t), t)
            rows.append(res)
            times = ", ".join(f"{name} {us:.1f} us" for name, us in res["us"].items())
            print(f"merge {splits} splits x {r} rows x {h} heads x D {d}: {times}", flush=True)
    result = dict(environment(), against={name: str(path) for name, path in sources.items() if path}, cases=rows)
    write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
