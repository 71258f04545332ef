"""QSA selection: the top-k blocks of the indexer's scores and their token expansion, the step between the
MQA indexer and sparse attention.

- `qsa_topk_blocks(scores, k)`: int32 [rows, k], the ids of each row's k largest scores in descending order
  (ties to the lower id), so a prefix of a row is its top-k' for any k' <= k. NaN and -inf are never
  selected: -1 fills the slots past a row's selectable scores. +inf is a score like any other (the
  largest); -0 and +0 tie.
- `qsa_expand_blocks(block_indices, query_positions)`: int32 [rows, block_size * k + block_size - 1], each
  block j's tokens block_size*j .. block_size*j + block_size - 1 (-1 for a negative id), then the tokens of
  the row's incomplete block, those past its last complete block up to its position (-1 where absent). The
  result and `block_indices` are qsa_sparse_attention's `token_indices` and its `block_indices` hint.
- `qsa_topk_tokens(scores, k, query_positions)`: both in one kernel, (block_indices, token_indices).

Natively one CTA selects a row (mate/qsa/kernels/topk.py): no host sync, the same bits every run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mate import _checks as C
from mate import _dispatch
from mate.qsa import reference
from mate.qsa.kernels.topk_card import KEY_BUCKETS, MAX_K, kpow_of

TOPK = _dispatch.STAGES["qsa_topk"]
EXPAND = _dispatch.STAGES["qsa_expand"]


def qsa_topk_blocks(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None, backend: str = "tilelang") -> torch.Tensor:
    """Top-k block ids of each row: int32 [rows, k] (`out` when given, written in place).

    scores: FP32 [rows, keys] (the indexer's output; any strides). k: 1 <= k <= min(keys, 2048). Ids by
    score descending, ties to the lower id; NaN and -inf never selected, -1 past a row's selectable
    scores. Native: rows of up to 49152 keys.
    """
    p = _resolve(scores, k, None, 4, out, backend, tokens=False)
    return _reference(p)[0] if p.backend == "reference" else _native(p)[0]


def qsa_topk_tokens(scores: torch.Tensor, k: int, query_positions: torch.Tensor, *, block_size: int = 4,
                    backend: str = "tilelang") -> tuple[torch.Tensor, torch.Tensor]:
    """qsa_topk_blocks and qsa_expand_blocks in one: (block_indices int32 [rows, k], token_indices int32
    [rows, block_size * k + block_size - 1]); natively one kernel, the ids never leave the chip between.

    query_positions: int32 [rows], each row's position (its incomplete tail block's last token).
    """
    p = _resolve(scores, k, query_positions, block_size, None, backend, tokens=True)
    return _reference(p) if p.backend == "reference" else _native(p)


def qsa_expand_blocks(block_indices: torch.Tensor, query_positions: torch.Tensor, *, block_size: int = 4,
                      out: torch.Tensor | None = None, backend: str = "tilelang") -> torch.Tensor:
    """Token ids of selected blocks: int32 [rows, block_size * k + block_size - 1] (`out` when given).

    block_indices: int32 [rows, k] (any strides; negative ids expand to -1); query_positions: int32 [rows].
    Block j gives tokens block_size*j + 0 .. block_size - 1 in order, then come the row's incomplete
    block's tokens (past its last complete block, up to its position; -1 where absent). int32 arithmetic:
    ids up to (2**31 - 1) // block_size.
    """
    backend = _dispatch.backend(backend)
    C.int32("block_indices", block_indices, ndim=2)
    rows, k = block_indices.shape
    C.int32("query_positions", query_positions, shape=(rows,))
    block_size = C.positive_int("block_size", block_size)
    width = _width(k, block_size)
    if out is not None:
        C.out_buffer("out", out, shape=(rows, width), dtype=torch.int32, device=block_indices.device)
    C.same_device(block_indices=block_indices, query_positions=query_positions, out=out)
    C.no_overlap({"out": out}, {"block_indices": block_indices, "query_positions": query_positions})
    if backend == "reference":
        res = reference.expand_blocks(block_indices, query_positions, block_size)
        return res if out is None else out.copy_(res)
    target = _dispatch.target_of(block_indices, "block_indices")
    tokens = torch.empty(rows, width, dtype=torch.int32, device=block_indices.device) if out is None else out
    if tokens.numel():
        _dispatch.kernel(EXPAND.name, {"dtype": "int32"}, target)(block_indices, query_positions, tokens, block_size)
    return tokens


def check_selection(k, keys: int, rows: int, query_positions, block_size, expand: bool, *, name: str, what: str) -> int:
    """The checks of a top-k of `keys` scores a row, and with `expand` of its expansion (query_positions and
    block_size); the block size, as an int."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name} must be an int, got {type(k).__name__}")
    if not 1 <= k <= min(keys, MAX_K):
        raise ValueError(f"{name} must be in [1, min(keys, {MAX_K})] = [1, {min(keys, MAX_K)}] for {what} with {keys} keys, got {k}")
    if not expand:
        return block_size
    C.int32("query_positions", query_positions, shape=(rows,))
    block_size = C.positive_int("block_size", block_size)
    _width(k, block_size)
    return block_size


def _width(k: int, block_size: int) -> int:
    width = block_size * k + block_size - 1
    if width > 2**31 - 1:
        raise ValueError(f"block_size * k + block_size - 1 = {width} token slots a row exceed int32")
    return width


class SelectProblem(NamedTuple):
    """One top-k call, resolved and checked; query_positions set when the tokens are asked for too, spec and
    target for backend='tilelang' only."""

    backend: str
    scores: torch.Tensor
    k: int
    query_positions: torch.Tensor | None
    block_size: int
    out: torch.Tensor | None
    spec: dict | None
    target: str | None


def _resolve(scores, k, query_positions, block_size, out, backend, *, tokens: bool) -> SelectProblem:
    """Every check of the top-k entrypoints, in one order: scores, k, positions, the output buffer, devices and
    overlap, the native limits."""
    backend = _dispatch.backend(backend)
    C.tensor("scores", scores, ndim=2)
    C.floating("scores", scores)
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 (the indexer's scores), got {scores.dtype}")
    rows, keys = scores.shape
    block_size = check_selection(k, keys, rows, query_positions, block_size, tokens, name="k", what="scores")
    if out is not None:
        C.out_buffer("out", out, shape=(rows, k), dtype=torch.int32, device=scores.device)
    C.same_device(scores=scores, query_positions=query_positions, out=out)
    C.no_overlap({"out": out}, {"scores": scores, "query_positions": query_positions})
    spec = target = None
    if backend == "tilelang":
        target = _dispatch.target_of(scores, "scores")
        spec = topk_spec(rows, keys, scores.device)
    return SelectProblem(backend, scores, k, query_positions, block_size, out, spec, target)


def topk_spec(rows: int, keys: int, device: torch.device) -> dict:
    """The qsa_topk specialization of a call: the smallest key bucket that holds a row, and whether there are
    more rows than multiprocessors (wide: then CTAs share one)."""
    bucket = next((b for b in KEY_BUCKETS if keys <= b), None)
    if bucket is None:
        raise ValueError(
            f"backend='tilelang' selects from rows of up to {KEY_BUCKETS[-1]} keys, got scores with {keys}; use backend='reference'"
        )
    return {"max_keys": bucket, "wide": int(rows > _dispatch.sm_count(device))}


def tokens_native(scores: torch.Tensor, k: int, query_positions: torch.Tensor, block_size: int, spec: dict,
                  target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """qsa_topk_tokens' native path on arguments its caller has checked (check_selection, topk_spec): the selection
    of qsa_mqa_decode(topk=...), which checks once for both of its kernels."""
    return _native(SelectProblem("tilelang", scores, k, query_positions, block_size, None, spec, target))


def _native(p: SelectProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, dev = p.scores.shape[0], p.scores.device
    blocks = torch.empty(rows, p.k, dtype=torch.int32, device=dev) if p.out is None else p.out
    tokens = None
    if p.query_positions is not None:
        tokens = torch.empty(rows, _width(p.k, p.block_size), dtype=torch.int32, device=dev)
    if rows:
        # Without the expansion the kernel reads no position and writes no token: views of the ids stand in
        # for those buffers (no placeholder tensor to keep across calls).
        positions = blocks[:, 0] if tokens is None else p.query_positions
        # the sort's size is compile-time, k rounded up to a power of two: every k of one power shares a kernel
        program = _dispatch.kernel(TOPK.name, p.spec, p.target, kpow=kpow_of(p.k))
        program(p.scores, blocks, positions, blocks if tokens is None else tokens, p.block_size, int(tokens is not None))
    return blocks, tokens


def _reference(p: SelectProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    blocks = reference.topk_blocks(p.scores, p.k)
    if p.out is not None:
        blocks = p.out.copy_(blocks)
    if p.query_positions is None:
        return blocks, None
    return blocks, reference.expand_blocks(blocks, p.query_positions, p.block_size)
