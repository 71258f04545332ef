"""TileLang programs of the QSA MQA indexer.

score(row, key) = scale * sum_h relu(q[row, h] . k[key]), FP32, -inf where the key is not visible.

`mqa_logits` serves the padded score and packed prefill entrypoints: each row
sees the keys of one half-open interval [lo, hi) of its batch entry. Query
rows are the MMA's M operand, one GEMM per head (ReLU sits between the heads'
products and their sum, so the heads cannot share one GEMM), keys the N
operand. Key tiles wholly outside every row's interval are filled with -inf
without loading K; the key axis is split over `grid_y` CTAs so that short
row counts still fill the GPU. The tensor cores stay busy through the CUDA-core
work: the heads' GEMMs go out asynchronously two at a time (each head's ReLU-add
runs under the next head's GEMM), and a tile's masked, scaled store runs under
the next tile's first two GEMMs; `min_blocks` CTAs per multiprocessor overlap
further. (H200, issue 16's prefill: 175.6 us with each head's GEMM waited for
and the store after the last, 139.7 overlapped, 137.0 with 2 CTAs per SM; a
TMA store through shared memory was slower, 167.9 us, as TileLang waits for it.)

`mqa_decode` serves paged decode, one query row of 4 heads per request. The
gathered keys are the M operand and the 4 heads, zero-padded to 8, the N
operand, so the tensor cores still do the dot products. At one request the
call is latency: the page-table entries, the context length and Q are loaded
together, then the keys, two memory round trips before the MMA. An FP8 key
cache (kv_dtype) is gathered as FP8, half the bytes of the 16-bit one (what
bounds this kernel at large batches), upcast exactly into the query's dtype
in shared memory, and its per-tensor k_scale multiplies the scores.
"""

import tilelang.language as T

from mate.qsa.kernels.mqa_card import DIM, FP8_KV, HEADS, HEADS_MMA, LOAD_ELEMS, PRODUCER_REGS, consumer_regs

NEG_INF = -T.infinity("float32")


# ---------------------------------------------------------------- mqa_logits


@T.macro
def _row_intervals(lo, hi, lo_s, hi_s, bz, r0, R, N, block_rows):
    """Each row's interval clamped to [0, N); rows past R and rows with an empty interval must not widen
    the tile range, so theirs become the empty [N, 0)."""
    for i in T.Parallel(block_rows):
        a = T.if_then_else(r0 + i < R, T.max(lo[bz, r0 + i], 0), N)
        b = T.if_then_else(r0 + i < R, T.min(hi[bz, r0 + i], N), 0)
        lo_s[i] = T.if_then_else(a < b, a, N)
        hi_s[i] = T.if_then_else(a < b, b, 0)


@T.macro
def _visible_tiles(lo_s, hi_s, lo_min: T.Ref, hi_max: T.Ref, by, key_splits, N, block_rows, block_keys):
    """This split's key tiles [t_begin, t_end), and of those the ones some row can see: [c_begin, c_end)."""
    lo_min = N
    hi_max = 0
    for i in T.serial(block_rows):
        lo_min = T.min(lo_min, lo_s[i])
        hi_max = T.max(hi_max, hi_s[i])
    tiles = T.ceildiv(N, block_keys)
    per_split = T.ceildiv(tiles, key_splits)
    t_begin = by * per_split
    t_end = T.min(t_begin + per_split, tiles)
    c_begin = T.max(t_begin, lo_min // block_keys)
    c_end = T.max(c_begin, T.min(t_end, T.ceildiv(hi_max, block_keys)))
    return t_begin, t_end, c_begin, c_end


@T.macro
def _fill_hidden(O, acc, bz, r0, t_begin, t_end, c_begin, c_end, block_rows, block_keys):
    """-inf into the split's tiles that no row can see, without loading their keys."""
    T.fill(acc, NEG_INF)
    for t in T.serial(t_begin, T.min(c_begin, t_end)):
        T.copy(acc, O[bz, r0 : r0 + block_rows, t * block_keys : (t + 1) * block_keys])
    for t in T.serial(c_end, t_end):
        T.copy(acc, O[bz, r0 : r0 + block_rows, t * block_keys : (t + 1) * block_keys])


@T.macro
def _heads(Qs, Ks, S0, S1, acc, regs, block_rows, block_keys, store_prev, O, lo_s, hi_s, bz, r0, kp, scale):
    """acc = sum_h relu(Q_h K^T) of the tile in Ks, the heads' GEMMs on the tensor cores two at a time
    (S0, S1): each head's ReLU-add runs under the next head's GEMM, and with `store_prev` the previous
    tile's store (from acc, at key kp) under the first two. Every GEMM is issued and waited inside this
    block: ptxas serializes an asynchronous GEMM that crosses a branch (C7514). After each wait the
    registers it released are fenced: else the compiler may read S before the tensor cores are done."""
    T.wgmma_gemm(Qs[0, :, :], Ks, S0, transpose_B=True, clear_accum=True)
    T.wgmma_gemm(Qs[1, :, :], Ks, S1, transpose_B=True, clear_accum=True)
    if store_prev:
        _store_tile(O, acc, lo_s, hi_s, bz, r0, kp, scale, block_rows, block_keys)
    T.wait_wgmma(1)
    T.warpgroup_fence_operand(S0, num_regs=regs)
    for i, j in T.Parallel(block_rows, block_keys):
        acc[i, j] = T.max(S0[i, j], 0)
    T.wgmma_gemm(Qs[2, :, :], Ks, S0, transpose_B=True, clear_accum=True)
    T.wait_wgmma(1)
    T.warpgroup_fence_operand(S1, num_regs=regs)
    for i, j in T.Parallel(block_rows, block_keys):
        acc[i, j] += T.max(S1[i, j], 0)
    T.wgmma_gemm(Qs[3, :, :], Ks, S1, transpose_B=True, clear_accum=True)
    T.wait_wgmma(1)
    T.warpgroup_fence_operand(S0, num_regs=regs)
    for i, j in T.Parallel(block_rows, block_keys):
        acc[i, j] += T.max(S0[i, j], 0)
    T.wait_wgmma(0)
    T.warpgroup_fence_operand(S1, num_regs=regs)
    for i, j in T.Parallel(block_rows, block_keys):
        acc[i, j] += T.max(S1[i, j], 0)


@T.macro
def _store_tile(O, acc, lo_s, hi_s, bz, r0, k0, scale, block_rows, block_keys):
    """The tile at k0 from acc: scaled, -inf outside each row's interval."""
    for i, j in T.Parallel(block_rows, block_keys):
        n = k0 + j
        acc[i, j] = T.if_then_else((n >= lo_s[i]) & (n < hi_s[i]), acc[i, j] * scale, NEG_INF)
    T.copy(acc, O[bz, r0 : r0 + block_rows, k0 : k0 + block_keys])


def mqa_logits(dtype, even_keys, block_rows, block_keys, threads, num_stages, min_blocks):
    assert HEADS == 4, "_heads issues the 4 heads' GEMMs two at a time"
    B, R, N = T.dynamic("B R N")
    sqb, sqr, sqh, skb, skn, slb, slr, shb, shr = T.dynamic("sqb sqr sqh skb skn slb slr shb shr", "int64")
    regs = block_rows * block_keys // threads

    @T.prim_func
    def main(
        Q: T.StridedTensor((B, R, HEADS, DIM), (sqb, sqr, sqh, 1), dtype),
        K: T.StridedTensor((B, N, DIM), (skb, skn, 1), dtype),
        lo: T.StridedTensor((B, R), (slb, slr), "int32"),
        hi: T.StridedTensor((B, R), (shb, shr), "int32"),
        O: T.Tensor((B, R, N), "float32"),
        scale: T.float32,
        key_splits: T.int32,
    ):
        with T.Kernel(T.ceildiv(R, block_rows), key_splits, B, threads=threads) as (bx, by, bz):
            if min_blocks > 1:
                # Several CTAs per multiprocessor: one's stores and ReLUs run beside another's GEMMs.
                # The producer warpgroup gives its registers to the consumer, within the CTA's share.
                T.annotate_min_blocks_per_sm(min_blocks)
                T.annotate_producer_reg_dealloc(PRODUCER_REGS)
                T.annotate_consumer_reg_alloc(consumer_regs(threads, min_blocks))
            Qs = T.alloc_shared((HEADS, block_rows, DIM), dtype)
            Ks = T.alloc_shared((block_keys, DIM), dtype)
            lo_s = T.alloc_shared((block_rows,), "int32")
            hi_s = T.alloc_shared((block_rows,), "int32")
            S0 = T.alloc_fragment((block_rows, block_keys), "float32")
            S1 = T.alloc_fragment((block_rows, block_keys), "float32")
            acc = T.alloc_fragment((block_rows, block_keys), "float32")
            lo_min = T.alloc_var("int32")
            hi_max = T.alloc_var("int32")
            # The wrapper checks the layout rule; telling the compiler lets it use 16-byte loads.
            T.assume(sqb % 8 == 0)
            T.assume(sqr % 8 == 0)
            T.assume(sqh % 8 == 0)
            if even_keys:
                # Each thread holds pairs of adjacent scores: with an even row length they
                # go out as 8-byte stores that fill whole 32-byte sectors (scalar stores
                # half-fill them, and L2 write traffic bounds this kernel).
                T.assume(N % 2 == 0)
            r0 = bx * block_rows

            _row_intervals(lo, hi, lo_s, hi_s, bz, r0, R, N, block_rows)
            for h in T.serial(HEADS):
                T.copy(Q[bz, r0 : r0 + block_rows, h, :], Qs[h, :, :])
            t_begin, t_end, c_begin, c_end = _visible_tiles(lo_s, hi_s, lo_min, hi_max, by, key_splits, N, block_rows, block_keys)
            _fill_hidden(O, acc, bz, r0, t_begin, t_end, c_begin, c_end, block_rows, block_keys)
            nt = c_end - c_begin
            # Iteration t scores tile t and stores tile t - 1 meanwhile: one more iteration than tiles,
            # whose load repeats the last tile (never used).
            for t in T.Pipelined(nt + T.if_then_else(nt > 0, 1, 0), num_stages=num_stages):
                k0 = T.min(c_begin + t, c_end - 1) * block_keys
                T.copy(K[bz, k0 : k0 + block_keys, :], Ks)
                kp = (c_begin + t - 1) * block_keys
                if (t > 0) & (t < nt):
                    _heads(Qs, Ks, S0, S1, acc, regs, block_rows, block_keys, True, O, lo_s, hi_s, bz, r0, kp, scale)
                elif t < nt:
                    _heads(Qs, Ks, S0, S1, acc, regs, block_rows, block_keys, False, O, lo_s, hi_s, bz, r0, kp, scale)
                else:
                    _store_tile(O, acc, lo_s, hi_s, bz, r0, kp, scale, block_rows, block_keys)

    return main


# ---------------------------------------------------------------- mqa_decode


@T.macro
def _tile_pages(pages, pt, tx, n0, ctx, P, page_size, pages_per_tile):
    """The pool pages of this key tile into `pages`, -1 for one not to read: a page is read only if it is
    in the table, inside the pool and holds a visible key. Thread j loaded entry j into `pt` (whatever the
    context length: it is inside the table) before the Q loads, so the table, the length and Q arrive
    in one memory round trip, not three in turn."""
    if tx < pages_per_tile:
        lp = n0 // page_size + tx
        pages[tx] = T.if_then_else((pt >= 0) & (pt < P) & (lp * page_size < ctx), pt, -1)


@T.macro
def _gather_keys(Kc, Ks, pages, page_size, block_keys, dtype):
    """The tile's keys into shared memory by cp.async (zero-filled for a page not read), all of a thread's
    copies in flight at once. Staged through registers instead (b8777bc to 04f8837), the tile took 54
    registers a thread, which held 9 CTAs on an SM; by cp.async 30, and shared memory holds 11. H200,
    bench_mqa's inputs (every request's 8192 keys, page 16), cold graph, 64 keys / 128 threads: batch 1
    7.14 -> 6.94 us, 16 17.57 -> 16.90, 64 45.09 -> 44.83, 128 78.37 -> 76.93
    (benchmarks/results/NVIDIA_H200-2026-12-02-mqa-decode-cp.md)."""
    for i, d in T.Parallel(block_keys, DIM, prefer_async=True):
        Ks[i, d] = T.if_then_else(pages[i // page_size] >= 0, Kc[T.max(pages[i // page_size], 0), i % page_size, d], T.cast(0, dtype))


@T.macro
def _upcast(K8, Ks, block_keys, dtype):
    """An FP8 tile (half the bytes gathered) into the query's dtype, exactly (every e4m3 / e5m2 value is a BF16
    and an FP16 value), once in shared memory: the MMA reads it from there, as it reads the 16-bit tile."""
    for i, d in T.Parallel(block_keys, DIM):
        Ks[i, d] = T.cast(K8[i, d], dtype)


@T.macro
def _store_scores(O, pages, score, by, n0, ctx, scale, page_size, block_keys):
    """The tile's scores, -inf for a key not visible or in a page not read."""
    for i in T.Parallel(block_keys):
        n = n0 + i
        if n < O.shape[1]:
            O[by, n] = T.if_then_else((pages[i // page_size] >= 0) & (n < ctx), score[i] * scale, NEG_INF)


def mqa_decode(dtype, page_size, block_keys, threads, kv_dtype=None):
    """kv_dtype (a compile-time option, not a config key): an FP8 cache's dtype, on the entry's tiles; its keys
    are gathered as FP8 and upcast in shared memory, and the per-tensor k_scale, a factor of every score, is
    folded into `scale` (a float, by the host) or read from KS (a one-element tensor, when k_dev)."""
    fp8 = kv_dtype is not None
    assert not fp8 or kv_dtype in FP8_KV, f"kv_dtype must be one of {FP8_KV}, got {kv_dtype}"
    kv_dtype = kv_dtype or dtype
    align = 16 if fp8 else LOAD_ELEMS  # cache elements per 16-byte copy
    assert block_keys % page_size == 0, "block_keys must be a multiple of page_size"
    assert (block_keys * DIM // align) % threads == 0, "every thread copies the same number of 16-byte chunks"
    B, P, MP, L = T.dynamic("B P MP L")
    sqb, sqh, skp, skt, spb, spp, scl = T.dynamic("sqb sqh skp skt spb spp scl", "int64")
    pages_per_tile = block_keys // page_size

    @T.macro
    def body(Q, Kc, page_table, context_lens, O, scale, KS=None, k_dev=None):
        with T.Kernel(T.ceildiv(L, block_keys), B, threads=threads) as (bx, by):
            Qs = T.alloc_shared((HEADS_MMA, DIM), dtype)
            Ks = T.alloc_shared((block_keys, DIM), dtype)
            K8 = T.alloc_shared((block_keys, DIM), kv_dtype) if fp8 else None  # the FP8 tile as gathered
            pages = T.alloc_shared((pages_per_tile,), "int32")
            S = T.alloc_fragment((block_keys, HEADS_MMA), "float32")
            score = T.alloc_fragment((block_keys,), "float32")
            tx = T.get_thread_binding()
            # The wrapper checks the layout rule; telling the compiler lets it use 16-byte loads.
            T.assume(skp % align == 0)
            T.assume(skt % align == 0)
            n0 = bx * block_keys
            ctx = context_lens[by]
            if fp8:
                # k_scale multiplies every q.k; ReLU commutes with a positive factor, so it multiplies the score
                # (the checks require it positive). Loaded with the table and the length, in their round trip;
                # with a float scale (k_dev 0, KS a stand-in) nothing is loaded.
                k_scale = T.alloc_var("float32")
                k_scale = T.if_then_else(k_dev > 0, KS[0], T.float32(1))

            lp = n0 // page_size + tx
            pt = T.if_then_else((tx < pages_per_tile) & (lp < MP), page_table[by, lp], -1)
            # Q goes through plain loads, so a broadcast (stride-0) batch axis is fine.
            # Heads past HEADS are the zero rows that pad the MMA's N.
            for h, d in T.Parallel(HEADS_MMA, DIM):
                Qs[h, d] = T.if_then_else(h < HEADS, Q[by, h, d], T.cast(0, dtype))
            _tile_pages(pages, pt, tx, n0, ctx, P, page_size, pages_per_tile)
            _gather_keys(Kc, K8 if fp8 else Ks, pages, page_size, block_keys, kv_dtype)
            if fp8:
                _upcast(K8, Ks, block_keys, dtype)
            T.gemm(Ks, Qs, S, transpose_B=True, clear_accum=True)
            for i, h in T.Parallel(block_keys, HEADS_MMA):
                S[i, h] = T.max(S[i, h], 0)
            T.reduce_sum(S, score, dim=1)
            _store_scores(O, pages, score, by, n0, ctx, scale * k_scale if fp8 else scale, page_size, block_keys)

    Q_t = T.StridedTensor((B, HEADS, DIM), (sqb, sqh, 1), dtype)
    K_t = T.StridedTensor((P, page_size, DIM), (skp, skt, 1), kv_dtype)
    PT_t = T.StridedTensor((B, MP), (spb, spp), "int32")
    CL_t = T.StridedTensor((B,), (scl,), "int32")

    if not fp8:
        @T.prim_func
        def main(Q: Q_t, Kc: K_t, page_table: PT_t, context_lens: CL_t, O: T.Tensor((B, L), "float32"), scale: T.float32):
            body(Q, Kc, page_table, context_lens, O, scale)

        return main

    @T.prim_func
    def main_fp8(Q: Q_t, Kc: K_t, page_table: PT_t, context_lens: CL_t, O: T.Tensor((B, L), "float32"), scale: T.float32,
                 KS: T.Tensor((1,), "float32"), k_dev: T.int32):
        body(Q, Kc, page_table, context_lens, O, scale, KS, k_dev)

    return main_fp8
