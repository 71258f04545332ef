"""GQA attention with a sliding window, and the seed's launcher over a packed QKV buffer.

16 query heads share 4 KV heads (GQA); each query attends to itself and the
255 keys before it: a Hugging Face `sliding_window=256` is
`sliding_window=(255, 0)` here (FlashAttention's `window_size`). `(-1, 0)` is
plain causal, `None` full attention.

On a Hopper GPU the native kernel runs and is compared with the reference
backend, then `build_gqa_attn` (the seed's launcher: fixed geometry, runtime
lengths and row strides) runs on column slices of one packed QKV tensor.
Elsewhere the reference runs and is compared with a naive masked softmax.

    python examples/gqa_sliding_window.py
"""

import torch

import mate
from common import report, where_to_run

B, S, H, HKV, D, WINDOW = 2, 512, 16, 4, 128, 256


def naive(q, k, v, left):
    """Dense float64 attention where query i sees keys i - left .. i."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    k, v = (x.double().repeat_interleave(H // HKV, 2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k) / D**0.5
    s = s.masked_fill(~((j <= i) & (j >= i - left)), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)


def main():
    device, backend, what = where_to_run()
    print(f"GQA sliding window: {what}")
    gen = torch.Generator().manual_seed(3)
    # One packed QKV activation [B, S, H + 2 * HKV, D], as a fused projection writes it; q, k, v are views.
    qkv = torch.randn(B, S, H + 2 * HKV, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :H], qkv[:, :, H : H + HKV], qkv[:, :, H + HKV :]
    window = (WINDOW - 1, 0)
    out = mate.gqa_attention(q, k, v, sliding_window=window, backend=backend)
    print(f"  q {tuple(q.shape)}, k/v {tuple(k.shape)} (views of one QKV tensor), sliding_window={window}")
    if backend == "reference":
        print("  ran backend='reference'; checked against a naive computation:")
        report("output", out, naive(q, k, v, WINDOW - 1), "a naive masked softmax", 1e-2)
        return
    ref = mate.gqa_attention(q, k, v, sliding_window=window, backend="reference")
    report("gqa_attention output", out, ref, "backend='reference'", 1e-2)
    launch = mate.build_gqa_attn(B, H, HKV, D, sliding_window=window)
    o = torch.empty(B, S, H, D, device=device, dtype=torch.bfloat16)
    row = qkv.stride(1)  # elements between consecutive tokens of the packed tensor
    launch(q, k, v, o, row, row, row, o.stride(1), S, S)
    report("build_gqa_attn output", o, ref, "backend='reference'", 1e-2)


if __name__ == "__main__":
    main()
