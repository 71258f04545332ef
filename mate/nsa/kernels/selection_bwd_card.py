"""Stage cards of the NSA selection attention backward (mate.nsa.kernels.selection_bwd).

Importable without TileLang. The programs import the constants below (and the
forward card's), so their buffers and these resource models are computed from
the same numbers.
"""

from mate._stage import Stage
from mate._hopper import MAX_GROUP, MAX_REGS, REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, WARPGROUP, itemsize
from mate.nsa.kernels.selection_card import MAX_SLOTS, SPARE_REGS, STAGE, TILE_KEYS


# At 2 CTAs per SM the dk/dv program's producer warpgroup lowers its registers to PRODUCER_REGS and the
# consumer raises its own to CONSUMER_REGS (setmaxnreg): per SM 2 x 128 x (40 + 216) = all 65536.
PRODUCER_REGS = 40
CONSUMER_REGS = 216


def _fits(t, smem: int, regs: int, cta_threads: int, cap: int | None = None) -> str | None:
    """Whether min_blocks CTAs of `smem` bytes and `cta_threads` threads of `regs` registers (beside SPARE_REGS)
    share an SM; `cap`: the registers a thread may hold, when the program sets them itself."""
    if t["min_blocks"] * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        return f"{t['min_blocks']} CTAs of {smem} B shared memory do not fit in one SM"
    cap = cap or min(MAX_REGS, REGS_PER_SM // (cta_threads * t["min_blocks"]))
    if regs + SPARE_REGS > cap:
        return f"{t['min_blocks']} CTAs per SM cap registers at {cap} per thread, below {regs} + {SPARE_REGS}"
    return None


def _common(t) -> str | None:
    if t["threads"] != WARPGROUP:
        return "the kernel's MMA tiles are sized for one warpgroup (threads=128)"
    if t["head_tile"] != MAX_GROUP:
        return f"head_tile below {MAX_GROUP} would refuse the supported H/G = {MAX_GROUP}; above {MAX_GROUP} wastes MMA columns"
    return None


def _dq_limits(spec, t):
    why = _common(t)
    if why:
        return why
    d, ht, ns, es = spec["dim"], t["head_tile"], t["num_stages"], itemsize(spec["dtype"])
    # Q and dO, the K and V rings, dS (input dtype); per head the LSE (log2) and delta, and the delta
    # reduction's scratch (FP32); static: the compacted block list, its count and four mbarriers per stage.
    smem = es * (2 * ht * d + ns * 2 * TILE_KEYS * d + TILE_KEYS * ht) + 4 * (2 * ht + t["threads"]) + MAX_SLOTS * 4 + 4 + 4 * ns * 8
    # dq^T, S, dP (FP32), dS (16-bit), the O.dO products of the delta pre-pass (FP32); a producer warpgroup
    # runs beside the consumer.
    regs = (d * ht + 2 * TILE_KEYS * ht + ht * d) // t["threads"] + TILE_KEYS * ht // 2 // t["threads"]
    return _fits(t, smem, regs, 2 * t["threads"])


def _dkv_limits(spec, t):
    why = _common(t)
    if why:
        return why
    d, cols, ns, es = spec["dim"], t["head_tile"] * t["queries"], t["num_stages"], itemsize(spec["dtype"])
    if cols % 32:
        return "the producer warp's lanes take a step's head_tile x queries columns 32 at a time"
    # The K and V tile, a ring of Q and dO of `queries` entries, P and dS (input dtype); per stage and
    # column the LSE (log2), delta and the query's last visible key row; two mbarriers per stage.
    smem = es * (2 * TILE_KEYS * d + ns * 2 * cols * d + 2 * TILE_KEYS * cols) + ns * 12 * cols + ns * 2 * 8
    # dK, dV, S, dP (FP32), P and dS (16-bit), in the consumer; a producer warpgroup beside it, which at
    # 2 CTAs per SM gives it registers.
    regs = (2 * TILE_KEYS * d + 2 * TILE_KEYS * cols) // t["threads"] + TILE_KEYS * cols // t["threads"]
    return _fits(t, smem, regs, 2 * t["threads"], CONSUMER_REGS if t["min_blocks"] == 2 else None)


DQ = Stage(
    "nsa_selection_bwd_dq", "mate.nsa.kernels.selection_bwd", "nsa_selection_bwd_dq",
    space=dict(head_tile=(MAX_GROUP,), threads=(128,), num_stages=(1, 2, 3), min_blocks=(1, 2, 3, 4, 5)),
    keys=("dtype", "dim", "block_size"),
    limits=_dq_limits,
    pass_configs="PASS_CONFIGS",
    shapes=STAGE.shapes,  # the forward's
    workload="nsa_selection_bwd_dq_workload",
    tol=1e-2,
)
DKV = Stage(
    "nsa_selection_bwd_dkv", "mate.nsa.kernels.selection_bwd", "nsa_selection_bwd_dkv",
    space=dict(head_tile=(MAX_GROUP,), threads=(128,), queries=(2, 4), num_stages=(1, 2, 3, 4), min_blocks=(1, 2)),
    keys=("dtype", "dim", "block_size"),
    limits=_dkv_limits,
    pass_configs="PASS_CONFIGS",
    shapes=STAGE.shapes,
    workload="nsa_selection_bwd_dkv_workload",
    tol=1e-2,
)
