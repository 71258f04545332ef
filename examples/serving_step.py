"""One QSA decode step of a server: paged caches, indexer -> top-k blocks -> token ids -> gated sparse attention.

Four requests of different lengths, each with its newest token as the query row.
The KV cache (24 query / 2 KV heads, D 256) and the indexer's cache of
compressed keys (one per 4-token block, 4 heads of D 128) share one page
table: a page holds 64 tokens, i.e. 16 compressed keys.

1. qsa_mqa_decode(topk=64) scores every complete 4-token block of each request,
   keeps the 64 best blocks (-1 where fewer are visible) and expands each
   block j to tokens 4j..4j+3, plus the (up to 3) tokens of the newest,
   incomplete block (the same as qsa_mqa_decode's scores through
   qsa_topk_tokens);
2. qsa_sparse_attention attends over those tokens, gated per head (sigmoid),
   with the blocks as its hint.

On a Hopper GPU the whole step is captured once in a CUDA graph and replayed
after the next token arrives (new inputs and lengths in the same buffers);
each stage of the replay is compared with the reference backend on the same
inputs. With --compile, torch.compile(mode="reduce-overhead", fullgraph=True)
makes the graph instead: mate's first native calls are made inside the compiled
step (its warm-up run), which then records and replays. Elsewhere the step runs
with the reference backend and is compared with a naive computation written out below.

    python examples/serving_step.py [--compile]
"""

import argparse
import functools
import math

import torch

import mate
from common import naive_relu_scores, naive_sparse_attention, report, where_to_run

HEADS_IDX, DIM_IDX = 4, 128  # the indexer's native geometry
HQ, HKV, DIM = 24, 2, 256  # sparse attention's canonical geometry
PAGE = 64  # tokens per page; 16 compressed keys per page of the index cache
TOPK = 64


def indexer(backend, q_idx, index_cache, table, seq_lens, **selection):
    """The indexer's scores of every complete block (context: the visible compressed keys), or with `topk` their
    selection (block ids, token ids)."""
    return mate.qsa_mqa_decode(q_idx, index_cache, table, seq_lens // 4, table.shape[1] * (PAGE // 4), **selection, backend=backend)


def step(backend, q_idx, index_cache, q, key, value, gate, table, seq_lens):
    """(token ids [B, W], attention output [B, 1, HQ, DIM]) of one decode step."""
    # the query row sits at seq_len - 1
    blocks, tokens = indexer(backend, q_idx, index_cache, table, seq_lens, topk=TOPK, query_positions=seq_lens - 1)
    out = mate.qsa_sparse_attention(q, key, value, tokens[:, None], block_indices=blocks[:, None], block_table=table,
                                    seq_lens_k=seq_lens, gate=gate, backend=backend)
    return tokens, out


def naive_tokens(logits, seq_lens):
    """Each request's TOPK best complete blocks (score descending, lower id first), 4 tokens each, then its newest
    block's tokens; -1 pads."""
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        row = logits[b].tolist()
        best = sorted((j for j in range(n // 4)), key=lambda j: (-row[j], j))[:TOPK]
        ids = [4 * j + t for j in best for t in range(4)] + [-1] * (4 * (TOPK - len(best)))
        rows.append(ids + [t if t < n else -1 for t in range(n // 4 * 4, n // 4 * 4 + 3)])
    return torch.tensor(rows, dtype=torch.int32)


def naive_logits(q_idx, index_cache, table, seq_lens):
    """The indexer's scores of each request's complete blocks, -inf past them."""
    out = torch.full((q_idx.shape[0], table.shape[1] * (PAGE // 4)), float("-inf"), dtype=torch.float64)
    for b in range(q_idx.shape[0]):
        n = int(seq_lens[b]) // 4
        out[b, :n] = naive_relu_scores(q_idx[b], index_cache[table[b].long()].reshape(-1, DIM_IDX)[:n])
    return out


def naive_attention(q, key, value, gate, table, seq_lens, tokens):
    """Each request's newest token (position seq_len - 1) over its listed tokens."""
    rows = [naive_sparse_attention(q[b, 0], key, value, table[b], tokens[b], lambda t, n=int(seq_lens[b]): t < n, gate[b, 0])
            for b in range(q.shape[0])]
    return torch.stack(rows)[:, None]


def main(argv=None):
    ap = argparse.ArgumentParser(description="One QSA decode step of a server, captured in a CUDA graph and replayed.")
    ap.add_argument("--compile", action="store_true", help='make the graph with torch.compile(mode="reduce-overhead")')
    compiled = ap.parse_args(argv).compile
    device, backend, what = where_to_run()
    print(f"serving step: {what}")
    gen = torch.Generator().manual_seed(0)
    lens = [300, 1000, 77, 2050]
    max_pages = math.ceil((max(lens) + 1) / PAGE)  # room for the next token
    n_pages = sum(math.ceil((n + 1) / PAGE) for n in lens) + 3
    # Each request owns scattered pages of the pool; -1 marks unused table slots.
    perm = torch.randperm(n_pages, generator=gen).to(torch.int32)
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = math.ceil((n + 1) / PAGE)
        table[b, :k] = perm[used : used + k]
        used += k

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    key, value = rand(n_pages, PAGE, HKV, DIM), rand(n_pages, PAGE, HKV, DIM)
    index_cache = rand(n_pages, PAGE // 4, DIM_IDX)
    q_idx, q, gate = rand(len(lens), HEADS_IDX, DIM_IDX), rand(len(lens), 1, HQ, DIM), rand(len(lens), 1, HQ)
    table, seq_lens = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    args = (q_idx, index_cache, q, key, value, gate, table, seq_lens)
    print(f"  {len(lens)} requests of {lens} tokens, pages of {PAGE}, top-{TOPK} blocks -> {4 * TOPK + 3} token slots a row")

    if backend == "reference":
        tokens, out = step(backend, *args)
        logits = indexer(backend, q_idx, index_cache, table, seq_lens)
        print("  ran the step with backend='reference'; checked against a naive computation:")
        report("indexer logits", logits, naive_logits(q_idx, index_cache, table, seq_lens), "naive relu scores", 1e-5)
        report("selected token ids", tokens, naive_tokens(logits, seq_lens), "a naive sort", 0.0)
        report("attention output", out, naive_attention(q, key, value, gate, table, seq_lens, tokens), "naive softmax", 1e-2)
        return

    if compiled:
        # torch.compile's CUDA graphs: the first call warms up (compiling each kernel, inside the compiled step), the
        # second records the graph, the next ones replay it.
        replay = torch.compile(functools.partial(step, backend), mode="reduce-overhead", fullgraph=True)
        for _ in range(2):
            replay(*args)
    else:
        # Warm up (compiles each kernel once) on a side stream, then capture the step.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(backend, *args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens, out = step(backend, *args)

    # The next token of every request arrives: new queries, one more token in the caches, lengths + 1.
    seq_lens += 1
    for x in (q_idx, q, gate):
        x.copy_(rand(*x.shape))
    for b, n in enumerate(lens):  # the new token's K/V, and the compressed key of a block it completes
        page, slot = table[b, n // PAGE], n % PAGE
        key[page, slot], value[page, slot] = rand(HKV, DIM), rand(HKV, DIM)
        if (n + 1) % 4 == 0:
            index_cache[table[b, n // PAGE], (n // 4) % (PAGE // 4)] = rand(DIM_IDX)
    if compiled:
        tokens, out = replay(*args)
    else:
        graph.replay()
    torch.cuda.synchronize()
    how = 'with torch.compile(mode="reduce-overhead")' if compiled else "in a CUDA graph"
    print(f"  captured the step {how} and replayed it for the next token ({[n + 1 for n in lens]} tokens)")
    report("indexer logits (called alone)", indexer(backend, q_idx, index_cache, table, seq_lens),
           indexer("reference", q_idx, index_cache, table, seq_lens), "backend='reference'", 1e-4)
    ref_tokens = indexer("reference", q_idx, index_cache, table, seq_lens, topk=TOPK, query_positions=seq_lens - 1)[1]
    report("selected token ids", tokens, ref_tokens, "backend='reference'", 0.0)
    ref_out = mate.qsa_sparse_attention(q, key, value, tokens[:, None], block_table=table, seq_lens_k=seq_lens, gate=gate,
                                        backend="reference")
    report("attention output (on the replay's token ids)", out, ref_out, "backend='reference'", 1e-2)


if __name__ == "__main__":
    main()
