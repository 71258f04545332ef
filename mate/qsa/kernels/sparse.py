"""TileLang programs of QSA sparse core attention: the attention pass and the SplitKV merge.

Attention: one CTA per (query row, KV head, split). The CTA's query heads (the
group, 1..16, zero-padded to `head_tile`) attend to the row's selected tokens,
read from K/V through a per-row token list. Every layout is the same gather:
K/V are seen as [pages, page_size, Hkv, D] with runtime int64 strides, and a
token t of request b lives at (page, slot) =

    paged K/V:      (block_table[b, t // page_size], t % page_size)
    padded [B, S]:  (b, t)             (page_size = S)
    physical ids:   (0, t)             ([N, Hkv, D] seen as one page of N)

Orientation ("keys as M", as in NSA selection): a group has too few heads for
wgmma's M of 64, so the 64 tokens of a tile are the M operand and the heads N:

    S^T [64, heads]  = K_tile [64, D] . Q^T
    O^T [D, heads]  += V_tile^T [D, 64] . P^T [64, heads]

Warp specialization: a consumer warpgroup (warps 4-7) runs the MMAs and the
online softmax; a producer warpgroup (warps 0-3: TileLang 0.1.15 emits cp.async
into a swizzled tile only from the first warps) decodes DECODE_TILES tiles of
token ids at a time (all their loads in flight together) into shared memory,
then gathers each tile's K/V rows with cp.async (one 512-byte row per warp
instruction, zero-filled for a masked token) into a ring of `num_stages`
tiles. Each stage has a pair of mbarriers for K and a pair for V: `full`
(producer -> consumer: the cp.async arrivals plus one plain arrival per
producer thread, which for K also publishes the stage's token-valid flags) and
`empty` (consumer -> producer), so that a tile's K gather waits only for the
previous S GEMM and its V gather only for the previous PV GEMM; the producer
loads the next chunk's token ids ahead. Both roles run the same number of
tiles, zero included, so no copy is ever left in flight. Named barriers:
TileLang's cross-warp reductions in the consumer use ids 1 and 2, so the
producer syncs on 3.

Where the time goes (H200, benchmarks/results/qsa_attention_h200.json): the
consumer is latency-bound at about 1.4 us per 64-token tile (32 wgmmas of
N = 16 and a cross-warp max; the tensor pipe is 5% busy), so a grid with two
CTAs per SM runs faster with a one-stage ring that lets two CTAs share an SM
(configs: `wide`). At decode sizes a CTA has a tile or two, so its straight-line
prologue and epilogue weigh as much as its tiles: binding the group size and
the softmax sum's reciprocal once took the split kernel's SASS from 121 to 77
KB and one row's attention from 27.3 to 16.8 us (ncu, caches flushed;
benchmarks/results/NVIDIA_H200-2026-12-01-qsa-issue16-sass.md). Prefill is not bound by L2 or DRAM: folding every selected token into a
quarter of the pool (16.8 MB of K/V instead of 67 MB) saved 2% (H200, 4096
rows); the separate K/V barriers saved 11% (3679 -> 3277 us;
benchmarks/results/NVIDIA_H200-2026-12-01-qsa-issue16-prefill.md). A timeline of split decode
(globaltimer stamps per phase, one row, 11 splits of 3 tiles, L2 flushed;
benchmarks/results/NVIDIA_H200-2026-12-01-qsa-issue16-s16x.md), in us after the first CTA starts:
request metadata 1.4, token ids 1.9, pages 2.6, the three tiles' cp.async issued by 4.1 / 5.4 / 6.8
(1.35 us of issue a tile), the consumer's Q tile in shared memory only at 10.0 (its 32 loads a
thread), each tile's math 0.85, the partial stores issued by 15.6, the merge 16.5 to 18.9. So the
split kernel's consumer loads its Q elements into registers at the CTA's start (_load_q), stages its partial
output through shared memory (_store_partial), and eight producer warps issue the gather where a CTA has an
SM to itself (wide=0): benchmarks/experiments/gather_probe.py times the gather alone, and a CTA's cp.async go out faster
from eight warps than from four (H200, 22 CTAs of 3 tiles: 11.6 against 12.6 us; 132 CTAs of 33 tiles,
3 stages: 84.8 against 100.0 us). With two CTAs an SM (wide=1, a one-stage ring each) four warps a CTA
issue as fast as eight (264 CTAs of 33 tiles: 143.2 against 141.3 us), and a third warpgroup's registers
would cost the second CTA (benchmarks/results/NVIDIA_H200-2026-12-01-qsa-gather-probe.md).

A masked token gets score -inf and a zero V row: its P is 0 and 0 * V is 0
(a garbage V row could be NaN). The running max starts at a finite floor, so
an all-masked tile rescales by exp2(0) = 1 instead of NaN.

Row metadata (request, index in the request, causal position, lengths) is
derived in the kernel from the caller's buffers, with `row_mode`:
0 padded query (row // q_len), 1 cu_seqlens_q (binary search), 2 token_to_req
(order of appearance, counted by the CTA), 3 physical ids (no request, no
causal mask). Optional buffers are flagged in `flags` (bit values below); an
absent one is a 1-element placeholder that is never read.

`split=False`: the CTA owns the whole token list and writes the output
(gated, dtype) and LSE straight into the caller's buffers. `split=True`: it
owns a contiguous share of the list and writes FP32 partials to a workspace;
`merge` combines them, in a second launch, a programmatic dependent one: the attention
kernel triggers at its start, so the merge's CTAs are resident (their gate lines sent to
L2) and wait in griddepcontrol.wait for the attention grid's end. Merging in the attention launch (the
last CTA of a row and KV head to finish merges, after a fence and an atomic in
every CTA) was measured slower on the H200: one row 31.0 us against 25.4 with
the one-pass merge kernel, 8 rows 37.9 against 35.4 (cold graph, one device
session; benchmarks/results/NVIDIA_H200-2026-12-01-qsa-twolaunch.md): its merge
is serial work on the one SM that finishes last.

`cluster` (split only; mate.qsa.attention.cluster_splits picks it): the `cluster` splits of a (row, KV
head) are one thread-block cluster. Each CTA stages its normalized partial in shared memory (its LSE on
the ring's token flags, dead by then: 64 bytes more would pass 227 KB at 3 stages), and after a cluster
barrier every thread of the cluster merges one element at a time, reading the peers' partials through
distributed shared memory (mapa + ld.shared::cluster); a second barrier keeps each CTA's shared memory
alive until its peers have read it. No partials go to global memory and there is no merge launch; the
merge is spread over all the cluster's threads, not one SM's (unlike the last-CTA merge above). H200,
cold graph: rows 8, 6 splits as a cluster 24.8 us against 26.6 for the two launches at 6 or 7 splits;
rows 1 (11 splits) 15.8 against 16.1 (benchmarks/results/NVIDIA_H200-2026-12-02-qsa-cluster.md).
"""

import tilelang.language as T
from tvm import tirx

from mate._tl import (
    FENCE_SOURCE, LOG2E, alloc_softmax_keys_as_m, alloc_vars, assume_aligned, fence, lse_keys_as_m, publish_p_keys_as_m,
    softmax_step_keys_as_m, times_sigmoid,
)
from mate.qsa.kernels.sparse_card import CONSUMER_THREADS, DECODE_TILES, DIM, TILE

# the split kernel's and the merge's: an L2 prefetch (never faults, never waits)
SPLIT_SOURCE = (
    '\n__device__ __forceinline__ void mate_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }\n'
)

# cluster merge: a peer CTA's shared-memory float (distributed shared memory), read after a cluster barrier
CLUSTER_SOURCE = (
    '\n__device__ __forceinline__ float mate_ld_peer(const float* p, int rank) {'
    ' unsigned a = (unsigned)__cvta_generic_to_shared(p), r; float v;'
    ' asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));'
    ' asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r)); return v; }\n'
)

NEG_INF = -T.infinity("float32")
ZERO = lambda dtype: tirx.const(0, dtype)  # a literal zero: the cp.async zero-fill pattern matches only that
M_FLOOR = -1.0e30  # running-max start: finite, so exp2(m_prev - m_new) of an all-masked tile is 1

# flags bits (an absent buffer's flag is 0)
HAS_SEQ_LENS_Q = 1
HAS_SEQ_LENS_K = 2
HAS_POSITIONS = 4
PAGED = 8
HAS_BLOCKS = 16
COMPACT_BLOCKS = 32
HAS_GATE = 64
WRITE_LSE = 128
GATE_NATIVE = 256  # with HAS_GATE: the gate is GH, in the output's dtype (no FP32 copy made first), not G
K_SCALE_DEV = 512  # an FP8 cache's k_scale is KS[0], on the GPU (else a factor of `scale`): the small-CTA program
V_SCALE_DEV = 1024  # its v_scale is VS[0] (else v_mult)

# The program places its own barriers (mbarriers between the roles, named barriers inside
# each), which TileLang 0.1.15's sync planner cannot prove warp-uniform; its token
# metadata is range-checked in the kernel, and the cp.async zero-fill needs the bare
# predicate that safe-memory legalization would wrap.
PASS_CONFIGS = (("tl.disable_thread_storage_sync", True), ("tl.disable_safe_memory_legalize", True))
CONSUMER_BARRIER = 1  # the same 128 threads as TileLang's consumer reductions (ids 1 and 2)
PRODUCER_BARRIER = 3
NO_COMMIT_WAIT = "parallel_async_without_async_commit_wait"  # completion is tracked by the full mbarrier

ROW_PADDED, ROW_CU, ROW_TOKEN_TO_REQ, ROW_PHYSICAL = 0, 1, 2, 3


@T.macro
def _row_request(ROWMAP, counts, b: T.Ref, local: T.Ref, nrows: T.Ref, lo: T.Ref, hi: T.Ref, row, tx, R, row_mode, n_req, q_len, threads):
    """The row's request b (-1: none), its index `local` in the request and the request's row count."""
    b = 0
    local = row
    nrows = R
    if row_mode == ROW_PADDED:
        b = row // q_len
        local = row % q_len
        nrows = q_len
    elif row_mode == ROW_CU:
        # the last request whose first row is <= row (cu_seqlens_q is nondecreasing). A guess is checked first,
        # request `row` (decode: a row a request), its two loads beside those of ROWMAP[0] and ROWMAP[n_req]:
        # a hit skips the search's chain of dependent loads.
        g = T.max(T.min(row, n_req - 1), 0)
        if (ROWMAP[g] <= row) & (row < ROWMAP[T.min(g + 1, n_req)]):
            lo = g
            hi = g + 1
        else:
            lo = 0
            hi = n_req
        for _ in T.serial(31):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                if ROWMAP[mid] <= row:
                    lo = mid
                else:
                    hi = mid
        b = T.if_then_else((row >= ROWMAP[0]) & (row < ROWMAP[n_req]), lo, -1)
        local = row - ROWMAP[T.max(b, 0)]
        nrows = ROWMAP[T.max(b, 0) + 1] - ROWMAP[T.max(b, 0)]
    elif row_mode == ROW_TOKEN_TO_REQ:
        # a row's index in its request is the number of earlier rows of that request
        b = ROWMAP[row]
        if tx == 0:
            counts[0] = 0
            counts[1] = 0
        T.sync_threads()
        fence()
        before = T.alloc_var("int32")
        total = T.alloc_var("int32")
        before = 0
        total = 0
        for j in T.serial(T.ceildiv(R, threads)):
            r = j * threads + tx
            if r < R:
                if ROWMAP[r] == b:
                    total += 1
                    if r < row:
                        before += 1
        T.atomic_add(counts[0], before)
        T.atomic_add(counts[1], total)
        T.sync_threads()
        local = counts[0]
        nrows = counts[1]
        b = T.if_then_else((b >= 0) & (b < n_req), b, -1)


@T.macro
def _row_keys(SLQ, SLK, QP, b: T.Ref, local: T.Ref, nrows: T.Ref, row, flags, MP, PS):
    """Which keys the row sees: those of page row bs (paged: of its block table row) below `limit`, and,
    causally, at or before `pos`; a row that is not `live` sees none."""
    bs = T.max(b, 0)
    paged = (flags & PAGED) != 0
    cap = T.if_then_else(paged, MP * PS, PS)
    sk = T.if_then_else((flags & HAS_SEQ_LENS_K) != 0, SLK[bs], cap)
    sq = T.if_then_else((flags & HAS_SEQ_LENS_Q) != 0, SLQ[bs], nrows)
    live = (b >= 0) & (((flags & HAS_SEQ_LENS_Q) == 0) | (local < sq))
    pos = T.if_then_else((flags & HAS_POSITIONS) != 0, QP[row], sk - sq + local)
    limit = T.min(cap, sk)
    return bs, paged, live, pos, limit


@T.macro
def _list_share(BI, n_slots: T.Ref, block_slots: T.Ref, lo: T.Ref, hi: T.Ref, row, sp, flags, chunk, W, NB):
    """This CTA's share [first, last) of the row's token list; list slots [0, block_slots) come from block ids."""
    blocks = (flags & HAS_BLOCKS) != 0
    n_slots = W
    block_slots = T.if_then_else(blocks, 4 * NB, 0)
    if (flags & COMPACT_BLOCKS) != 0:
        # valid block ids are a prefix of the row: find its end, keep the 3 tail tokens
        lo = 0
        hi = NB + 1
        for _ in T.serial(11):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                if BI[row, mid - 1] >= 0:
                    lo = mid
                else:
                    hi = mid
        n_slots = 4 * lo + 3
        block_slots = 4 * lo
    first = sp * chunk
    last = T.min(n_slots, first + chunk)
    n_tiles = T.ceildiv(T.max(last - first, 0), TILE)
    return blocks, first, last, n_tiles


def _prefetch(x):
    T.evaluate(T.call_extern("handle", "mate_prefetch_l2", T.address_of(x)))


@T.macro
def _prefetch_metadata(TI, BT, ROWMAP, SLK, row, sp, chunk, tx, threads, W, MP, BTB, NM, NSLK):
    """split (decode): the CTA's first loads wait on each other (the row's request, its lengths, the token ids,
    their pages, then K/V), a DRAM round trip each when cold. Their lines are sent to L2 at once, a line a
    thread: this split's share of the token list (one line more where it straddles one), the block table
    row of request `row` (the row's own request in decode, one row a request; elsewhere a few wasted lines),
    and the request metadata's first lines."""
    ti_lines = T.ceildiv(chunk, 32) + 1
    if tx < ti_lines:
        _prefetch(TI[row, T.min(sp * chunk + tx * 32, W - 1)])
    elif tx < ti_lines + T.ceildiv(MP, 32):
        _prefetch(BT[T.min(row, BTB - 1), T.min((tx - ti_lines) * 32, MP - 1)])
    if tx == threads - 1:
        _prefetch(ROWMAP[0])
    if tx == threads - 2:
        _prefetch(ROWMAP[T.min(row, NM - 1)])
    if tx == threads - 3:
        _prefetch(SLK[0])


@T.macro
def token_id(TI, BI, tok, j, s, row, last, block_slots: T.Ref, blocks, NB):
    """tok[j]: the token id of list slot s of the row (-1: none); both families' decode."""
    tok[j] = -1
    if s < last:
        if s < block_slots:
            blk = BI[row, s // 4]
            tok[j] = T.if_then_else(blk >= 0, blk * 4 + s % 4, -1)
        else:
            # the tail tokens follow the 4 * NB block tokens in token_indices
            tok[j] = TI[row, s - block_slots + T.if_then_else(blocks, 4 * NB, 0)]


@T.macro
def _decode_tokens(TI, BI, tok, row, it, ptx, first, last, block_slots: T.Ref, blocks, NB, producers):
    """The token ids of this thread's slots of the next DECODE_TILES tiles (-1: none), all loads in flight."""
    for j in T.unroll(DECODE_TILES * TILE // producers):
        token_id(TI, BI, tok, j, first + it * TILE + j * producers + ptx, row, last, block_slots, blocks, NB)


@T.macro
def _token_addresses(BT, tok, pg, tok_page, tok_slot, ptx, bs, paged, live, limit, pos, row_mode, P, PS, producers):
    """Each decoded token's (page, slot) in K/V, page -1 for a masked token, published to the producer's shared lists."""
    for j in T.unroll(DECODE_TILES * TILE // producers):
        t = tok[j]
        ok = live & (t >= 0) & (t < limit) & ((row_mode == ROW_PHYSICAL) | (t <= pos))
        pg[j] = T.if_then_else(row_mode == ROW_PHYSICAL, 0, bs)
        if paged:
            # loaded whether or not the token is visible (an entry of the row's table, clamped, selected away
            # when not), so that the load waits for the token id and the request, not for seq_lens_k
            pg[j] = T.if_then_else(live & (BT.shape[1] > 0), BT[bs, T.min(T.max(t, 0) // PS, BT.shape[1] - 1)], -1)
        pg[j] = T.if_then_else(ok & (pg[j] >= 0) & (pg[j] < P), pg[j], -1)
    for j in T.unroll(DECODE_TILES * TILE // producers):
        tok_page[j * producers + ptx] = pg[j]  # -1: masked
        tok_slot[j * producers + ptx] = T.if_then_else(paged, T.max(tok[j], 0) % PS, T.max(tok[j], 0))


@T.macro
def _load_q(Q, qr, row, h0, group, ctx, head_tile):
    """split: this consumer thread's Q elements into registers at the CTA's start, all loads in flight together
    (unconditional: a head past the group reads the group's last head, zeroed by _store_q). Loaded where the
    tile goes to shared memory, under `h < group`, they went out a few at a time: the Q tile landed 8.5 us
    after the CTA's start, 3 us after the producer had issued the last tile (benchmarks/results/
    NVIDIA_H200-2026-12-01-qsa-issue16-s16x.md)."""
    for i in T.unroll(head_tile * DIM // 128):
        e = i * 128 + ctx
        qr[i] = Q[row, h0 + T.min(e // DIM, group - 1), e % DIM]


@T.macro
def _store_q(Qs, qr, group, ctx, dtype, head_tile):
    """The registers of _load_q into the Q tile; heads past the group are zero rows, never stored."""
    for i in T.unroll(head_tile * DIM // 128):
        e = i * 128 + ctx
        Qs[e // DIM, e % DIM] = T.if_then_else(e // DIM < group, qr[i], T.cast(0, dtype))


@T.macro
def _gather_rows(X, Xs, tok_page, tok_slot, st, c, kvh, dtype):
    """Tile rows of K or V into stage st by cp.async, zero-filled for masked tokens."""
    for k, d in T.Parallel(TILE, DIM, prefer_async=True, annotations={NO_COMMIT_WAIT: True}):
        Xs[st, k, d] = T.if_then_else(
            tok_page[c + k] >= 0, X[T.max(tok_page[c + k], 0), tok_slot[c + k], kvh, d], ZERO(dtype)
        )


@T.macro
def _gather_tile(K, V, Ks, Vs, valid, tok_page, tok_slot, k_full, k_empty, v_full, v_empty, it, ptx, kvh, num_stages, dtype):
    """Tile `it`'s K rows as soon as the consumer's S GEMM has freed the K stage, then its V rows once
    its PV GEMM has freed the V stage; each half lands on its own full barrier (the valid flags ride with K).
    With one stage the next K gather overlaps the consumer's softmax and PV GEMM, and the next V gather its
    S GEMM: one full-tile barrier serialized the tile's gather with all of the tile's math (H200: prefill 3679
    -> 3277 us; in the split kernel, decode batch 128 / 256 at 2 splits 173 / 267 -> 159 / 221 us,
    benchmarks/results/NVIDIA_H200-2026-12-03-qsa-kv-split.md)."""
    st = it % num_stages
    c = (it % DECODE_TILES) * TILE
    phase = ((it // num_stages) & 1) ^ 1
    T.barrier_wait(k_empty[st], phase)
    fence()
    if ptx < TILE:
        valid[st, ptx] = T.if_then_else(tok_page[c + ptx] >= 0, 1, 0)
    _gather_rows(K, Ks, tok_page, tok_slot, st, c, kvh, dtype)
    fence()
    T.cp_async_barrier_noinc(k_full[st])
    T.barrier_arrive(k_full[st])
    T.barrier_wait(v_empty[st], phase)
    fence()
    _gather_rows(V, Vs, tok_page, tok_slot, st, c, kvh, dtype)
    fence()
    T.cp_async_barrier_noinc(v_full[st])
    T.barrier_arrive(v_full[st])


@T.macro
def _produce(TI, BI, BT, K, V, Ks, Vs, valid, tok, pg, tok_page, tok_slot, k_full, k_empty, v_full, v_empty, row, ptx, kvh,
             n_tiles, first, last, block_slots: T.Ref, blocks, bs, paged, live, limit, pos, row_mode, num_stages, dtype, NB, P, PS,
             producers):
    """The producer: the token ids of chunk n + 1 are loaded while chunk n is gathered (a chunk's page
    lookups wait only for block_table, not for token_indices first), then tiles go out by _gather_tile."""
    _decode_tokens(TI, BI, tok, row, 0, ptx, first, last, block_slots, blocks, NB, producers)
    for it in T.serial(n_tiles):
        if it % DECODE_TILES == 0:
            # every producer thread is done reading the previous chunk's addresses
            T.sync_threads(PRODUCER_BARRIER, producers)
            fence()
            _token_addresses(BT, tok, pg, tok_page, tok_slot, ptx, bs, paged, live, limit, pos, row_mode, P, PS, producers)
            _decode_tokens(TI, BI, tok, row, it + DECODE_TILES, ptx, first, last, block_slots, blocks, NB, producers)
            T.sync_threads(PRODUCER_BARRIER, producers)
            fence()
        _gather_tile(K, V, Ks, Vs, valid, tok_page, tok_slot, k_full, k_empty, v_full, v_empty, it, ptx, kvh, num_stages, dtype)


@T.macro
def _attend_tile(Ks, Vs, Qs, Ps, valid, k_full, k_empty, v_full, v_empty, S, rowsum, Pf, acc, m_cur, m_prev, alpha, it, scale_log2, num_stages, head_tile):
    """One tile of the consumer: S^T = K Q^T once the K stage has landed, mask, hand the K stage (and its valid
    flags) back, online softmax, then O^T += V^T P^T once the V stage has landed, and hand it back."""
    st = it % num_stages
    phase = (it // num_stages) & 1
    T.barrier_wait(k_full[st], phase)
    fence()
    T.fence_proxy_async()  # the cp.async writes are read by wgmma (async proxy)
    T.gemm(Ks[st, :, :], Qs, S, transpose_B=True, clear_accum=True)
    for k, h in T.Parallel(TILE, head_tile):
        S[k, h] = T.if_then_else(valid[st, k] != 0, S[k, h], NEG_INF)
    fence()
    T.barrier_arrive(k_empty[st])
    softmax_step_keys_as_m(S, m_cur, m_prev, alpha, rowsum, scale_log2, TILE, head_tile)
    publish_p_keys_as_m(S, Pf, Ps, acc, alpha, CONSUMER_BARRIER, 128, DIM, head_tile)
    T.barrier_wait(v_full[st], phase)
    fence()
    T.fence_proxy_async()
    T.gemm(Vs[st, :, :], Ps, acc, transpose_A=True)
    fence()
    T.barrier_arrive(v_empty[st])


def gate_at(G, GH, flags, r, h, d):
    """The gate at (r, h, d) in FP32: from GH (the output's dtype) under GATE_NATIVE, else from G (FP32). Each
    index is clamped to its own buffer, so that a read of the other one (a 1-element placeholder) stays inside it."""
    at = lambda X: X[T.min(r, X.shape[0] - 1), T.min(h, X.shape[1] - 1), T.min(d, X.shape[2] - 1)]  # noqa: E731
    return T.if_then_else((flags & GATE_NATIVE) != 0, T.cast(at(GH), "float32"), at(G))


@T.macro
def _reciprocal(l_sum, inv, head_tile):
    """1 / l_sum per head (0 where nothing was visible): one division a head, not one per output element
    (each an IEEE division with its slow-path call in the SASS)."""
    for h in T.Parallel(head_tile):
        inv[h] = T.if_then_else(l_sum[h] > 0, 1.0 / l_sum[h], 0)


@T.macro
def _normalized_partial(Os, acc, l_sum, inv, head_tile):
    """split: this share's output (acc / its softmax sum) into shared memory Os [heads, DIM]."""
    _reciprocal(l_sum, inv, head_tile)
    for d, h in T.Parallel(DIM, head_tile):
        Os[h, d] = acc[d, h] * inv[h]


@T.macro
def _store_partial(O, LSE, Os, acc, m_cur, l_sum, inv, sp, row, h0, group, scale, head_tile):
    """split: this share's FP32 partial output and LSE, for `merge`. The output goes through shared memory Os
    [heads, DIM]: straight from the fragment, a thread's 32 values are 32 scalar stores 8 rows apart, which the
    H200 timeline put at 2.7 us of a one-row decode; from Os they are 8 coalesced 16-byte stores. (A view of the
    idle K ring would save the 16 KB, but TileLang 0.1.15 carries the ring's swizzle into a 32-bit view.)"""
    _normalized_partial(Os, acc, l_sum, inv, head_tile)
    T.sync_threads(CONSUMER_BARRIER, 128)
    fence()
    for h, d in T.Parallel(head_tile, DIM):
        if h < group:
            O[sp, row, h0 + h, d] = Os[h, d]
    for h in T.Parallel(head_tile):
        if h < group:
            LSE[sp, row, h0 + h] = lse_keys_as_m(m_cur, l_sum, h, scale)


@T.macro
def _stage_partial(Os, Ls, acc, m_cur, l_sum, inv, scale, head_tile):
    """cluster: this share's partial output and LSE into shared memory, where the cluster's CTAs read them."""
    _normalized_partial(Os, acc, l_sum, inv, head_tile)
    for h in T.Parallel(head_tile):
        Ls[h] = lse_keys_as_m(m_cur, l_sum, h, scale)


@T.macro
def _cluster_merge(Os, Ls, O, LSE, G, GH, ls, ps, st, flags, row, h0, group, sp, tx, threads, cluster):
    """cluster: the merged output, each element by one thread of the cluster (element (rank * threads + tx)):
    the `cluster` shares' LSE and partial of its head and column, read from the peers' shared memory."""
    for i in T.serial(T.ceildiv(group * DIM, cluster * threads)):
        e = (i * cluster + sp) * threads + tx
        if e < group * DIM:
            for p in T.unroll(cluster):
                ls[p] = T.call_extern("float32", "mate_ld_peer", T.address_of(Ls[e // DIM]), p)
                ps[p] = T.call_extern("float32", "mate_ld_peer", T.address_of(Os[e // DIM, e % DIM]), p)
            _merge_start(st, 1)
            _merge_step(ls, ps, st, cluster, 1)
            _merge_store(G, GH, O, LSE, st, flags, row, h0 + e // DIM, e % DIM, 1, True, e % DIM == 0, DIM)


@T.macro
def _store_output(O, LSE, G, GH, acc, m_cur, l_sum, inv, row, h0, group, scale, flags, head_tile):
    """No split: the output (gated when asked) in the caller's dtype, and the LSE when asked."""
    _reciprocal(l_sum, inv, head_tile)
    gated = (flags & HAS_GATE) != 0
    for d, h in T.Parallel(DIM, head_tile):
        if h < group:
            o = acc[d, h] * inv[h]
            gv = T.if_then_else(gated, gate_at(G, GH, flags, row, h0 + h, d), 0)
            O[row, h0 + h, d] = T.if_then_else(gated, times_sigmoid(o, gv), o)
    if (flags & WRITE_LSE) != 0:
        for h in T.Parallel(head_tile):
            if h < group:
                LSE[row, h0 + h] = lse_keys_as_m(m_cur, l_sum, h, scale)


class Signature:
    """The tensor types of the QSA attention programs' arguments, which both families take in this order (the
    small-CTA one adds KS, VS and v_mult), with the dynamic sizes and strides they bind. Q's feature stride is
    sqd, or 1 where the program assumes it (`unit_q`); K and V are in kv_dtype; O and LSE are every split's FP32
    partials for `merge` (`partials`), else the caller's output and LSE."""

    def __init__(self, dtype, kv_dtype, partials, unit_q):
        R, HQ, P, PS, HKV, W, RB, NB, BTB, MP, NM = T.dynamic("R HQ P PS HKV W RB NB BTB MP NM")
        NSLQ, NSLK, NQP, RG, HG, DG, RO, HO, RL, HL, SPL = T.dynamic("NSLQ NSLK NQP RG HG DG RO HO RL HL SPL")
        RGH, HGH, DGH = T.dynamic("RGH HGH DGH")
        (sqr, sqh, sqd, skp, sks, skh, svp, svs, svh, sir, siw, sbr, sbw, stb, stp, smm, slq, slk, sqp) = T.dynamic(
            "sqr sqh sqd skp sks skh svp svs svh sir siw sbr sbw stb stp smm slq slk sqp", "int64"
        )
        sgr, sgh, sgd, sor, soh, sod, slr, slh = T.dynamic("sgr sgh sgd sor soh sod slr slh", "int64")
        shr, shh, shd = T.dynamic("shr shh shd", "int64")
        self.R, self.HQ, self.P, self.PS, self.HKV, self.W, self.NB, self.BTB, self.MP, self.NM = R, HQ, P, PS, HKV, W, NB, BTB, MP, NM
        self.NSLK, self.SPL = NSLK, SPL
        self.q_strides, self.kv_strides = (sqr, sqh), (skp, sks, skh, svp, svs, svh)
        self.Q = T.StridedTensor((R, HQ, DIM), (sqr, sqh, 1 if unit_q else sqd), dtype)
        self.K = T.StridedTensor((P, PS, HKV, DIM), (skp, sks, skh, 1), kv_dtype)
        self.V = T.StridedTensor((P, PS, HKV, DIM), (svp, svs, svh, 1), kv_dtype)
        self.TI = T.StridedTensor((R, W), (sir, siw), "int32")
        self.BI = T.StridedTensor((RB, NB), (sbr, sbw), "int32")
        self.BT = T.StridedTensor((BTB, MP), (stb, stp), "int32")
        self.ROWMAP = T.StridedTensor((NM,), (smm,), "int32")
        self.SLQ = T.StridedTensor((NSLQ,), (slq,), "int32")
        self.SLK = T.StridedTensor((NSLK,), (slk,), "int32")
        self.QP = T.StridedTensor((NQP,), (sqp,), "int32")
        self.G = T.StridedTensor((RG, HG, DG), (sgr, sgh, sgd), "float32")
        self.GH = T.StridedTensor((RGH, HGH, DGH), (shr, shh, shd), dtype)
        if partials:
            self.O = T.Tensor((SPL, RO, HO, DIM), "float32")
            self.LSE = T.Tensor((SPL, RL, HL), "float32")
        else:
            self.O = T.StridedTensor((RO, HO, DIM), (sor, soh, sod), dtype)
            self.LSE = T.StridedTensor((RL, HL), (slr, slh), "float32")


def sparse_attention(dtype, split, wide, head_tile, num_stages, producers, cluster=0):
    # `wide` (a grid of two CTAs or more per SM) only picks the config entry, i.e. the ring depth.
    # cluster (split only): the grid's splits of a (row, KV head) are one thread-block cluster of `cluster`
    # CTAs that merge their partials through distributed shared memory, with no partials in global memory
    # and no merge launch; the output and LSE are the caller's, as without a split.
    assert not cluster or split, "a cluster merges splits"
    threads = producers + CONSUMER_THREADS  # producer warpgroup(s), then the consumer warpgroup
    per_thread = DECODE_TILES * TILE // producers  # token slots a producer thread decodes per chunk
    a = Signature(dtype, dtype, split and not cluster, unit_q=False)  # no cluster: every split's partials, for `merge`
    R, HQ, P, PS, HKV, W, NB, BTB, MP, NM, NSLK, SPL = a.R, a.HQ, a.P, a.PS, a.HKV, a.W, a.NB, a.BTB, a.MP, a.NM, a.NSLK, a.SPL
    sources = FENCE_SOURCE + SPLIT_SOURCE if split else FENCE_SOURCE  # one import per program
    sources += CLUSTER_SOURCE if cluster else ""

    @T.prim_func
    def main(
        Q: a.Q, K: a.K, V: a.V, TI: a.TI, BI: a.BI, BT: a.BT, ROWMAP: a.ROWMAP, SLQ: a.SLQ, SLK: a.SLK, QP: a.QP, G: a.G, GH: a.GH,
        O: a.O, LSE: a.LSE,
        scale: T.float32, row_mode: T.int32, flags: T.int32, n_req: T.int32, q_len: T.int32, chunk: T.int32,
    ):
        with (T.ClusterKernel(R, HKV, cluster, cluster_dims=(1, 1, cluster), threads=threads) if cluster
              else T.Kernel(R, HKV, SPL if split else 1, threads=threads)) as (row, kvh, sp):
            T.import_source(sources)
            Qs = T.alloc_shared((head_tile, DIM), dtype)
            Ks = T.alloc_shared((num_stages, TILE, DIM), dtype)
            Vs = T.alloc_shared((num_stages, TILE, DIM), dtype)
            Ps = T.alloc_shared((TILE, head_tile), dtype)
            if split:
                # unpadded: at 3 stages a padded one (4-way bank conflicts gone) passes 227 KB
                Os = T.alloc_shared((head_tile, DIM), "float32")
                if cluster:
                    ls = T.alloc_local((cluster,), "float32")
                    ps = T.alloc_local((cluster,), "float32")
                    st = T.alloc_local((4,), "float32")
            valid = T.alloc_shared((num_stages, TILE), "int32", scope="shared")
            tok_page = T.alloc_shared((DECODE_TILES * TILE,), "int32", scope="shared")
            tok_slot = T.alloc_shared((DECODE_TILES * TILE,), "int32", scope="shared")
            if cluster:
                # on the ring's token flags, dead once both roles are past their loops: 64 B of its own would pass
                # the 227 KB at 3 stages
                Ls = T.view(valid, (num_stages * TILE,), "float32")
            tok = T.alloc_local((per_thread,), "int32")
            pg = T.alloc_local((per_thread,), "int32")
            qr = T.alloc_local((head_tile * DIM // 128,), dtype)  # split: the consumer's Q elements (_load_q)
            counts = T.alloc_shared((2,), "int32", scope="shared")
            k_full = T.alloc_barrier([2 * producers] * num_stages)
            k_empty = T.alloc_barrier([128] * num_stages)
            v_full = T.alloc_barrier([2 * producers] * num_stages)
            v_empty = T.alloc_barrier([128] * num_stages)
            S, rowsum, Pf, acc, m_cur, m_prev, alpha, l_sum = alloc_softmax_keys_as_m(TILE, head_tile, DIM, dtype)
            b, local, nrows, lo, hi = alloc_vars(5)
            tx = T.get_thread_binding()
            # The wrapper checks K/V: unit feature stride, 16-byte aligned base and strides.
            assume_aligned(*a.kv_strides)
            if split and not cluster:
                # the merge launch (programmatic dependent launch) may start once every CTA of this grid runs:
                # its CTAs wait in griddepcontrol.wait for this grid's end, having been launched already
                T.pdl_trigger()
                _prefetch_metadata(TI, BT, ROWMAP, SLK, row, sp, chunk, tx, threads, W, MP, BTB, NM, NSLK)

            # bound once: as expressions, the division and its floor fixups are re-emitted (int64 in the
            # output's index) in every unrolled load and store
            group = T.alloc_var("int32")
            h0 = T.alloc_var("int32")
            group = HQ // HKV
            h0 = kvh * group
            if split:
                if tx >= producers:
                    _load_q(Q, qr, row, h0, group, tx - producers, head_tile)
            _row_request(ROWMAP, counts, b, local, nrows, lo, hi, row, tx, R, row_mode, n_req, q_len, threads)
            bs, paged, live, pos, limit = _row_keys(SLQ, SLK, QP, b, local, nrows, row, flags, MP, PS)
            n_slots = T.alloc_var("int32")
            block_slots = T.alloc_var("int32")
            blocks, first, last, n_tiles = _list_share(BI, n_slots, block_slots, lo, hi, row, sp, flags, chunk, W, NB)

            if tx < producers:
                # ---------------- producer
                ptx = tx
                _produce(TI, BI, BT, K, V, Ks, Vs, valid, tok, pg, tok_page, tok_slot, k_full, k_empty, v_full, v_empty,
                         row, ptx, kvh, n_tiles, first, last, block_slots, blocks, bs, paged, live, limit, pos, row_mode,
                         num_stages, dtype, NB, P, PS, producers)
            else:
                # ---------------- consumer
                if split:
                    _store_q(Qs, qr, group, tx - producers, dtype, head_tile)
                else:
                    # Heads past the group are zero rows of Q, never stored.
                    for h, d in T.Parallel(head_tile, DIM):
                        Qs[h, d] = T.if_then_else(h < group, Q[row, h0 + h, d], T.cast(0, dtype))
                T.sync_threads(CONSUMER_BARRIER, 128)
                fence()
                T.fill(acc, 0)
                T.fill(rowsum, 0)
                T.fill(m_cur, M_FLOOR)
                scale_log2 = scale * LOG2E
                for it in T.serial(n_tiles):
                    _attend_tile(Ks, Vs, Qs, Ps, valid, k_full, k_empty, v_full, v_empty, S, rowsum, Pf, acc, m_cur,
                                 m_prev, alpha, it, scale_log2, num_stages, head_tile)
                T.reduce_sum(rowsum, l_sum, dim=0, batch=head_tile // 4)
                if cluster:
                    _stage_partial(Os, Ls, acc, m_cur, l_sum, alpha, scale, head_tile)
                elif split:
                    _store_partial(O, LSE, Os, acc, m_cur, l_sum, alpha, sp, row, h0, group, scale, head_tile)
                else:
                    _store_output(O, LSE, G, GH, acc, m_cur, l_sum, alpha, row, h0, group, scale, flags, head_tile)
            if cluster:
                # TileLang's barrier.cluster asm has no memory clobber: the compiler fences keep the staging
                # stores before it and the peers' reads after it (the barrier orders them in hardware)
                fence()
                T.cluster_sync()  # every share staged (both roles of every CTA are past their loops)
                fence()
                _cluster_merge(Os, Ls, O, LSE, G, GH, ls, ps, st, flags, row, h0, group, sp, tx, threads, cluster)
                fence()
                T.cluster_sync()  # no CTA leaves while a peer still reads its shared memory

    return main


# Splits a step of a merge: their loads are in flight together (one L2 round trip for up to 16 splits).
MERGE_STEP = 16


@T.macro
def _merge_start(st, lanes):
    """An empty merge state for _merge_step: max -inf, no weight, `lanes` zero accumulators."""
    st[0] = NEG_INF
    st[1] = 0
    for v in T.unroll(lanes):
        st[3 + v] = 0


@T.macro
def _merge_step(ls, ps, st, step, lanes):
    """One step of the online merge: `step` splits' LSEs ls (-inf: no key, or past the split count) and
    partials ps (`lanes` elements a split) fold into st = [running max, sum of weights, the step's max,
    `lanes` accumulators]. A split with l_s = -inf weighs 0 and its partial (possibly NaN) is selected
    away, never multiplied."""
    st[2] = st[0]
    for j in T.unroll(step):
        st[2] = T.max(st[2], ls[j])
    # new max -inf: nothing live yet, the sums stay 0; else exp(-inf) = 0 rescales a first live step's zeros
    rescale = T.if_then_else(st[2] > NEG_INF, T.exp2((st[0] - st[2]) * LOG2E), 1)
    st[1] *= rescale
    for v in T.unroll(lanes):
        st[3 + v] *= rescale
    for j in T.unroll(step):
        w = T.if_then_else(ls[j] > NEG_INF, T.exp2((ls[j] - st[2]) * LOG2E), 0)
        st[1] += w
        for v in T.unroll(lanes):
            st[3 + v] += T.if_then_else(ls[j] > NEG_INF, w * ps[j * lanes + v], 0)
    st[0] = st[2]


@T.macro
def _merge_store(G, GH, O, LSE, st, flags, r, h, d, lanes, live, write_lse, D):
    """Elements (r, h, d .. d + lanes) of the merged output from st (_merge_step), those below D, gated when
    asked, and the LSE when `write_lse` (one thread a head)."""
    inv = T.if_then_else(st[1] > 0, 1.0 / st[1], 0)
    gated = (flags & HAS_GATE) != 0
    for v in T.unroll(lanes):
        if live & (d + v < D):
            o = st[3 + v] * inv
            gv = T.if_then_else(gated, gate_at(G, GH, flags, r, h, d + v), 0)
            O[r, h, d + v] = T.cast(T.if_then_else(gated, times_sigmoid(o, gv), o), O.dtype)
    if write_lse & ((flags & WRITE_LSE) != 0):
        LSE[r, h] = T.if_then_else(st[1] > 0, st[0] + T.log(st[1]), NEG_INF)


@T.macro
def _merge_element(PO, PL, G, GH, O, LSE, ls, ps, st, flags, r, h, d, live, last, S, D, step, lanes):
    """The merge kernel's output elements (r, h, d .. d + lanes) in one pass over the splits, `step` splits a
    step: the step's LSE and partial loads go out together (predicated on the split count only; a lane past
    D repeats element D - 1), then _merge_step."""
    _merge_start(st, lanes)
    for s0 in T.serial(T.ceildiv(S, step)):
        for j in T.unroll(step):
            sj = T.min(s0 * step + j, S - 1)
            ls[j] = T.if_then_else(s0 * step + j < S, PL[sj, r, h], NEG_INF)
            for v in T.unroll(lanes):
                ps[j * lanes + v] = T.if_then_else(s0 * step + j < S, T.cast(PO[sj, r, h, T.min(d + v, D - 1)], "float32"), 0)
        _merge_step(ls, ps, st, step, lanes)
    _merge_store(G, GH, O, LSE, st, flags, r, h, d, lanes, live, last, D)


# The merge's grid: one (row, head) pair a CTA, one thread an element, up to MERGE_CTAS pairs (latency-bound
# sizes: split decode). Past that, MERGE_CTAS CTAs with several pairs each, WIDE_LANES consecutive elements a
# thread, WIDE_STEP splits a step: each split's LSE load and weight then serve four elements, and a step's
# unrolled loads fit the few splits of GQA decode. H200, 3 splits x 512 rows x 64 heads x D 128: 244 us one
# pair a CTA (every element ran the 16-split step's unrolled code for 3 live splits: 4 splits a step alone
# made it 85 us), 36 us wide (benchmarks/results/NVIDIA_H200-2026-12-02-merge.md).
MERGE_CTAS = 1024
WIDE_LANES = 4
WIDE_STEP = 4


def merge(pdtype, odtype, threads):
    """SplitKV merge: lse = log sum_s exp(l_s), out = sum_s exp(l_s - lse) o_s, over the (row, head) pairs
    (grid: see MERGE_CTAS).

    A split with l_s = -inf is skipped (its partial is never read); a row with no
    live split gets 0 and -inf. The gate (flag HAS_GATE: G in FP32, or GH in odtype) multiplies the merged
    output by sigmoid(gate). Strides are runtime, so this also serves the public
    `merge_attention_states` on caller-made partials.
    """
    S, R, H, D, RG, HG, DG, RGH, HGH, DGH, RL, HL = T.dynamic("S R H D RG HG DG RGH HGH DGH RL HL")
    sps, spr, sph, spd, sls, slr, slh, sgr, sgh, sgd, shr, shh, shd, sor, soh, sod, smr, smh = T.dynamic(
        "sps spr sph spd sls slr slh sgr sgh sgd shr shh shd sor soh sod smr smh", "int64"
    )

    @T.prim_func
    def main(
        PO: T.StridedTensor((S, R, H, D), (sps, spr, sph, spd), pdtype),
        PL: T.StridedTensor((S, R, H), (sls, slr, slh), "float32"),
        G: T.StridedTensor((RG, HG, DG), (sgr, sgh, sgd), "float32"),
        GH: T.StridedTensor((RGH, HGH, DGH), (shr, shh, shd), odtype),
        O: T.StridedTensor((R, H, D), (sor, soh, sod), odtype),
        LSE: T.StridedTensor((RL, HL), (smr, smh), "float32"),
        flags: T.int32,
    ):
        with T.Kernel(T.min(R * H, MERGE_CTAS), threads=threads) as bx:
            T.import_source(SPLIT_SOURCE)
            # four CTAs an SM at 256 threads: 64 registers instead of 79, no spills (at five CTAs it spills);
            # H200: 0-13% faster merges (benchmarks/results/NVIDIA_H200-2026-12-02-gqa_decode_tma.md)
            T.annotate_min_blocks_per_sm(4)
            tx = T.get_thread_binding()
            # bound once, not re-derived (with floor fix-ups) in every unrolled load; all are non-negative
            p = T.alloc_var("int32")
            r = T.alloc_var("int32")
            h = T.alloc_var("int32")
            d = T.alloc_var("int32")
            wide = R * H > MERGE_CTAS
            # wide: pairs [first, end) of this CTA, as evenly as MERGE_CTAS splits them (64-bit: bx * R * H
            # passes 2**31 from two million pairs)
            first = T.Cast("int32", T.truncdiv(T.Cast("int64", bx) * R * H, MERGE_CTAS))
            end = T.Cast("int32", T.truncdiv(T.Cast("int64", bx + 1) * R * H, MERGE_CTAS))
            p = T.if_then_else(wide, first, bx)  # the CTA's first pair
            r = T.truncdiv(p, H)
            h = T.truncmod(p, H)
            # Launched as a programmatic dependent (TileLang does so for a kernel with pdl_sync): it may start
            # before the previous kernel in the stream ends (the split attention kernel lets it at its start),
            # and reads nothing before this wait for that kernel's end. The gate's line (the first pair's) is
            # sent to L2 first: the gate is older than the previous kernel, and an L2 prefetch cannot make a
            # later load stale (L2 is where the GPU's global memory is coherent).
            if (flags & HAS_GATE) != 0:
                dg = T.min(tx, D - 1)
                if (flags & GATE_NATIVE) != 0:
                    _prefetch(GH[T.min(r, RGH - 1), T.min(h, HGH - 1), T.min(dg, DGH - 1)])
                else:
                    _prefetch(G[T.min(r, RG - 1), T.min(h, HG - 1), T.min(dg, DG - 1)])
            T.pdl_sync()
            ls = T.alloc_local((MERGE_STEP,), "float32")
            ps = T.alloc_local((MERGE_STEP,), "float32")
            st = T.alloc_local((3 + WIDE_LANES,), "float32")
            if wide:
                # chunks of WIDE_LANES elements, a thread past the last one repeating an element without storing it
                chunks = T.ceildiv(D, WIDE_LANES)
                for i in T.serial(T.ceildiv((end - first) * chunks, threads)):
                    e = i * threads + tx
                    p = T.min(first + T.truncdiv(e, chunks), end - 1)
                    d = T.truncmod(e, chunks) * WIDE_LANES
                    r = T.truncdiv(p, H)
                    h = T.truncmod(p, H)
                    live = e < (end - first) * chunks
                    _merge_element(PO, PL, G, GH, O, LSE, ls, ps, st, flags, r, h, d, live, live & (d == 0), S, D,
                                   WIDE_STEP, WIDE_LANES)
            else:
                for i in T.serial(T.ceildiv(D, threads)):
                    # a thread past D repeats element D - 1 without storing it; thread 0's last element writes the LSE
                    d = T.min(i * threads + tx, D - 1)
                    _merge_element(PO, PL, G, GH, O, LSE, ls, ps, st, flags, r, h, d, i * threads + tx < D,
                                   (tx == 0) & (i == T.ceildiv(D, threads) - 1), S, D, MERGE_STEP, 1)

    return main
