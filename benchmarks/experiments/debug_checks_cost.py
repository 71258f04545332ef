"""What MATE_DEBUG_CHECKS costs: each entrypoint timed with the debug value checks off and on.

    python benchmarks/experiments/debug_checks_cost.py [--out FILE]

Times are medians of triton.testing.do_bench over back-to-back calls (not CUDA-graph
replays: the checks sync with the host, so graphs cannot hold them), so both columns
include the host's launch cost; the inputs are valid, so every check runs to the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

import mate  # noqa: E402
from common import RESULTS, median_ms, write_json  # noqa: E402

I32 = torch.int32


def qsa_paged(rows, per_req, nb=512, ps=64):
    """Canonical 24/2/256 paged QSA with the block hint (2051 tokens a row), flattened rows."""
    n_req = rows // per_req
    maxp = (4 * nb + 3 + 4 * 64) // ps
    pool = n_req * maxp + 1
    q = torch.randn(rows, 24, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(pool, ps, 2, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(pool, device="cuda")[: n_req * maxp].to(I32).view(n_req, maxp)
    blocks = torch.randint(0, maxp * ps // 4, (rows, nb), device="cuda", dtype=I32)
    blocks[:, nb // 2 :] = -1
    tok = torch.where(blocks[..., None] >= 0, 4 * blocks[..., None] + torch.arange(4, device="cuda", dtype=I32), -1).flatten(1)
    tok = torch.cat([tok, torch.arange(3, device="cuda", dtype=I32).expand(rows, 3)], 1).contiguous()
    cu = torch.arange(0, rows + 1, per_req, device="cuda", dtype=I32)
    sk = torch.full((n_req,), maxp * ps, device="cuda", dtype=I32)
    return lambda: mate.qsa_sparse_attention(q, k, v, tok, block_indices=blocks, cu_seqlens_q=cu, block_table=table, seq_lens_k=sk)


def mqa_decode(batch=64, ps=64, max_len=8192):
    maxp = max_len // ps
    q = torch.randn(batch, 4, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(batch * maxp, ps, 1, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(batch * maxp, device="cuda", dtype=I32).view(batch, maxp)
    ctx = torch.randint(1, max_len, (batch,), device="cuda", dtype=I32)
    return lambda: mate.qsa_mqa_decode(q, cache, table, ctx, max_len)


def nsa(seq=8192, heads=64, groups=4, dim=128, bs=64, t=16):
    q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seq, groups, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(seq, device="cuda")[:, None, None] // bs
    idx = (torch.rand(1, seq, groups, t, device="cuda") * (pos + 1)).to(I32)
    return lambda: mate.nsa_selection_attention(q, k, v, idx, block_size=bs)


CASES = {
    "qsa_sparse_attention paged decode, 64 rows x 2051 tokens": lambda: qsa_paged(64, 1),
    "qsa_sparse_attention paged prefill, 4096 rows x 2051 tokens": lambda: qsa_paged(4096, 1024),
    "qsa_mqa_decode batch 64, 8192 keys": mqa_decode,
    "nsa_selection_attention L 8192, H 64, T 16": nsa,
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'case':<62} {'off ms':>9} {'on ms':>9} {'added us':>9}")
    for name, make in CASES.items():
        fn = make()
        with mate.debug_checks(False):
            off = median_ms(fn)
        with mate.debug_checks():
            on = median_ms(fn)
        rows.append(dict(case=name, off_ms=off, on_ms=on))
        print(f"{name:<62} {off:>9.3f} {on:>9.3f} {1e3 * (on - off):>9.1f}", flush=True)
    out = write_json(a.out or RESULTS / "debug_checks_cost.json", dict(gpu=torch.cuda.get_device_name(), rows=rows))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
