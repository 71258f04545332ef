"""PyTorch oracle of GQA attention with (LEFT, RIGHT) sliding windows: FP32 math, any device.

Inputs are assumed validated by the API layer; these functions only compute.
"""

from __future__ import annotations

import torch

from mate._reference import visible_value_sum

NEG_INF = float("-inf")


def window_mask(sq: int, sk: int, left: int, right: int, device=None) -> torch.Tensor:
    """[sq, sk] bool: query i (at position p = i + sk - sq) sees key j iff p - left <= j <= p + right.

    -1 leaves that side unbounded; (-1, -1) is full attention.
    """
    p = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= p - left
    if right >= 0:
        visible &= j <= p + right
    return visible


def gqa_attention(q, k, v, left: int, right: int, scale: float, *, max_scores: int = 1 << 26):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D] FP32, lse [B, H, Sq] FP32 natural log).

    Query head h reads KV head h // (H // Hkv). A row with no visible key gets
    output 0 and LSE -inf. Query rows are processed in chunks so that one
    chunk's score matrix holds at most `max_scores` elements.
    """
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    out = torch.zeros(B, Sq, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Sq), NEG_INF, dtype=torch.float32, device=q.device)
    if B == 0 or Sq == 0 or Sk == 0:
        return out, lse
    mask = window_mask(Sq, Sk, left, right, q.device)
    # [B, Hkv, group, S, D]: query head h = kv * group + g.
    qf = q.float().permute(0, 2, 1, 3).reshape(B, Hkv, group, Sq, D)
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Sk, D]
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    rows = max(1, max_scores // max(1, B * H * Sk))
    for r0 in range(0, Sq, rows):
        r1 = min(Sq, r0 + rows)
        s = torch.matmul(qf[:, :, :, r0:r1], kf.transpose(-1, -2)) * scale  # [B, Hkv, group, r, Sk]
        s = s.masked_fill(~mask[r0:r1], NEG_INF)
        m = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for empty rows
        p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        o = visible_value_sum(p, mask[r0:r1], vf)  # [B, Hkv, group, r, D]; empty rows: exp(-inf) = 0 everywhere
        out[:, r0:r1] = o.reshape(B, H, r1 - r0, D).permute(0, 2, 1, 3)
        lse[:, :, r0:r1] = m.reshape(B, H, r1 - r0)
    return out, lse
