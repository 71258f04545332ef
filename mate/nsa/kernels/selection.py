"""TileLang program of the NSA selection attention forward.

One CTA per (query m, KV group g, batch b): the grid's x axis is the query, so
the CTAs in flight at a time read the K/V blocks of one group, which fit in L2.

Orientation ("keys as M"): a group has only 1..16 query heads, too few rows for
Hopper's wgmma (M is 64 per warpgroup), so the selected keys are the MMA's M
operand and the group's heads (zero-padded to `head_tile`) its N operand:

    S^T [64 keys, heads]  = K_tile [64, D] . Q^T           (wgmma m64nHk16)
    O^T [D, heads]       += V_tile^T [D, 64] . P^T [64, heads]  (wgmma, V read M-major)

so no MMA row is wasted on padding heads beyond `head_tile`. The online
softmax runs down the key axis in FP32 (exp2 with the scale folded in); the
per-thread row sums are reduced once at the end.

Before the pipeline, the CTA compacts its row of block_indices into a shared
list of the entries that are used: inside the first `block_counts` slots,
>= 0, and with at least the block's first token at or before the query's
position (bottom-right aligned: N - M + m). Duplicates stay, once per slot.
Skipped entries are never read. The loop then walks that list: a 64-key tile
is one selected block (block_size 64) or two (block_size 32; an odd last
block is paired with a masked repeat of a valid block), loaded by TMA (zero
fill past N) into a ring of `num_stages` tiles.

Roles are placed by the program, not by TileLang's automatic warp
specialization: warp 0 of the first warpgroup issues the TMA loads, each
stage with a K and a V "full" mbarrier (one arrival plus the bytes) and a K
and a V "empty" one (the consumer warpgroup's 128 threads; K is released
after QK^T, so the next K load overlaps the softmax). The automatic producer
made all four warps of its warpgroup wait on every empty barrier while one
lane issued; three warps held in step by nothing, and a one-stage ring hung
within 100 to 300 launches on the H200, which it stopped doing when a patch
left the producer loop to warp 0 alone
(benchmarks/results/NVIDIA_H200-2026-11-30-nsa-hang.md). Here each waiting warp
either issues the loads that the others wait for (warp 0, its lanes
reconverging every iteration) or arrives on the barrier that the producer
waits for (the consumer), so none can fall a phase behind.

Where the time goes (H200, seed shape B=1 M=N=65536 H=128 G=8 D=128 T=16,
block 64; benchmarks/results/nsa_selection_h200.json): 28.5 ms with the tuned
one-stage ring, 3 CTAs per SM; 273 GB of gathered K/V at 9.6 TB/s, all L2
hits (a group's K/V, 32 MB, fits in L2). T = 1 / 4 / 16 take 5.1 / 8.7 /
28.5 ms: 1.2 to 1.65 ms per selected block plus about 3.5 ms of per-CTA cost
(index and Q loads, first TMA latency, epilogue). A plain Triton gather of
the same 32 KB tiles from an L2-resident pool, with no attention math, takes
29.4 ms. With two stages, shared memory set the loads in flight: at 76 KB a
CTA, 3 CTAs (6 tiles of 32 KB) fit in an SM, and one more KB (MAX_SLOTS =
256) dropped it to 2 CTAs and cost 18%. Against the automatic producer this
program replaced, at the same tiles: 0.84 to 1.00 of its time
(benchmarks/experiments/nsa_ab.py). Since the V zeroing (2026-12-01, NVIDIA_H200-2026-12-01-nsa-fwd-s19f.md):
30.1 ms at 3 CTAs per SM (without the zeroing 28.7), 28.7 ms at 4; evict_last on the K/V loads
changed nothing. Fewer gathers are the only way under ~26 ms; on the benchmark's random indices
deduplicating within W consecutive queries saves 9% (W 4) to 28% (W 16) of them (same file), and on
real-looking selections (benchmarks/bench_nsa.py's smooth generator) 68% (W 4) to 90% (W 16): the
program of a CTA of W queries that gathers their union once is selection_shared.py (tile parameter
`queries` > 1; a draft, not yet run on a GPU; the shipped entries keep queries at 1, this program).
"""

import tilelang.language as T

from mate._tl import (
    FENCE_SOURCE, LOG2E, alloc_softmax_keys_as_m, assume_aligned, fence, lse_keys_as_m, publish_p_keys_as_m,
    softmax_step_keys_as_m,
)
from mate.nsa.kernels.selection_card import MAX_SLOTS, TILE_KEYS

NEG_INF = -T.infinity("float32")
CONSUMER_BARRIER = 1  # named barrier of the consumer warpgroup (TileLang's own reductions there use 1 and 2)
# The program places its own barriers (mbarriers between the roles, named barriers inside the
# consumer), which TileLang 0.1.15's sync planner would mistake for a whole-CTA matter. Its
# shared-memory planner then merges nothing: the epilogue's reduction scratch (2 KB) gets its own
# space, which at dim 128 makes 76800 B a CTA, the most with which 3 CTAs fit in an SM (228 KB,
# 1 KB of it reserved per CTA). "Aggressive" merging would alias the softmax's max-reduction scratch with Ps,
# a race: TileLang's AllReduce has no barrier after its last read of the scratch.
PASS_CONFIGS = (("tl.disable_thread_storage_sync", True),)


def _tiles_per_block(block_size, threads):
    """Selected blocks a 64-key tile holds (the MMA tiles are sized for one consumer warpgroup)."""
    assert TILE_KEYS % block_size == 0, "block_size must divide 64"
    assert threads == 128, "the MMA tiles are sized for one consumer warpgroup (threads=128)"
    return TILE_KEYS // block_size


@T.macro
def _kernel_prologue(min_blocks):
    """The fence's source and the CTAs-per-SM cap of the NSA programs; the thread index."""
    T.import_source(FENCE_SOURCE)
    # Several CTAs per multiprocessor keep more gathered blocks in flight than one CTA's
    # pipeline can: cap registers for that instead of the producer/consumer reallocation.
    T.annotate_min_blocks_per_sm(min_blocks)
    return T.get_thread_binding()


def _alloc_ring_state(num_stages, threads):
    """The compacted list of used blocks and its count, then per stage: K, V landed (one arrival by the
    issuing lane plus the TMA bytes); K, V consumed (the consumer's 128 threads)."""
    # Static shared memory: never aliased with the dynamic pool (reduction workspaces),
    # which matters because the producer and consumer warps read it at different times.
    blocks = T.alloc_shared((MAX_SLOTS,), "int32", scope="shared")
    used = T.alloc_shared((1,), "int32", scope="shared")
    k_full = T.alloc_barrier([1] * num_stages)
    v_full = T.alloc_barrier([1] * num_stages)
    k_empty = T.alloc_barrier([threads] * num_stages)
    v_empty = T.alloc_barrier([threads] * num_stages)
    return blocks, used, k_full, v_full, k_empty, v_empty


@T.macro
def _tile_copy(src, dst, bar, st, b, g, n0, n1, c0, block_size, per_tile):
    # One 64-column panel of a tile by TMA, counted on `bar` (the leader lane expects the bytes).
    T.tma_copy(src[b, n0 : n0 + block_size, g, c0 : c0 + 64], dst[st, 0:block_size, c0 : c0 + 64], barrier=bar[st],
               leader_scope_threads=32)
    if per_tile == 2:
        T.tma_copy(src[b, n1 : n1 + block_size, g, c0 : c0 + 64], dst[st, block_size:TILE_KEYS, c0 : c0 + 64],
                   barrier=bar[st], leader_scope_threads=32)


@T.macro
def _tile_load(src, dst, empty, full, st, phase, b, g, n0, n1, block_size, per_tile, dim):
    # Wait until the consumer has freed stage `st`, load the tile (a 64-column panel or two), and
    # arrive once on its full barrier.
    T.barrier_wait(empty[st], phase ^ 1)
    _tile_copy(src, dst, full, st, b, g, n0, n1, 0, block_size, per_tile)
    if dim == 128:
        _tile_copy(src, dst, full, st, b, g, n0, n1, 64, block_size, per_tile)
    if T.shuffle_elect(32):
        T.barrier_arrive(full[st])


@T.macro
def _produce(K, V, Ks, Vs, blocks, k_full, v_full, k_empty, v_empty, n_tiles, n_used, key_base, bb, bg, num_stages, block_size,
             per_tile, dim):
    """The producer warp's loop: each used tile's K and V rows (sequence rows from key_base) into the ring."""
    for it in T.serial(n_tiles):
        st = it % num_stages
        # A 64-key tile is one block (block_size 64) or two (block_size 32; an odd last
        # block pairs with a masked repeat of a valid one).
        n0 = key_base + blocks[it * per_tile] * block_size
        n1 = key_base + blocks[T.min(it * per_tile + 1, n_used - 1)] * block_size
        _tile_load(K, Ks, k_empty, k_full, st, (it // num_stages) & 1, bb, bg, n0, n1, block_size, per_tile, dim)
        _tile_load(V, Vs, v_empty, v_full, st, (it // num_stages) & 1, bb, bg, n0, n1, block_size, per_tile, dim)


@T.macro
def _tile_key(blocks, it, k, n_used, block_size, per_tile):
    """Row k of tile `it`: its slot in the compacted list (>= n_used: a masked repeat) and its key's position."""
    slot = it * per_tile + k // block_size
    n = blocks[T.min(slot, n_used - 1)] * block_size + k % block_size
    return slot, n


@T.macro
def _landed_product(full, tiles, rhs, out, st, it, num_stages):
    """Once stage st of a ring has landed: out = tiles[st] . rhs^T (the keys on the MMA's M)."""
    T.barrier_wait(full[st], (it // num_stages) & 1)
    fence()
    T.gemm(tiles[st, :, :], rhs, out, transpose_B=True, clear_accum=True)


@T.macro
def _compact_blocks(BI, blocks, used, bb, bm, bg, slots, last_block):
    """The used entries of this row, in slot order, into `blocks`, their count into used[0]."""
    # Entry t goes to the count of used entries before it, which each thread takes from the indices
    # themselves (L1 hits, the same addresses across the CTA), four loads in flight. Counting from
    # shared flags instead needs a 128-thread barrier first, after which compute-sanitizer's
    # racecheck reports a hazard on `used` across the CTA barrier below (a false positive by
    # the SASS: STS, BAR.SYNC 0, LDS).
    for t in T.Parallel(MAX_SLOTS):
        rank = T.alloc_var("int32")
        rank = 0
        for u4 in T.serial(T.ceildiv(slots, 4)):
            for j in T.unroll(4):
                u = u4 * 4 + j
                eu = BI[bb, bm, bg, T.min(u, slots - 1)]
                rank += T.if_then_else((u < T.min(t, slots)) & (eu >= 0) & (eu <= last_block), 1, 0)
        e = T.if_then_else(t < slots, BI[bb, bm, bg, t], -1)
        keep = T.if_then_else((e >= 0) & (e <= last_block), 1, 0)
        if keep != 0:
            blocks[rank] = e
        if t == MAX_SLOTS - 1:
            used[0] = rank + keep


def _masked_tile(blocks, it, n_used, pos, block_size, per_tile):
    """1 if tile `it` holds keys past the query (its block's end is past `pos`) or a masked repeat, else 0."""
    last0 = blocks[it * per_tile] * block_size + block_size - 1
    last1 = blocks[T.min(it * per_tile + 1, n_used - 1)] * block_size + block_size - 1
    return T.if_then_else((last0 > pos) | ((per_tile == 2) & ((it * per_tile + 1 >= n_used) | (last1 > pos))), 1, 0)


@T.macro
def _zero_masked_v(Vs, blocks, masked, st, it, n_used, pos, block_size, per_tile, dim, threads, dtype):
    # A masked key has P = 0, but its V row still enters P.V, and 0 * NaN is NaN: the rows past the
    # query (a causally future token of the block, or garbage in a cache) and a masked repeat are
    # zeroed first. Only a tile that holds such keys pays (`masked`: _masked_tile): generic stores,
    # the proxy fence that orders them before the wgmma's reads, and a consumer barrier.
    if masked != 0:
        for k, d in T.Parallel(TILE_KEYS, dim):
            slot, n = _tile_key(blocks, it, k, n_used, block_size, per_tile)
            if (slot >= n_used) | (n > pos):
                Vs[st, k, d] = T.cast(0, dtype)
        T.fence_proxy_async()
        T.sync_threads(CONSUMER_BARRIER, threads)


@T.macro
def _attend_tile(Ks, Vs, Qs, Ps, blocks, k_full, v_full, k_empty, v_empty, S, rowsum, P, acc, m_cur, m_prev, alpha, masked,
                 it, n_used, pos, scale_log2, num_stages, block_size, per_tile, dim, head_tile, threads, dtype):
    """One tile of the consumer. K is released right after S^T = K Q^T, so the next K load overlaps the softmax."""
    st = it % num_stages
    # Read here, off the path from the V load's arrival to the P.V wgmma: on the H200 that path was 2.4%
    # of the seed shape's time (benchmarks/results/NVIDIA_H200-2026-12-01-nsa-fwd-s19f.md).
    masked = _masked_tile(blocks, it, n_used, pos, block_size, per_tile)
    _landed_product(k_full, Ks, Qs, S, st, it, num_stages)
    fence()
    T.barrier_arrive(k_empty[st])
    for k, h in T.Parallel(TILE_KEYS, head_tile):
        slot, n = _tile_key(blocks, it, k, n_used, block_size, per_tile)
        S[k, h] = T.if_then_else((slot < n_used) & (n <= pos), S[k, h], NEG_INF)
    softmax_step_keys_as_m(S, m_cur, m_prev, alpha, rowsum, scale_log2, TILE_KEYS, head_tile)
    publish_p_keys_as_m(S, P, Ps, acc, alpha, CONSUMER_BARRIER, threads, dim, head_tile)
    T.barrier_wait(v_full[st], (it // num_stages) & 1)
    fence()
    _zero_masked_v(Vs, blocks, masked, st, it, n_used, pos, block_size, per_tile, dim, threads, dtype)
    T.gemm(Vs[st, :, :], Ps, acc, transpose_A=True)
    fence()
    T.barrier_arrive(v_empty[st])


@T.macro
def _store(O, LSE, Ks, acc, m_cur, l_sum, bb, bm, h0, group_heads, scale, dim, head_tile, threads):
    """Nothing visible: l_sum is 0, the output 0 and the LSE -inf."""
    # The output goes through the first K stage (every load has landed and been read): a buffer of
    # its own would cost the third CTA per SM.
    for d, h in T.Parallel(dim, head_tile):
        Ks[0, h, d] = T.if_then_else(l_sum[h] > 0, acc[d, h] / l_sum[h], 0)
    T.sync_threads(CONSUMER_BARRIER, threads)
    fence()
    for h, d in T.Parallel(head_tile, dim):
        if h < group_heads:
            O[bb, bm, h0 + h, d] = Ks[0, h, d]
    for h in T.Parallel(head_tile):
        if h < group_heads:
            LSE[bb, h0 + h, bm] = lse_keys_as_m(m_cur, l_sum, h, scale)


class Signature:
    """The tensor types of the forward programs' arguments, which this one-query program and the shared one
    (selection_shared.py) take in this order, with the dynamic sizes and strides they bind. `aligned`: Q's and
    O's strides, which the layout rule makes multiples of 16 bytes."""

    def __init__(self, dtype, dim):
        B, M, N, H, G, TT, NS = T.dynamic("B M N H G TT NS")
        (sqb, sqm, sqh, skb, skn, skg, svb, svn, svg, sib, sim, sig, sit, scb, scm, scg, sob, som, soh, slb, slh, slm) = T.dynamic(
            "sqb sqm sqh skb skn skg svb svn svg sib sim sig sit scb scm scg sob som soh slb slh slm", "int64"
        )
        self.B, self.M, self.N, self.G, self.TT = B, M, N, G, TT
        self.aligned = (sqb, sqm, sqh, sob, som, soh)
        self.Q = T.StridedTensor((B, M, H, dim), (sqb, sqm, sqh, 1), dtype)
        self.K = T.StridedTensor((B, N, G, dim), (skb, skn, skg, 1), dtype)
        self.V = T.StridedTensor((B, N, G, dim), (svb, svn, svg, 1), dtype)
        self.BI = T.StridedTensor((B, M, G, TT), (sib, sim, sig, sit), "int32")
        self.BC = T.StridedTensor((B, M, G), (scb, scm, scg), "int32")
        self.O = T.StridedTensor((B, M, H, dim), (sob, som, soh, 1), dtype)
        self.LSE = T.StridedTensor((B, H, M), (slb, slh, slm), "float32")
        self.ST = T.Tensor((NS,), "int32")


def nsa_selection_fwd(dtype, dim, block_size, head_tile, threads, num_stages, min_blocks, queries):
    """The forward program; queries (W) > 1: selection_shared's, whose CTA shares its gathers among W queries."""
    if queries > 1:
        from mate.nsa.kernels.selection_shared import nsa_selection_shared_fwd

        return nsa_selection_shared_fwd(dtype, dim, block_size, head_tile, threads, num_stages, min_blocks, queries)
    a = Signature(dtype, dim)
    B, M, N, G, TT = a.B, a.M, a.N, a.G, a.TT
    per_tile = _tiles_per_block(block_size, threads)

    @T.prim_func
    def main(
        Q: a.Q, K: a.K, V: a.V, BI: a.BI, BC: a.BC, O: a.O, LSE: a.LSE, ST: a.ST,
        scale: T.float32, group_heads: T.int32, use_counts: T.int32, varlen: T.int32,
    ):
        # A producer warpgroup (of which warp 0 works) and the consumer warpgroup.
        with T.Kernel(M, G, B, threads=2 * threads) as (bm, bg, bb):
            tx = _kernel_prologue(min_blocks)
            Qs = T.alloc_shared((head_tile, dim), dtype)
            Ks = T.alloc_shared((num_stages, TILE_KEYS, dim), dtype)
            Vs = T.alloc_shared((num_stages, TILE_KEYS, dim), dtype)
            Ps = T.alloc_shared((TILE_KEYS, head_tile), dtype)
            blocks, used, k_full, v_full, k_empty, v_empty = _alloc_ring_state(num_stages, threads)
            S, rowsum, P, acc, m_cur, m_prev, alpha, l_sum = alloc_softmax_keys_as_m(TILE_KEYS, head_tile, dim, dtype)
            assume_aligned(*a.aligned)  # the layout rule on Q and O

            # Bottom-right aligned causal position of this query; packed sequences (varlen, B = 1): its index
            # in its sequence, whose keys start at row ST[bm].
            key_base = ST[bm * varlen] * varlen  # (padded: ST is a 1-element placeholder)
            pos = T.if_then_else(varlen != 0, bm - key_base, N - M + bm)
            last_block = T.if_then_else(pos >= 0, pos // block_size, -1)  # blocks <= this have a visible token
            slots = T.min(T.if_then_else(use_counts != 0, T.max(BC[bb, bm, bg], 0), TT), TT)
            h0 = bg * group_heads
            scale_log2 = scale * LOG2E

            # Q first, so its loads are in flight with the index loads. Heads past the group
            # (padding up to head_tile) are zero rows, never stored.
            for h, d in T.Parallel(head_tile, dim):
                Qs[h, d] = T.if_then_else(h < group_heads, Q[bb, bm, h0 + h, d], T.cast(0, dtype))
            _compact_blocks(BI, blocks, used, bb, bm, bg, slots, last_block)
            T.sync_threads()
            fence()
            n_used = used[0]
            n_tiles = T.ceildiv(n_used, per_tile)

            if tx < threads:
                # ---------------- producer: warp 0 alone. A warp that issues nothing would wait on
                # the empty barriers held in step by nothing; one that fell a ring behind would take
                # a barrier whose parity flipped twice for not done and wait forever at the end.
                if tx < 32:
                    _produce(K, V, Ks, Vs, blocks, k_full, v_full, k_empty, v_empty, n_tiles, n_used, key_base, bb, bg, num_stages,
                             block_size, per_tile, dim)
            else:
                # ---------------- consumer: S^T = K Q^T, online softmax, O^T += V^T P^T
                T.fill(acc, 0)
                T.fill(rowsum, 0)
                T.fill(m_cur, NEG_INF)
                masked = T.alloc_var("int32")
                for it in T.serial(n_tiles):
                    _attend_tile(Ks, Vs, Qs, Ps, blocks, k_full, v_full, k_empty, v_empty, S, rowsum, P, acc, m_cur, m_prev,
                                 alpha, masked, it, n_used, pos, scale_log2, num_stages, block_size, per_tile, dim, head_tile, threads, dtype)
                T.reduce_sum(rowsum, l_sum, dim=0, batch=head_tile // 4)
                _store(O, LSE, Ks, acc, m_cur, l_sum, bb, bm, h0, group_heads, scale, dim, head_tile, threads)

    return main
