"""TileLang pieces shared by the stages' programs (macros inline where they are called)."""

import tilelang.language as T

# TileLang 0.1.15's barrier intrinsics (bar.sync, mbarrier wait/arrive) are asm without a
# "memory" clobber, so the compiler may move shared-memory loads and stores across them; a
# compiler fence next to each barrier pins the order. A program that calls fence() imports
# FENCE_SOURCE once (T.import_source).
FENCE_SOURCE = '\n__device__ __forceinline__ void mate_compiler_fence() { asm volatile("" ::: "memory"); }\n'


def fence():
    T.evaluate(T.call_extern("handle", "mate_compiler_fence"))


@T.macro
def softmax_step_keys_as_m(S, m_cur, m_prev, alpha, rowsum, scale_log2, tile, head_tile):
    """One tile of the online softmax with the keys on the MMA's M axis (S is [tile keys, heads], FP32,
    masked scores -inf): the running max m_cur moves on, alpha = exp2((m_prev - m_cur) * scale) is the
    output's rescale, S becomes P = exp2((S - m_cur) * scale), and the per-thread row sums absorb it
    (reduced over the keys once, after the last tile)."""
    T.copy(m_cur, m_prev)
    T.reduce_max(S, m_cur, dim=0, clear=False, batch=head_tile // 4)
    for h in T.Parallel(head_tile):
        alpha[h] = T.exp2((m_prev[h] - m_cur[h]) * scale_log2)
    for k, h in T.Parallel(tile, head_tile):
        S[k, h] = T.exp2(S[k, h] * scale_log2 - m_cur[h] * scale_log2)
        rowsum[k, h] = rowsum[k, h] * alpha[h] + S[k, h]
