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
# The shared program (selection_shared.py, tile parameter `queries` = W > 1): the CTA widths it is written for,
# and the slots a query may use there (T above it goes to the one-query program).
SHARED_QUERIES = (2, 4, 8)
SHARED_SLOTS = 16
SHARED_PRODUCER_REGS = 40  # setmaxnreg of the producer warpgroup at 2 or more CTAs an SM


def shared_registers(min_blocks):
    """The shared program's (producer, consumer) setmaxnreg counts at min_blocks CTAs an SM, or None at one CTA
    (then every thread may use 255)."""
    if min_blocks == 1:
        return None
    return SHARED_PRODUCER_REGS, min(256, (REGS_PER_SM // min_blocks // 128 - SHARED_PRODUCER_REGS) // 8 * 8)


def shared_tile_sums(queries):
    """W >= 8 keeps each query's softmax sum per head (reduced every tile: 4 registers a query) rather than per
    thread row (reduced once at the end: 8 registers a query), so that 8 queries fit 255 registers."""
    return queries >= 8


def _shared_limits(spec, t):
    """The shared program (queries = W > 1, selection_shared.py), as its generated CUDA lays it out."""
    W = t["queries"]
    if W not in SHARED_QUERIES:
        return f"queries (W) is 1 (the one-query program) or one of {SHARED_QUERIES}"
    if spec["block_size"] != TILE_KEYS:
        return f"the shared program gathers one block of {TILE_KEYS} keys a tile (block_size {TILE_KEYS})"
    d, ht, ns, cap = spec["dim"], t["head_tile"], t["num_stages"], W * SHARED_SLOTS
    # Q of W queries, the K and V rings, P, the output staging; a max reduction's scratch per query and a sum's
    # per query (never merged: PASS_CONFIGS); static: the union's seven int32 lists, mult [W, cap], barriers.
    smem = itemsize(spec["dtype"]) * (W * ht * d + ns * 2 * TILE_KEYS * d + TILE_KEYS * ht + ht * d)
    smem += 2 * W * reduction_scratch(t["threads"], ht) + 4 * (6 * cap + MAX_SLOTS + 1 + W * cap) + 4 * ns * 8
    if t["min_blocks"] * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        return f"{t['min_blocks']} CTAs of {smem} B shared memory do not fit in one SM"
    nreg = shared_registers(t["min_blocks"])
    cap_regs = MAX_REGS if nreg is None else min(MAX_REGS, nreg[1])
    # per query: O^T, the softmax sums, the running max (FP32); beside them: S, P, m_prev, alpha (and a tile's sums)
    sums = ht // 4 if shared_tile_sums(W) else TILE_KEYS * ht // t["threads"]
    per_query = d * ht // t["threads"] + sums + ht // 4
    regs = W * per_query + TILE_KEYS * ht // t["threads"] + TILE_KEYS * ht // 2 // t["threads"] + 3 * ht // 4
    if regs + SPARE_REGS > cap_regs:
        return f"{t['min_blocks']} CTAs per SM cap registers at {cap_regs} per thread, below {regs} + {SPARE_REGS} (W = {W})"
    return None


def _limits(spec, t):
    if t.get("queries", 1) > 1:
        if t["threads"] != WARPGROUP or t["head_tile"] != MAX_GROUP:
            return f"the shared program runs one consumer warpgroup (threads=128) on head_tile {MAX_GROUP}"
        return _shared_limits(spec, t)
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
    # queries: W consecutive queries a CTA, 1 the one-query program (selection.py), above 1 the shared one
    # (selection_shared.py; a draft not yet run on a GPU: no shipped entry names it)
    space=dict(head_tile=(MAX_GROUP,), threads=(128,), num_stages=(1, 2, 3, 4), min_blocks=(1, 2, 3, 4), queries=(1,) + SHARED_QUERIES),
    defaults=dict(queries=1),
    keys=("dtype", "dim", "block_size"),
    limits=_limits,
    pass_configs="PASS_CONFIGS",
    # B 1, `seq` queries and keys, `selected` blocks a row (the backward's cards time the same shapes)
    shapes=dict(quick=[dict(seq=8192, heads=128, kv_heads=8, selected=16)],
                full=[dict(seq=32768, heads=128, kv_heads=8, selected=16), dict(seq=32768, heads=64, kv_heads=4, selected=16)]),
    workload="nsa_selection_workload",
    tol=1e-2,
)
