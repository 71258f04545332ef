"""TileLang pieces shared by the stages' programs (macros inline where they are called)."""

import tilelang.language as T

LOG2E = 1.4426950408889634

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


NEG_INF = -T.infinity("float32")


def alloc_softmax_keys_as_m(tile, head_tile, dim, dtype):
    """The consumer's state of a keys-as-M attention: scores S and the per-thread row sums [tile, head_tile]
    (FP32), P in the input dtype, the output O^T [dim, head_tile] (FP32), and per head the running max,
    its previous value, the rescale and the final sum."""
    S = T.alloc_fragment((tile, head_tile), "float32")
    rowsum = T.alloc_fragment((tile, head_tile), "float32")
    P = T.alloc_fragment((tile, head_tile), dtype)
    acc = T.alloc_fragment((dim, head_tile), "float32")
    m_cur = T.alloc_fragment((head_tile,), "float32")
    m_prev = T.alloc_fragment((head_tile,), "float32")
    alpha = T.alloc_fragment((head_tile,), "float32")
    l_sum = T.alloc_fragment((head_tile,), "float32")
    return S, rowsum, P, acc, m_cur, m_prev, alpha, l_sum


@T.macro
def publish_p_keys_as_m(S, P, Ps, acc, alpha, barrier, threads, dim, head_tile):
    """P (the input dtype) goes to shared memory, where the PV wgmma reads it, and the output is rescaled
    for this tile's running max."""
    T.copy(S, P)
    T.copy(P, Ps)
    T.sync_threads(barrier, threads)  # P is in shared memory
    fence()
    for d, h in T.Parallel(dim, head_tile):
        acc[d, h] *= alpha[h]


def lse_keys_as_m(m_cur, l_sum, h, scale):
    """Head h's log-sum-exp (natural log) from the running max of the unscaled scores and the sum; -inf when
    nothing was visible."""
    return T.if_then_else(l_sum[h] > 0, m_cur[h] * scale + T.log(l_sum[h]), NEG_INF)


def assume_aligned(*strides, elems=8):
    """The wrapper checks that these strides are multiples of 16 bytes (`elems` elements: 8 of 16 bits, 16 of FP8);
    telling the compiler gives 16-byte accesses (and TMA tensor maps, whose strides must be multiples of 16 bytes)."""
    # A plain function, not a macro: a macro would bind each stride to its parameter's name, renaming it.
    for s in strides:
        T.evaluate(T.assume(s % elems == 0))


def alloc_vars(count, dtype="int32"):
    """`count` scalars (T.alloc_var), for one tuple assignment that names them in order."""
    return tuple(T.alloc_var(dtype) for _ in range(count))


@T.macro
def scale_into_fp16(Qf, Qs, qmax, qmax_s, qmul: T.Ref):
    """Qs = Qf * qmul in FP16 (the MMA dtype of an FP8 cache's upcast tiles), qmul the power of two that brings the
    tile's largest |Qf| to [2^13, 2^14): exact wherever a BF16 value is an FP16 normal after it (below 2^-24 of the
    largest only), never an overflow. The scores' factor divides by qmul again. Qf: the query tile (a fragment, any
    16-bit dtype); qmax a fragment and qmax_s a shared vector of its rows; one CTA barrier."""
    T.reduce_absmax(Qf, qmax, dim=1)
    for i in T.Parallel(Qf.shape[0]):
        qmax_s[i] = qmax[i]
    T.sync_threads()
    amax = T.alloc_var("float32")
    amax = 0.0
    for i in T.serial(Qf.shape[0]):
        amax = T.max(amax, T.cast(qmax_s[i], "float32"))
    # from the exponent bits, not log2 / exp2 (approximate): an Inf |q| gives 2^-115 and stays Inf, as in BF16
    biased = (T.reinterpret(amax, "int32") >> 23) & 255
    qmul = T.reinterpret(T.min(T.max(267 - biased, 1), 254) << 23, "float32")
    for i, d in T.Parallel(Qf.shape[0], Qf.shape[1]):
        Qs[i, d] = T.cast(T.cast(Qf[i, d], "float32") * qmul, Qs.dtype)


@T.macro
def upcast_stage(X8, Xs, st):
    """Ring stage st of an FP8 tile [stages, rows, D] into the MMA's one-stage FP16 tile Xs, exactly (every e4m3 / e5m2
    value is an FP16 one): one cvt.rn.f16x2 a pair. (Upcast to BF16, each pair took that cvt and two cvt.rn.bf16.f16
    more.)"""
    for k, d in T.Parallel(X8.shape[1], X8.shape[2]):
        Xs[0, k, d] = T.cast(X8[st, k, d], Xs.dtype)


def times_sigmoid(x, g):
    """x * sigmoid(g) in FP32, as x / (1 + 2^(-g log2 e)) with the fast division (__fdividef: a reciprocal and a
    multiply; 0 where 1 + 2^(-g log2 e) overflows, sigmoid's limit). IEEE division leaves a slow-path call after
    every element, and ptxas moves no load across it: a gated epilogue's gate loads went out one at a time, each
    after the store before it (the small-CTA program: 128 dependent loads a lane)."""
    return T.call_extern("float32", "__fdividef", x, 1 + T.exp2(g * -LOG2E))
