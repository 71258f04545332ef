"""Stage cards of QSA selection (mate.qsa.kernels.topk): `qsa_topk` (top-k block ids of each row's scores, with
the token expansion fused on request) and `qsa_expand` (the expansion of given block ids alone).

Importable without TileLang. The programs import the constants below, and the resource model follows their
buffers: the radix histogram, the sort buffer of (key, id) pairs, the per-warp ballot counts and, where a
row's keys do not fit in registers, the keys in shared memory.
"""

from mate._stage import Stage
from mate._hopper import SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, THREADS_PER_SM

MAX_K = 2048  # the largest k: the sort buffer's size
RADIX_BITS = 11  # digit of one radix round: three rounds cover any 32-bit key range
BINS = 1 << RADIX_BITS
ROUNDS = 3
WARP = 32
# Key buckets: a row of up to `max_keys` scores is one CTA's; its keys stay in registers while a thread holds
# at most REG_KEYS of them, else in shared memory (49152 x 4 B = 192 KB, beside the 25 KB of the rest).
KEY_BUCKETS = (8192, 16384, 32768, 49152)
REG_KEYS = 16


def keys_in_registers(max_keys: int, threads: int) -> bool:
    return max_keys // threads <= REG_KEYS


def topk_smem(spec: dict, t: dict) -> int:
    """Shared memory of one qsa_topk CTA in bytes: the sort buffer (8-byte pairs), which the radix rounds'
    histogram, per-warp partials and answer overlay (TileLang merges them, a barrier apart), the ballot counts
    (one a warp and key group) and the keys where not in registers."""
    mk, threads = spec["max_keys"], t["threads"]
    rounds = 4 * BINS + 4 * 4 * (threads // WARP) + 4 * 4
    smem = max(8 * MAX_K, rounds) + 4 * (mk // WARP)
    return smem + (0 if keys_in_registers(mk, threads) else 4 * mk)


def _topk_limits(spec, t):
    mk, threads = spec["max_keys"], t["threads"]
    if mk % threads or BINS % threads:
        return f"threads {threads} must divide max_keys {mk} and the {BINS} bins"
    if (mk // WARP) % WARP:
        return f"max_keys {mk} must give each lane of one warp whole ballot counts to scan"
    if (smem := topk_smem(spec, t)) > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    blocks = t["min_blocks"]
    if blocks * threads > THREADS_PER_SM:
        return f"{blocks} CTAs of {threads} threads > {THREADS_PER_SM} per multiprocessor"
    if blocks * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        return f"{blocks} CTAs of {smem} B shared memory > {SMEM_PER_SM} per multiprocessor"
    return None


TOPK = Stage(
    "qsa_topk", "mate.qsa.kernels.topk", "topk",
    # min_blocks: CTAs a multiprocessor must hold (ptxas fits the registers to it)
    space=dict(threads=(256, 512, 1024), min_blocks=(1, 2, 4, 8)),
    # max_keys: the smallest bucket that holds the row; wide: more rows than multiprocessors (mate.qsa.selection)
    keys=("max_keys", "wide"),
    limits=_topk_limits,
    pass_configs="PASS_CONFIGS",
    shapes=dict(quick=[dict(rows=256, keys=8192, k=512)],
                full=[dict(rows=1, keys=8192, k=512), dict(rows=64, keys=8192, k=512), dict(rows=4096, keys=8192, k=512),
                      dict(rows=64, keys=32768, k=2048)]),
    workload="qsa_topk_workload",
    tol=1e-9,  # exact: one wrong id is an error of at least 1 / |ids|, above 1e-9 at any timed shape
)

EXPAND = Stage(
    "qsa_expand", "mate.qsa.kernels.topk", "expand",
    space=dict(threads=(128, 256, 512)),
    # index tensors are int32 (SPEC): one specialization
    keys=("dtype",),
    limits=lambda spec, t: None,  # no shared memory, a few registers
    pass_configs="PASS_CONFIGS",
    shapes=dict(quick=[dict(rows=256, k=512)], full=[dict(rows=64, k=512), dict(rows=4096, k=512)]),
    workload="qsa_expand_workload",
    tol=1e-9,  # exact: one wrong id is an error of at least 1 / |ids|, above 1e-9 at any timed shape
)
