"""Opt-in value checks of what the native fast path trusts (issue 18).

The native wrappers never read device memory (no host sync, CUDA-graph capturable), so
they cannot see a wrong value in an index tensor. With `MATE_DEBUG_CHECKS=1` in the
environment, or inside `with mate.debug_checks():`, every entrypoint also checks the
values of its metadata on their device and raises ValueError naming the argument, the
first offending entry and its value:

- token / page / block ids: in [-1, capacity) (the kernels mask the others, but an id
  past the capacity is almost always a bug upstream);
- `block_indices`: the hint agrees with `token_indices` (4 tokens a block, -1 for -1),
  and with `assume_compact_blocks` the valid ids form a prefix of each row;
- `cu_seqlens_q`: nondecreasing, from 0 to the row count; `token_to_req` in
  [-1, num_requests);
- `seq_lens_q` / `seq_lens_k` / `context_lens` / `block_counts`: in [0, capacity].
- a tensor dequant scale of an FP8 cache (`k_scale`, `v_scale`): positive and finite.

Each check costs a few small kernels and one host sync per checked tensor: debug mode is
for development, not for serving, and cannot be captured in a CUDA graph. The reference
backend runs its own content checks (offsets) always; those share `offsets` below.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

ENV = "MATE_DEBUG_CHECKS"
_local = threading.local()


def enabled() -> bool:
    """Whether debug checks run: inside debug_checks(), else MATE_DEBUG_CHECKS=1."""
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced
    return os.environ.get(ENV, "") not in ("", "0")


@contextlib.contextmanager
def debug_checks(enable: bool = True):
    """Turn the debug value checks on (or off, with enable=False) inside the block, for this thread."""
    before = getattr(_local, "forced", None)
    _local.forced = bool(enable)
    try:
        yield
    finally:
        _local.forced = before


def _first(bad: torch.Tensor):
    """Index tuple of the first True entry of bad, or None (one host sync)."""
    if not bool(bad.any()):
        return None
    return tuple(torch.nonzero(bad)[0].tolist())


def _at(idx: tuple) -> str:
    return "[" + ", ".join(map(str, idx)) + "]"


def in_range(name: str, x: torch.Tensor, lo, hi, why: str = "") -> None:
    """Every entry of x in [lo, hi); lo and hi are ints or tensors broadcastable to x."""
    if x.numel() == 0:
        return
    idx = _first((x < lo) | (x >= hi))
    if idx is not None:
        bound = lambda b: b if isinstance(b, int) else int(torch.as_tensor(b).expand(x.shape)[idx])  # noqa: E731
        raise ValueError(f"{name}{_at(idx)} is {int(x[idx])}, expected {bound(lo)} <= value < {bound(hi)}{why}")


def offsets(name: str, cu: torch.Tensor, total: int, *, exact: bool = False) -> None:
    """Cumulative offsets: nondecreasing within [0, total]; with exact, from 0 to total."""
    if cu.numel() == 0:
        return
    lo, hi = int(cu[0]), int(cu[-1])
    step = _first(cu[1:] < cu[:-1])
    if step is not None:
        i = step[0]
        raise ValueError(f"{name} must be nondecreasing offsets, but {name}[{i + 1}] = {int(cu[i + 1])} < {name}[{i}] = {int(cu[i])}")
    if lo < 0 or hi > total:
        raise ValueError(f"{name} must be offsets within [0, {total}] (the row count), got first {lo} and last {hi}")
    if exact and (lo != 0 or hi != total):
        raise ValueError(f"{name} must run from 0 to the row count {total}, got first {lo} and last {hi} (debug checks)")


def block_hint(token_indices: torch.Tensor, block_indices: torch.Tensor, compact: bool) -> None:
    """The block hint expands to the token list's first 4 * nb slots; compact: valid ids are a prefix."""
    nb = block_indices.shape[-1]
    bi = block_indices.long()
    want = torch.where(bi[..., None] >= 0, 4 * bi[..., None] + torch.arange(4, device=bi.device), -1).flatten(-2)
    idx = _first(token_indices[..., : 4 * nb].long() != want)
    if idx is not None:
        blk = idx[:-1] + (idx[-1] // 4,)
        raise ValueError(
            f"block_indices{_at(blk)} = {int(block_indices[blk])} disagrees with token_indices{_at(idx)} = {int(token_indices[idx])} "
            f"(the hint is trusted: block b stands for tokens 4b .. 4b+3, and -1 for four -1)"
        )
    if compact and nb > 1:
        valid = bi >= 0
        idx = _first(valid[..., 1:] & ~valid[..., :-1])
        if idx is not None:
            raise ValueError(
                f"assume_compact_blocks=True but block_indices row {_at(idx[:-1])} has a valid id at slot {idx[-1] + 1} "
                "after a -1 (valid ids must form a prefix)"
            )


def request_rows(rows: int, n_req: int, cu_seqlens_q, token_to_req) -> None:
    """Flattened rows' request metadata."""
    if cu_seqlens_q is not None:
        offsets("cu_seqlens_q", cu_seqlens_q.long(), rows, exact=True)
    if token_to_req is not None:
        in_range("token_to_req", token_to_req, -1, n_req, f" (num_requests = {n_req}; -1 marks a row of no request)")


def lengths(name: str, x, cap, what: str) -> None:
    if x is not None:
        in_range(name, x, 0, cap + 1 if isinstance(cap, int) else cap + 1, f" ({what})")


def scales(kv) -> None:
    """The tensor dequant scales of a resolved KV cache (mate._checks.KVScales): positive and finite.
    The reference backend runs this always (it reads the values anyway)."""
    for name, t in (("k_scale", kv.k_tensor), ("v_scale", kv.v_tensor)):
        if t is not None:
            value = float(t.reshape(()))
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value} (its tensor's value)")
