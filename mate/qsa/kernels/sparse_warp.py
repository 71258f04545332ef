"""TileLang program of QSA sparse core attention, small-CTA family: one warp per (row, KV head, split).

Design of the fastest public kernels for this job (vLLM's and SGLang's Triton QSA kernels, read
at the commits of issue 37): the group's heads, zero-padded to 16, are the M of mma.sync
(m16n8k16), the tokens N, `block_n` a step, and the softmax stays inside the warp, so a CTA needs
no mbarrier, no producer role and no cross-warp reduction; with ~40 KB of shared memory five or
more CTAs share an SM, and their gathers overlap each other's math.

    S [16, n]   = Q [16, D] . K_tile [n, D]^T
    O [16, D]  += P [16, n] . V_tile [n, D]        (P from registers: S's accumulator layout)

What this program adds to that design: the token -> page -> address chain is decoded a chunk of
CHUNK token slots at a time, all of a chunk's loads in flight together, a chunk ahead of the gather:
the token ids of chunk c + 2 and the pages of chunk c + 1 go out when chunk c starts. (Decoded a tile
ahead, every tile waited for one page lookup: H200, one row-head alone, 2.4 us per 16-token tile at
any ring depth.) The K/V rows are gathered by cp.async into a ring of `num_stages` tiles, zero-filled
for a masked token.

Row metadata, the selection's layout and the flags are those of mate.qsa.kernels.sparse (its
macros, shared), so the two programs take the same arguments.
"""

import tilelang.language as T

from mate._tl import FENCE_SOURCE, alloc_vars, assume_aligned, fence, scale_into_fp16, times_sigmoid, upcast_stage
from mate.qsa.kernels.sparse import (
    GATE_NATIVE, HAS_GATE, K_SCALE_DEV, LOG2E, M_FLOOR, NEG_INF, NO_COMMIT_WAIT, PASS_CONFIGS as _BASE_PASS_CONFIGS, V_SCALE_DEV,
    ROW_PHYSICAL, SPLIT_SOURCE, WRITE_LSE, ZERO, Signature, _list_share, token_id, _prefetch_metadata, _row_keys, _row_request,
)
from mate._hopper import FP8_KV, itemsize
from mate.qsa.kernels.sparse_card import DIM, WARP, WARP_CHUNK
from mate.qsa.kernels.sparse_card import WARP_HEADS as HEADS

# cp.async by hand (commit and wait groups of the ring), no TMA, no automatic warp specialization
PASS_CONFIGS = (*_BASE_PASS_CONFIGS, ("tl.disable_tma_lower", True), ("tl.disable_warp_specialized", True))


# Token slots decoded at a time, CHUNK // threads a thread: a chunk's token-id loads, then its page loads, are in
# flight together, a chunk ahead of the gather that reads them.
CHUNK = WARP_CHUNK


@T.macro
def _chunk_ids(TI, BI, tok, row, c, tx, first, last, block_slots: T.Ref, blocks, NB, threads):
    """The token ids of this thread's slots of chunk c (-1: none); the loads are consumed a chunk later."""
    for j in T.unroll(CHUNK // threads):
        token_id(TI, BI, tok, j, first + c * CHUNK + j * threads + tx, row, last, block_slots, blocks, NB)


@T.macro
def _chunk_pages(BT, tok, pg, sl, bs, paged, live, limit, pos, row_mode, PS, threads):
    """The page of each of this thread's token ids (its load goes out now, consumed a chunk later) and its slot,
    -1 for a token the row cannot see."""
    for j in T.unroll(CHUNK // threads):
        t = tok[j]
        # the page is loaded whether or not the token is visible, so that it waits only for the token id
        pg[j] = T.if_then_else(paged, T.if_then_else(live & (BT.shape[1] > 0), BT[bs, T.min(T.max(t, 0) // PS, BT.shape[1] - 1)], -1),
                               T.if_then_else(row_mode == ROW_PHYSICAL, 0, bs))
        visible = live & (t >= 0) & (t < limit) & ((row_mode == ROW_PHYSICAL) | (t <= pos))
        sl[j] = T.if_then_else(visible, T.if_then_else(paged, T.max(t, 0) % PS, T.max(t, 0)), -1)


@T.macro
def _publish(ko, vo, pg, sl, c, tx, kvh, P, strides, vec, threads):
    """Chunk c's K and V row offsets into its half of the shared lists, in 16-byte units of `vec` elements (the
    strides are multiples of vec; int32: the wrapper runs this family only on K/V spans under 32 GiB), -1 for a
    masked token."""
    skp, sks, skh, svp, svs, svh = strides
    for j in T.unroll(CHUNK // threads):
        ok = (sl[j] >= 0) & (pg[j] >= 0) & (pg[j] < P)
        ko[c % 2, j * threads + tx] = T.if_then_else(ok, T.Cast("int32", (T.Cast("int64", pg[j]) * skp + sl[j] * sks + kvh * skh) // vec), -1)
        vo[c % 2, j * threads + tx] = T.if_then_else(ok, T.Cast("int32", (T.Cast("int64", pg[j]) * svp + sl[j] * svs + kvh * svh) // vec), -1)


# A round of the gather covers threads / 8 rows, 8 threads x 16 bytes (one 128-byte line) each, and a thread
# keeps its row for the row's lines (4 of BF16, 2 of FP8): it reads the row's offset once, and each copy is an immediate
# offset from it. (One row per instruction, its (page, slot) re-read for every copy, took 23 instructions and
# two dependent shared loads per 16-byte copy: nvcc reloads shared memory after every cp.async.)


@T.macro
def _gather_rows(X, Xs, offsets, st, i, tx, block_n, vec, threads):
    """Tile i's rows of X into ring stage st by cp.async (16 bytes, `vec` elements, a copy), zero-filled for a
    masked token."""
    rows = threads // 8
    for j in T.unroll(block_n // rows):
        k = j * rows + tx // 8
        off = offsets[i * block_n // CHUNK % 2, i * block_n % CHUNK + k]
        for line in T.unroll(DIM // (8 * vec)):
            d = line * 8 * vec + tx % 8 * vec
            # X[0, 0, 0, e] is element e of X's storage: the offset spans the row's page, slot and head
            T.ptx_cp_async(T.access_ptr(Xs[st, k, d], "w", vec), T.access_ptr(X[0, 0, 0, T.Cast("int64", T.max(off, 0)) * vec + d], "r", vec),
                           vec, predicate=off >= 0)


@T.macro
def _attend(Qs, Ks, Vs, ko, S, S1, Pr, acc, m_cur, m_prev, alpha, rowsum, st, t, scale_log2, block_n, warps):
    """One tile: S = Q K^T, masked to -inf where the token is, online softmax, O = O * alpha + P V.

    Several warps share a tile: each takes block_n / warps of its tokens in QK and DIM / warps of the output in PV
    (so P, whole, goes through shared memory: Pr is then a shared tile), the softmax's row reductions across them."""
    policy = T.GemmWarpPolicy.FullCol
    # the D reduction as two independent MMA chains of DIM / 32 steps, not one of DIM / 16: the tensor core's
    # dependent-accumulate latency is paid half as often (H200 prefill 2493 -> 2426 us; 4 chains 2478)
    T.gemm(Qs[:, 0:DIM // 2], Ks[st, :, 0:DIM // 2], S, transpose_B=True, clear_accum=True, policy=policy)
    T.gemm(Qs[:, DIM // 2:DIM], Ks[st, :, DIM // 2:DIM], S1, transpose_B=True, clear_accum=True, policy=policy)
    for h, k in T.Parallel(HEADS, block_n):
        S[h, k] = S[h, k] + S1[h, k]
    for h, k in T.Parallel(HEADS, block_n):
        S[h, k] = T.if_then_else(ko[t * block_n // CHUNK % 2, t * block_n % CHUNK + k] >= 0, S[h, k], NEG_INF)
    T.copy(m_cur, m_prev)
    T.reduce_max(S, m_cur, dim=1, clear=False)
    for h in T.Parallel(HEADS):
        alpha[h] = T.exp2((m_prev[h] - m_cur[h]) * scale_log2)
    for h, k in T.Parallel(HEADS, block_n):
        # (S - m) * scale, not S * scale - m * scale: with a large scale (an FP8 call's query scaled down into
        # FP16, scale_log2 up to 1e23), M_FLOOR * scale is -inf and a masked tile's -inf - -inf a NaN
        S[h, k] = T.exp2((S[h, k] - m_cur[h]) * scale_log2)
        rowsum[h, k] = rowsum[h, k] * alpha[h] + S[h, k]
    for h, d in T.Parallel(HEADS, DIM):
        acc[h, d] *= alpha[h]
    T.copy(S, Pr)
    if warps > 1:
        T.sync_threads()  # every warp's columns of P are in
        fence()
    T.gemm(Pr, Vs[st, :, :], acc, policy=policy)


@T.macro
def _store(O, acc, alpha, row, h0, group, gate):
    """The output rows of the group's heads, times sigmoid(gate) where there is one. A padded head repeats the
    group's last one bit for bit (same Q row, same keys), so it stores that head's values again: no branch
    around a load, and no branch after one (times_sigmoid), so that a lane's gate loads go out together
    (with a branch, each waited for the store before it)."""
    for h, d in T.Parallel(HEADS, DIM):
        hd = h0 + T.min(h, group - 1)
        if gate is None:
            O[row, hd, d] = acc[h, d] * alpha[h]
        else:
            O[row, hd, d] = times_sigmoid(acc[h, d] * alpha[h], T.cast(gate[row, hd, d], "float32"))


@T.macro
def _load_q(Q, Qs, row, h0: T.Ref, group: T.Ref, qmul: T.Ref, fp8, dtype):
    """The Q tile of the group's heads; an FP8 cache's is scaled into FP16 (scale_into_fp16), qmul its factor.
    Heads past the group repeat its last head: their rows of S and O are finite and never stored."""
    if fp8:
        Qf = T.alloc_fragment((HEADS, DIM), dtype)
        for h, d in T.Parallel(HEADS, DIM):
            Qf[h, d] = Q[row, h0 + T.min(h, group - 1), d]
        scale_into_fp16(Qf, Qs, T.alloc_fragment((HEADS,), dtype), T.alloc_shared((HEADS,), dtype), qmul)
    else:
        for h, d in T.Parallel(HEADS, DIM):
            Qs[h, d] = Q[row, h0 + T.min(h, group - 1), d]


@T.macro
def _finish(O, LSE, G, GH, acc, rowsum, l_sum, alpha, m_cur, row, sp, h0: T.Ref, group: T.Ref, qk_scale: T.Ref, norm: T.Ref,
            flags, split):
    """After the last tile: the softmax sums, then split's FP32 partial and LSE for `merge`, or the output (gated
    when asked) and the LSE when asked."""
    T.reduce_sum(rowsum, l_sum, dim=1)
    for h in T.Parallel(HEADS):
        alpha[h] = T.if_then_else(l_sum[h] > 0, norm / l_sum[h], 0)  # one division a head
    if split:
        for h, d in T.Parallel(HEADS, DIM):
            if h < group:
                O[sp, row, h0 + h, d] = acc[h, d] * alpha[h]
        for h in T.Parallel(HEADS):
            if h < group:
                LSE[sp, row, h0 + h] = T.if_then_else(l_sum[h] > 0, m_cur[h] * qk_scale + T.log(l_sum[h]), NEG_INF)
    else:
        # one loop per gate kind, the flag tests outside it (prefill, one split, with the tests inside:
        # 4358 us gated, 2762 ungated)
        if (flags & HAS_GATE) == 0:
            _store(O, acc, alpha, row, h0, group, None)
        elif (flags & GATE_NATIVE) != 0:
            _store(O, acc, alpha, row, h0, group, GH)
        else:
            _store(O, acc, alpha, row, h0, group, G)
        if (flags & WRITE_LSE) != 0:
            for h in T.Parallel(HEADS):
                if h < group:
                    LSE[row, h0 + h] = T.if_then_else(l_sum[h] > 0, m_cur[h] * qk_scale + T.log(l_sum[h]), NEG_INF)


def sparse_attention_warp(dtype, split, block_n, num_stages, kv_dtype=None, warps=1):
    """The attention pass (mate.qsa.kernels.sparse's arguments, then KS, VS, v_mult); split: FP32 partials per
    split for `merge`.

    warps: the warps that share one (row, KV head, split) and its tiles (see _attend); 1, the design above.
    (Not a config key yet: written 2026-12-08 without a GPU, never run; issue 37's probe found one warp's tile
    math, ~950 ns a 16-token tile on an H100, to be what bounds a CTA at decode.)

    kv_dtype (a compile-time option, not a config key): an FP8 cache's dtype, on the entry's tiles. Its rows are
    gathered as FP8 into the ring (half the bytes) and upcast to FP16 a tile at a time (FP16 MMAs). The dequant scales are factors
    of the scores and of the output: k_scale multiplies `scale` (a float, by the host, or KS[0] where flags has
    K_SCALE_DEV), v_scale the output's normalization (v_mult, or VS[0] with V_SCALE_DEV). A 16-bit cache ignores
    KS, VS and v_mult (the wrapper passes stand-ins and 1)."""
    assert CHUNK % block_n == 0 and num_stages - 1 <= CHUNK // block_n, "a chunk's lists live until its tiles are read"
    threads = WARP * warps
    assert CHUNK % threads == 0 and block_n % (threads // 8) == 0 and block_n // warps >= 8, f"warps {warps} at block_n {block_n}"
    fp8 = kv_dtype is not None
    assert not fp8 or kv_dtype in FP8_KV, f"kv_dtype must be one of {FP8_KV}, got {kv_dtype}"
    kv_dtype = kv_dtype or dtype
    # FP8 K/V: FP16 MMAs, the query scaled by a power of two into FP16's range (scale_into_fp16)
    mma = "float16" if fp8 else dtype
    vec = 16 // itemsize(kv_dtype)
    a = Signature(dtype, kv_dtype, split, unit_q=True)
    R, HQ, P, PS, HKV, W, NB, BTB, MP, NM, NSLK, SPL = a.R, a.HQ, a.P, a.PS, a.HKV, a.W, a.NB, a.BTB, a.MP, a.NM, a.NSLK, a.SPL
    sources = FENCE_SOURCE + SPLIT_SOURCE if split else FENCE_SOURCE

    @T.prim_func
    def main(
        Q: a.Q, K: a.K, V: a.V, TI: a.TI, BI: a.BI, BT: a.BT, ROWMAP: a.ROWMAP, SLQ: a.SLQ, SLK: a.SLK, QP: a.QP, G: a.G, GH: a.GH,
        O: a.O, LSE: a.LSE,
        scale: T.float32, row_mode: T.int32, flags: T.int32, n_req: T.int32, q_len: T.int32, chunk: T.int32,
        KS: T.Tensor((1,), "float32"), VS: T.Tensor((1,), "float32"), v_mult: T.float32,
    ):
        with T.Kernel(R, HKV, SPL if split else 1, threads=threads) as (row, kvh, sp):
            T.import_source(sources)
            Qs = T.alloc_shared((HEADS, DIM), mma)
            # the ring as gathered; an FP8 one is upcast into a one-stage FP16 tile for the MMAs
            Kr = T.alloc_shared((num_stages, block_n, DIM), kv_dtype)
            Vr = T.alloc_shared((num_stages, block_n, DIM), kv_dtype)
            Ks = T.alloc_shared((1, block_n, DIM), mma) if fp8 else Kr
            Vs = T.alloc_shared((1, block_n, DIM), mma) if fp8 else Vr
            # two chunks' K/V row offsets: the one the gather reads and the one published next
            ko = T.alloc_shared((2, CHUNK), "int32", scope="shared")
            vo = T.alloc_shared((2, CHUNK), "int32", scope="shared")
            counts = T.alloc_shared((2,), "int32", scope="shared")
            tok = T.alloc_local((CHUNK // threads,), "int32")
            pg = T.alloc_local((CHUNK // threads,), "int32")
            sl = T.alloc_local((CHUNK // threads,), "int32")
            S = T.alloc_fragment((HEADS, block_n), "float32")
            S1 = T.alloc_fragment((HEADS, block_n), "float32")
            # P in the MMA's dtype, the PV MMA's A (from registers, or shared when warps share the tile)
            Pr = T.alloc_fragment((HEADS, block_n), mma) if warps == 1 else T.alloc_shared((HEADS, block_n), mma)
            rowsum = T.alloc_fragment((HEADS, block_n), "float32")
            acc = T.alloc_fragment((HEADS, DIM), "float32")
            m_cur = T.alloc_fragment((HEADS,), "float32")
            m_prev = T.alloc_fragment((HEADS,), "float32")
            alpha = T.alloc_fragment((HEADS,), "float32")
            l_sum = T.alloc_fragment((HEADS,), "float32")
            b, local, nrows, lo, hi = alloc_vars(5)
            tx = T.get_thread_binding()
            # The wrapper passes Q and K/V with unit feature stride, 16-byte aligned bases and strides.
            assume_aligned(*a.q_strides)
            assume_aligned(*a.kv_strides, elems=vec)
            if split:
                T.pdl_trigger()
                _prefetch_metadata(TI, BT, ROWMAP, SLK, row, sp, chunk, tx, threads, W, MP, BTB, NM, NSLK)
            strides = a.kv_strides
            group = T.alloc_var("int32")
            h0 = T.alloc_var("int32")
            group = HQ // HKV
            h0 = kvh * group
            _row_request(ROWMAP, counts, b, local, nrows, lo, hi, row, tx, R, row_mode, n_req, q_len, threads)
            bs, paged, live, pos, limit = _row_keys(SLQ, SLK, QP, b, local, nrows, row, flags, MP, PS)
            n_slots = T.alloc_var("int32")
            block_slots = T.alloc_var("int32")
            blocks, first, last, _ = _list_share(BI, n_slots, block_slots, lo, hi, row, sp, flags, chunk, W, NB)
            n_tiles = T.ceildiv(T.max(last - first, 0), block_n)

            # chunk 0's pages and chunk 1's token ids in flight before the ring starts
            _chunk_ids(TI, BI, tok, row, 0, tx, first, last, block_slots, blocks, NB, threads)
            _chunk_pages(BT, tok, pg, sl, bs, paged, live, limit, pos, row_mode, PS, threads)
            _chunk_ids(TI, BI, tok, row, 1, tx, first, last, block_slots, blocks, NB, threads)
            qmul = T.alloc_var("float32")
            qmul = 1.0
            _load_q(Q, Qs, row, h0, group, qmul, fp8, dtype)
            T.fill(acc, 0)
            T.fill(rowsum, 0)
            T.fill(m_cur, M_FLOOR)
            # the scores' factor, with k_scale; `norm` the output's, with v_scale (FP8 only)
            qk_scale = T.alloc_var("float32")
            norm = T.alloc_var("float32")
            qk_scale = scale
            norm = 1.0
            if fp8:
                qk_scale = scale * T.if_then_else((flags & K_SCALE_DEV) != 0, KS[0], T.float32(1)) / qmul
                norm = T.if_then_else((flags & V_SCALE_DEV) != 0, VS[0], v_mult)
            scale_log2 = qk_scale * LOG2E
            for i in T.serial(n_tiles + num_stages - 1):
                # issue tile i, then compute tile i - (num_stages - 1), whose group is then the oldest in flight
                if i < n_tiles:
                    if i * block_n % CHUNK == 0:
                        c = i * block_n // CHUNK
                        _publish(ko, vo, pg, sl, c, tx, kvh, P, strides, vec, threads)
                        _chunk_pages(BT, tok, pg, sl, bs, paged, live, limit, pos, row_mode, PS, threads)
                        _chunk_ids(TI, BI, tok, row, c + 2, tx, first, last, block_slots, blocks, NB, threads)
                        T.sync_threads()  # the chunk's lists are published
                        fence()
                    _gather_rows(K, Kr, ko, i % num_stages, i, tx, block_n, vec, threads)
                    _gather_rows(V, Vr, vo, i % num_stages, i, tx, block_n, vec, threads)
                T.ptx_commit_group()
                if i >= num_stages - 1:
                    T.ptx_wait_group(num_stages - 1)
                    T.sync_threads()
                    fence()
                    st = (i - num_stages + 1) % num_stages
                    if fp8:
                        upcast_stage(Kr, Ks, st)
                        upcast_stage(Vr, Vs, st)
                        T.sync_threads()
                    _attend(Qs, Ks, Vs, ko, S, S1, Pr, acc, m_cur, m_prev, alpha, rowsum, 0 if fp8 else st,
                            i - num_stages + 1, scale_log2, block_n, warps)
                    fence()
                    T.sync_threads()  # the stage is free for the gather num_stages - 1 tiles on
            _finish(O, LSE, G, GH, acc, rowsum, l_sum, alpha, m_cur, row, sp, h0, group, qk_scale, norm, flags, split)

    return main
