"""Pieces the PyTorch oracles share."""

from __future__ import annotations

import torch


def visible_value_sum(p: torch.Tensor, visible: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p @ v over the keys a row sees, as a kernel that never reads the others computes it.

    p [..., R, N] (0 where not visible), visible [..., R, N] (broadcastable to p), v [..., N, D]
    FP32. A dense product would let a key a row does not see into its sum as 0 * NaN = NaN
    (stale cache memory holds NaN and Inf), so non-finite values are summed apart: they
    make NaN exactly the features of the rows that see them.
    """
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return p @ v
    out = p @ torch.where(bad, 0.0, v)
    seen = (visible.to(v.dtype) @ bad.to(v.dtype)) > 0
    return torch.where(seen, float("nan"), out)


def apply_gate(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """out * sigmoid(gate) in FP32; gate is per head (out.shape[:-1]) or per element (out.shape)."""
    if gate is None:
        return out
    g = torch.sigmoid(gate.float())
    return out * (g.unsqueeze(-1) if g.dim() == out.dim() - 1 else g)
