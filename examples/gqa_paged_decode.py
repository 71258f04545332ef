"""A decode step of a sliding-window model with attention sinks (gpt-oss style) against a paged KV cache.

Each sequence has one new query row at its last position; its keys live in
16-token pages scattered over a shared cache (`block_table`, `seq_lens_k`).
The window `(127, 0)` lets the row see itself and the 127 keys before it,
and `sinks` adds one logit per query head to the softmax's normaliser.

On a Hopper GPU the step is captured once in a CUDA graph, and the graph is replayed
for the next token. That token has new queries, one more key and value in the cache,
and lengths + 1; nothing is read back to the host. The replay's result is compared
with backend='reference'. Elsewhere the reference runs, and it is compared with a
naive computation over the gathered pages.

    python examples/gqa_paged_decode.py
"""

import torch

import mate
from common import report, where_to_run

H, HKV, D, PAGE, WINDOW = 8, 2, 64, 16, (127, 0)
LENS = [1000, 37, 513, 1]  # keys already in the cache, per sequence


def naive(q, k_cache, v_cache, table, lens, sinks):
    """Float64 attention of each sequence's one row over its gathered keys, window and sink logit included."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pages = table[b, : -(-n // PAGE)].long().cpu()
        k, v = (c[pages].reshape(-1, HKV, D)[:n].double().cpu() for c in (k_cache, v_cache))
        seen = torch.arange(n) >= n - 1 - WINDOW[0]  # the last row is at position n - 1
        for h in range(H):
            s = (k[seen, h // (H // HKV)] @ q[b, 0, h].double().cpu()) / D**0.5
            m = torch.maximum(s.max(), sinks[h].double().cpu())
            p = torch.exp(s - m) / (torch.exp(s - m).sum() + torch.exp(sinks[h].double().cpu() - m))
            out[b, 0, h] = p @ v[seen, h // (H // HKV)]
    return out


def main():
    device, backend, what = where_to_run()
    print(f"GQA paged decode: {what}")
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)  # noqa: E731
    # A cache of pages in random order, with room for one more token a sequence.
    need = [-(-(n + 1) // PAGE) for n in LENS]
    order = torch.randperm(sum(need) + 3, generator=gen)
    k_cache, v_cache = rand(sum(need) + 3, PAGE, HKV, D), rand(sum(need) + 3, PAGE, HKV, D)
    table = torch.full((len(LENS), max(need)), -1, dtype=torch.int32)  # -1: no page
    for b, n in enumerate(need):
        table[b, :n], order = order[:n].int(), order[n:]
    table, lens = table.to(device), torch.tensor(LENS, dtype=torch.int32, device=device)
    q, sinks = rand(len(LENS), 1, H, D), torch.randn(H, generator=gen).to(device)
    out = torch.empty_like(q)
    kw = dict(block_table=table, seq_lens_k=lens, sliding_window=WINDOW, sinks=sinks)
    print(f"  {len(LENS)} sequences of {LENS} keys in pages of {PAGE}, H {H} / {HKV}, window {WINDOW}, sinks")

    if backend == "reference":
        mate.gqa_attention(q, k_cache, v_cache, out=out, **kw, backend=backend)
        print("  ran backend='reference'; checked against a naive computation:")
        report("output", out, naive(q, k_cache, v_cache, table, lens, sinks), "a naive gather and softmax", 1e-2)
        return

    # Warm up (compiles the kernel once) on a side stream, then capture the step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mate.gqa_attention(q, k_cache, v_cache, out=out, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mate.gqa_attention(q, k_cache, v_cache, out=out, **kw)

    # The next token: its K/V into the cache, new queries, lengths + 1; the same graph runs it.
    for b, n in enumerate(LENS):
        page, slot = table[b, n // PAGE], n % PAGE
        k_cache[page, slot], v_cache[page, slot] = rand(HKV, D), rand(HKV, D)
    q.copy_(rand(*q.shape))
    lens += 1
    graph.replay()
    torch.cuda.synchronize()
    print(f"  captured the step in a CUDA graph and replayed it for the next token ({[n + 1 for n in LENS]} keys)")
    ref = mate.gqa_attention(q, k_cache, v_cache, **kw, backend="reference")
    report("replayed output", out, ref, "backend='reference'", 1e-2)


if __name__ == "__main__":
    main()
