"""TileLang program of GQA split-KV attention over a paged KV cache (decode and paged prefill).

Layouts: q packed [R, H, D] (rows of sequence b are cu_seqlens_q[b] .. cu_seqlens_q[b + 1]; a
padded q is its [B * Sq] rows), the caches [pages, page_size, H_kv, D] (page_size a runtime
value), block_table int32 [B, max_pages], seq_lens_k int32 [B]. Key j of sequence b is slot
j % page_size of page block_table[b, j // page_size]; a page id outside [0, pages) holds no key.

Head packing: one CTA takes `block_m` packed rows of one KV group: packed row f is query row
f // G of head kv_head * G + f % G (G = H // H_kv), so a decode step of 1-8 rows fills the
wgmma's 64 rows with the group's heads. Row i of a sequence sits at position i + Sk - Sq
(bottom-right aligned) and sees the keys of the (LEFT, RIGHT) window, as in gqa.py; the window
class (none / causal / local) is compile-time, the sides are runtime.

Split-KV: the CTAs of one (row tile, KV head, sequence) share its band (the keys [lo, hi) some
row of the tile sees) in `num_splits` runs of whole key tiles; each writes its rows' partial
output (normalized, FP32) and natural-log LSE to slot `split` of the partials, which
mate.qsa.merge.merge_attention_states combines (a split with no visible key writes LSE -inf
and output 0). With sinks, split 0 also writes slot `num_splits`: output 0 and LSE the sink's
logit, so the merge adds the sink to the normaliser. Softcap (runtime, 0 = off) caps the scores
before the mask, the host then passes scale_log2 = log2(e).

Unused cache memory is never read: each key tile's page id (-1 for a key past the band's end, so
past seq_lens_k, or on a page id outside [0, pages); the block_table index is clamped to its row)
and slot within the page go to shared memory first, then its K and V rows arrive by cp.async,
zero-filled where the id is -1. Masked keys are zeros in shared memory, so 0 * V is 0: NaN in
unused pages or past seq_lens_k cannot reach an output. No TMA (a TMA box cannot skip the tail
of a sequence's last page): all threads issue the copies, into a `num_stages`-deep ring with one
cp.async group per tile (tile t + num_stages - 1 is in flight while tile t is computed), and
wgmma reads the landed stage after a barrier and a proxy fence. The block_table entries of tile
t + num_stages are loaded into registers before tile t is computed and placed (id and slot, one
division per key) after it, in a ring of num_stages + 1 id slots: no tile's copies wait for a
global load, and each 16-byte copy costs two shared loads and its address. Runtime divisions are
truncating (every operand is non-negative); the per-row query index, head and position live in
shared memory, computed once.

Speed (H200, benchmarks/results/NVIDIA_H200-2026-12-01-gqa_decode_ab.json; B 64 x 8192 keys, H 64 / 8,
D 128, pages of 64 in random order): one warpgroup both copies and computes, so what counts is CTAs
per SM, whose copies and math overlap. The first tiles (block_n 128, 3 stages: one CTA of 208 KB
per SM) ran 1 row dense in 0.89 ms (2.4 TB/s, 56% of 4.3); the shipped D 128 tiles (block_n 64,
2 stages: 83 KB, 155 registers, two CTAs per SM) 0.67 ms (3.2 TB/s, 74%), (4096, 0) 0.37 ms
(2.9 TB/s), 4 rows 0.74 / 0.44 ms; block_n 32 x 3 stages (three CTAs) 0.69 ms, 32 x 4 (two) 0.82.
Loading the block_table entries a tile ahead measured within 1% of loading them at the top of
each tile, at the same tiles; cuDNN SDPA on the same keys laid out dense runs 0.48 ms (4.45 TB/s).
"""

import tilelang.language as T

from mate.swa.kernels.gqa import LN2, NEG_INF, online_softmax

# No TMA and no warp specialization (all threads issue cp.async); the loads and stores are guarded by hand, and
# so are the barriers: TileLang's planner put one before every 16-byte copy of the ring (it cannot tell the
# swizzled stores apart), the program's own sit where shared memory changes hands (see the loop).
PASS_CONFIGS = (("tl.disable_tma_lower", True), ("tl.disable_warp_specialized", True), ("tl.disable_safe_memory_legalize", True),
                ("tl.disable_thread_storage_sync", True))
# TileLang's annotation for cp.async loops whose commit and wait the program issues itself.
NO_COMMIT_WAIT = "parallel_async_without_async_commit_wait"


@T.macro
def _rows(row_q, row_h, row_pos, q0, sq, shift, m0, group, kvh, block_m):
    """Packed row i's query row in Q (-1 past the sequence's rows), head and position."""
    for i in T.Parallel(block_m):
        row_q[i] = T.if_then_else(T.truncdiv(m0 + i, group) < sq, q0 + T.truncdiv(m0 + i, group), -1)
        row_h[i] = kvh * group + T.truncmod(m0 + i, group)
        row_pos[i] = T.truncdiv(m0 + i, group) + shift


@T.macro
def _fetch(next_page, BT, K, b, k0, block_n):
    """The block_table entries of tile keys k0 .. k0 + block_n into registers (the row index clamped to the row):
    issued a tile before _place needs them, so their latency hides behind a tile's compute."""
    for j in T.Parallel(block_n):
        next_page[j] = BT[b, T.min(T.truncdiv(k0 + j, K.shape[1]), BT.shape[1] - 1)]


@T.macro
def _place(pg, sl, next_page, K, slot, k0, hi, block_n):
    """Tile keys k0 .. k0 + block_n in id slot `slot`: page id (-1: masked, never read: past the band's end, so
    past seq_lens_k, or an id outside [0, pages)) and slot within the page, computed once per key."""
    for j in T.Parallel(block_n):
        pg[slot, j] = T.if_then_else((k0 + j < hi) & (next_page[j] >= 0) & (next_page[j] < K.shape[0]), next_page[j], -1)
        sl[slot, j] = T.truncmod(k0 + j, K.shape[1])


@T.macro
def _issue(K, V, K_s, V_s, pg, sl, st, slot, kvh, block_n, dim):
    """K and V rows of the tile in id slot `slot` into ring stage st by cp.async (zero-filled where masked), one
    group the caller commits."""
    for j, d in T.Parallel(block_n, dim, prefer_async=True, annotations={NO_COMMIT_WAIT: True}):
        K_s[st, j, d] = T.if_then_else(pg[slot, j] >= 0, K[T.max(pg[slot, j], 0), sl[slot, j], kvh, d], T.cast(0, K.dtype))
    for j, d in T.Parallel(block_n, dim, prefer_async=True, annotations={NO_COMMIT_WAIT: True}):
        V_s[st, j, d] = T.if_then_else(pg[slot, j] >= 0, V[T.max(pg[slot, j], 0), sl[slot, j], kvh, d], T.cast(0, K.dtype))


@T.macro
def _mask(acc_s, pages, row_pos, st, k0, left, right, block_m, block_n, has_left, has_right):
    """Masked keys (page id -1) and keys outside a row's window get score -inf."""
    for i, j in T.Parallel(block_m, block_n):
        ok = pages[st, j] >= 0
        if has_left:
            ok = ok & (k0 + j >= row_pos[i] - left)
        if has_right:
            ok = ok & (k0 + j <= row_pos[i] + right)
        acc_s[i, j] = T.if_then_else(ok, acc_s[i, j], NEG_INF)


@T.macro
def _store_partial(PO, PL, Sinks, acc_o, m_off, l_run, row_q, row_h, split, num_splits, has_sinks, block_m, dim):
    """The tile's rows of slot `split` (output normalized, 0 and LSE -inf where nothing is visible); with
    sinks, split 0 writes slot num_splits too: output 0, LSE the sink's logit."""
    for i, d in T.Parallel(block_m, dim):
        if row_q[i] >= 0:
            PO[split, row_q[i], row_h[i], d] = T.if_then_else(l_run[i] > 0, acc_o[i, d] / l_run[i], 0)
    for i in T.Parallel(block_m):
        if row_q[i] >= 0:
            PL[split, row_q[i], row_h[i]] = T.if_then_else(l_run[i] > 0, (m_off[i] + T.log2(l_run[i])) * LN2, NEG_INF)
    if (has_sinks > 0) & (split == 0):
        for i, d in T.Parallel(block_m, dim):
            if row_q[i] >= 0:
                PO[num_splits, row_q[i], row_h[i], d] = 0
        for i in T.Parallel(block_m):
            if row_q[i] >= 0:
                PL[num_splits, row_q[i], row_h[i]] = Sinks[row_h[i]]


@T.macro
def _aligned(sqr, sqh, skp, sks, skh, svp, svs, svh):
    """The wrapper checks the layout rule (16-byte aligned strides): 16-byte cp.async."""
    T.assume(sqr % 8 == 0)
    T.assume(sqh % 8 == 0)
    T.assume(skp % 8 == 0)
    T.assume(sks % 8 == 0)
    T.assume(skh % 8 == 0)
    T.assume(svp % 8 == 0)
    T.assume(svs % 8 == 0)
    T.assume(svh % 8 == 0)


def _alloc(block_m, block_n, dim, num_stages, dtype):
    """Q, the K/V ring, its page ids and slots (num_stages + 1 tiles: one more than the ring, filled a tile
    ahead) and the per-row metadata in shared memory; the next tile's block_table entries, S, P and O and the
    per-row softmax state in registers."""
    return (
        T.alloc_shared((block_m, dim), dtype), T.alloc_shared((num_stages, block_n, dim), dtype),
        T.alloc_shared((num_stages, block_n, dim), dtype),
        *(T.alloc_shared((num_stages + 1, block_n), "int32") for _ in range(2)), T.alloc_fragment((block_n,), "int32"),
        *(T.alloc_shared((block_m,), "int32") for _ in range(3)),
        T.alloc_fragment((block_m, block_n), "float32"), T.alloc_fragment((block_m, block_n), dtype),
        T.alloc_fragment((block_m, dim), "float32"), *(T.alloc_fragment((block_m,), "float32") for _ in range(6)),
    )


def gqa_decode(dtype, dim, window, block_m, block_n, threads, num_stages):
    """The program of one (dtype, dim, window class) with its tiles; every option is a runtime argument."""
    has_left, has_right = window == "local", window != "none"
    accum = "float32"
    R, H, Pages, PS, Hkv, B, MP, NQ, HS, NS = T.dynamic("R H Pages PS Hkv B MP NQ HS NS")
    sqr, sqh, skp, sks, skh, svp, svs, svh = T.dynamic("sqr sqh skp sks skh svp svs svh", "int64")

    @T.prim_func
    def main(
        Q: T.StridedTensor((R, H, dim), (sqr, sqh, 1), dtype),
        K: T.StridedTensor((Pages, PS, Hkv, dim), (skp, sks, skh, 1), dtype),
        V: T.StridedTensor((Pages, PS, Hkv, dim), (svp, svs, svh, 1), dtype),
        BT: T.Tensor((B, MP), "int32"),
        SeqK: T.Tensor((B,), "int32"),
        CuQ: T.Tensor((NQ,), "int32"),
        Sinks: T.Tensor((HS,), accum),
        PO: T.Tensor((NS, R, H, dim), accum),
        PL: T.Tensor((NS, R, H), accum),
        scale_log2: T.float32,
        left: T.int32,
        right: T.int32,
        softcap_value: T.float32,
        softcap_mul: T.float32,
        num_splits: T.int32,
        packed_rows: T.int32,
        has_sinks: T.int32,
    ):
        with T.Kernel(T.ceildiv(packed_rows, block_m), Hkv, B * num_splits, threads=threads) as (bx, kvh, bz):
            (Q_s, K_s, V_s, pg, sl, next_page, row_q, row_h, row_pos, acc_s, acc_p, acc_o,
             m_run, m_prev, m_off, alpha, row_sum, l_run) = _alloc(block_m, block_n, dim, num_stages, dtype)
            _aligned(sqr, sqh, skp, sks, skh, svp, svs, svh)
            b = T.alloc_var("int32")
            split = T.alloc_var("int32")
            group = T.alloc_var("int32")
            q0 = T.alloc_var("int32")
            sq = T.alloc_var("int32")
            sk = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            n = T.alloc_var("int32")
            b = T.truncdiv(bz, num_splits)
            split = T.truncmod(bz, num_splits)
            group = T.truncdiv(H, Hkv)
            q0 = CuQ[b]
            sq = CuQ[b + 1] - q0
            # Keys past the block_table row's capacity do not exist (seq_lens_k is clamped to it).
            sk = T.min(T.max(SeqK[b], 0), MP * PS)
            # The band of the tile's rows (first row m0 // group, last min(.., sq - 1)), in whole key tiles per split.
            lo = 0
            if has_left:
                lo = T.max(T.truncdiv(bx * block_m, group) + sk - sq - left, 0)
            hi = sk
            if has_right:
                hi = T.min(T.min(T.truncdiv(bx * block_m + block_m - 1, group), sq - 1) + sk - sq + right + 1, sk)
            n = 0
            if (T.truncdiv(bx * block_m, group) < sq) & (hi > lo):
                n = T.ceildiv(hi - lo, block_n)
            t0 = split * T.ceildiv(n, num_splits)
            n = T.max(T.min(T.ceildiv(n, num_splits), n - t0), 0)

            _rows(row_q, row_h, row_pos, q0, sq, sk - sq, bx * block_m, group, kvh, block_m)
            T.sync_threads()
            for i, d in T.Parallel(block_m, dim):
                Q_s[i, d] = T.if_then_else(row_q[i] >= 0, Q[T.max(row_q[i], 0), row_h[i], d], T.cast(0, dtype))
            T.fill(acc_o, 0)
            T.fill(l_run, 0)
            T.fill(m_run, NEG_INF)
            T.fill(m_off, 0)
            # Tile u's ids sit in slot u % ids; tile u + num_stages's are fetched while tile u is computed.
            ids = num_stages + 1
            for s in T.serial(num_stages):
                if s < n:
                    _fetch(next_page, BT, K, b, lo + (t0 + s) * block_n, block_n)
                    _place(pg, sl, next_page, K, s, lo + (t0 + s) * block_n, hi, block_n)
            T.sync_threads()
            for s in T.serial(num_stages - 1):
                if s < n:
                    _issue(K, V, K_s, V_s, pg, sl, s, s, kvh, block_n, dim)
                T.ptx_commit_group()
            for t in T.serial(n):
                if t + num_stages < n:
                    _fetch(next_page, BT, K, b, lo + (t0 + t + num_stages) * block_n, block_n)
                if t + num_stages - 1 < n:
                    _issue(K, V, K_s, V_s, pg, sl, (t + num_stages - 1) % num_stages, (t + num_stages - 1) % ids, kvh, block_n, dim)
                T.ptx_commit_group()
                T.ptx_wait_group(num_stages - 1)  # this thread's copies of tile t have landed
                T.sync_threads()  # everyone's
                T.fence_proxy_async()  # cp.async writes, read by wgmma (the async proxy)
                T.gemm(Q_s, K_s[t % num_stages, :, :], acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if softcap_value > 0:
                    for i, j in T.Parallel(block_m, block_n):
                        acc_s[i, j] = softcap_value * T.tanh(acc_s[i, j] * softcap_mul)
                _mask(acc_s, pg, row_pos, t % ids, lo + (t0 + t) * block_n, left, right, block_m, block_n, has_left, has_right)
                online_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, scale_log2, block_m, block_n)
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_m, dim):
                    acc_o[i, d] *= alpha[i]
                T.gemm(acc_p, V_s[t % num_stages, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                if t + num_stages < n:  # the slot of tile t - 1, read by no one since the last barrier
                    _place(pg, sl, next_page, K, (t + num_stages) % ids, lo + (t0 + t + num_stages) * block_n, hi, block_n)
                T.sync_threads()  # stage t % num_stages is refilled, and these ids read, in the next iteration
            _store_partial(PO, PL, Sinks, acc_o, m_off, l_run, row_q, row_h, split, num_splits, has_sinks, block_m, dim)

    return main.with_attr("tilelang_pass_configs", {"tl.enable_fast_math": True})
