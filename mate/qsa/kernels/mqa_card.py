"""Stage cards of the QSA MQA indexer (mate.qsa.kernels.mqa): `mqa_logits` and `mqa_decode`.

Importable without TileLang: the API and the tuner read these. The programs import
the geometry constants below, and the resource models follow their buffers (Q and K
tiles in shared memory, the score tiles in FP32 registers).
"""

from mate._stage import Stage
from mate._hopper import FP8_KV, MAX_REGS, REGS_PER_SM, SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, WARPGROUP, itemsize, warpgroups

HEADS, DIM = 4, 128  # the indexer's geometry: the programs' `heads` and `dim`
HEADS_MMA = max(8, HEADS)  # the decode MMA's N is at least 8: heads padded with zero rows
LOAD_ELEMS = 8  # 16-bit elements per 16-byte load
PAGE_SIZES = (8, 16, 32, 64)  # decode's page sizes, one specialization each
SPARE_REGS = 64  # registers per thread kept beside the tiles (addresses, indices, loop state)
# mqa_logits' consumer beside its three score fragments: ptxas fit 64 x 128 tiles (192 fragment registers)
# into 232 with a 4-byte spill (CUDA 13.0)
LOGITS_SPARE_REGS = 40
PRODUCER_REGS = 24  # per thread of mqa_logits' TMA warpgroup, which only issues copies


def _logits_limits(spec, t):
    if why := warpgroups(t["threads"], t["block_rows"], "block_rows"):
        return why
    # Q (all heads) and the K ring, plus the rows' lo / hi (int32)
    smem = itemsize(spec["dtype"]) * (HEADS * t["block_rows"] * DIM + t["num_stages"] * t["block_keys"] * DIM) + 2 * t["block_rows"] * 4
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    blocks = t["min_blocks"]
    if blocks * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        return f"{blocks} CTAs of {smem} B shared memory > {SMEM_PER_SM} per multiprocessor"
    # Two heads' products and the sum, FP32, in the consumer's share of the CTA's registers.
    regs = 3 * t["block_rows"] * t["block_keys"] // t["threads"]
    have = consumer_regs(t["threads"], blocks)
    if regs + LOGITS_SPARE_REGS > have:
        return f"{regs} accumulator registers per thread leave too few of {have}"
    return None


def consumer_regs(threads: int, min_blocks: int) -> int:
    """Registers per consumer thread of a mqa_logits CTA: what setmaxnreg can give it from `min_blocks` CTAs'
    share of the register file, after the TMA warpgroup's PRODUCER_REGS (at most 240: TileLang's default)."""
    return min(240, (REGS_PER_SM // min_blocks - WARPGROUP * PRODUCER_REGS) // threads // 8 * 8)


def _decode_limits(spec, t):
    if t["block_keys"] % spec["page_size"]:
        return f"block_keys {t['block_keys']} is not a multiple of page_size {spec['page_size']}"
    if (t["block_keys"] * DIM // LOAD_ELEMS) % t["threads"]:
        return "threads do not split the tile's 16-byte loads evenly"
    if why := warpgroups(t["threads"], t["block_keys"], "block_keys"):
        return why
    nbytes = itemsize(spec["dtype"])
    # Q (padded heads) and the K tile the MMA reads; an FP8 variant (one program of every entry) gathers its tile
    # as FP8 beside that one (1 byte a key element), so an entry is legal only if that fits too
    smem = nbytes * (HEADS_MMA + t["block_keys"]) * DIM + t["block_keys"] * DIM
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B (with the FP8 variant's tile) > {SMEM_PER_CTA}"
    # S (block_keys x padded heads, FP32); the keys go to shared memory by cp.async, not through registers
    regs = t["block_keys"] * HEADS_MMA // t["threads"]
    if regs + SPARE_REGS > MAX_REGS:
        return f"{regs} registers per thread for S leave too few of {MAX_REGS}"
    return None


LOGITS = Stage(
    "mqa_logits", "mate.qsa.kernels.mqa", "mqa_logits",
    space=dict(block_rows=(64, 128), block_keys=(64, 128, 256), threads=(128, 256), num_stages=(1, 2, 3), min_blocks=(1, 2)),
    keys=("dtype", "even_keys"),
    limits=_logits_limits,
    shapes=dict(
        quick=[dict(rows=4096, keys=4096)],
        full=[dict(rows=8192, keys=8192), dict(rows=1024, keys=8192), dict(rows=8192, keys=2048)],
    ),
    workload="mqa_logits_workload",
    tol=1e-4,
)

DECODE = Stage(
    "mqa_decode", "mate.qsa.kernels.mqa", "mqa_decode",
    space=dict(block_keys=(64, 128, 256), threads=(128, 256)),
    keys=("dtype", "page_size"),
    limits=_decode_limits,
    # Batches whose keys (batch x keys x 256 B) exceed the 60 MB L2, so the timing is of HBM reads.
    shapes=dict(quick=[dict(batch=32, keys=8192)], full=[dict(batch=32, keys=8192), dict(batch=128, keys=8192), dict(batch=8, keys=65536)]),
    workload="mqa_decode_workload",
    tol=1e-4,
    # FP8 key caches (issue 38): a compile-time option on the entry's tiles (_decode_limits counts their FP8 tile)
    variants=lambda spec: [{"kv_dtype": kv} for kv in FP8_KV],
)
