"""TileLang programs of the NSA selection attention backward.

Both work on flat token rows (padded batches and packed sequences alike): Q,
O, dO [TQ, H, D] and K, V [TK, G, D], with per query row the flat key row
where its sequence's keys start (`KB`) and its position there (`POS`), so
key n of a selected block j is row KB + j*block_size + n' and is visible iff
j*block_size + n' <= POS. The probabilities are recomputed from the forward's
LSE: P = exp(scale * q.k - LSE), dS = P * (dO.v - delta), delta = rowsum(dO*O).

`nsa_selection_bwd_dq`: one CTA per (query row, KV group), as the forward:
delta of the group's heads first (written out for the second kernel), then
per selected 64-key tile (one block of 64, or two of 32) S^T = K Q^T and
dP^T = V dO^T ("keys as M", the group's heads padded to head_tile as N),
dS^T, and dq^T += K^T dS^T. Masked key rows of the K and V tiles are loaded
as zeros, so NaN in keys the row does not see never meets a zero weight in
a product.

`nsa_selection_bwd_dkv`: one CTA per (key block, KV group), over the queries
that selected the block (the caller lists them, sorted, per block: `LO`/`HI`
bound the block's run of entries, `EQ` the query row of an entry, `ER` the
block's first key row). It keeps the block's K and V tile and its dK, dV
accumulators [64, D] (FP32) and takes `queries` entries a step, their heads
side by side as the MMA's N: S^T, dP^T as above, then dV += P^T dO and
dK += dS^T Q. Each dk/dv row is written once, by its block's CTA, after a
fixed order of entries: no atomics, bitwise reproducible. Rows of blocks no
query uses are not written (the caller zeroes them).

Both use plain 16-byte loads into shared memory (the wrapper checks the
layout rule on every tensor they read; the programs assume it) and
TileLang's own synchronisation (no producer warp): simple first; several
CTAs per SM hide the latency.
"""

import tilelang.language as T

from mate.nsa.kernels.selection import _compact_blocks
from mate.nsa.kernels.selection_card import MAX_SLOTS, TILE_KEYS

LOG2E = 1.4426950408889634
INF = T.infinity("float32")


def nsa_selection_bwd_dq(dtype, dim, block_size, head_tile, threads, min_blocks):
    assert TILE_KEYS % block_size == 0, "block_size must divide 64"
    per_tile = TILE_KEYS // block_size
    TQ, TK, H, G, TT = T.dynamic("TQ TK H G TT")
    (sq0, sq1, so0, so1, sd0, sd1, sk0, sk1, sv0, sv1, sib, si0, si1, si2, scb, sc0, sc1, sl0, sl1, sg0, sg1) = T.dynamic(
        "sq0 sq1 so0 so1 sd0 sd1 sk0 sk1 sv0 sv1 sib si0 si1 si2 scb sc0 sc1 sl0 sl1 sg0 sg1", "int64")

    @T.prim_func
    def main(
        Q: T.StridedTensor((TQ, H, dim), (sq0, sq1, 1), dtype),
        O: T.StridedTensor((TQ, H, dim), (so0, so1, 1), dtype),
        DO: T.StridedTensor((TQ, H, dim), (sd0, sd1, 1), dtype),
        K: T.StridedTensor((TK, G, dim), (sk0, sk1, 1), dtype),
        V: T.StridedTensor((TK, G, dim), (sv0, sv1, 1), dtype),
        BI: T.StridedTensor((1, TQ, G, TT), (sib, si0, si1, si2), "int32"),
        BC: T.StridedTensor((1, TQ, G), (scb, sc0, sc1), "int32"),
        LSE: T.StridedTensor((H, TQ), (sl0, sl1), "float32"),
        KB: T.Tensor((TQ,), "int32"),
        POS: T.Tensor((TQ,), "int32"),
        DQ: T.StridedTensor((TQ, H, dim), (sg0, sg1, 1), dtype),
        DELTA: T.Tensor((H, TQ), "float32"),
        scale: T.float32,
        group_heads: T.int32,
        use_counts: T.int32,
    ):
        with T.Kernel(TQ, G, threads=threads) as (bq, bg):
            T.annotate_min_blocks_per_sm(min_blocks)
            Qs = T.alloc_shared((head_tile, dim), dtype)
            dOs = T.alloc_shared((head_tile, dim), dtype)
            Ks = T.alloc_shared((TILE_KEYS, dim), dtype)
            Vs = T.alloc_shared((TILE_KEYS, dim), dtype)
            dSs = T.alloc_shared((TILE_KEYS, head_tile), dtype)
            lse2 = T.alloc_shared((head_tile,), "float32")
            delta = T.alloc_shared((head_tile,), "float32")
            blocks = T.alloc_shared((MAX_SLOTS,), "int32", scope="shared")
            used = T.alloc_shared((1,), "int32", scope="shared")
            od = T.alloc_fragment((head_tile, dim), "float32")
            dlt = T.alloc_fragment((head_tile,), "float32")
            S = T.alloc_fragment((TILE_KEYS, head_tile), "float32")
            dP = T.alloc_fragment((TILE_KEYS, head_tile), "float32")
            dS = T.alloc_fragment((TILE_KEYS, head_tile), dtype)
            dqT = T.alloc_fragment((dim, head_tile), "float32")
            T.assume(sq0 % 8 == 0)
            T.assume(sq1 % 8 == 0)
            T.assume(sd0 % 8 == 0)
            T.assume(sd1 % 8 == 0)
            T.assume(sg0 % 8 == 0)
            T.assume(sg1 % 8 == 0)
            T.assume(so0 % 8 == 0)
            T.assume(so1 % 8 == 0)
            T.assume(sk0 % 8 == 0)
            T.assume(sk1 % 8 == 0)
            T.assume(sv0 % 8 == 0)
            T.assume(sv1 % 8 == 0)

            pos = POS[bq]
            kb = KB[bq]
            last_block = T.if_then_else(pos >= 0, pos // block_size, -1)
            slots = T.min(T.if_then_else(use_counts != 0, T.max(BC[0, bq, bg], 0), TT), TT)
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E

            for h, d in T.Parallel(head_tile, dim):
                Qs[h, d] = T.if_then_else(h < group_heads, Q[bq, h0 + h, d], T.cast(0, dtype))
                dOs[h, d] = T.if_then_else(h < group_heads, DO[bq, h0 + h, d], T.cast(0, dtype))
            for h, d in T.Parallel(head_tile, dim):
                od[h, d] = T.if_then_else(h < group_heads, T.cast(O[bq, h0 + h, d], "float32") * T.cast(DO[bq, h0 + h, d], "float32"), 0)
            T.reduce_sum(od, dlt, dim=1)
            for h in T.Parallel(head_tile):
                delta[h] = dlt[h]
                # A padded head gets LSE +inf, so P = 0 there.
                lse2[h] = T.if_then_else(h < group_heads, LSE[h0 + T.min(h, group_heads - 1), bq] * LOG2E, INF)
            for h in T.Parallel(head_tile):
                if h < group_heads:
                    DELTA[h0 + h, bq] = dlt[h]
            _compact_blocks(BI, blocks, used, 0, bq, bg, slots, last_block)
            T.fill(dqT, 0)
            n_used = used[0]
            for it in T.serial(T.ceildiv(n_used, per_tile)):
                for k, d in T.Parallel(TILE_KEYS, dim):
                    slot = it * per_tile + k // block_size
                    n = blocks[T.min(slot, n_used - 1)] * block_size + k % block_size
                    ok = (slot < n_used) & (n <= pos)
                    row = T.if_then_else(ok, kb + n, 0)
                    Ks[k, d] = T.if_then_else(ok, K[row, bg, d], T.cast(0, dtype))
                    Vs[k, d] = T.if_then_else(ok, V[row, bg, d], T.cast(0, dtype))
                T.gemm(Ks, Qs, S, transpose_B=True, clear_accum=True)
                T.gemm(Vs, dOs, dP, transpose_B=True, clear_accum=True)
                for k, h in T.Parallel(TILE_KEYS, head_tile):
                    slot = it * per_tile + k // block_size
                    n = blocks[T.min(slot, n_used - 1)] * block_size + k % block_size
                    ok = (slot < n_used) & (n <= pos)
                    p = T.exp2(S[k, h] * scale_log2 - lse2[h])
                    dS[k, h] = T.cast(T.if_then_else(ok, p * (dP[k, h] - delta[h]), 0), dtype)
                T.copy(dS, dSs)
                T.gemm(Ks, dSs, dqT, transpose_A=True)
            for d, h in T.Parallel(dim, head_tile):
                Qs[h, d] = T.cast(dqT[d, h] * scale, dtype)
            for h, d in T.Parallel(head_tile, dim):
                if h < group_heads:
                    DQ[bq, h0 + h, d] = Qs[h, d]

    return main


def nsa_selection_bwd_dkv(dtype, dim, block_size, head_tile, threads, queries, min_blocks):
    assert TILE_KEYS % block_size == 0, "block_size must divide 64"
    cols = queries * head_tile
    TQ, TK, H, G, E, NSEG = T.dynamic("TQ TK H G E NSEG")
    (sq0, sq1, sd0, sd1, sk0, sk1, sv0, sv1, sl0, sl1, sa0, sa1, sb0, sb1, so0, so1) = T.dynamic(
        "sq0 sq1 sd0 sd1 sk0 sk1 sv0 sv1 sl0 sl1 sa0 sa1 sb0 sb1 so0 so1", "int64")

    @T.prim_func
    def main(
        Q: T.StridedTensor((TQ, H, dim), (sq0, sq1, 1), dtype),
        DO: T.StridedTensor((TQ, H, dim), (sd0, sd1, 1), dtype),
        K: T.StridedTensor((TK, G, dim), (sk0, sk1, 1), dtype),
        V: T.StridedTensor((TK, G, dim), (sv0, sv1, 1), dtype),
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
        with T.Kernel(NSEG, G, threads=threads) as (bs_, bg):
            T.annotate_min_blocks_per_sm(min_blocks)
            Ks = T.alloc_shared((TILE_KEYS, dim), dtype)
            Vs = T.alloc_shared((TILE_KEYS, dim), dtype)
            Qs = T.alloc_shared((cols, dim), dtype)
            dOs = T.alloc_shared((cols, dim), dtype)
            Ps = T.alloc_shared((TILE_KEYS, cols), dtype)
            dSs = T.alloc_shared((TILE_KEYS, cols), dtype)
            lse2 = T.alloc_shared((cols,), "float32")
            delta = T.alloc_shared((cols,), "float32")
            qlim = T.alloc_shared((cols,), "int32")
            S = T.alloc_fragment((TILE_KEYS, cols), "float32")
            dP = T.alloc_fragment((TILE_KEYS, cols), "float32")
            P = T.alloc_fragment((TILE_KEYS, cols), dtype)
            dS = T.alloc_fragment((TILE_KEYS, cols), dtype)
            dK = T.alloc_fragment((TILE_KEYS, dim), "float32")
            dV = T.alloc_fragment((TILE_KEYS, dim), "float32")
            T.assume(sq0 % 8 == 0)
            T.assume(sq1 % 8 == 0)
            T.assume(sd0 % 8 == 0)
            T.assume(sd1 % 8 == 0)
            T.assume(so0 % 8 == 0)
            T.assume(so1 % 8 == 0)
            T.assume(sk0 % 8 == 0)
            T.assume(sk1 % 8 == 0)
            T.assume(sv0 % 8 == 0)
            T.assume(sv1 % 8 == 0)

            lo = LO[bg, bs_]
            n_entries = HI[bg, bs_] - lo
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E
            if n_entries > 0:
                row0 = ER[lo]
                kend = KEND[EQ[lo]]
                for k, d in T.Parallel(TILE_KEYS, dim):
                    ok = (k < block_size) & (row0 + k < kend)
                    row = T.if_then_else(ok, row0 + k, 0)
                    Ks[k, d] = T.if_then_else(ok, K[row, bg, d], T.cast(0, dtype))
                    Vs[k, d] = T.if_then_else(ok, V[row, bg, d], T.cast(0, dtype))
                T.fill(dK, 0)
                T.fill(dV, 0)
                for step in T.serial(T.ceildiv(n_entries, queries)):
                    # Column c is head c % head_tile of entry step * queries + c // head_tile; a padded head
                    # or an entry past the block's run is a zero column with P = 0.
                    for c, d in T.Parallel(cols, dim):
                        e = step * queries + c // head_tile
                        h = c % head_tile
                        live = (e < n_entries) & (h < group_heads)
                        qi = EQ[lo + T.min(e, n_entries - 1)]
                        hh = h0 + T.min(h, group_heads - 1)
                        Qs[c, d] = T.if_then_else(live, Q[qi, hh, d], T.cast(0, dtype))
                        dOs[c, d] = T.if_then_else(live, DO[qi, hh, d], T.cast(0, dtype))
                    for c in T.Parallel(cols):
                        e = step * queries + c // head_tile
                        h = c % head_tile
                        live = (e < n_entries) & (h < group_heads)
                        qi = EQ[lo + T.min(e, n_entries - 1)]
                        hh = h0 + T.min(h, group_heads - 1)
                        lse2[c] = T.if_then_else(live, LSE[hh, qi] * LOG2E, INF)
                        delta[c] = T.if_then_else(live, DELTA[hh, qi], 0)
                        qlim[c] = T.if_then_else(live, QLIM[qi], -1)
                    T.gemm(Ks, Qs, S, transpose_B=True, clear_accum=True)
                    T.gemm(Vs, dOs, dP, transpose_B=True, clear_accum=True)
                    for k, c in T.Parallel(TILE_KEYS, cols):
                        ok = (k < block_size) & (row0 + k <= qlim[c])
                        p = T.if_then_else(ok, T.exp2(S[k, c] * scale_log2 - lse2[c]), 0)
                        P[k, c] = T.cast(p, dtype)
                        dS[k, c] = T.cast(T.if_then_else(ok, p * (dP[k, c] - delta[c]), 0), dtype)
                    T.copy(P, Ps)
                    T.copy(dS, dSs)
                    T.gemm(Ps, dOs, dV)
                    T.gemm(dSs, Qs, dK)
                for k, d in T.Parallel(TILE_KEYS, dim):
                    if (k < block_size) & (row0 + k < kend):
                        DK[row0 + k, bg, d] = T.cast(dK[k, d] * scale, dtype)
                        DV[row0 + k, bg, d] = T.cast(dV[k, d], dtype)

    return main
