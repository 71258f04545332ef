"""Stage card of GQA forward attention, dense or sliding window (mate.swa.kernels.gqa).

Importable without TileLang. The resource model follows the program's buffers: Q
(O reuses it), the K and V rings in shared memory; S, O (FP32) and P (16-bit) in
the consumer warpgroups' registers.
"""

from mate._stage import Stage
from mate._hopper import SMEM_PER_CTA, WARPGROUP, itemsize, warpgroups

OPTIONS = ("varlen", "sinks", "softcap")  # gqa_fwd's compile-time options (mate.swa.kernels.gqa)

WINDOWS = ("none", "causal", "local")  # the window classes, one specialization each
NATIVE_DIMS = (64, 128)
MAX_CONSUMERS = 3  # consumer warpgroups; with the producer's, 512 threads
WGMMA_N_MAX = 256
SPARE_REGS = 32  # registers per consumer thread kept beside the accumulators (addresses, indices, loop state)


def consumer_regs_cap(warpgroups: int) -> int:
    """The registers per consumer thread that TileLang's `setmaxnreg` gives the consumers."""
    return 240 if warpgroups <= 2 else 160


def _limits(spec, t):
    wgs = t["threads"] // WARPGROUP
    if why := warpgroups(t["threads"], t["block_m"], "block_m"):
        return why
    if wgs > MAX_CONSUMERS:
        return f"more than {MAX_CONSUMERS} consumer warpgroups (plus the producer) exceed 512 threads"
    return tile_limits(spec, t, consumer_regs_cap(wgs), SPARE_REGS)


def tile_smem(spec, t, extra_smem: int = 0) -> int:
    """Shared memory of the GQA programs' tiles in bytes: Q (O reuses it), the K and V rings of num_stages stages,
    and `extra_smem`."""
    d = spec["dim"]
    return itemsize(spec["dtype"]) * (t["block_m"] * d + t["num_stages"] * 2 * t["block_n"] * d) + extra_smem


def tile_regs(spec, t) -> int:
    """Accumulator registers per thread of the GQA programs' tiles: S, O (FP32) and P (16-bit)."""
    return (t["block_m"] * t["block_n"] * 3 // 2 + t["block_m"] * spec["dim"]) // t["threads"]


def tile_limits(spec, t, regs_cap: int, spare: int, extra_smem: int = 0) -> str | None:
    """The limits of the GQA programs' tiles: block_n a wgmma N; tile_smem (with `extra_smem`) in shared memory;
    tile_regs plus `spare` in regs_cap registers per thread."""
    if t["block_n"] % 16 or t["block_n"] > WGMMA_N_MAX:
        return f"block_n {t['block_n']} is not a wgmma N (multiple of 16, at most {WGMMA_N_MAX})"
    if (smem := tile_smem(spec, t, extra_smem)) > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    regs = tile_regs(spec, t)
    if regs + spare > regs_cap:
        return f"{regs} accumulator registers per consumer thread + {spare} > {regs_cap}"
    return None


STAGE = Stage(
    "gqa_fwd", "mate.swa.kernels.gqa", "gqa_fwd",
    space=dict(block_m=(64, 128, 192), block_n=(64, 128, 192), threads=(128, 256, 384), num_stages=(1, 2, 3), mma_depth=(1, 2)),
    keys=("dtype", "dim", "window"),
    limits=_limits,
    shapes=dict(quick=[dict(seq=4096, heads=64, kv_heads=8)],
                full=[dict(seq=16384, heads=64, kv_heads=8), dict(seq=16384, heads=64, kv_heads=8, window=(512, 0))]),
    workload="gqa_fwd_workload",
    tol=1e-2,
    # every combination of the options (issue 17), compile-time flags on the entry's tiles
    variants=lambda spec: [{n: bool(m >> i & 1) for i, n in enumerate(OPTIONS)} for m in range(1, 1 << len(OPTIONS))],
)
