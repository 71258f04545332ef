"""Stage card of the NSA selection attention forward (mate.nsa.kernels.selection).

Importable without TileLang. The program imports the constants below, so its
buffers and this resource model are computed from the same numbers.
"""

from mate._stage import Stage
from mate._hopper import MAX_GROUP, MAX_REGS, REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, WARPGROUP, itemsize, reduction_scratch

TILE_KEYS = 64  # wgmma's M per warpgroup
MAX_SLOTS = 128  # capacity of the compacted list (T <= 128); small enough for 3 CTAs per SM
NATIVE_DIMS = (64, 128)
NATIVE_BLOCK_SIZES = (32, 64)
SPARE_REGS = 24  # registers per thread kept beside the tiles (addresses, indices, loop state)


def _limits(spec, t):
    if t["threads"] != WARPGROUP:
        return "the kernel's MMA tiles are sized for one consumer warpgroup (threads=128)"
    if t["head_tile"] != MAX_GROUP:
        return f"head_tile below {MAX_GROUP} would refuse the supported H/G = {MAX_GROUP}; above {MAX_GROUP} wastes MMA columns"
    d, ht, ns = spec["dim"], t["head_tile"], t["num_stages"]
    # As the program lays it out (its generated CUDA agrees): Q, the K and V rings (O goes through
    # the first K stage), P, and the max and sum reductions' scratch (never merged: the program's
    # PASS_CONFIGS); static: the compacted block list, its count and the four mbarriers per stage.
    smem = itemsize(spec["dtype"]) * (ht * d + ns * 2 * TILE_KEYS * d + TILE_KEYS * ht) + 2 * reduction_scratch(t["threads"], ht)
    smem += MAX_SLOTS * 4 + 4 + 4 * ns * 8
    if t["min_blocks"] * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        return f"{t['min_blocks']} CTAs of {smem} B shared memory do not fit in one SM"
    # A producer warpgroup runs beside the consumer: 2 x threads per CTA share the SM's registers.
    cap = min(MAX_REGS, REGS_PER_SM // (2 * t["threads"] * t["min_blocks"]))
    # acc, S, row sums (FP32), P (16-bit)
    regs = (d * ht + TILE_KEYS * ht * 2) // t["threads"] + TILE_KEYS * ht // 2 // t["threads"]
    if regs + SPARE_REGS > cap:
        return f"{t['min_blocks']} CTAs per SM cap registers at {cap} per thread, below {regs} + {SPARE_REGS}"
    return None


STAGE = Stage(
    "nsa_selection", "mate.nsa.kernels.selection", "nsa_selection_fwd",
    space=dict(head_tile=(MAX_GROUP,), threads=(128,), num_stages=(1, 2, 3, 4), min_blocks=(1, 2, 3, 4)),
    keys=("dtype", "dim", "block_size"),
    limits=_limits,
    pass_configs="PASS_CONFIGS",
    # B 1, `seq` queries and keys, `selected` blocks a row (the backward's cards time the same shapes)
    shapes=dict(quick=[dict(seq=8192, heads=128, kv_heads=8, selected=16)],
                full=[dict(seq=32768, heads=128, kv_heads=8, selected=16), dict(seq=32768, heads=64, kv_heads=4, selected=16)]),
    workload="nsa_selection_workload",
    tol=1e-2,
)
