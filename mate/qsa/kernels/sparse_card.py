"""Stage cards of QSA sparse core attention and its SplitKV merge (mate.qsa.kernels.sparse).

Importable without TileLang. The program imports the constants below, so its
buffers and the resource model are computed from the same numbers.
"""

from mate import _dispatch
from mate._hopper import SMEM_PER_CTA, itemsize

TILE = 64  # tokens per tile: wgmma's M per warpgroup
DIM = 256
MAX_GROUP = 16  # query heads per KV head: head_tile pads the group to the wgmma N
DECODE_TILES = 8  # tiles whose tokens the producer decodes in one go
CANONICAL_GEOMETRY = (24, 2, 256)  # Hq, Hkv, D: the geometry of warp_specialized, the tuner and the benchmarks


def _attention_limits(spec, t):
    ht, ns = t["head_tile"], t["num_stages"]
    if ht < MAX_GROUP or ht % 8:
        return f"head_tile {ht} must be a multiple of 8 (wgmma N) holding a group of up to {MAX_GROUP} heads"
    # Q and P tiles, the K/V ring, reduction workspaces; token lists, flags and barriers are static (about 5 KB).
    smem = itemsize(spec["dtype"]) * (ht * DIM + 2 * ns * TILE * DIM + TILE * ht)
    smem += 4096 + 5 * 1024
    if smem > SMEM_PER_CTA:
        return f"shared memory {smem} B > {SMEM_PER_CTA}"
    return None


ATTENTION = _dispatch.Stage(
    "qsa_attention", "mate.qsa.kernels.sparse", "sparse_attention",
    space=dict(head_tile=(16,), num_stages=(1, 2, 3)),
    # wide: the grid has at least two CTAs per SM (a shallow ring lets two share one)
    keys=("dtype", "split", "wide"),
    limits=_attention_limits,
    pass_configs="PASS_CONFIGS",
)

MERGE = _dispatch.Stage(
    "qsa_merge", "mate.qsa.kernels.sparse", "merge",
    space=dict(threads=(64, 128, 256)),
    keys=("pdtype", "odtype"),
    limits=lambda spec, t: None,  # one CTA per (row, head): every thread count of the space fits
)
