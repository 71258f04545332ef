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
mate.merge.merge_attention_states combines (a split with no visible key writes LSE -inf
and output 0). With sinks, split 0 also writes slot `num_splits`: output 0 and LSE the sink's
logit, so the merge adds the sink to the normaliser. With one split (`direct`) the CTA writes the
output in q's dtype and the LSE itself, the sink folded in, and there is no merge: at B 64 x 8192
keys the merge took 10 to 36 us of a 0.3 to 0.7 ms call, one split or three, and one split's
attention was no slower than three's (H200; benchmarks/results/NVIDIA_H200-2026-12-02-decode-splits.md).
Softcap (runtime, 0 = off) caps the scores before the mask, the host then passes scale_log2 = log2(e).

Unused cache memory is never read: each key tile's page id (-1 for a key outside the band [lo, hi), so
past seq_lens_k, or on a page id outside [0, pages); the block_table index is clamped to its row) and slot
within the page go to shared memory first (in a ring of num_stages + 1 id slots, a tile ahead). Key tiles
start at multiples of block_n (the first tile's keys before the band are masked like those past its end).
A tile whose keys are all in the band and whose boxes each lie in one valid page goes by TMA: one box of
block_n rows when one page holds the tile (page_size >= block_n), else block_n / r boxes of r = 64/32/16
rows (page_size a multiple of r), each box r rows x 64 columns (the 128-byte swizzle span) of the 4-D
tensor map (D, slot, KV head, page) with the cache's runtime strides. The CTA's elected thread
(tl_shuffle_elect, lane 0 of warp 0) expects each box's bytes on the stage's mbarrier, issues the boxes
and arrives once. Every other tile (the band's first and last, pages < 16 keys or not a multiple of 16,
invalid ids) goes by cp.async from all threads, zero-filled where the id is -1, and the elected thread
arrives without bytes, so every tile completes one phase of its stage's mbarrier (count 1). Masked keys
are zeros in shared memory, so 0 * V is 0: NaN in unused pages or past seq_lens_k cannot reach an
output. The ring is `num_stages` deep with one cp.async group per tile (empty for TMA tiles): tile
t + num_stages - 1 is issued while tile t is computed; before computing tile t every thread waits for
its cp.async groups (wait_group num_stages - 1), for phase t // num_stages of mbarrier t % num_stages
(the TMA bytes), then a CTA barrier (everyone's cp.async) and a proxy fence; after P.V (wgmma waited) a
CTA barrier releases the stage, which the next iteration refills. Runtime divisions are truncating
(every operand is non-negative); the per-row query index, head and position live in shared memory.

Speed (H200, B 64 x 8192 keys, H 64 / 8, D 128, pages of 64 in random order; bytes = the K/V rows the
query rows see, q, out and the table): one warpgroup both copies and computes, so what counts is CTAs per
SM, whose copies and math overlap, and how a CTA's copies go out. Per-row cp.async (every tile, the
kernel before TMA) moved about 25 KB/us per SM: 1 row dense 0.684 ms (3.14 TB/s), (4096, 0) 0.382 ms
(2.82), 4 rows 0.790 / 0.488 ms. With the TMA boxes, at the same tiles (block_n 64, 2 stages: two CTAs of
84 KB per SM) and in the same run: 0.567 ms (3.79 TB/s, 88% of 4.3), 0.324 ms (3.32 TB/s, 77%), 4 rows
0.680 / 0.434 ms; block_n 32 x 4 or 5 stages (two CTAs) 0.77-0.78 ms. cuDNN SDPA on the same keys
laid out dense: 0.471 ms (4.56 TB/s), (4096, 0) 0.241 ms (benchmarks/results/
NVIDIA_H200-2026-12-02-gqa_decode_tma.md). Earlier tiles (cp.async; -2026-12-01-gqa_decode_ab.json):
block_n 128 x 3 stages (one CTA of 208 KB per SM) 0.89 ms; loading the block_table entries a tile
ahead measured within 1% of loading them at the top of each tile. One split (`direct`, the grid's 512 CTAs
unsplit): 0.556-0.560 ms dense (89-90%), (4096, 0) 0.288 ms (87%); 8 rows 0.613 / 0.316-0.319 ms
(benchmarks/results/NVIDIA_H200-2026-12-02-decode-splits.md).

FP8 K/V (kv_dtype, issue 38): the ring holds the FP8 bytes (TMA boxes of 128 columns, 16-byte cp.async), and each
tile is upcast exactly into one FP16 K and V tile before the MMAs (FP16, the BF16 query scaled into FP16's range).
Varlen k (KEY_BASE) reads the keys as one page, sequence b's from KBase[b] on. H100, the decode above: e4m3 648 us
against BF16 716 (0.91x; page 16: 0.96x). Deeper rings and wider tiles are slower, so the FP8 call is not bound by
its gather: the one warpgroup's per-tile chain is, at one row mostly the 64-row wgmma on 8 real rows
(benchmarks/results/NVIDIA_H100-2026-12-06-gqa-decode-fp8-rings.md).
"""

import tilelang.language as T

from mate._hopper import FP8_KV, itemsize
from mate._tl import alloc_vars, assume_aligned, scale_into_fp16, upcast_stage
from mate.swa.kernels.gqa import LN2, LOG2E, NEG_INF, online_softmax

# TileLang lowers the T.tma_copy's (TMA lowering stays on); no warp specialization (one warpgroup issues the
# copies and computes); the loads and stores are guarded by hand, and so are the barriers (see the loop).
PASS_CONFIGS = (("tl.disable_warp_specialized", True), ("tl.disable_safe_memory_legalize", True),
                ("tl.disable_thread_storage_sync", True))
# TileLang's annotation for cp.async loops whose commit and wait the program issues itself.
NO_COMMIT_WAIT = "parallel_async_without_async_commit_wait"
# The runtime `flags`: k_scale / v_scale are one-element device tensors (KS[0] / VS[0]), not host floats; key j of
# sequence b sits at cache position KBase[b] + j (varlen k: the keys as one page, KBase its cu_seqlens_k), not j.
K_SCALE_DEV, V_SCALE_DEV, KEY_BASE = 1, 2, 4

def box_rows(block_n):
    """The TMA box heights a tile may go in, largest first: the whole tile (one page holds it), then whole
    sub-tiles of 64, 32 or 16 rows (page_size a multiple of it: each sub-tile lies in one page)."""
    return [block_n] + [r for r in (64, 32, 16) if r < block_n and block_n % r == 0]


@T.macro
def _rows(row_q, row_h, row_pos, q0, sq, shift, m0, group, kvh, block_m):
    """Packed row i's query row in Q (-1 past the sequence's rows), head and position."""
    for i in T.Parallel(block_m):
        row_q[i] = T.if_then_else(T.truncdiv(m0 + i, group) < sq, q0 + T.truncdiv(m0 + i, group), -1)
        row_h[i] = kvh * group + T.truncmod(m0 + i, group)
        row_pos[i] = T.truncdiv(m0 + i, group) + shift


@T.macro
def _fetch(next_page, BT, K, b, k0, base, block_n):
    """The block_table entries of tile keys k0 .. k0 + block_n (cache positions base + k0 ..) into registers (the
    row index clamped to the row): issued a tile before _place needs them, so their latency hides behind a tile's
    compute."""
    for j in T.Parallel(block_n):
        next_page[j] = BT[b, T.min(T.truncdiv(base + k0 + j, K.shape[1]), BT.shape[1] - 1)]


@T.macro
def _place(pg, sl, next_page, K, slot, k0, base, lo, hi, block_n):
    """Tile keys k0 .. k0 + block_n in id slot `slot`: page id (-1: masked, never read: outside the band [lo, hi),
    so past seq_lens_k or before the window of every row, or an id outside [0, pages)) and slot within the page,
    computed once per key."""
    for j in T.Parallel(block_n):
        pg[slot, j] = T.if_then_else((k0 + j >= lo) & (k0 + j < hi) & (next_page[j] >= 0) & (next_page[j] < K.shape[0]),
                                     next_page[j], -1)
        sl[slot, j] = T.truncmod(base + k0 + j, K.shape[1])


def _pages_valid(pg, slot, r, block_n):
    """Every box of r rows of the tile in id slot `slot` has a valid page (its first key's id is >= 0)."""
    ok = pg[slot, 0] >= 0
    for q in range(1, block_n // r):
        ok = ok & (pg[slot, q * r] >= 0)
    return ok


def _mode(pg, K, slot, k0, base, lo, hi, block_n):
    """How the tile in id slot `slot` travels (the same in every thread: scalars and shared ids): r > 0, by TMA in
    boxes of r rows (every key in the band, each box in one valid page); 0, by cp.async (zero-filled where masked).
    Tiles start at multiples of block_n, so a box of r rows (r | block_n) starts at a multiple of r when base is
    one (varlen k's base is any offset: its one page holds the tile)."""
    ps = K.shape[1]
    band = (k0 >= lo) & (k0 + block_n <= hi)
    mode = 0
    for r in reversed(box_rows(block_n)[1:]):  # built inside out: the largest box that fits wins
        mode = T.if_then_else((T.truncmod(ps, r) == 0) & (T.truncmod(base, r) == 0) & _pages_valid(pg, slot, r, block_n), r, mode)
    one_page = (T.truncdiv(base + k0, ps) == T.truncdiv(base + k0 + block_n - 1, ps)) & (pg[slot, 0] >= 0)
    return T.if_then_else(band, T.if_then_else(one_page, block_n, mode), 0)


@T.macro
def _issue(K, V, K_s, V_s, pg, sl, bars, mode, st, slot, kvh, block_n, dim, threads):
    """The K and V rows of the tile in id slot `slot` into ring stage st. TMA (mode r > 0): the elected thread
    expects each box's bytes on the stage's mbarrier, issues the boxes, then arrives (once). cp.async (mode 0):
    every thread copies, zero-filled where masked (one group the caller commits), and the elected thread arrives
    on the mbarrier without bytes, so every tile completes one phase of its stage's mbarrier."""
    # Boxes of r rows x 128 bytes (the swizzle span: a box is one contiguous run of the swizzled stage).
    cols = 128 // itemsize(K.dtype)
    panels = [(c, min(c + cols, dim)) for c in range(0, dim, cols)]
    for r in box_rows(block_n):
        if mode == r:
            for q in range(block_n // r):
                for c0, c1 in panels:
                    T.tma_copy(K[pg[slot, q * r], sl[slot, q * r] : sl[slot, q * r] + r, kvh, c0:c1], K_s[st, q * r : q * r + r, c0:c1],
                               barrier=bars[st])
                for c0, c1 in panels:
                    T.tma_copy(V[pg[slot, q * r], sl[slot, q * r] : sl[slot, q * r] + r, kvh, c0:c1], V_s[st, q * r : q * r + r, c0:c1],
                               barrier=bars[st])
    # One arrival a tile, by the thread that expected the bytes (tma_copy's leader: tl_shuffle_elect<threads>, lane 0
    # of warp 0), after its expect_tx's in program order, so the phase cannot complete before all bytes are counted.
    if T.shuffle_elect(threads):
        T.barrier_arrive(bars[st])
    if mode == 0:
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
def _store_partial(PO, PL, Sinks, acc_o, m_off, l_run, row_q, row_h, split, num_splits, has_sinks, norm, block_m, dim):
    """The tile's rows of slot `split` (output normalized, times norm: v_scale; 0 and LSE -inf where nothing is
    visible); with sinks, split 0 writes slot num_splits too: output 0, LSE the sink's logit."""
    for i, d in T.Parallel(block_m, dim):
        if row_q[i] >= 0:
            PO[split, row_q[i], row_h[i], d] = T.if_then_else(l_run[i] > 0, acc_o[i, d] * norm / l_run[i], 0)
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
def _store_out(O, LSE, Sinks, acc_o, m_off, l_run, m_fin, l_fin, r, row_q, row_h, has_sinks, norm, block_m, dim):
    """One split (`direct`): the tile's rows straight into the output (q's dtype; times norm, v_scale) and the LSE,
    as the merge of one partial would give them; the sink's logit (with sinks) joins the normaliser. A row with
    nothing visible gets output 0 and LSE -inf (with sinks, the sink's logit)."""
    for i in T.Parallel(block_m):
        # l_fin holds the sink's logit (log2) first; without sinks it is -inf, so m_fin = m_off and l_fin = l_run.
        l_fin[i] = T.if_then_else(has_sinks > 0, Sinks[T.min(row_h[i], Sinks.shape[0] - 1)] * LOG2E, NEG_INF)
        m_fin[i] = T.max(m_off[i], l_fin[i])
        l_fin[i] = l_run[i] * T.exp2(m_off[i] - m_fin[i]) + T.exp2(l_fin[i] - m_fin[i])
        r[i] = T.if_then_else(l_fin[i] > 0, T.exp2(m_off[i] - m_fin[i]) * norm / l_fin[i], 0)
    for i, d in T.Parallel(block_m, dim):
        if row_q[i] >= 0:
            O[row_q[i], row_h[i], d] = T.cast(acc_o[i, d] * r[i], O.dtype)
    for i in T.Parallel(block_m):
        if row_q[i] >= 0:
            LSE[row_q[i], row_h[i]] = T.if_then_else(l_fin[i] > 0, (m_fin[i] + T.log2(l_fin[i])) * LN2, NEG_INF)


@T.macro
def _load_q(Q, Q_s, KS, VS, row_q, row_h, flags, v_mult, qk: T.Ref, norm: T.Ref, fp8, dtype, mma, block_m, dim):
    """The packed rows' queries into Q_s (0 past the sequence's rows), and the factors of an FP8 cache: qk the scores'
    (k_scale over the query's FP16 multiplier), norm the output's (v_scale); 1 for a 16-bit cache."""
    qk = 1.0
    norm = 1.0
    if fp8 and dtype != mma:
        Qf = T.alloc_fragment((block_m, dim), dtype)
        for i, d in T.Parallel(block_m, dim):
            Qf[i, d] = T.if_then_else(row_q[i] >= 0, Q[T.max(row_q[i], 0), row_h[i], d], T.cast(0, dtype))
        scale_into_fp16(Qf, Q_s, T.alloc_fragment((block_m,), dtype), T.alloc_shared((block_m,), dtype), qk)
        qk = 1.0 / qk
    else:
        for i, d in T.Parallel(block_m, dim):
            Q_s[i, d] = T.if_then_else(row_q[i] >= 0, Q[T.max(row_q[i], 0), row_h[i], d], T.cast(0, dtype))
    if fp8:
        qk = qk * T.if_then_else((flags & K_SCALE_DEV) != 0, KS[0], T.float32(1))
        norm = T.if_then_else((flags & V_SCALE_DEV) != 0, VS[0], v_mult)


def _alloc(block_m, block_n, dim, num_stages, mma, kv_dtype):
    """Q, the K/V ring, its page ids and slots (num_stages + 1 tiles: one more than the ring, filled a tile
    ahead) and the per-row metadata in shared memory; the next tile's block_table entries, S, P and O and the
    per-row softmax state in registers. Q and P in the MMA's dtype, the ring in the cache's."""
    return (
        T.alloc_shared((block_m, dim), mma), T.alloc_shared((num_stages, block_n, dim), kv_dtype),
        T.alloc_shared((num_stages, block_n, dim), kv_dtype),
        *(T.alloc_shared((num_stages + 1, block_n), "int32") for _ in range(2)), T.alloc_fragment((block_n,), "int32"),
        *(T.alloc_shared((block_m,), "int32") for _ in range(3)),
        T.alloc_fragment((block_m, block_n), "float32"), T.alloc_fragment((block_m, block_n), mma),
        T.alloc_fragment((block_m, dim), "float32"), *(T.alloc_fragment((block_m,), "float32") for _ in range(6)),
    )


def gqa_decode(dtype, dim, window, block_m, block_n, threads, num_stages, kv_dtype=None):
    """The program of one (dtype, dim, window class) with its tiles; every option is a runtime argument.

    kv_dtype (a compile-time option, not a config key): an FP8 cache's dtype, on the entry's tiles. Its tiles travel
    as FP8 (half the bytes, TMA boxes of 128 columns) into the ring and are upcast exactly into one FP16 K and V tile
    (FP16 MMAs; a BF16 query is scaled by a power of two into FP16's range, scale_into_fp16). k_scale is a factor
    of the scores (the host folds a float one into scale_log2, or softcap_mul with softcap; KS[0] with K_SCALE_DEV),
    v_scale one of the output (v_mult, or VS[0] with V_SCALE_DEV). A 16-bit cache ignores KS, VS and v_mult."""
    has_left, has_right = window == "local", window != "none"
    accum = "float32"
    fp8 = kv_dtype is not None
    assert not fp8 or kv_dtype in FP8_KV, f"kv_dtype must be one of {FP8_KV}, got {kv_dtype}"
    kv_dtype = kv_dtype or dtype
    mma = "float16" if fp8 else dtype
    R, H, Pages, PS, Hkv, B, MP, NQ, HS, NS, NKB = T.dynamic("R H Pages PS Hkv B MP NQ HS NS NKB")
    # The partials' rows and heads are sizes of their own: `direct` passes 1-row placeholders.
    RP, HP = T.dynamic("RP HP")
    sqr, sqh, skp, sks, skh, svp, svs, svh, sor, soh = T.dynamic("sqr sqh skp sks skh svp svs svh sor soh", "int64")

    @T.prim_func
    def main(
        Q: T.StridedTensor((R, H, dim), (sqr, sqh, 1), dtype),
        K: T.StridedTensor((Pages, PS, Hkv, dim), (skp, sks, skh, 1), kv_dtype),
        V: T.StridedTensor((Pages, PS, Hkv, dim), (svp, svs, svh, 1), kv_dtype),
        BT: T.Tensor((B, MP), "int32"),
        SeqK: T.Tensor((B,), "int32"),
        CuQ: T.Tensor((NQ,), "int32"),
        KBase: T.Tensor((NKB,), "int32"),
        Sinks: T.Tensor((HS,), accum),
        PO: T.Tensor((NS, RP, HP, dim), accum),
        PL: T.Tensor((NS, RP, HP), accum),
        O: T.StridedTensor((R, H, dim), (sor, soh, 1), dtype),
        LSE: T.Tensor((R, H), accum),
        scale_log2: T.float32,
        left: T.int32,
        right: T.int32,
        softcap_value: T.float32,
        softcap_mul: T.float32,
        num_splits: T.int32,
        packed_rows: T.int32,
        has_sinks: T.int32,
        direct: T.int32,
        flags: T.int32,
        KS: T.Tensor((1,), accum),
        VS: T.Tensor((1,), accum),
        v_mult: T.float32,
    ):
        with T.Kernel(T.ceildiv(packed_rows, block_m), Hkv, B * num_splits, threads=threads) as (bx, kvh, bz):
            (Q_s, K_s, V_s, pg, sl, next_page, row_q, row_h, row_pos, acc_s, acc_p, acc_o,
             m_run, m_prev, m_off, alpha, row_sum, l_run) = _alloc(block_m, block_n, dim, num_stages, mma, kv_dtype)
            # An FP8 ring's tiles upcast for the MMAs (read only after the upcast's barrier, rewritten after the
            # iteration's last one)
            K16 = T.alloc_shared((1, block_n, dim), mma) if fp8 else K_s
            V16 = T.alloc_shared((1, block_n, dim), mma) if fp8 else V_s
            # The wrapper checks the layout rule (16-byte aligned strides), which 16-byte cp.async and the TMA tensor
            # maps (strides in multiples of 16 bytes) both need, and 16-byte stores of the output.
            assume_aligned(sqr, sqh, sor, soh)
            assume_aligned(skp, sks, skh, svp, svs, svh, elems=16 // itemsize(kv_dtype))
            b, split, group, q0, sq, sk, lo, hi, t0, n, k_lo, mode, base = alloc_vars(13)
            qk, sl2, cap_mul, norm = alloc_vars(4, accum)
            # Per ring stage: the tile landed (one arrival by the elected thread, plus the TMA bytes of a TMA tile).
            bars = T.alloc_barrier([1] * num_stages)
            b = T.truncdiv(bz, num_splits)
            split = T.truncmod(bz, num_splits)
            group = T.truncdiv(H, Hkv)
            q0 = CuQ[b]
            base = T.if_then_else((flags & KEY_BASE) != 0, KBase[T.min(b, NKB - 1)], 0)
            sq = CuQ[b + 1] - q0
            # Keys past the block_table row's capacity do not exist (seq_lens_k is clamped to it).
            sk = T.min(T.max(SeqK[b], 0), MP * PS)
            # The band of the tile's rows (first row m0 // group, last min(.., sq - 1)), in whole key tiles per split.
            lo = 0
            if has_left:
                lo = T.max(T.truncdiv(bx * block_m, group) + sk - sq - left, 0)
            # Tiles start at multiples of block_n (so a tile of a page of >= block_n keys is one TMA box); the keys of
            # the first tile before the band's start are masked like those past its end.
            k_lo = lo
            lo = T.truncdiv(lo, block_n) * block_n
            hi = sk
            if has_right:
                hi = T.min(T.min(T.truncdiv(bx * block_m + block_m - 1, group), sq - 1) + sk - sq + right + 1, sk)
            n = 0
            if (T.truncdiv(bx * block_m, group) < sq) & (hi > k_lo):
                n = T.ceildiv(hi - lo, block_n)
            t0 = split * T.ceildiv(n, num_splits)
            n = T.max(T.min(T.ceildiv(n, num_splits), n - t0), 0)

            _rows(row_q, row_h, row_pos, q0, sq, sk - sq, bx * block_m, group, kvh, block_m)
            T.sync_threads()
            _load_q(Q, Q_s, KS, VS, row_q, row_h, flags, v_mult, qk, norm, fp8, dtype, mma, block_m, dim)
            # k_scale enters the tanh's argument with softcap (scores in natural units), else the softmax's factor
            sl2 = T.if_then_else(softcap_value > 0, scale_log2, scale_log2 * qk)
            cap_mul = softcap_mul * qk
            T.fill(acc_o, 0)
            T.fill(l_run, 0)
            T.fill(m_run, NEG_INF)
            T.fill(m_off, 0)
            # Tile u's ids sit in slot u % ids; tile u + num_stages's are fetched while tile u is computed.
            ids = num_stages + 1
            for s in T.serial(num_stages):
                if s < n:
                    _fetch(next_page, BT, K, b, lo + (t0 + s) * block_n, base, block_n)
                    _place(pg, sl, next_page, K, s, lo + (t0 + s) * block_n, base, k_lo, hi, block_n)
            T.sync_threads()
            for s in T.serial(num_stages - 1):
                if s < n:
                    mode = _mode(pg, K, s, lo + (t0 + s) * block_n, base, k_lo, hi, block_n)
                    _issue(K, V, K_s, V_s, pg, sl, bars, mode, s, s, kvh, block_n, dim, threads)
                T.ptx_commit_group()
            for t in T.serial(n):
                if t + num_stages < n:
                    _fetch(next_page, BT, K, b, lo + (t0 + t + num_stages) * block_n, base, block_n)
                if t + num_stages - 1 < n:
                    mode = _mode(pg, K, (t + num_stages - 1) % ids, lo + (t0 + t + num_stages - 1) * block_n, base, k_lo, hi,
                                 block_n)
                    _issue(K, V, K_s, V_s, pg, sl, bars, mode, (t + num_stages - 1) % num_stages, (t + num_stages - 1) % ids, kvh,
                           block_n, dim, threads)
                T.ptx_commit_group()
                T.ptx_wait_group(num_stages - 1)  # this thread's cp.async copies of tile t (if any) have landed
                T.mbarrier_wait_parity(bars[t % num_stages], T.truncmod(T.truncdiv(t, num_stages), 2))  # its TMA bytes
                T.sync_threads()  # everyone's cp.async copies
                T.fence_proxy_async()  # cp.async writes, read by wgmma (the async proxy)
                st = 0 if fp8 else t % num_stages
                if fp8:
                    upcast_stage(K_s, K16, t % num_stages)
                    upcast_stage(V_s, V16, t % num_stages)
                    T.fence_proxy_async()  # the upcast's stores, read by wgmma
                    T.sync_threads()
                T.gemm(Q_s, K16[st, :, :], acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if softcap_value > 0:
                    for i, j in T.Parallel(block_m, block_n):
                        acc_s[i, j] = softcap_value * T.tanh(acc_s[i, j] * cap_mul)
                _mask(acc_s, pg, row_pos, t % ids, lo + (t0 + t) * block_n, left, right, block_m, block_n, has_left, has_right)
                online_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, sl2, block_m, block_n)
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_m, dim):
                    acc_o[i, d] *= alpha[i]
                T.gemm(acc_p, V16[st, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                if t + num_stages < n:  # the slot of tile t - 1, read by no one since the last barrier
                    _place(pg, sl, next_page, K, (t + num_stages) % ids, lo + (t0 + t + num_stages) * block_n, base, k_lo, hi,
                           block_n)
                T.sync_threads()  # stage t % num_stages is refilled, and these ids read, in the next iteration
            if direct > 0:
                _store_out(O, LSE, Sinks, acc_o, m_off, l_run, m_prev, alpha, row_sum, row_q, row_h, has_sinks, norm, block_m, dim)
            else:
                _store_partial(PO, PL, Sinks, acc_o, m_off, l_run, row_q, row_h, split, num_splits, has_sinks, norm, block_m, dim)

    return main.with_attr("tilelang_pass_configs", {"tl.enable_fast_math": True})
