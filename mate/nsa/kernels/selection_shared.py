"""TileLang program of the NSA selection forward whose CTA shares its K/V gathers among W queries (issue 40).

DRAFT: lowered and compiled with nvcc for sm_90a on a CPU host only; NOT YET RUN ON A GPU. The shipped
configs route nothing here (configs/sm90.yaml's nsa_selection entries leave `queries` at its default, 1:
mate.nsa.kernels.selection's one-query program); an entry with queries > 1 routes here.

One CTA per (W consecutive query rows m0 .. m0 + W - 1, KV group g, batch b). Neighbouring queries select
many of the same blocks (82% of them shared at W = 8 on benchmarks/bench_nsa.py's smooth selections, 17%
on its uniform ones), so the CTA gathers each block of the union of its queries' selections once, and
each query runs its own two MMAs (S^T = K Q^T, O^T += V^T P^T; keys as M, as in selection.py) only on the
blocks it selected: the MMA work is that of the one-query program, the gathered bytes that of the union.

The union, built by the whole CTA before the roles split (all in shared memory, CAP = W x 16 entries):
  1. entries: ent[i * TT + t] = the first key row (flat: varlen's sequence start included) of query i's
     slot t when the slot is used (inside block_counts, >= 0, its first token at or before the query),
     else -1;
  2. per entry, one pass over all entries (the same address across the CTA each step, a broadcast): the
     first entry with its value (is it the union's first?), and within its query, how often the value
     occurs (a duplicate slot counts once per occurrence) and whether it is the query's first;
  3. the rank of each union-first entry among them: the union list `ublk` (first-occurrence order) and
     its size;
  4. mult[i, u] = how many of query i's used slots select union block u (0: query i skips u), written by
     the query's first entry of that value; thr[u] = the key row of the last query that selected u (its position plus its sequence's first row).
A query with mult c > 0 on a block weighs its keys' probabilities by c (the same as c passes over it:
the max does not change, the sum and P.V take c copies), as the reference's log(multiplicity) does.

Roles, as in selection.py: warp 0 of the first warpgroup issues the TMA loads of the union's tiles into
a ring of `num_stages` (K and V full / empty mbarriers per stage), the second warpgroup (the consumer)
walks the union. Per tile it waits for K and V, zeroes the V rows past thr[u] (the rows no query of the
CTA sees: P = 0 there, but 0 x NaN garbage is NaN), then for each of its W queries with mult > 0 on the
tile runs S^T = K Q_i^T, masks the keys past query i, one online-softmax step on query i's own state,
publishes P_i (x mult) through shared memory and accumulates O_i^T += V^T P_i^T, then releases the stage.

Where each query's accumulator lives: in registers of the one consumer warpgroup. Per query O^T
[D, 16] FP32 (16 registers a thread at D 128), the softmax sums (per thread row [64, 16] FP32: 8
registers, reduced once at the end; at W = 8 per head, reduced every tile: 4) and the running max (4).
Compiled for sm_90a (ptxas -v, BF16, D 128, num_stages 2; no spills in any): W = 2 and W = 4 at 2 CTAs
an SM (__launch_bounds__(256, 2), setmaxnreg 40 for the producer warpgroup and 216 for the consumer;
128 registers at launch), 88064 / 104448 B dynamic + 2048 / 4096 B static shared memory a CTA; W = 8
at 1 CTA an SM, 242 registers, 137216 B dynamic + 8192 B static. Each query's softmax reductions have
their own 2 KB scratch (PASS_CONFIGS merges none), 4 KB a query of the shared memory above. The
issue's plan (W = 8 on two consumer warpgroups, 4 queries each) is not written here: TileLang 0.1.15's
reductions (the softmax's max) synchronise through named barrier 1 with a thread count of one
warpgroup, whatever warpgroup they run in (tl::AllReduce<..., tl::NamedBarrier<128>>, phase 1), so two
consumer warpgroups reducing at once would complete each other's barriers. Two consumers need a max
reduction of the program's own (a named barrier per warpgroup).

The output goes through shared memory a query at a time (Os), coalesced rows of O; LSE as selection.py.
"""

import tilelang.language as T

from mate._tl import assume_aligned, fence, lse_keys_as_m, publish_p_keys_as_m
from mate.nsa.kernels.selection import (
    CONSUMER_BARRIER, LOG2E, NEG_INF, PASS_CONFIGS, Signature, _alloc_ring_state, _kernel_prologue, _tile_load,  # noqa: F401
)
from mate.nsa.kernels.selection_card import SHARED_QUERIES, SHARED_SLOTS, TILE_KEYS, shared_registers, shared_tile_sums

__all__ = ["nsa_selection_shared_fwd", "PASS_CONFIGS"]


tile_sums = shared_tile_sums
consumer_registers = shared_registers


def _alloc_query_states(queries, dim, head_tile):
    """Per query: O^T [dim, heads] and the softmax sums (FP32: per thread row [64 keys, heads], or per head with
    tile_sums), and the running max."""
    states = []
    for _ in range(queries):
        acc = T.alloc_fragment((dim, head_tile), "float32")
        rowsum = T.alloc_fragment((head_tile,) if tile_sums(queries) else (TILE_KEYS, head_tile), "float32")
        m_cur = T.alloc_fragment((head_tile,), "float32")
        states.append((acc, rowsum, m_cur))
    return states


@T.macro
def _build_union(BI, BC, ST, ent, first, qcount, isfirst, urank, ublk, thr, mult, n_union, bb, m0, off, bg, M, N, TT, use_counts,
                 varlen, block_size, W, CAP):
    """Steps 1 to 4 of the module docstring: the union list ublk[0 .. n_union[0]), mult [W, CAP] and thr."""
    for e in T.Parallel(CAP):
        i = e // TT
        t = e % TT
        qm = T.min(m0 + i, M - 1)
        kb = ST[qm * varlen] * varlen
        pos = T.if_then_else(varlen != 0, qm - kb, N - M + qm)
        slots = T.min(T.if_then_else(use_counts != 0, T.max(BC[bb, qm, bg], 0), TT), TT)
        blk = BI[bb, qm, bg, T.min(t, TT - 1)]
        ok = (e < W * TT) & (m0 + i < M) & (t < slots) & (blk >= 0) & (pos >= 0) & (blk <= pos // block_size)
        ent[e] = T.if_then_else(ok, kb + blk * block_size, -1)
    for e in T.Parallel(W * CAP):
        mult[e] = 0
    T.sync_threads()
    fence()
    for e in T.Parallel(CAP):
        v = ent[e]
        i = e // TT
        f0 = T.alloc_var("int32")
        cnt = T.alloc_var("int32")
        qfirst = T.alloc_var("int32")
        f0 = e
        cnt = 0
        qfirst = 1
        for f in T.serial(CAP):
            same = (ent[f] == v) & (v >= 0)
            f0 = T.if_then_else(same & (f < f0), f, f0)
            mine = same & (f // TT == i) & (f < W * TT)
            cnt += T.if_then_else(mine, 1, 0)
            qfirst = T.if_then_else(mine & (f < e), 0, qfirst)
        first[e] = f0
        qcount[e] = T.if_then_else((v >= 0) & (qfirst != 0), cnt, 0)
        isfirst[e] = T.if_then_else((v >= 0) & (f0 == e), 1, 0)
    T.sync_threads()
    fence()
    for e in T.Parallel(CAP):
        rank = T.alloc_var("int32")
        rank = 0
        for f in T.serial(CAP):
            rank += T.if_then_else(f < e, isfirst[f], 0)
        urank[e] = rank
        if isfirst[e] != 0:
            ublk[rank] = ent[e]
        if e == CAP - 1:
            n_union[0] = rank + isfirst[e]
    T.sync_threads()
    fence()
    for e in T.Parallel(CAP):
        if qcount[e] > 0:
            mult[(e // TT) * CAP + urank[first[e]]] = qcount[e]
    T.sync_threads()
    fence()
    for u in T.Parallel(CAP):
        last = T.alloc_var("int32")
        last = -1
        for i in T.serial(W):
            last = T.if_then_else(mult[i * CAP + u] > 0, m0 + i + off, last)  # rows ascend with i
        thr[u] = last
    T.sync_threads()
    fence()


@T.macro
def _query_tile(Ks, Vs, Qs, Ps, S, P, m_prev, alpha, lt, state, mult, ublk, st, it, qi, qrow, scale_log2, CAP, dim, head_tile,
                threads, sums_per_tile):
    """Query qi's step on union tile `it` (stage st), when it selected the tile."""
    acc, rowsum, m_cur = state
    c = mult[qi * CAP + it]
    if c > 0:
        T.gemm(Ks[st, :, :], Qs[qi, :, :], S, transpose_B=True, clear_accum=True)
        for k, h in T.Parallel(TILE_KEYS, head_tile):
            S[k, h] = T.if_then_else(ublk[it] + k <= qrow, S[k, h], NEG_INF)
        T.copy(m_cur, m_prev)
        T.reduce_max(S, m_cur, dim=0, clear=False, batch=head_tile // 4)
        for h in T.Parallel(head_tile):
            alpha[h] = T.exp2((m_prev[h] - m_cur[h]) * scale_log2)
        if sums_per_tile:
            for k, h in T.Parallel(TILE_KEYS, head_tile):
                S[k, h] = T.exp2(S[k, h] * scale_log2 - m_cur[h] * scale_log2) * T.cast(c, "float32")
            T.reduce_sum(S, lt, dim=0, batch=head_tile // 4)
            for h in T.Parallel(head_tile):
                rowsum[h] = rowsum[h] * alpha[h] + lt[h]
        else:
            for k, h in T.Parallel(TILE_KEYS, head_tile):
                S[k, h] = T.exp2(S[k, h] * scale_log2 - m_cur[h] * scale_log2) * T.cast(c, "float32")
                rowsum[k, h] = rowsum[k, h] * alpha[h] + S[k, h]
        publish_p_keys_as_m(S, P, Ps, acc, alpha, CONSUMER_BARRIER, threads, dim, head_tile)
        T.gemm(Vs[st, :, :], Ps, acc, transpose_A=True)
        fence()


@T.macro
def _query_store(O, LSE, Os, l_sum, state, bb, qm, M, h0, group_heads, scale, dim, head_tile, threads, sums_per_tile):
    acc, rowsum, m_cur = state
    if sums_per_tile:
        T.copy(rowsum, l_sum)
    else:
        T.reduce_sum(rowsum, l_sum, dim=0, batch=head_tile // 4)
    for d, h in T.Parallel(dim, head_tile):
        Os[h, d] = T.if_then_else(l_sum[h] > 0, acc[d, h] / l_sum[h], 0)
    T.sync_threads(CONSUMER_BARRIER, threads)
    fence()
    for h, d in T.Parallel(head_tile, dim):
        if (h < group_heads) & (qm < M):
            O[bb, qm, h0 + h, d] = Os[h, d]
    for h in T.Parallel(head_tile):
        if (h < group_heads) & (qm < M):
            LSE[bb, h0 + h, qm] = lse_keys_as_m(m_cur, l_sum, h, scale)
    T.sync_threads(CONSUMER_BARRIER, threads)  # Os is free for the next query
    fence()


def nsa_selection_shared_fwd(dtype, dim, block_size, head_tile, threads, num_stages, min_blocks, queries):
    """The program: the arguments of selection.nsa_selection_fwd's, the same kernel signature (selection.Signature);
    `queries` = W."""
    W = queries
    assert W in SHARED_QUERIES, f"queries (W) must be one of {SHARED_QUERIES}"
    assert block_size == TILE_KEYS, "the shared program gathers one 64-key block a tile (block_size 64)"
    assert threads == 128, "one consumer warpgroup"
    sums = tile_sums(W)
    nreg = consumer_registers(min_blocks)
    CAP = W * SHARED_SLOTS  # entries a CTA holds (the API sends T > SHARED_SLOTS to the one-query program)
    a = Signature(dtype, dim)
    B, M, N, G, TT = a.B, a.M, a.N, a.G, a.TT

    @T.prim_func
    def main(
        Q: a.Q, K: a.K, V: a.V, BI: a.BI, BC: a.BC, O: a.O, LSE: a.LSE, ST: a.ST,
        scale: T.float32, group_heads: T.int32, use_counts: T.int32, varlen: T.int32,
    ):
        with T.Kernel(T.ceildiv(M, W), G, B, threads=2 * threads) as (bq, bg, bb):
            tx = _kernel_prologue(min_blocks)
            Qs = T.alloc_shared((W, head_tile, dim), dtype)
            Ks = T.alloc_shared((num_stages, TILE_KEYS, dim), dtype)
            Vs = T.alloc_shared((num_stages, TILE_KEYS, dim), dtype)
            Ps = T.alloc_shared((TILE_KEYS, head_tile), dtype)
            Os = T.alloc_shared((head_tile, dim), dtype)
            ent = T.alloc_shared((CAP,), "int32", scope="shared")
            first = T.alloc_shared((CAP,), "int32", scope="shared")
            qcount = T.alloc_shared((CAP,), "int32", scope="shared")
            isfirst = T.alloc_shared((CAP,), "int32", scope="shared")
            urank = T.alloc_shared((CAP,), "int32", scope="shared")
            thr = T.alloc_shared((CAP,), "int32", scope="shared")
            mult = T.alloc_shared((W * CAP,), "int32", scope="shared")
            ublk, n_union, k_full, v_full, k_empty, v_empty = _alloc_ring_state(num_stages, threads)
            S = T.alloc_fragment((TILE_KEYS, head_tile), "float32")
            P = T.alloc_fragment((TILE_KEYS, head_tile), dtype)
            m_prev = T.alloc_fragment((head_tile,), "float32")
            alpha = T.alloc_fragment((head_tile,), "float32")
            l_sum = T.alloc_fragment((head_tile,), "float32")
            lt = T.alloc_fragment((head_tile,), "float32")
            qs = _alloc_query_states(W, dim, head_tile)
            assume_aligned(*a.aligned)

            m0 = bq * W
            off = T.if_then_else(varlen != 0, 0, N - M)  # a query row's position + its sequence's first key row
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E
            for i, h, d in T.Parallel(W, head_tile, dim):
                Qs[i, h, d] = T.if_then_else((h < group_heads) & (m0 + i < M), Q[bb, T.min(m0 + i, M - 1), h0 + h, d], T.cast(0, dtype))
            _build_union(BI, BC, ST, ent, first, qcount, isfirst, urank, ublk, thr, mult, n_union, bb, m0, off, bg, M, N, TT,
                         use_counts, varlen, block_size, W, CAP)
            n_tiles = n_union[0]

            if tx < threads:
                # ---------------- producer: warp 0 alone (selection.py says why)
                if nreg is not None:
                    T.set_max_nreg(nreg[0], 0)
                if tx < 32:
                    for it in T.serial(n_tiles):
                        st = it % num_stages
                        n0 = ublk[it]
                        _tile_load(K, Ks, k_empty, k_full, st, (it // num_stages) & 1, bb, bg, n0, n0, block_size, 1, dim)
                        _tile_load(V, Vs, v_empty, v_full, st, (it // num_stages) & 1, bb, bg, n0, n0, block_size, 1, dim)
            else:
                # ---------------- consumer: every query of the CTA, on the tiles it selected
                if nreg is not None:
                    T.set_max_nreg(nreg[1], 1)
                # Python loops over the queries: each query's state is fragments of its own (registers), which no
                # device loop could index; the program repeats each step W times as it is built.
                for acc, rowsum, m_cur in qs:
                    T.fill(acc, 0)
                    T.fill(rowsum, 0)
                    T.fill(m_cur, NEG_INF)
                for it in T.serial(n_tiles):
                    st = it % num_stages
                    T.barrier_wait(k_full[st], (it // num_stages) & 1)
                    T.barrier_wait(v_full[st], (it // num_stages) & 1)
                    fence()
                    # Rows no query of the CTA sees (past thr, the last selecting query's row) are zeroed:
                    # generic stores, the proxy fence before the wgmma reads, a consumer barrier.
                    if ublk[it] + TILE_KEYS - 1 > thr[it]:
                        for k, d in T.Parallel(TILE_KEYS, dim):
                            if ublk[it] + k > thr[it]:
                                Vs[st, k, d] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(CONSUMER_BARRIER, threads)
                    for i, state in enumerate(qs):
                        _query_tile(Ks, Vs, Qs, Ps, S, P, m_prev, alpha, lt, state, mult, ublk, st, it, i, m0 + i + off, scale_log2, CAP,
                                    dim, head_tile, threads, sums)
                    T.barrier_arrive(k_empty[st])
                    T.barrier_arrive(v_empty[st])
                for i, state in enumerate(qs):
                    _query_store(O, LSE, Os, l_sum, state, bb, m0 + i, M, h0, group_heads, scale, dim, head_tile, threads, sums)

    return main
