"""Stage cards of QSA selection (mate.qsa.kernels.topk): `qsa_topk` (top-k block ids of each row's scores, with
the token expansion fused on request) and `qsa_expand` (the expansion of given block ids alone).

Importable without TileLang. The programs import the constants below, and the resource model follows their
buffers: the arena of the radix histogram and the sort's exchange buffers of (key, id) pairs, the per-warp
partials, the ballot counts and, where a row's keys do not fit in registers, the keys in shared memory.
"""

from mate._stage import Stage
from mate._hopper import SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, THREADS_PER_SM

MAX_K = 2048  # the largest k, and the largest sort (pairs)
RADIX_BITS = 11  # digit of one radix round: three rounds cover any 32-bit key range
BINS = 1 << RADIX_BITS
ROUNDS = 3
# The sorted order by one more 11-bit digit where no bin of it holds more than this many selected keys (else a
# bitonic sort): a pair's rank in its bin takes a comparison with each of the bin's pairs
ORDER_BIN_MAX = 32
WARP = 32
# Key buckets: a row of up to `max_keys` scores is one CTA's; its keys stay in registers while a thread holds
# at most REG_KEYS of them, else in shared memory (49152 x 4 B = 192 KB, beside the 25 KB of the rest).
KEY_BUCKETS = (8192, 16384, 32768, 49152)
REG_KEYS = 16


KPOWS = tuple(1 << b for b in range(5, 12))  # k rounded up to a power of two, at least a warp: the program's kpow


def keys_in_registers(max_keys: int, threads: int) -> bool:
    return max_keys // threads <= REG_KEYS


def kpow_of(k: int) -> int:
    return max(WARP, 1 << (k - 1).bit_length())


def sort_size(kpow: int, sort_mult: int) -> int:
    """Pairs the bitonic sort orders: k's power of two times `sort_mult` (1 or 2), at most MAX_K (a larger sort
    takes the threshold bin whole sooner, in fewer radix rounds, but has more stages)."""
    return max(kpow, min(kpow * sort_mult, MAX_K))


def _smem(max_keys: int, threads: int, n_sort: int, ring: int) -> int:
    """The arena of the sort's exchange buffers (8-byte pairs) and the radix histogram, then the rounds'
    per-warp partials and answer, the ballot counts (one a warp and key group) and the keys where not in
    registers (an upper bound: TileLang may overlay the partials with the counts)."""
    arena = max(8 * ring * n_sort, 4 * BINS)
    smem = arena + 4 * 4 * (threads // WARP) + 4 * 4 + 4 * (max_keys // WARP)
    # the keys in shared memory, or, where they are in registers, the ordering's own pairs and bins (in shared
    # memory the dead keys hold those)
    return smem + (8 * n_sort + 4 * BINS if keys_in_registers(max_keys, threads) else 4 * max_keys)


def exchange_buffers(max_keys: int, threads: int, min_blocks: int, n_sort: int) -> int:
    """Shared buffers of the sort's wide stages: two (one barrier a stage) where they fit a CTA and `min_blocks`
    CTAs fit a multiprocessor, else one (two barriers a stage)."""
    smem = _smem(max_keys, threads, n_sort, 2)
    return 2 if smem <= SMEM_PER_CTA and min_blocks * (smem + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM else 1


def topk_smem(spec: dict, t: dict) -> int:
    """Shared memory of one qsa_topk CTA in bytes at the largest sort (k 2048)."""
    mk, threads = spec["max_keys"], t["threads"]
    return _smem(mk, threads, MAX_K, exchange_buffers(mk, threads, t["min_blocks"], MAX_K))


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
    space=dict(threads=(256, 512, 1024), min_blocks=(1, 2, 4, 8), sort_mult=(1, 2)),
    # max_keys: the smallest bucket that holds the row; wide: more rows than multiprocessors (mate.qsa.selection)
    keys=("max_keys", "wide"),
    limits=_topk_limits,
    pass_configs="PASS_CONFIGS",
    shapes=dict(quick=[dict(rows=256, keys=8192, k=512)],
                full=[dict(rows=1, keys=8192, k=512), dict(rows=64, keys=8192, k=512), dict(rows=4096, keys=8192, k=512),
                      dict(rows=64, keys=32768, k=2048)]),
    workload="qsa_topk_workload",
    tol=1e-9,  # exact: one wrong id is an error of at least 1 / |ids|, above 1e-9 at any timed shape
    # kpow: k rounded up to a power of two (mate.qsa.selection), the sort's size; 512 is the program's default
    variants=lambda spec: [{"kpow": p} for p in KPOWS if p != 512],
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
