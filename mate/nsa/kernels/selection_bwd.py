"""TileLang programs of the NSA selection attention backward.

Both work on flat token rows (padded batches and packed sequences alike): Q,
O, dO [TQ, H, D] and K, V [TK, G, D], with per query row the flat key row
where its sequence's keys start (`KB`) and its position there (`POS`), so
key n of a selected block j is row KB + j*block_size + n' and is visible iff
j*block_size + n' <= POS. The probabilities are recomputed from the forward's
LSE: P = exp(scale * q.k - LSE), dS = P * (dO.v - delta), delta = rowsum(dO*O).

`nsa_selection_bwd_dq`: one CTA per (query row, KV group), built as the
forward (mate.nsa.kernels.selection): warp 0 of a producer warpgroup loads
the selected 64-key tiles (one block of 64, or two of 32) of K and V by TMA
into a ring of `num_stages` tiles, while the consumer warpgroup computes
delta of the group's heads (written out for the second kernel), then per tile
S^T = K Q^T and dP^T = V dO^T ("keys as M", the group's heads padded to
head_tile as N), dS^T, and dq^T += K^T dS^T. V is released after dP, K after
dq. Masked scores are selected away; K rows of masked keys are zeroed before
dq's product (only the tiles that hold some), so NaN in keys the row does not
see never meets a zero weight.

`nsa_selection_bwd_dkv`: one CTA per (key block, KV group), over the queries
that selected the block (the caller lists them, sorted, per block: `LO`/`HI`
bound the block's run of entries, `EQ` the query row of an entry, `ER` the
block's first key row). The consumer warpgroup keeps the block's K and V tile
and its dK, dV accumulators [64, D] (FP32) and takes `queries` entries a
step, their heads side by side as the MMA's N: S^T, dP^T as above, then
dV += P^T dO and dK += dS^T Q. Warp 0 of a producer warpgroup loads each
step's Q and dO rows of the group's heads by TMA into a ring of `num_stages`
steps, and per column the LSE, delta and the query's last visible key row by
its lanes; an entry past the block's run repeats the last entry (finite data,
weight 0). At 2 CTAs per SM the producer warpgroup gives its registers to the
consumer (setmaxnreg, the card's PRODUCER_REGS / CONSUMER_REGS), whose dK and
dV alone take 128 a thread at D 128: against one producer warp and 1 CTA per
SM (5 warps a CTA: 2 CTAs would cap registers at 168 and spill), 27.2 ms
instead of 41.7 at the seed shape on the H200, bitwise the same gradients. Each dk/dv row is written once, by its
block's CTA, after a fixed order of entries: no atomics, bitwise
reproducible. Rows of blocks no query uses are not written (the caller
zeroes them).

Both take the forward's pass options (no automatic thread-storage sync: the
programs place their own barriers, see the forward's PASS_CONFIGS).
"""

import tilelang.language as T

from mate._tl import LOG2E, assume_aligned, fence
from mate.nsa.kernels.selection import (  # noqa: F401
    CONSUMER_BARRIER, PASS_CONFIGS, _alloc_ring_state, _compact_blocks, _kernel_prologue, _landed_product, _masked_tile,
    _produce, _tile_key, _tiles_per_block, _zero_masked_v,
)
from mate.nsa.kernels.selection_bwd_card import CONSUMER_REGS, PRODUCER_REGS
from mate.nsa.kernels.selection_card import TILE_KEYS

INF = T.infinity("float32")


def _rows(n, heads, dim, dtype, strides):
    """Flat token rows [n, heads, dim] of unit feature stride; the other strides are dynamic (int64), named
    `strides`."""
    return T.StridedTensor((n, heads, dim), (*T.dynamic(strides, "int64"), 1), dtype)


def _alloc_operands(keep_rows, ring_rows, n, published, num_stages, dim, dtype):
    """A kernel's MMA operands in shared memory: the pair it keeps ([keep_rows, dim]: dq's Q and dO, dk/dv's K
    and V), the pair the producer streams through the ring ([num_stages, ring_rows, dim]), then the `published`
    tiles [TILE_KEYS, n] the consumer writes for its second products (dq: dS^T; dk/dv: P and dS)."""
    return (T.alloc_shared((keep_rows, dim), dtype), T.alloc_shared((keep_rows, dim), dtype),
            T.alloc_shared((num_stages, ring_rows, dim), dtype), T.alloc_shared((num_stages, ring_rows, dim), dtype),
            *(T.alloc_shared((TILE_KEYS, n), dtype) for _ in range(published)))


@T.macro
def _delta_and_lse(O, DO, LSE, DELTA, od, dlt, delta, lse2, bq, h0, group_heads, head_tile, dim):
    # delta = rowsum(dO * O) per head (also written out, for the dk/dv kernel) and the LSE in log2 units;
    # a padded head gets LSE +inf, so P = 0 there.
    for h, d in T.Parallel(head_tile, dim):
        od[h, d] = T.if_then_else(h < group_heads, T.cast(O[bq, h0 + h, d], "float32") * T.cast(DO[bq, h0 + h, d], "float32"), 0)
    T.reduce_sum(od, dlt, dim=1)
    for h in T.Parallel(head_tile):
        delta[h] = dlt[h]
        lse2[h] = T.if_then_else(h < group_heads, LSE[h0 + T.min(h, group_heads - 1), bq] * LOG2E, INF)
    for h in T.Parallel(head_tile):
        if h < group_heads:
            DELTA[h0 + h, bq] = dlt[h]


@T.macro
def _dq_tile(Ks, Vs, Qs, dOs, dSs, blocks, lse2, delta, k_full, v_full, k_empty, v_empty, S, dP, dS, dqT, it, n_used, pos,
             scale_log2, num_stages, block_size, per_tile, dim, head_tile, threads, dtype):
    """One tile of the dq consumer: S^T and dP^T, dS^T (masked keys 0), dq^T += K^T dS^T."""
    st = it % num_stages
    _landed_product(k_full, Ks, Qs, S, st, it, num_stages)
    _landed_product(v_full, Vs, dOs, dP, st, it, num_stages)
    fence()
    T.barrier_arrive(v_empty[st])
    for k, h in T.Parallel(TILE_KEYS, head_tile):
        slot, n = _tile_key(blocks, it, k, n_used, block_size, per_tile)
        p = T.exp2(S[k, h] * scale_log2 - lse2[h])
        dS[k, h] = T.cast(T.if_then_else((slot < n_used) & (n <= pos), p * (dP[k, h] - delta[h]), 0), dtype)
    T.copy(dS, dSs)
    _zero_masked_v(Ks, blocks, _masked_tile(blocks, it, n_used, pos, block_size, per_tile), st, it, n_used, pos, block_size, per_tile, dim,
                   threads, dtype)
    T.fence_proxy_async()
    T.sync_threads(CONSUMER_BARRIER, threads)  # dS is in shared memory
    fence()
    T.gemm(Ks[st, :, :], dSs, dqT, transpose_A=True)
    fence()
    T.barrier_arrive(k_empty[st])


def nsa_selection_bwd_dq(dtype, dim, block_size, head_tile, threads, num_stages, min_blocks):
    per_tile = _tiles_per_block(block_size, threads)
    TQ, TK, H, G, TT = T.dynamic("TQ TK H G TT")
    skb, svb, sk0, sk1, sv0, sv1, sib, si0, si1, si2, scb, sc0, sc1, sl0, sl1 = T.dynamic(
        "skb svb sk0 sk1 sv0 sv1 sib si0 si1 si2 scb sc0 sc1 sl0 sl1", "int64")

    @T.prim_func
    def main(
        Q: _rows(TQ, H, dim, dtype, "sq0 sq1"),
        O: _rows(TQ, H, dim, dtype, "so0 so1"),
        DO: _rows(TQ, H, dim, dtype, "sd0 sd1"),
        K: T.StridedTensor((1, TK, G, dim), (skb, sk0, sk1, 1), dtype),
        V: T.StridedTensor((1, TK, G, dim), (svb, sv0, sv1, 1), dtype),
        BI: T.StridedTensor((1, TQ, G, TT), (sib, si0, si1, si2), "int32"),
        BC: T.StridedTensor((1, TQ, G), (scb, sc0, sc1), "int32"),
        LSE: T.StridedTensor((H, TQ), (sl0, sl1), "float32"),
        KB: T.Tensor((TQ,), "int32"),
        POS: T.Tensor((TQ,), "int32"),
        DQ: _rows(TQ, H, dim, dtype, "sg0 sg1"),
        DELTA: T.Tensor((H, TQ), "float32"),
        scale: T.float32,
        group_heads: T.int32,
        use_counts: T.int32,
    ):
        # A producer warpgroup (of which warp 0 works) and the consumer warpgroup, as the forward.
        with T.Kernel(TQ, G, threads=2 * threads) as (bq, bg):
            tx = _kernel_prologue(min_blocks)
            Qs, dOs, Ks, Vs, dSs = _alloc_operands(head_tile, TILE_KEYS, head_tile, 1, num_stages, dim, dtype)
            lse2 = T.alloc_shared((head_tile,), "float32")
            delta = T.alloc_shared((head_tile,), "float32")
            blocks, used, k_full, v_full, k_empty, v_empty = _alloc_ring_state(num_stages, threads)
            od = T.alloc_fragment((head_tile, dim), "float32")
            dlt = T.alloc_fragment((head_tile,), "float32")
            S = T.alloc_fragment((TILE_KEYS, head_tile), "float32")
            dP = T.alloc_fragment((TILE_KEYS, head_tile), "float32")
            dS = T.alloc_fragment((TILE_KEYS, head_tile), dtype)
            dqT = T.alloc_fragment((dim, head_tile), "float32")
            assume_aligned(*Q.strides[:2], *DO.strides[:2], *DQ.strides[:2], *O.strides[:2])

            pos = POS[bq]
            key_base = KB[bq]
            last_block = T.if_then_else(pos >= 0, pos // block_size, -1)
            slots = T.min(T.if_then_else(use_counts != 0, T.max(BC[0, bq, bg], 0), TT), TT)
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E

            for h, d in T.Parallel(head_tile, dim):
                Qs[h, d] = T.if_then_else(h < group_heads, Q[bq, h0 + h, d], T.cast(0, dtype))
                dOs[h, d] = T.if_then_else(h < group_heads, DO[bq, h0 + h, d], T.cast(0, dtype))
            _compact_blocks(BI, blocks, used, 0, bq, bg, slots, last_block)
            T.sync_threads()
            fence()
            n_used = used[0]
            n_tiles = T.ceildiv(n_used, per_tile)

            if tx < threads:
                if tx < 32:  # warp 0 alone (see the forward)
                    _produce(K, V, Ks, Vs, blocks, k_full, v_full, k_empty, v_empty, n_tiles, n_used, key_base, 0, bg, num_stages,
                             block_size, per_tile, dim)
            else:
                _delta_and_lse(O, DO, LSE, DELTA, od, dlt, delta, lse2, bq, h0, group_heads, head_tile, dim)
                T.sync_threads(CONSUMER_BARRIER, threads)
                fence()
                T.fill(dqT, 0)
                for it in T.serial(n_tiles):
                    _dq_tile(Ks, Vs, Qs, dOs, dSs, blocks, lse2, delta, k_full, v_full, k_empty, v_empty, S, dP, dS, dqT, it, n_used,
                             pos, scale_log2, num_stages, block_size, per_tile, dim, head_tile, threads, dtype)
                # dq goes out through Q's buffer (the last product has read it).
                for d, h in T.Parallel(dim, head_tile):
                    Qs[h, d] = T.cast(dqT[d, h] * scale, dtype)
                T.sync_threads(CONSUMER_BARRIER, threads)
                fence()
                for h, d in T.Parallel(head_tile, dim):
                    if h < group_heads:
                        DQ[bq, h0 + h, d] = Qs[h, d]

    return main


@T.macro
def _load_entries(Q, DO, LSE, DELTA, QLIM, EQ, Qs, dOs, lse2, delta, qlim, full, empty, step, lo, n_entries, h0, bg, lane,
                  group_heads, queries, head_tile, num_stages, dim):
    """The producer warp's step: Q and dO rows of `queries` entries by TMA, per column the LSE (log2), delta and
    last visible key row by the lanes; then all 32 lanes arrive on the stage's full barrier."""
    st = step % num_stages
    T.barrier_wait(empty[st], ((step // num_stages) & 1) ^ 1)
    for j in T.unroll(queries):
        qj = EQ[lo + T.min(step * queries + j, n_entries - 1)]
        for c0 in T.unroll(dim // 64):
            T.tma_copy(Q[qj, h0 : h0 + head_tile, c0 * 64 : c0 * 64 + 64],
                       Qs[st, j * head_tile : j * head_tile + head_tile, c0 * 64 : c0 * 64 + 64], barrier=full[st],
                       leader_scope_threads=32)
            T.tma_copy(DO[qj, h0 : h0 + head_tile, c0 * 64 : c0 * 64 + 64],
                       dOs[st, j * head_tile : j * head_tile + head_tile, c0 * 64 : c0 * 64 + 64], barrier=full[st],
                       leader_scope_threads=32)
    for r in T.unroll(queries * head_tile // 32):
        c = r * 32 + lane
        e = step * queries + c // head_tile
        h = c % head_tile
        live = (e < n_entries) & (h < group_heads)
        qi = EQ[lo + T.min(e, n_entries - 1)]
        hh = h0 + T.min(h, group_heads - 1)
        lse2[st, c] = T.if_then_else(live, LSE[hh, qi] * LOG2E, INF)
        delta[st, c] = T.if_then_else(live, DELTA[hh, qi], 0)
        qlim[st, c] = T.if_then_else(live, QLIM[qi], -1)
    T.barrier_arrive(full[st])


@T.macro
def _dkv_step(Ks, Vs, Qs, dOs, Ps, dSs, lse2, delta, qlim, full, empty, S, dP, P, dS, dK, dV, step, row0, block_size,
              group_heads, scale_log2, num_stages, cols, head_tile, dim, threads, dtype):
    """One step of the dk/dv consumer: S^T, dP^T, P and dS (0 where masked), dV += P dO, dK += dS Q."""
    st = step % num_stages
    T.barrier_wait(full[st], (step // num_stages) & 1)
    fence()
    if group_heads < head_tile:
        # The TMA box holds head_tile heads: those past the group are another group's rows (or zeros past H).
        # Their weights are 0, but 0 * NaN is NaN: zero them.
        for c, d in T.Parallel(cols, dim):
            if c % head_tile >= group_heads:
                Qs[st, c, d] = T.cast(0, dtype)
                dOs[st, c, d] = T.cast(0, dtype)
        T.fence_proxy_async()
        T.sync_threads(CONSUMER_BARRIER, threads)
        fence()
    T.gemm(Ks, Qs[st, :, :], S, transpose_B=True, clear_accum=True)
    T.gemm(Vs, dOs[st, :, :], dP, transpose_B=True, clear_accum=True)
    for k, c in T.Parallel(TILE_KEYS, cols):
        ok = (k < block_size) & (row0 + k <= qlim[st, c])
        p = T.if_then_else(ok, T.exp2(S[k, c] * scale_log2 - lse2[st, c]), 0)
        P[k, c] = T.cast(p, dtype)
        dS[k, c] = T.cast(T.if_then_else(ok, p * (dP[k, c] - delta[st, c]), 0), dtype)
    T.copy(P, Ps)
    T.copy(dS, dSs)
    T.fence_proxy_async()
    T.sync_threads(CONSUMER_BARRIER, threads)  # P and dS are in shared memory
    fence()
    T.gemm(Ps, dOs[st, :, :], dV)
    T.gemm(dSs, Qs[st, :, :], dK)
    fence()
    T.barrier_arrive(empty[st])


def nsa_selection_bwd_dkv(dtype, dim, block_size, head_tile, threads, queries, num_stages, min_blocks):
    _tiles_per_block(block_size, threads)
    cols = queries * head_tile
    assert cols % 32 == 0, "the producer warp's lanes take the step's columns 32 at a time"
    TQ, TK, H, G, E, NSEG = T.dynamic("TQ TK H G E NSEG")
    sl0, sl1, sa0, sa1, sb0, sb1, so0, so1 = T.dynamic("sl0 sl1 sa0 sa1 sb0 sb1 so0 so1", "int64")

    @T.prim_func
    def main(
        Q: _rows(TQ, H, dim, dtype, "sq0 sq1"),
        DO: _rows(TQ, H, dim, dtype, "sd0 sd1"),
        K: _rows(TK, G, dim, dtype, "sk0 sk1"),
        V: _rows(TK, G, dim, dtype, "sv0 sv1"),
        LSE: T.StridedTensor((H, TQ), (sl0, sl1), "float32"),
        DELTA: T.Tensor((H, TQ), "float32"),
        LO: T.StridedTensor((G, NSEG), (sa0, sa1), "int32"),
        HI: T.StridedTensor((G, NSEG), (sb0, sb1), "int32"),
        EQ: T.Tensor((E,), "int32"),
        ER: T.Tensor((E,), "int32"),
        QLIM: T.Tensor((TQ,), "int32"),
        KEND: T.Tensor((TQ,), "int32"),
        DK: T.StridedTensor((TK, G, dim), (so0, so1, 1), dtype),
        DV: T.StridedTensor((TK, G, dim), (so0, so1, 1), dtype),
        scale: T.float32,
        group_heads: T.int32,
    ):
        with T.Kernel(NSEG, G, threads=2 * threads) as (bs_, bg):
            tx = _kernel_prologue(min_blocks)
            Ks, Vs, Qs, dOs, Ps, dSs = _alloc_operands(TILE_KEYS, cols, cols, 2, num_stages, dim, dtype)
            lse2 = T.alloc_shared((num_stages, cols), "float32", scope="shared")
            delta = T.alloc_shared((num_stages, cols), "float32", scope="shared")
            qlim = T.alloc_shared((num_stages, cols), "int32", scope="shared")
            full = T.alloc_barrier([32] * num_stages)
            empty = T.alloc_barrier([threads] * num_stages)
            S = T.alloc_fragment((TILE_KEYS, cols), "float32")
            dP = T.alloc_fragment((TILE_KEYS, cols), "float32")
            P = T.alloc_fragment((TILE_KEYS, cols), dtype)
            dS = T.alloc_fragment((TILE_KEYS, cols), dtype)
            dK = T.alloc_fragment((TILE_KEYS, dim), "float32")
            dV = T.alloc_fragment((TILE_KEYS, dim), "float32")
            assume_aligned(so0, so1, *K.strides[:2], *V.strides[:2])

            lo = LO[bg, bs_]
            n_entries = HI[bg, bs_] - lo
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E
            if n_entries > 0:
                row0 = ER[lo]
                if tx < threads:
                    if min_blocks == 2:
                        T.dec_max_nreg(PRODUCER_REGS)
                    if tx < 32:  # warp 0 alone (see the forward)
                        for step in T.serial(T.ceildiv(n_entries, queries)):
                            _load_entries(Q, DO, LSE, DELTA, QLIM, EQ, Qs, dOs, lse2, delta, qlim, full, empty, step, lo, n_entries,
                                          h0, bg, tx, group_heads, queries, head_tile, num_stages, dim)
                else:
                    if min_blocks == 2:
                        T.inc_max_nreg(CONSUMER_REGS)
                    kend = KEND[EQ[lo]]
                    for k, d in T.Parallel(TILE_KEYS, dim):
                        ok = (k < block_size) & (row0 + k < kend)
                        row = T.if_then_else(ok, row0 + k, 0)
                        Ks[k, d] = T.if_then_else(ok, K[row, bg, d], T.cast(0, dtype))
                        Vs[k, d] = T.if_then_else(ok, V[row, bg, d], T.cast(0, dtype))
                    T.fence_proxy_async()
                    T.sync_threads(CONSUMER_BARRIER, threads)
                    fence()
                    T.fill(dK, 0)
                    T.fill(dV, 0)
                    for step in T.serial(T.ceildiv(n_entries, queries)):
                        _dkv_step(Ks, Vs, Qs, dOs, Ps, dSs, lse2, delta, qlim, full, empty, S, dP, P, dS, dK, dV, step, row0,
                                  block_size, group_heads, scale_log2, num_stages, cols, head_tile, dim, threads, dtype)
                    for k, d in T.Parallel(TILE_KEYS, dim):
                        if (k < block_size) & (row0 + k < kend):
                            DK[row0 + k, bg, d] = T.cast(dK[k, d] * scale, dtype)
                            DV[row0 + k, bg, d] = T.cast(dV[k, d], dtype)

    return main
