"""Variant of mate/swa/kernels/gqa.py for benchmarks/gqa_ab.py: FlashAttention-3's inter-warpgroup
ping-pong on top of the shipped mma_depth-2 schedule (issue 17, dense causal and windowed prefill).

Same program signature and results as the shipped module; only the consumer schedule of
mma_depth 2 changes (mma_depth 1 is the shipped one):

- The consumer warpgroups take turns issuing their GEMMs, in a ring of named barriers, one per
  warpgroup (TileLang numbers its own from 0 up, 3 in these kernels; these are 13, 14 and 15 for
  a third): warpgroup w waits on barrier PP_BARRIER + w, issues QK^T of tile t and PV of tile
  t-1, and arrives on the next warpgroup's barrier. So while one warpgroup runs its softmax, the
  other's GEMMs have the tensor cores; unordered (the shipped schedule), both warpgroups can
  reach their softmax at once and leave the tensor cores idle.
- The rescale of O by the tile's alpha moves after the PV wait, out of the turn: the same
  multiplications on the same values in the same order (bit-identical O), but the turn holds
  only the two wgmma issues.
- Every warpgroup runs the same number of turns (nt + 1, none for an empty band): the last
  warpgroup arrives once, in the first tile's branch, to give warpgroup 0 the first turn, and
  warpgroup 0 takes the last warpgroup's final hand-over after the loop, so no barrier is left
  half-arrived.
- The producer warpgroup and the register split are TileLang's (setmaxnreg 24 for the producer,
  240 for two consumer warpgroups, 160 for three), as in the shipped kernel and FlashAttention-3.

Masking, LSE, sinks, softcap and varlen are the shipped macros, imported unchanged.
"""

import tilelang.language as T

from mate._hopper import WARPGROUP
from mate.swa.kernels.gqa import NEG_INF, _aligned, _alloc, _at, _mask_and_softmax, _store, _store_ext, _tile_start
from mate.swa.kernels.gqa_card import WINDOWS

PP_BARRIER = 13  # named barriers 13..15: the ping-pong turns of up to three consumer warpgroups
PP_COUNT = 2 * WARPGROUP  # a turn's barrier: the waiting warpgroup and the one that hands over
MARK = "__named_barrier_arrive"  # in this variant's generated CUDA, not in the shipped one's (check_gqa_variant.py)


@T.macro
def _attend(Q, K, V, O, LSE, Sinks, Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run,
            bx, by, qb, kb, n_qtiles, qoff, koff, Sq, Sk, base, H, Hkv, left, right, scale_log2,
            block_m, block_n, dim, num_stages, mma_depth, regs_s, regs_o, regs_p, has_left, has_right, varlen, sinks, cap, n_wg):
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
        # Ping-pong (module docstring): this warpgroup's turn barrier and the next one's.
        wg = T.get_thread_binding() // WARPGROUP
        pingpong = n_wg > 1
        T.clear(acc_p)
        for t in T.Pipelined(0, nt + 1, num_stages=num_stages):
            k0 = _tile_start(lo, hi, t, Sk, block_n, has_right, base)
            T.copy(K[kb, _at(koff, k0) : _at(koff, k0) + block_n, kvh, :], K_s)
            v0 = _tile_start(lo, hi, T.max(t - 1, 0), Sk, block_n, has_right, base)
            T.copy(V[kb, _at(koff, v0) : _at(koff, v0) + block_n, kvh, :], V_s)
            # Each branch issues and waits its own wgmma groups: no asynchronous GEMM
            # crosses a branch, so ptxas keeps them asynchronous (else it serializes, C7514).
            if (t > 0) & (t < nt):
                if pingpong:
                    T.sync_threads(PP_BARRIER + wg, PP_COUNT)
                T.wgmma_gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.wgmma_gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                if pingpong:
                    T.named_barrier_arrive(PP_BARRIER + (wg + 1) % n_wg, PP_COUNT)
                T.wait_wgmma(1)  # QK^T of tile t done; PV of tile t-1 still on the tensor cores
                # After each wait, fence the registers it released: else the compiler may read
                # S (or overwrite P and O) before the wait, while the tensor cores still own them.
                T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, t, k0, lo + t * block_n, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, None if koff is None else Sk, cap)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                T.warpgroup_fence_operand(acc_p, num_regs=regs_p)
                T.copy(acc_s, acc_p)
                # O (tiles up to t-1) to tile t's max: the shipped schedule's rescale at the start
                # of iteration t + 1, done here, outside the turn.
                for i, j in T.Parallel(block_m, dim):
                    acc_o[i, j] *= alpha[i]
            elif t < nt:  # first tile: nothing to overlap with (O is still 0: no rescale)
                if pingpong:
                    # The first turn is warpgroup 0's. (Inside the loop: before it, TileLang would
                    # hoist this out of the consumer branch, where the thread index is not theirs.)
                    if wg == n_wg - 1:
                        T.named_barrier_arrive(PP_BARRIER, PP_COUNT)
                    T.sync_threads(PP_BARRIER + wg, PP_COUNT)
                T.wgmma_gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if pingpong:
                    T.named_barrier_arrive(PP_BARRIER + (wg + 1) % n_wg, PP_COUNT)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                _mask_and_softmax(acc_s, m_run, m_prev, m_off, alpha, row_sum, l_run, t, k0, lo + t * block_n, m0, shift, full_lo, full_hi, left, right, scale_log2, K, block_m, block_n, has_left, has_right, None if koff is None else Sk, cap)
                T.copy(acc_s, acc_p)
            elif t > 0:  # one past the last tile: PV of the last tile (O already at its max)
                if pingpong:
                    T.sync_threads(PP_BARRIER + wg, PP_COUNT)
                T.wgmma_gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                if pingpong:
                    T.named_barrier_arrive(PP_BARRIER + (wg + 1) % n_wg, PP_COUNT)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                T.warpgroup_fence_operand(acc_p, num_regs=regs_p)
        if pingpong:
            # The last warpgroup's final hand-over: taken, so no barrier is left half-arrived.
            if (nt > 0) & (wg == 0):
                T.sync_threads(PP_BARRIER, PP_COUNT)

    if Sinks is None:
        _store(O, LSE, O_s, acc_o, m_off, l_run, qb, by, m0, Sq, block_m, dim)
    else:
        # m_prev, row_sum and alpha are free after the loop: the store's scratch.
        _store_ext(O, LSE, Sinks, O_s, acc_o, m_off, l_run, m_prev, row_sum, alpha, qb, by, qoff, m0, Sq, block_m, dim, sinks, varlen)


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
                regs_o=regs_o, regs_p=regs_p, has_left=has_left, has_right=has_right, n_wg=threads // WARPGROUP)

    B, Sq, Sk, H, Hkv = T.dynamic("B Sq Sk H Hkv")
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh = T.dynamic(
        "sqb sqs sqh skb sks skh svb svs svh sob sos soh", "int64"
    )

    @T.prim_func
    def main(
        Q: T.StridedTensor((B, Sq, H, dim), (sqb, sqs, sqh, 1), dtype),
        K: T.StridedTensor((B, Sk, Hkv, dim), (skb, sks, skh, 1), dtype),
        V: T.StridedTensor((B, Sk, Hkv, dim), (svb, svs, svh, 1), dtype),
        O: T.StridedTensor((B, Sq, H, dim), (sob, sos, soh, 1), dtype),
        LSE: T.Tensor((B, H, Sq), accum),
        scale_log2: T.float32,
        left: T.int32,
        right: T.int32,
    ):
        with T.Kernel(T.ceildiv(Sq, block_m), H, B, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, acc_s, acc_p, acc_o, m_run, m_prev, m_off, alpha, row_sum, l_run = _alloc(block_m, block_n, dim, dtype, accum)

            _aligned(sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh)
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
        Q: T.StridedTensor((B, Sq, H, dim), (sqb, sqs, sqh, 1), dtype),
        K: T.StridedTensor((B, Sk, Hkv, dim), (skb, sks, skh, 1), dtype),
        V: T.StridedTensor((B, Sk, Hkv, dim), (svb, svs, svh, 1), dtype),
        O: T.StridedTensor((B, Sq, H, dim), (sob, sos, soh, 1), dtype),
        LSE: T.Tensor((B, H, Sq), accum),
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
            _aligned(sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh)
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
