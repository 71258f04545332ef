"""Hopper (sm_90a) resource limits that the stage cards' resource models check a tile candidate against."""

import torch

SMEM_PER_CTA = 227 * 1024  # the opt-in maximum of one block's shared memory
SMEM_PER_SM = 228 * 1024  # one multiprocessor's, of which 1 KB per resident block is reserved
SMEM_RESERVED_PER_CTA = 1024
REGS_PER_SM = 65536
MAX_REGS = 255
WARPGROUP = 128  # wgmma is issued by warpgroups of 128 threads, each owning 64 rows of M
WGMMA_M = 64
# Query heads per KV group in the kernels that hold a group as wgmma's N (QSA sparse attention, NSA selection
# forward and backward: a group is too few rows for M = 64, so keys are M): the group is zero-padded to
# head_tile = 16 columns (N comes in multiples of 8), the one head_tile their search spaces hold.
MAX_GROUP = 16


def itemsize(dtype: str) -> int:
    """Bytes of one element of a config key's dtype name (`bfloat16`, `float32`, ...)."""
    return getattr(torch, dtype).itemsize


def warpgroups(threads: int, rows: int, what: str) -> str | None:
    """Why `threads` cannot split `rows` into whole 64-row wgmma tiles per warpgroup, or None."""
    if threads % WARPGROUP:
        return f"threads {threads} is not whole warpgroups (wgmma)"
    if rows % (WGMMA_M * (threads // WARPGROUP)):
        return f"{what} {rows} does not give each of {threads // WARPGROUP} warpgroups whole 64-row wgmma tiles"
    return None


def reduction_scratch(threads: int, columns: int) -> int:
    """Bytes of shared memory one TileLang cross-warp reduction over a [64, columns] FP32 fragment takes
    (threads x columns/4 floats; the programs that disable TileLang's buffer merging keep each one)."""
    return threads * (columns // 4) * 4
