"""Stage cards of QSA sparse core attention and its SplitKV merge (mate.qsa.kernels.sparse).

Importable without TileLang. The program imports the constants below, so its
buffers and the resource model are computed from the same numbers.
"""

from mate._stage import Stage
from mate._hopper import FP8_KV, MAX_CLUSTER, MAX_GROUP, SMEM_PER_CTA, WARPGROUP, itemsize, reduction_scratch

TILE = 64  # tokens per tile: wgmma's M per warpgroup
DIM = 256
DECODE_TILES = 8  # tiles whose tokens the producer decodes in one go
CONSUMER_THREADS = WARPGROUP  # one consumer warpgroup, beside the producer one
CANONICAL_GEOMETRY = (24, 2, 256)  # Hq, Hkv, D: the geometry of warp_specialized, the tuner and the benchmarks
# The tuner's serving shape, both families' quick shape and the first of their full ones (tuning.workloads): decode
# rows of `batch` requests, `context` tokens each, `width` selected tokens a row.
SERVING_SHAPE = dict(batch=256, context=32768, width=2051)


def attention_smem(spec: dict, t: dict) -> int:
    """Shared memory of one CTA in bytes, as the program lays it out (the generated CUDA agrees, 16-byte
    alignment of the static buffers aside): Q and P tiles, the K/V ring, the max and sum reductions'
    scratch (never merged: PASS_CONFIGS), the split kernel's [heads, DIM] FP32 output staging; static: the ring's token-valid flags, the decoded token
    lists (page and slot), two counts, a full and an empty mbarrier for K and for V per stage."""
    ht, ns = t["head_tile"], t["num_stages"]
    smem = itemsize(spec["dtype"]) * (ht * DIM + 2 * ns * TILE * DIM + TILE * ht) + 2 * reduction_scratch(CONSUMER_THREADS, ht)
    smem += 4 * ht * DIM if spec.get("split") else 0  # the split kernel's FP32 output staging (_store_partial)
    return smem + ns * TILE * 4 + 2 * DECODE_TILES * TILE * 4 + 2 * 4 + 4 * ns * 8


def _attention_limits(spec, t):
    if t["producers"] % WARPGROUP or (DECODE_TILES * TILE) % t["producers"]:
        return f"producers {t['producers']} must be whole warpgroups dividing a chunk's {DECODE_TILES * TILE} token slots"
    if t["head_tile"] < MAX_GROUP or t["head_tile"] % 8:
        return f"head_tile {t['head_tile']} must be a multiple of 8 (wgmma N) holding a group of up to {MAX_GROUP} heads"
    if (smem := attention_smem(spec, t)) > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    return None


ATTENTION = Stage(
    "qsa_attention", "mate.qsa.kernels.sparse", "sparse_attention",
    # producers: threads that gather (one or two warpgroups before the consumer's): the H200 issues a
    # CTA's cp.async faster from eight warps than from four (benchmarks/experiments/gather_probe.py)
    space=dict(head_tile=(MAX_GROUP,), num_stages=(1, 2, 3), producers=(128, 256)),
    # wide: the grid has at least two CTAs per SM (a shallow ring lets two share one)
    keys=("dtype", "split", "wide"),
    limits=_attention_limits,
    pass_configs="PASS_CONFIGS",
    # batch 256: 512 CTAs (wide); the narrow keys run batch 16 (32 CTAs, 128 with 4 splits)
    shapes=dict(quick=[SERVING_SHAPE], full=[SERVING_SHAPE, dict(batch=128, context=16384, width=2051)]),
    workload="qsa_attention_workload",
    tol=1e-2,
    # the split kernel as a cluster launch of each size (mate.qsa.attention.cluster_splits): the narrow grids only
    variants=lambda spec: [{"cluster": c} for c in range(2, MAX_CLUSTER + 1)] if spec["split"] and not spec["wide"] else [],
)

WARP = 32
WARP_HEADS = 16  # the small-CTA program's MMA M: a group of up to 16 heads, zero-padded


def warp_attention_smem(spec: dict, t: dict, kv_dtype: str | None = None) -> int:
    """Shared memory of one small-CTA program (mate.qsa.kernels.sparse_warp): the Q tile, the K/V ring, two
    decoded chunks' K and V row offsets (int32), two counts and TileLang's 1 KB of static reduction scratch
    (ptxas: 3072 bytes of static shared memory beside the dynamic Q tile and ring). kv_dtype, an FP8 cache's:
    the ring holds it, and a K and a V FP16 tile beside it take the upcast. With several warps a tile (the
    program's `warps`, not a config key), P goes through a shared tile."""
    bn, ns, es = t["block_n"], t["num_stages"], itemsize(spec["dtype"])
    ring = 2 * ns * bn * DIM * es if kv_dtype is None else 2 * ns * bn * DIM * itemsize(kv_dtype) + 2 * bn * DIM * es
    p_tile = WARP_HEADS * bn * es if t.get("warps", 1) > 1 else 0
    return es * WARP_HEADS * DIM + ring + p_tile + 2 * 2 * WARP_CHUNK * 4 + 1024


WARP_CHUNK = 128  # token slots the small-CTA program decodes at a time (mate.qsa.kernels.sparse_warp.CHUNK)


def _warp_limits(spec, t):
    if t["block_n"] % 16 or WARP_CHUNK % t["block_n"]:
        return f"block_n {t['block_n']} must be a multiple of 16 (the PV MMA's k) dividing {WARP_CHUNK}"
    if t["num_stages"] - 1 > WARP_CHUNK // t["block_n"]:
        return f"num_stages {t['num_stages']}: a decoded chunk's lists must outlive the ring ({WARP_CHUNK // t['block_n']} tiles a chunk)"
    if (w := t.get("warps", 1)) > 1 and (WARP_CHUNK % (WARP * w) or t["block_n"] % (WARP * w // 8) or t["block_n"] // w < 8):
        return f"warps {w} at block_n {t['block_n']}: a chunk a whole number of slots a thread, whole gather rounds, 8 tokens a warp"
    if t["num_stages"] < 2:
        return f"num_stages {t['num_stages']}: the ring needs 2 stages or more (one gathers while one is read)"
    # an entry's tiles serve its FP8 variants too (the upcast tiles make theirs the larger at one byte an element)
    if (smem := max(warp_attention_smem(spec, t, kv) for kv in (None, *FP8_KV))) > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    return None


# The small-CTA family: one warp per (row, KV head, split), heads as the mma.sync M (mate.qsa.kernels.sparse_warp).
WARP_ATTENTION = Stage(
    "qsa_attention_warp", "mate.qsa.kernels.sparse_warp", "sparse_attention_warp",
    # H200, issue 37's inputs: 64-token tiles (one CTA an SM) and 4-stage rings were slower at every shape
    # (benchmarks/results/NVIDIA_H200-2026-12-04-qsa-small-cta.md)
    space=dict(block_n=(16, 32), num_stages=(2, 3)),
    keys=("dtype", "split"),
    limits=_warp_limits,
    pass_configs="PASS_CONFIGS",
    shapes=dict(quick=[SERVING_SHAPE], full=[SERVING_SHAPE, dict(batch=64, context=32768, width=2051)]),
    workload="qsa_attention_warp_workload",
    tol=1e-2,
    # FP8 K/V caches (issue 38): a compile-time option on the entry's tiles; every FP8 call runs this family
    variants=lambda spec: [{"kv_dtype": kv} for kv in FP8_KV],
)

MERGE = Stage(
    "qsa_merge", "mate.qsa.kernels.sparse", "merge",
    space=dict(threads=(64, 128, 256)),
    keys=("pdtype", "odtype"),
    limits=lambda spec, t: None,  # no shared memory, few registers: every thread count of the space fits
    shapes=dict(quick=[dict(splits=8, rows=64)], full=[dict(splits=8, rows=64), dict(splits=16, rows=8)]),
    workload="qsa_merge_workload",
    tol=1e-2,
)
