"""Stage card of GQA split-KV attention over a paged cache (mate.swa.kernels.gqa_decode).

Importable without TileLang. The resource model follows the program's buffers: the packed
query tile, the K and V rings (`num_stages` deep, filled by TMA boxes or cp.async), the key tiles' page ids
and slots and the rows' metadata in shared memory; S, P and O in the registers of one warpgroup per 64
packed rows.
"""

from mate._hopper import FP8_KV, MAX_REGS, REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, THREADS_PER_SM, warpgroups
from mate._stage import Stage
from mate.swa.kernels.gqa_card import tile_limits, tile_regs, tile_smem

SPARE_REGS = 40  # addresses, page ids and loop state beside the accumulators


def _ids_smem(t) -> int:
    # Beside the rings: the page ids and slots of num_stages + 1 key tiles and three int32 per packed row.
    return 4 * (2 * (t["num_stages"] + 1) * t["block_n"] + 3 * t["block_m"])


def _limits(spec, t):
    # One warpgroup per 64 rows and no producer: every thread may hold MAX_REGS registers.
    return warpgroups(t["threads"], t["block_m"], "block_m") or tile_limits(spec, t, MAX_REGS, SPARE_REGS, _ids_smem(t))


def resident_ctas(spec, t) -> int:
    """CTAs of these tiles that fit in one multiprocessor at once, by shared memory (Q, the K/V ring, the ids) and by
    the registers the model counts (S, P, O and SPARE_REGS a thread): two at D 128 and the shipped tiles, four at
    D 64. ptxas gives the D 64 kernel 168 registers a thread (three CTAs by registers), yet the split counts four
    slots give measured faster on the H200 than those of three (B 16: 4 splits 0.101 ms against 3 splits 0.108;
    B 32: 2 against 3, 0.185 / 0.191; benchmarks/results/NVIDIA_H200-2026-12-02-decode-splits.md), so the model
    stays a model."""
    smem = tile_smem(spec, t, _ids_smem(t))
    regs = tile_regs(spec, t) + SPARE_REGS
    return max(1, min(SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA), REGS_PER_SM // (regs * t["threads"]),
                      THREADS_PER_SM // t["threads"]))


STAGE = Stage(
    "gqa_decode", "mate.swa.kernels.gqa_decode", "gqa_decode",
    space=dict(block_m=(64, 128), block_n=(32, 64, 128), threads=(128, 256), num_stages=(2, 3, 4)),
    keys=("dtype", "dim", "window"),
    limits=_limits,
    pass_configs="PASS_CONFIGS",
    shapes=dict(quick=[dict(batch=16, context=4096, rows=1, page=64, heads=64, kv_heads=8)],
                full=[dict(batch=64, context=8192, rows=1, page=64, heads=64, kv_heads=8),
                      dict(batch=64, context=8192, rows=4, page=16, heads=64, kv_heads=8)]),
    workload="gqa_decode_workload",
    tol=1e-2,
    # FP8 K/V caches (issue 38): a compile-time option on the entry's tiles. Its ring at one byte an element and the
    # upcast K and V tiles take no more shared memory than the 16-bit ring at num_stages >= 2 (2 S + 4 <= 4 S
    # bytes per key and feature), so the entry's limits and resident_ctas hold for it.
    variants=lambda spec: [{"kv_dtype": kv} for kv in FP8_KV],
)
