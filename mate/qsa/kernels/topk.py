"""TileLang programs of QSA selection: the top-k block ids of each row of FP32 scores, and their token expansion.

`topk`: one CTA a row. Each score becomes an order-preserving uint32 key (0 for NaN and -inf, which are never
selected; -0 as +0, so that the two tie), held in registers (or shared memory for the longest rows). The keys
that can still be among the k largest are those above a range [lo, hi] and some of those inside it: at first
the row's whole range. While they are more than the sort takes (k rounded up to a power of two), a radix
round histograms the keys inside the range on an 11-bit digit of their offset from lo (the digit starts at
the range's top bit, so a row whose scores share their exponent still spreads over the bins) and narrows the
range to the bin where the count from the top reaches k. At most three rounds reach one key value, of which
the first in id order are taken (ties to the lower ids). A ballot-and-scan in id order gives each
kept key its slot, with no atomics, then a bitonic sort of the (key, id) pairs in shared memory orders them
(score descending, id ascending; stages within a warp's 64 pairs sync the warp only) and the first k slots are
the ids, -1 past the row's valid keys. With `expand`, the same CTA writes each block's `block_size` tokens and
the row's incomplete tail block.

`expand`: the expansion alone, one thread an output slot.
"""

import tilelang
import tilelang.language as T
from tvm import tirx as tir

from mate.qsa.kernels.topk_card import BINS, MAX_K, RADIX_BITS, ROUNDS, WARP, keys_in_registers

# Synchronization is written out: the phases hand data between threads through shared memory at known points,
# and TileLang's automatic barriers would also land inside the warp-uniform branches. TileLang overlays shared
# buffers whose uses it sees apart (the radix round's with the sort's): a barrier separates the two phases.
# Every access is inside its bounds by construction (no guards added).
PASS_CONFIGS = (
    (tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC, True),
    (tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS, True),
)


def _u32(v):
    return tir.const(v, "uint32")


def _u64(v):
    return tir.const(v, "uint64")


def score_key(v):
    """The order-preserving uint32 key of an FP32 score, 0 for NaN and -inf. Decided on the bits, so no
    floating-point assumption of the compiler can drop the NaN test."""
    bits = T.reinterpret("uint32", v)
    bits = T.if_then_else(bits == _u32(0x80000000), _u32(0), bits)
    key = T.if_then_else((bits & _u32(0x80000000)) != _u32(0), ~bits, bits | _u32(0x80000000))
    bad = ((bits & _u32(0x7FFFFFFF)) > _u32(0x7F800000)) | (bits == _u32(0xFF800000))
    return T.if_then_else(bad, _u32(0), key)


def _tail_token(pos, t, block_size):
    """Token t of a row's incomplete block: past its last complete block, up to its position; -1 where absent."""
    tok = T.truncdiv(T.max(pos + 1, 0), block_size) * block_size + t
    return T.if_then_else(tok <= pos, tok, -1)


def _pair_id(v):
    """The block id of a sorted (key, complemented id) pair, -1 for a pad (key 0)."""
    return T.if_then_else((v >> _u64(32)) == _u64(0), -1, T.Cast("int32", _u32(0xFFFFFFFF) - T.Cast("uint32", v & _u64(0xFFFFFFFF))))


def _block_token(b, t, block_size):
    return T.if_then_else(b >= 0, b * block_size + t, -1)


@T.macro
def _warp_totals(n_valid: T.Ref, kmin: T.Ref, kmax: T.Ref):
    """The warp's count, smallest and largest key, in every lane."""
    for d in T.unroll(5):
        n_valid += T.shfl_xor(n_valid, 16 >> d)
        kmax = T.max(kmax, T.shfl_xor(kmax, 16 >> d))
        kmin = T.min(kmin, T.shfl_xor(kmin, 16 >> d))


@T.macro
def _warp_scan(x: T.Ref, y: T.Ref, lane, suffix):
    """x becomes the inclusive sum of x over the lanes from this one up (suffix) or down to it (y: scratch)."""
    for d in T.unroll(5):
        if suffix:
            y = T.shfl_down(x, 1 << d)
            x += T.if_then_else(lane + (1 << d) < WARP, y, 0)
        else:
            y = T.shfl_up(x, 1 << d)
            x += T.if_then_else(lane >= (1 << d), y, 0)


def topk(max_keys, wide, threads, min_blocks):
    R, N, K, RP, RT, W = T.dynamic("R N K RP RT W")
    ssr, ssn, sor, soc, spr, str_, stc = T.dynamic("ssr ssn sor soc spr str_ stc", "int64")
    per = max_keys // threads
    nw = threads // WARP
    in_regs = keys_in_registers(max_keys, threads)
    bins_per_thread = BINS // threads
    groups_per_lane = max_keys // WARP // WARP  # ballot counts each lane of warp 0 scans

    def at(i, tx):
        """Where key i of a thread lives: its registers, or shared memory in id order."""
        return i if in_regs else i * threads + tx

    @T.prim_func
    def main(
        S: T.StridedTensor((R, N), (ssr, ssn), "float32"),
        O: T.StridedTensor((R, K), (sor, soc), "int32"),
        P: T.StridedTensor((RP,), (spr,), "int32"),
        TOK: T.StridedTensor((RT, W), (str_, stc), "int32"),
        block_size: T.int32,
        expand: T.int32,
    ):
        with T.Kernel(R, threads=threads) as r:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % WARP
            wid = tx // WARP
            hist = T.alloc_shared((BINS,), "int32")
            pairs = T.alloc_shared((MAX_K,), "uint64")
            counts = T.alloc_shared((max_keys // WARP,), "int32")
            part = T.alloc_shared((4, nw), "uint32")
            found = T.alloc_shared((4,), "int32")
            vals = T.alloc_local((per,), "float32")
            if in_regs:
                keys = T.alloc_local((per,), "uint32")
            else:
                keys = T.alloc_shared((max_keys,), "uint32")
            n_valid = T.alloc_var("int32")
            kmin = T.alloc_var("uint32")
            kmax = T.alloc_var("uint32")
            lo = T.alloc_var("uint32")
            hi = T.alloc_var("uint32")
            remaining = T.alloc_var("int32")
            take = T.alloc_var("int32")
            done = T.alloc_var("int32")
            acc = T.alloc_var("int32")
            x = T.alloc_var("int32")
            y = T.alloc_var("int32")

            # ---- the row's keys, their count and range
            n_valid = 0
            kmin = _u32(0xFFFFFFFF)
            kmax = _u32(0)
            # every load at a clamped (in-bounds) address, all in flight before the first is used: a load under
            # its bounds test waited for the previous one, a DRAM round trip each (ptxas issues them in batches)
            for i in T.unroll(per):
                vals[i] = S[r, T.min(i * threads + tx, N - 1)]
            for i in T.unroll(per):
                u = T.if_then_else(i * threads + tx < N, score_key(vals[i]), _u32(0))
                keys[at(i, tx)] = u
                n_valid += T.if_then_else(u != _u32(0), 1, 0)
                kmax = T.max(kmax, u)
                kmin = T.min(kmin, T.if_then_else(u != _u32(0), u, _u32(0xFFFFFFFF)))
            _warp_totals(n_valid, kmin, kmax)
            if lane == 0:
                part[0, wid] = T.Cast("uint32", n_valid)
                part[1, wid] = kmin
                part[2, wid] = kmax
            T.sync_threads()
            # lane l takes warp l's partials, then the warp reduces them: every warp holds the row's totals
            n_valid = T.if_then_else(lane < nw, T.Cast("int32", part[0, lane]), 0)
            kmin = T.if_then_else(lane < nw, part[1, lane], _u32(0xFFFFFFFF))
            kmax = T.if_then_else(lane < nw, part[2, lane], _u32(0))
            _warp_totals(n_valid, kmin, kmax)

            # ---- radix select of the range [lo, hi] that holds the k-th largest key
            # `take`: how many keys inside [lo, hi] join the sort (by id order) beside every key above hi. The sort
            # runs over the next power of two of k, which the ids take anyway: sorting a whole bin of up to MAX_K
            # instead of narrowing it further cost more than the rounds it saved (H200, 8192 keys, k 512, with the
            # expansion: rows 1 / 4096 28.9 / 424.8 us against 24.6 / 338.8; benchmarks/results/*-topk.md)
            sort_log = 32 - T.Cast("int32", T.clz(K - 1))
            if n_valid <= (1 << sort_log):
                # every valid key fits the sort
                lo = kmin
                hi = kmax
                take = n_valid
                done = 1
            else:
                lo = kmin
                hi = kmax
                remaining = K
                done = 0
            for _ in T.serial(ROUNDS):
                if done == 0:
                    if lo == hi:
                        take = remaining  # ties: the first `remaining` in id order
                        done = 1
                    else:
                        shift = T.max(32 - T.Cast("int32", T.clz(hi - lo)) - RADIX_BITS, 0)
                        for j in T.unroll(bins_per_thread):
                            hist[j * threads + tx] = 0
                        T.sync_threads()
                        for i in T.unroll(per):
                            u = keys[at(i, tx)]
                            if (u >= lo) & (u <= hi):
                                T.atomic_add(hist[T.Cast("int32", (u - lo) >> T.Cast("uint32", shift))], 1)
                        T.sync_threads()
                        # the bin where the count from the top reaches `remaining`: thread t holds bins
                        # [t * bins_per_thread, ...), counts above it come from a suffix scan over threads
                        x = 0
                        for j in T.unroll(bins_per_thread):
                            x += hist[tx * bins_per_thread + j]
                        acc = x
                        _warp_scan(x, y, lane, True)
                        if lane == 0:
                            part[3, wid] = T.Cast("uint32", x)
                        T.sync_threads()
                        # the counts of the warps above this one: lane l takes warp l's, the warp sums them
                        y = T.if_then_else((lane > wid) & (lane < nw), T.Cast("int32", part[3, lane]), 0)
                        for d in T.unroll(5):
                            y += T.shfl_xor(y, 16 >> d)
                        acc = x - acc + y
                        for j in T.unroll(bins_per_thread):
                            b = tx * bins_per_thread + bins_per_thread - 1 - j
                            h = hist[b]
                            if (acc < remaining) & (acc + h >= remaining):
                                found[0] = b
                                found[1] = acc
                                found[2] = h
                            acc += h
                        T.sync_threads()
                        remaining -= found[1]
                        lo = lo + (T.Cast("uint32", found[0]) << T.Cast("uint32", shift))
                        hi = T.min(hi, lo + ((_u32(1) << T.Cast("uint32", shift)) - _u32(1)))
                        if K - remaining + found[2] <= (1 << sort_log):
                            take = found[2]  # the whole bin fits the sort, which orders it: no more rounds
                            done = 1
                        elif shift == 0:
                            take = remaining
                            done = 1
            T.sync_threads()  # the round's buffers are dead: the sort's may overlay them

            # ---- each selected key's slot in id order: above the range, or inside it and among its first `take`
            n_sort = 1 << sort_log
            for c in T.serial(T.ceildiv(n_sort, threads)):
                if c * threads + tx < n_sort:
                    pairs[c * threads + tx] = _u64(0)  # sorts last
            for i in T.unroll(per):
                u = keys[at(i, tx)]
                above = T.ballot(u > hi)
                inside = T.ballot((u >= lo) & (u <= hi))
                if lane == 0:
                    counts[i * nw + wid] = (T.Cast("int32", T.popcount(above)) << 16) | T.Cast("int32", T.popcount(inside))
            T.sync_threads()
            if wid == 0:
                # exclusive scan of the packed (above, inside) counts, in id order (key group-major, then warp)
                x = 0
                for j in T.unroll(groups_per_lane):
                    x += counts[lane * groups_per_lane + j]
                acc = x
                _warp_scan(x, y, lane, False)
                acc = x - acc
                for j in T.unroll(groups_per_lane):
                    c0 = counts[lane * groups_per_lane + j]
                    counts[lane * groups_per_lane + j] = acc
                    acc += c0
            T.sync_threads()
            lanes_below = (_u64(1) << T.Cast("uint64", lane)) - _u64(1)
            for i in T.unroll(per):
                u = keys[at(i, tx)]
                is_above = u > hi
                is_inside = (u >= lo) & (u <= hi)
                above = T.ballot(is_above)
                inside = T.ballot(is_inside)
                before = counts[i * nw + wid]
                n_above = (before >> 16) + T.Cast("int32", T.popcount(above & lanes_below))
                n_inside = (before & 0xFFFF) + T.Cast("int32", T.popcount(inside & lanes_below))
                if is_above | (is_inside & (n_inside < take)):
                    e = i * threads + tx
                    pairs[n_above + T.min(n_inside, take)] = (T.Cast("uint64", u) << _u64(32)) | T.Cast(
                        "uint64", _u32(0xFFFFFFFF) - T.Cast("uint32", e))
            T.sync_threads()

            # ---- bitonic sort, descending: key high, complemented id low (lower ids first among ties)
            half = n_sort >> 1
            for s in T.serial(sort_log):
                for jj in T.serial(s + 1):
                    j = s - jj  # stride 1 << j within blocks of 2 << s
                    for c in T.serial(T.ceildiv(half, threads)):
                        t = c * threads + tx
                        if t < half:
                            a = ((t >> j) << (j + 1)) | (t & ((1 << j) - 1))
                            b = a + (1 << j)
                            pa = pairs[a]
                            pb = pairs[b]
                            if T.if_then_else(((a >> (s + 1)) & 1) == 0, pa < pb, pa > pb):
                                pairs[a] = pb
                                pairs[b] = pa
                    # a warp's 32 compare-exchanges of strides up to 32 stay inside its 64 pairs
                    nxt = T.if_then_else(j > 0, j - 1, s + 1)
                    if (j >= 6) | (nxt >= 6):
                        T.sync_threads()
                    else:
                        T.sync_warp()
            T.sync_threads()

            # ---- ids, -1 past the valid keys; with `expand`, the tokens
            for c in T.serial(T.ceildiv(K, threads)):
                q = c * threads + tx
                if q < K:
                    O[r, q] = _pair_id(pairs[q])
            if expand != 0:
                pos = P[r]
                for c in T.serial(T.ceildiv(K * block_size + block_size - 1, threads)):
                    q = c * threads + tx
                    if q < K * block_size:
                        TOK[r, q] = _block_token(_pair_id(pairs[T.truncdiv(q, block_size)]), T.truncmod(q, block_size), block_size)
                    elif q < K * block_size + block_size - 1:
                        TOK[r, q] = _tail_token(pos, q - K * block_size, block_size)

    return main


def expand(dtype, threads):
    assert dtype == "int32"
    R, K, RP, W = T.dynamic("R K RP W")
    sbr, sbc, spr, str_, stc = T.dynamic("sbr sbc spr str_ stc", "int64")

    @T.prim_func
    def main(
        B: T.StridedTensor((R, K), (sbr, sbc), "int32"),
        P: T.StridedTensor((RP,), (spr,), "int32"),
        TOK: T.StridedTensor((R, W), (str_, stc), "int32"),
        block_size: T.int32,
    ):
        with T.Kernel(T.ceildiv(W, threads), R, threads=threads) as (bx, r):
            tx = T.get_thread_binding()
            q = bx * threads + tx
            if q < K * block_size:
                TOK[r, q] = _block_token(B[r, T.truncdiv(q, block_size)], T.truncmod(q, block_size), block_size)
            elif q < W:
                TOK[r, q] = _tail_token(P[r], q - K * block_size, block_size)

    return main
