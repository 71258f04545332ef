"""The NSA selection kernel against another version of its source, in one process on the same data.

    git show REV:mate/nsa/kernels/selection.py > /tmp/old_selection.py
    python benchmarks/nsa_ab.py --against /tmp/old_selection.py [--tiles 2/3 2/2] [--out FILE]

For a kernel change, side by side: per case (specialization key, num_stages /
CTAs per SM, shape), both programs are compiled with the same tiles and run on
one workload (the tuner's), each checked against the reference on its last
rows, then timed in three interleaved rounds of do_bench medians; the middle
round is reported. Cases: the four bfloat16 keys on the tuner's quick shape
(L = 8192, H = 128, G = 8, T = 16), and the seed shape of issue 5 (L = 65536,
D = 128, block 64). The other source must define `nsa_selection_fwd` with the
same signature; its PASS_CONFIGS are used if it has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import RESULTS, environment, median_ms, write_json  # noqa: E402
from mate import _dispatch  # noqa: E402
from tuning import configfile  # noqa: E402
from tuning.stages import NSA_SELECTION  # noqa: E402

QUICK = dict(seq=8192, heads=128, kv_heads=8, selected=16)
SEED = dict(seq=65536, heads=128, kv_heads=8, selected=16)
KEYS = [f"dtype=bfloat16,dim={d},block_size={b}" for d in (64, 128) for b in (32, 64)]


def load_stage(path: Path):
    # The dispatcher imports a stage's program by module name: register the other source under one.
    name = f"nsa_other_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = _dispatch.STAGES["nsa_selection"]
    return dataclasses.replace(current, module=name, pass_configs="PASS_CONFIGS" if hasattr(module, "PASS_CONFIGS") else None)


def run_case(variants: dict, key: str, stages: int, min_blocks: int, shape: dict) -> dict:
    tiles = dict(head_tile=16, threads=128, num_stages=stages, min_blocks=min_blocks)
    current = _dispatch.STAGES["nsa_selection"]
    with configfile.using_tiles("sm90", "nsa_selection", key, tiles):
        native, ref, pick = NSA_SELECTION.workload(_dispatch.parse_key(key), shape)
        want = ref()
        kernels, err = {}, {}
        try:
            for name, stage in variants.items():
                # The wrapper takes its kernel from the dispatcher's cache: fill it per variant, keep each.
                _dispatch.STAGES["nsa_selection"] = stage
                _dispatch._kernels.clear()
                got = pick(native())
                err[name] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
                kernels[name] = dict(_dispatch._kernels)
        finally:
            _dispatch.STAGES["nsa_selection"] = current
        rounds = {name: [] for name in variants}
        for _ in range(3):
            for name in variants:
                _dispatch._kernels.clear()
                _dispatch._kernels.update(kernels[name])
                rounds[name].append(median_ms(native, warmup=50, rep=600 if shape["seq"] > 8192 else 200))
    ms = {name: sorted(r)[1] for name, r in rounds.items()}
    return dict(key=key, num_stages=stages, min_blocks=min_blocks, shape=shape, max_abs_err=err, ms=ms, rounds=rounds,
                ratio=ms["current"] / ms["other"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, required=True, help="the other version of mate/nsa/kernels/selection.py")
    ap.add_argument("--tiles", nargs="*", default=["2/3", "2/2"], help="num_stages/min_blocks pairs")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    variants = {"current": _dispatch.STAGES["nsa_selection"], "other": load_stage(a.against)}
    torch.manual_seed(0)
    res = dict(environment(), against=str(a.against), rows=[])
    pairs = [tuple(map(int, t.split("/"))) for t in a.tiles]
    cases = [(k, s, b, QUICK) for k in KEYS for s, b in pairs] + [(KEYS[3], s, b, SEED) for s, b in pairs]
    print(f"{'key':<38} {'tiles':>5} {'L':>6} {'current ms':>10} {'other ms':>9} {'ratio':>6} {'err cur/oth':>16}")
    for key, s, b, shape in cases:
        r = run_case(variants, key, s, b, shape)
        res["rows"].append(r)
        print(f"{key:<38} {s}/{b:<3} {shape['seq']:>6} {r['ms']['current']:>10.3f} {r['ms']['other']:>9.3f} {r['ratio']:>6.3f} "
              f"{r['max_abs_err']['current']:>8.1e}/{r['max_abs_err']['other']:.1e}", flush=True)
    out = write_json(a.out or RESULTS / f"nsa_ab_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"GPU {res['gpu']} commit {res['commit']} -> {out}")
    return res


if __name__ == "__main__":
    main()
