"""GQA paged decode's kernels one by one: the split-KV attention kernel and the SplitKV merge (bench_gqa --decode's shape).

    python benchmarks/experiments/gqa_decode_kernels.py [--merge-variant FILE]

B 64 x 8192 keys in pages of 64 (random order), H 64 / 8, D 128, BF16; 1 and 4 query rows, dense causal and
(4096, 0). Per case: each kernel's median time over 20 calls (torch.profiler, kernels in call order: the
profiler names every TileLang kernel `main_kernel`), its start after the call's first kernel starts, the
call's CUDA-graph replay time, and the relative error against the reference on 8 sequences. With
--merge-variant (another version of mate/qsa/kernels/sparse.py, whose `merge` program is taken), the shipped
merge and the variant's alternate, two rounds each. H200 results:
benchmarks/results/NVIDIA_H200-2026-12-02-gqa_decode_tma.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, overrides, bench_*

import mate  # noqa: E402
from common import graph_ms  # noqa: E402
from overrides import program_variants  # noqa: E402

B, CTX, H, HKV, D, PAGE, CALLS = 64, 8192, 64, 8, 128, 64, 20


def kernel_times(call) -> list[tuple[str, float, float]]:
    """(name, median us, median start after the call's first kernel in us) of each kernel of `call`."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    per = len(ks) // CALLS
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return [(ks[i].name[:30], med([k.time_range.end - k.time_range.start for k in ks[i::per]]),
             med([ks[c * per + i].time_range.start - ks[c * per].time_range.start for c in range(CALLS)])) for i in range(per)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merge-variant", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    pages = B * CTX // PAGE
    kc = torch.randn(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages, device="cuda").int().view(B, CTX // PAGE)
    lens = torch.full((B,), CTX, dtype=torch.int32, device="cuda")
    sources = {"shipped": None, **({"variant": args.merge_variant} if args.merge_variant else {})}
    with program_variants("qsa_merge", sources) as use:
        for rnd in range(2 if args.merge_variant else 1):
            for name in sources:
                use(name)
                for sq in (1, 4):
                    for window in [(-1, 0), (4096, 0)]:
                        q = torch.randn(B, sq, H, D, device="cuda", dtype=torch.bfloat16)
                        kw = dict(block_table=table, seq_lens_k=lens, sliding_window=window, out=torch.empty_like(q))
                        call = lambda: mate.gqa_attention(q, kc, vc, **kw)  # noqa: E731
                        times = kernel_times(call)
                        ref = mate.gqa_attention(q[:8], kc, vc, block_table=table[:8], seq_lens_k=lens[:8], sliding_window=window,
                                                 backend="reference")
                        out = kw["out"][:8].float()
                        err = float((out - ref.float()).norm() / ref.float().norm())
                        print(f"[{name} {rnd}] rows {sq} window {window}: graph {graph_ms(call) * 1e3:.1f} us, error {err:.1e}; "
                              + "; ".join(f"#{i} {n} {us:.1f} us (starts at {at:.1f})" for i, (n, us, at) in enumerate(times)),
                              flush=True)


if __name__ == "__main__":
    main()
