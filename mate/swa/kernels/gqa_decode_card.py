"""Stage card of GQA split-KV attention over a paged cache (mate.swa.kernels.gqa_decode).

Importable without TileLang. The resource model follows the program's buffers: the packed
query tile, the K and V rings (`num_stages` deep, filled by TMA boxes or cp.async), the key tiles' page ids
and slots and the rows' metadata in shared memory; S, P and O in the registers of one warpgroup per 64
packed rows.
"""

from mate._hopper import MAX_REGS, warpgroups
from mate._stage import Stage
from mate.swa.kernels.gqa_card import tile_limits

SPARE_REGS = 40  # addresses, page ids and loop state beside the accumulators


def _limits(spec, t):
    # One warpgroup per 64 rows and no producer: every thread may hold MAX_REGS registers. Beside the rings, the
    # page ids and slots of num_stages + 1 key tiles and three int32 per packed row.
    ids = 4 * (2 * (t["num_stages"] + 1) * t["block_n"] + 3 * t["block_m"])
    return warpgroups(t["threads"], t["block_m"], "block_m") or tile_limits(spec, t, MAX_REGS, SPARE_REGS, ids)


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
)
