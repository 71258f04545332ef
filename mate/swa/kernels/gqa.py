"""TileLang program of GQA forward attention, dense or sliding window (BSHD).

One CTA computes `block_m` query rows of one query head against the keys of
its KV head (`kv_head = head // (H // H_kv)`). Query row `i` sits at position
`p = i + Sk - Sq` (bottom-right aligned) and sees the keys `j` with
`p - left <= j <= p + right` and `0 <= j < Sk`.

The window class fixes at compile time which sides of the band exist:

- `none`:   no window (full, non-causal attention); only the last key tile
            can hold keys past `Sk`.
- `causal`: left side unbounded, right side `p + right` (causal is right = 0).
- `local`:  left side bounded; the right side too (an unbounded right side
            comes in as a sentinel larger than any distance).

`left` and `right` are runtime scalars, so one compiled kernel serves every
window of its class. Each CTA covers its band, the keys `[lo, hi)` that some
row of its query tile sees, with `nt` key tiles that start at `lo` (not at a
multiple of `block_n`); when `hi < Sk` the last tile ends at `hi` instead,
overlapping its predecessor, whose keys it masks. It masks only the tiles that
some row does not see whole, `t < full_lo or t >= full_hi`. The online softmax
keeps the running max at -inf for a row that has seen nothing yet and
exponentiates against 0 then, so a row with no visible key ends with sum 0:
output 0 and LSE -inf, never NaN.

Unused cache memory: no key outside the band is loaded (tile parts before
key 0 or past `Sk` arrive as zeros from TMA), so NaN or Inf there never
reaches a result. Why the tiles follow the band rather than masking: a masked
key has P = 0, but its V row still enters P.V, and 0 * NaN is NaN; zeroing
those V rows in shared memory instead would cost two consumer barriers and a
proxy fence in every iteration (TileLang's sync planner puts them at the loop
level). This needs a band at least `block_n` keys wide unless it touches key
0 (the clamped tile then starts before 0) or `Sk`; with `block_n <= block_m`
it is (a full query tile has `block_m` rows, and a partial one is the last,
whose band ends at `Sk`); a config with a wider `block_n` keeps the results
but not this guarantee (tests/test_garbage.py checks the shipped configs). Inside
the band, K is safe (masked scores are replaced, NaN included), but a
non-finite V row of a key that some row of the query tile sees reaches the
tile's other rows as 0 * NaN: garbage can only matter to a row if it lies in
the window of a row of the same `block_m`-row query tile.

Options (issue 17), compile-time flags that are not config keys (a variant takes the tiles of its
(dtype, dim, window) entry); with all off the program is the plain one, whose generated CUDA is
what it was before the options:

- `varlen`: q/out [1, total_q, H, D], k/v [1, total_k, H_kv, D], LSE [1, H, total_q]; the grid
  is (ceil(max_seqlen_q / block_m), H, B) and each CTA reads its sequence's offsets and lengths
  from cu_seqlens_q/k, runs the band above in the sequence's coordinates (a tile past the
  sequence's rows runs no key tile) and stores its rows one by one (a TMA store of the tile
  would write the next sequence's rows). Key tiles never start before cu_seqlens_k[0] and the
  last one ends at the band's end, so rows outside [cu_seqlens_k[0], cu_seqlens_k[B]) are
  never read unless the whole used range is shorter than block_n keys; a band narrower than
  block_n reads keys of the neighbouring sequences (masked, finite values assumed: they are
  used memory).
- `sinks`: one FP32 logit per query head joins the normaliser in the store (the running max
  taken over it too, so no sum overflows): output scaled by the sink's share, LSE with it; a
  row with no visible key gets output 0 and the sink's logit as LSE.
- `softcap`: S becomes softcap * tanh(scale * S / softcap) before the mask, and the softmax
  then runs on scores already scaled (the wrapper passes scale_log2 = log2(e)).

Hopper: Q, K and V tiles arrive through TMA, K and V into a `num_stages`-deep
shared ring fed by a producer warpgroup (TileLang's warp specialization of the
pipelined loop; `setmaxnreg` gives two consumer warpgroups 240 registers, three
160); both GEMMs are
wgmma (QK^T from shared memory, PV with P in registers); O leaves through
shared memory and a TMA store. `mma_depth` picks the consumer schedule:

- 1: tile n's QK^T, softmax and PV in turn (each GEMM waited right away);
     the loop runs at least once, so the consumers always wait for the Q load
     (O_s shares shared memory with Q_s);
- 2: the FlashAttention-3 intra-warpgroup overlap. Iteration t issues QK^T of
     tile t and PV of tile t-1 back to back without waiting, then runs the
     softmax of tile t while PV of tile t-1 is still on the tensor cores.
     K(t) and V(t-1) are loaded in iteration t; the loop runs one extra
     iteration, so it loads one K tile past the band (TMA fills rows past Sk
     with zeros) and, first, tile 0's V twice; their GEMMs are skipped. The first and the extra iteration take their own branches, so
     that no asynchronous wgmma crosses a branch (ptxas would serialize them).
     The loop always runs at least once, so the Q load is always waited for.
     As compiled (TileLang 0.1.15, CUDA 13), ptxas hoists the PV wait above the
     softmax, so the overlap does not happen; a program that keeps the wait after
     the softmax measured neutral on the H200 (two consumer warpgroups keep the
     tensor cores busy; benchmarks/results/NVIDIA_H200-2026-12-01-gqa-softmax-join.md).
     After each wgmma wait the released accumulators are fenced, so the
     compiler cannot read S (or overwrite P and O) before the wait.

One query tile a CTA, not a persistent loop over tiles: a CTA's fixed cost (Q and first K/V in flight,
the first tile's QK^T and the last PV with nothing beside them, the epilogue) is about 25-35% of a
(1024, 0) window's time (benchmarks/results/NVIDIA_H200-2026-12-01-gqa-softmax-join.md), but TileLang
0.1.15 does not overlap it across tiles. It does lower a `for` over tiles around this pipelined loop, as
its stateless PersistentTileScheduler form does. The generated CUDA then has a CTA barrier at each tile,
loads Q with plain 2-byte loads instead of TMA, and the producer never runs ahead into the next tile
(read on the CPU, 2026-12-02; not timed). Hiding that cost needs explicit roles and barriers. Two
64-row CTAs an SM instead (one consumer warpgroup each) measured 5-36% slower. What bounds the loop
(ncu, dense causal 16k): each warpgroup's softmax between its GEMMs, 64 MUFU exponentials a thread and
the row max as one 32-long FMNMX chain, with the tensor pipe 71% busy; under sustained load the H200
runs this kernel, cuDNN's and FlashAttention-3's at its 700 W limit
(benchmarks/results/NVIDIA_H200-2026-12-03-gqa-power.md).
"""

import tilelang.language as T

from mate._tl import LOG2E, assume_aligned
from mate.swa.kernels.gqa_card import WINDOWS
LN2 = 0.6931471805599453


NEG_INF = -T.infinity("float32")


def _tile_start(lo, hi, t, Sk, block_n, has_right, base=None):
    """First key of tile t of the band [lo, hi); the last tile ends at hi when hi < Sk.

    Varlen (`base` given): the last tile always ends at hi, since the keys past a sequence are the
    next one's (or the unused tail past cu_seqlens_k[B]), and no tile starts before `base` (the
    first used key, cu_seqlens_k[0], in the sequence's coordinates): a band narrower than
    block_n reads the keys before its own, which some other sequence owns."""
    start = lo + t * block_n
    if base is not None:
        return T.max(T.min(start, hi - block_n), base)
    if has_right:
        start = T.if_then_else(hi < Sk, T.min(start, hi - block_n), start)
    return start


@T.macro
def _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, t, start, fresh, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, seq_k=None, cap=None):
    """Mask key tile t (its keys start at `start`, the new ones at `fresh`) where needed,
    update the running max and sum, leave P (FP32) in acc_s. Varlen: the sequence's key count
    seq_k (else K's length), and every tile masks the keys before `fresh` (its start may be clamped
    down). cap = (softcap, scale / softcap): the scores become softcap * tanh(q.k * scale / softcap)
    first (already scaled: the caller passes scale_log2 = log2(e))."""
    # Sk is read from K's shape: a macro argument would rename that variable (the generated CUDA names it).
    if cap is not None:
        for i, j in T.Parallel(block_m, block_n):
            acc_s[i, j] = cap[0] * T.tanh(acc_s[i, j] * cap[1])
    if (t < full_lo) | (t >= full_hi):
        for i, j in T.Parallel(block_m, block_n):
            key = start + j
            pos = m0 + i + shift
            ok = key < (K.shape[1] if seq_k is None else seq_k)
            if has_left:
                ok = ok & (key >= pos - left)
            if has_right:
                ok = ok & (key <= pos + right) & (key >= fresh)
            elif seq_k is not None:
                ok = ok & (key >= fresh)
            acc_s[i, j] = T.if_then_else(ok, acc_s[i, j], NEG_INF)
    online_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, scale_log2, block_m, block_n)


@T.macro
def online_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, scale_log2, block_m, block_n):
    """One key tile of the online softmax on masked scores (-inf): the running max and sum move on,
    alpha is the output's rescale, acc_s becomes P (FP32)."""
    T.copy(m_run, m_prev)
    T.reduce_max(acc_s, m_run, dim=1, clear=False)
    for i in T.Parallel(block_m):
        # A row that has seen nothing keeps max -inf; exponentiate against 0 then.
        m_off[i] = T.if_then_else(m_run[i] == NEG_INF, 0, m_run[i] * scale_log2)
        alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_off[i])
    for i, j in T.Parallel(block_m, block_n):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_off[i])
    T.reduce_sum(acc_s, row_sum, dim=1)
    for i in T.Parallel(block_m):
        l_run[i] = l_run[i] * alpha[i] + row_sum[i]


@T.macro
def _store(O, LSE, O_s, acc_o, m_off, l_run, bz, by, m0, Sq, block_m, dim):
    """A row with nothing visible (sum 0) gets output 0 and LSE -inf; O leaves through shared memory by TMA."""
    for i, j in T.Parallel(block_m, dim):
        acc_o[i, j] = T.if_then_else(l_run[i] > 0, acc_o[i, j] / l_run[i], 0)
    T.copy(acc_o, O_s)
    T.copy(O_s, O[bz, m0 : m0 + block_m, by, :])
    for i in T.Parallel(block_m):
        if m0 + i < Sq:
            LSE[bz, by, m0 + i] = T.if_then_else(l_run[i] > 0, (m_off[i] + T.log2(l_run[i])) * LN2, NEG_INF)


@T.macro
def _store_ext(O, LSE, Sinks, O_s, acc_o, m_off, l_run, m_fin, l_fin, r, qb, by, q0, m0, sq, block_m, dim, sinks, varlen):
    """_store with the options: the sink's logit joins the normaliser (m_fin, l_fin: the running max and
    sum with it, r: the output's factor); varlen rows leave one by one, only those of the sequence
    (a TMA store of the tile would write the next sequence's rows)."""
    if sinks:
        for i in T.Parallel(block_m):
            m_fin[i] = T.max(m_off[i], Sinks[by] * LOG2E)
            l_fin[i] = l_run[i] * T.exp2(m_off[i] - m_fin[i]) + T.exp2(Sinks[by] * LOG2E - m_fin[i])
            r[i] = T.exp2(m_off[i] - m_fin[i]) / l_fin[i]
        for i, j in T.Parallel(block_m, dim):
            acc_o[i, j] = acc_o[i, j] * r[i]
    else:
        for i, j in T.Parallel(block_m, dim):
            acc_o[i, j] = T.if_then_else(l_run[i] > 0, acc_o[i, j] / l_run[i], 0)
    T.copy(acc_o, O_s)
    if varlen:
        for i, j in T.Parallel(block_m, dim):
            if m0 + i < sq:
                O[qb, _at(q0, m0 + i), by, j] = O_s[i, j]
    else:
        T.copy(O_s, O[qb, m0 : m0 + block_m, by, :])
    for i in T.Parallel(block_m):
        if m0 + i < sq:
            if sinks:
                LSE[qb, by, _at(q0, m0 + i)] = (m_fin[i] + T.log2(l_fin[i])) * LN2
            else:
                LSE[qb, by, _at(q0, m0 + i)] = T.if_then_else(l_run[i] > 0, (m_off[i] + T.log2(l_run[i])) * LN2, NEG_INF)


def _at(offset, start):
    """A sequence's row `start` in the packed tensor (plain layouts: offset None, the row itself)."""
    return start if offset is None else offset + start


@T.macro
def _attend(Q, K, V, O, LSE, Sinks, Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run,
            bx, by, qb, kb, n_qtiles, qoff, koff, Sq, Sk, base, H, Hkv, left, right, scale_log2,
            block_m, block_n, dim, num_stages, mma_depth, regs_s, regs_o, regs_p, has_left, has_right, varlen, sinks, cap):
    """One CTA's query tile against its band, then the store. Plain layouts: qoff, koff and base
    None, Sq and Sk the tensors' lengths, the TMA store; varlen (qb = kb = 0): the sequence's row
    offsets and lengths, read from cu_seqlens by the caller."""
    # Last query tiles first: under a causal band they carry the most key tiles.
    m0 = (n_qtiles - 1 - bx) * block_m
    kvh = by // (H // Hkv)
    shift = Sk - Sq
    p_first = m0 + shift
    p_last = T.min(m0 + block_m, Sq) - 1 + shift

    # The band: keys [lo, hi) that some row of this tile sees, in nt tiles.
    lo = T.max(p_first - left, 0) if has_left else 0
    hi = T.min(p_last + right + 1, Sk) if has_right else Sk
    # Varlen: a tile past its sequence's rows (the grid covers max_seqlen_q) runs no key tile.
    nt = T.ceildiv(T.max(hi - lo, 0), block_n) if not varlen else T.if_then_else(m0 < Sq, T.ceildiv(T.max(hi - lo, 0), block_n), 0)
    # Tiles every row sees whole: [full_lo, full_hi) (a clamped last tile is never one).
    full_lo = T.ceildiv(T.max(p_last - left - lo, 0), block_n) if has_left else 0
    full_hi = T.floordiv((T.min(p_first + right + 1, Sk) if has_right else Sk) - lo, block_n)

    T.copy(Q[qb, _at(qoff, m0) : _at(qoff, m0) + block_m, by, :], Q_s)
    T.fill(acc_o, 0)
    T.fill(l_run, 0)
    T.fill(m_run, NEG_INF)
    T.fill(m_off, 0)
    T.fill(alpha, 1)

    if mma_depth == 1:
        # At least one iteration, even for an empty band: the consumers wait for the Q
        # load inside the loop, and O_s shares shared memory with Q_s, so a Q load left
        # unwaited could land on O_s after the epilogue wrote it (seen on the H200:
        # tiles with nothing visible stored nonzero rows).
        for n in T.Pipelined(0, T.max(nt, 1), num_stages=num_stages):
            s0 = _tile_start(lo, hi, n, Sk, block_n, has_right, base)
            T.copy(K[kb, _at(koff, s0) : _at(koff, s0) + block_n, kvh, :], K_s)
            if n < nt:
                T.gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, n, s0, lo + n * block_n, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, None if koff is None else Sk, cap)
                T.copy(acc_s, acc_p)
                for i, j in T.Parallel(block_m, dim):
                    acc_o[i, j] *= alpha[i]
            T.copy(V[kb, _at(koff, s0) : _at(koff, s0) + block_n, kvh, :], V_s)
            if n < nt:
                T.gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
    else:
        T.clear(acc_p)
        for t in T.Pipelined(0, nt + 1, num_stages=num_stages):
            k0 = _tile_start(lo, hi, t, Sk, block_n, has_right, base)
            T.copy(K[kb, _at(koff, k0) : _at(koff, k0) + block_n, kvh, :], K_s)
            v0 = _tile_start(lo, hi, T.max(t - 1, 0), Sk, block_n, has_right, base)
            T.copy(V[kb, _at(koff, v0) : _at(koff, v0) + block_n, kvh, :], V_s)
            # Each branch issues and waits its own wgmma groups: no asynchronous GEMM
            # crosses a branch, so ptxas keeps them asynchronous (else it serializes, C7514).
            if (t > 0) & (t < nt):
                T.wgmma_gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block_m, dim):
                    acc_o[i, j] *= alpha[i]
                T.wgmma_gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(1)  # QK^T of tile t done; PV of tile t-1 still on the tensor cores
                # After each wait, fence the registers it released: else the compiler may read
                # S (or overwrite P and O) before the wait, while the tensor cores still own them.
                T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, t, k0, lo + t * block_n, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, None if koff is None else Sk, cap)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                T.warpgroup_fence_operand(acc_p, num_regs=regs_p)
                T.copy(acc_s, acc_p)
            elif t < nt:  # first tile: nothing to overlap with
                T.wgmma_gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, t, k0, lo + t * block_n, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, None if koff is None else Sk, cap)
                T.copy(acc_s, acc_p)
            elif t > 0:  # one past the last tile: PV of the last tile
                for i, j in T.Parallel(block_m, dim):
                    acc_o[i, j] *= alpha[i]
                T.wgmma_gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                T.warpgroup_fence_operand(acc_p, num_regs=regs_p)

    if Sinks is None:
        _store(O, LSE, O_s, acc_o, m_off, l_run, qb, by, m0, Sq, block_m, dim)
    else:
        # m_prev, row_sum and alpha are free after the loop: the store's scratch.
        _store_ext(O, LSE, Sinks, O_s, acc_o, m_off, l_run, m_prev, row_sum, alpha, qb, by, qoff, m0, Sq, block_m, dim, sinks, varlen)


def _alloc(block_m, block_n, dim, dtype, accum):
    """The CTA's buffers: Q, K, V and O tiles in shared memory, S, P and O (FP32) and the per-row softmax state."""
    return (
        T.alloc_shared((block_m, dim), dtype), T.alloc_shared((block_n, dim), dtype), T.alloc_shared((block_n, dim), dtype),
        T.alloc_shared((block_m, dim), dtype), T.alloc_fragment((block_m, block_n), accum), T.alloc_fragment((block_m, block_n), dtype),
        T.alloc_fragment((block_m, dim), accum), *(T.alloc_fragment((block_m,), accum) for _ in range(6)),
    )


def gqa_fwd(dtype, dim, window, block_m, block_n, threads, num_stages, mma_depth, varlen=False, sinks=False, softcap=False):
    """The program of one specialization. varlen, sinks and softcap (compile-time, not config keys: they
    take the tiles of their (dtype, dim, window) entry) give the program with the options' arguments;
    all off, the plain program, as before the options (the same generated code)."""
    assert window in WINDOWS, window
    assert mma_depth in (1, 2), mma_depth
    has_left = window == "local"
    # 32-bit registers per consumer thread of S (FP32), O (FP32) and P (16-bit)
    regs_s = block_m * block_n // threads
    regs_o = block_m * dim // threads
    regs_p = block_m * block_n // threads // 2
    has_right = window != "none"
    accum = "float32"
    opts = dict(block_m=block_m, block_n=block_n, dim=dim, num_stages=num_stages, mma_depth=mma_depth, regs_s=regs_s,
                regs_o=regs_o, regs_p=regs_p, has_left=has_left, has_right=has_right)

    B, Sq, Sk, H, Hkv = T.dynamic("B Sq Sk H Hkv")
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh = T.dynamic(
        "sqb sqs sqh skb sks skh svb svs svh sob sos soh", "int64"
    )

    # The tensors both programs take first (q, k, v, out, LSE); the wrapper checks the layout rule (16-byte aligned
    # strides) of each.
    q_t = T.StridedTensor((B, Sq, H, dim), (sqb, sqs, sqh, 1), dtype)
    k_t = T.StridedTensor((B, Sk, Hkv, dim), (skb, sks, skh, 1), dtype)
    v_t = T.StridedTensor((B, Sk, Hkv, dim), (svb, svs, svh, 1), dtype)
    o_t = T.StridedTensor((B, Sq, H, dim), (sob, sos, soh, 1), dtype)
    lse_t = T.Tensor((B, H, Sq), accum)
    strides = (sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh)

    @T.prim_func
    def main(Q: q_t, K: k_t, V: v_t, O: o_t, LSE: lse_t, scale_log2: T.float32, left: T.int32, right: T.int32):
        with T.Kernel(T.ceildiv(Sq, block_m), H, B, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run = _alloc(block_m, block_n, dim, dtype, accum)

            assume_aligned(*strides)
            _attend(Q, K, V, O, LSE, None, Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run,
                    bx, by, bz, bz, T.ceildiv(Sq, block_m), None, None, Sq, Sk, None, H, Hkv, left, right, scale_log2,
                    varlen=False, sinks=False, cap=None, **opts)

    if not (varlen or sinks or softcap):
        # exp2 and the final division take the approximate hardware paths (ex2.approx.ftz,
        # rcp.approx): the softmax is the throughput limit of this kernel.
        return main.with_attr("tilelang_pass_configs", {"tl.enable_fast_math": True})

    # With the options: q/out [Bq, Sq, H, D] and LSE [Bq, H, Sq] (varlen: [1, total_q, H, D] and
    # [1, H, total_q], one CTA column per sequence of cu_seqlens); sinks FP32 [H]; the softcap as
    # (softcap, scale / softcap). Arguments an option does not use are never read (placeholders).
    NQ, NK, HS = T.dynamic("NQ NK HS")

    @T.prim_func
    def ext(
        Q: q_t, K: k_t, V: v_t, O: o_t, LSE: lse_t,
        CuQ: T.Tensor((NQ,), "int32"),
        CuK: T.Tensor((NK,), "int32"),
        Sinks: T.Tensor((HS,), accum),
        scale_log2: T.float32,
        left: T.int32,
        right: T.int32,
        softcap_value: T.float32,
        softcap_mul: T.float32,
        max_seqlen_q: T.int32,
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q if varlen else Sq, block_m), H, NQ - 1 if varlen else B, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run = _alloc(block_m, block_n, dim, dtype, accum)
            assume_aligned(*strides)
            if varlen:
                _attend(Q, K, V, O, LSE, Sinks, Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run,
                        bx, by, 0, 0, T.ceildiv(max_seqlen_q, block_m), CuQ[bz], CuK[bz], CuQ[bz + 1] - CuQ[bz], CuK[bz + 1] - CuK[bz],
                        CuK[0] - CuK[bz], H, Hkv, left, right, scale_log2,
                        varlen=True, sinks=sinks, cap=(softcap_value, softcap_mul) if softcap else None, **opts)
            else:
                _attend(Q, K, V, O, LSE, Sinks, Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run,
                        bx, by, bz, bz, T.ceildiv(Sq, block_m), None, None, Sq, Sk, None, H, Hkv, left, right, scale_log2,
                        varlen=False, sinks=sinks, cap=(softcap_value, softcap_mul) if softcap else None, **opts)

    return ext.with_attr("tilelang_pass_configs", {"tl.enable_fast_math": True})
