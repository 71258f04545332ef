"""TileLang programs of QSA selection: the top-k block ids of each row of FP32 scores, and their token expansion.

`topk`: one CTA a row. Each score becomes an order-preserving uint32 key (0 for NaN and -inf, which are never
selected; -0 as +0, so that the two tie), held in registers (or shared memory for the longest rows). The keys
that can still be among the k largest are those above a range [lo, hi] and some of those inside it: at first
the row's whole range. While they are more than the sort takes (k rounded up to a power of two, times the
tile's `sort_mult`, at most 2048: a larger sort takes the threshold bin whole sooner, in fewer rounds), a radix
round histograms the keys inside the range on an 11-bit digit of their offset from lo (the digit starts at
the range's top bit, so a row whose scores share their exponent still spreads over the bins) and narrows the
range to the bin where the count from the top reaches k. At most three rounds reach one key value, of which
the first in id order are taken (ties to the lower ids). Where the kept keys are every key from the range's
bottom up, each thread counts its own and each warp takes its slots from one shared counter (any order: the
pairs are distinct, the order comes next); where only some keys of one value are kept, a ballot-and-scan in id
order gives the slots. The pairs are ordered (score descending, id ascending) by one more 11-bit digit of
their range: a counting sort into bins, then each pair's rank among its bin's by comparison, where no bin
holds more than ORDER_BIN_MAX of them; else (ties, clustered scores) by a bitonic sort that holds E pairs a
thread in registers: strides below E inside the thread, below a warp's 32 E by shuffles, wider ones through
shared memory (two buffers taken in turn: one barrier a stage). The first k pairs give the ids, -1 past the
row's valid keys. With `expand`, the same CTA writes each block's `block_size` tokens and the row's incomplete
tail block.

`expand`: the expansion alone, one thread an output slot.
"""

from typing import NamedTuple

import tilelang
import tilelang.language as T
from tvm import tirx as tir

from mate._tl import alloc_vars
from mate.qsa.kernels.topk_card import BINS, ORDER_BIN_MAX, RADIX_BITS, ROUNDS, WARP, exchange_buffers, keys_in_registers, sort_size

# Synchronization is written out: the phases hand data between threads through shared memory at known points,
# and TileLang's automatic barriers would also land inside the warp-uniform branches. The radix rounds'
# histogram and the sort's buffers share one arena (views of it), a barrier apart; the other shared buffers are
# small and TileLang may overlay them where it sees their uses apart (the ballot counts with the rounds'
# partials): a barrier separates each phase from the next.
# Every access is inside its bounds by construction (no guards added).
PASS_CONFIGS = (
    (tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC, True),
    (tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS, True),
)


def _u32(v):
    return tir.const(v, "uint32")


def _u64(v):
    return tir.const(v, "uint64")


def _sel(c, a, b):
    """c ? a : b as an expression (a select): T.if_then_else prints an if-else, which ptxas kept as a branch
    in the unrolled per-key loops (two branches a key)."""
    return tir.Select(c, a, b)


def score_key(v):
    """The order-preserving uint32 key of an FP32 score, 0 for NaN and -inf. Decided on the bits, so no
    floating-point assumption of the compiler can drop the NaN test."""
    bits = T.reinterpret("uint32", v)
    bits = _sel(bits == _u32(0x80000000), _u32(0), bits)
    # negative: every bit flipped; positive: the sign bit set (the sign smeared over the word by a shift)
    key = bits ^ (T.Cast("uint32", T.shift_right(T.Cast("int32", bits), 31)) | _u32(0x80000000))
    bad = ((bits & _u32(0x7FFFFFFF)) > _u32(0x7F800000)) | (bits == _u32(0xFF800000))
    return _sel(bad, _u32(0), key)


def _tail_token(pos, t, block_size):
    """Token t of a row's incomplete block: past its last complete block, up to its position; -1 where absent."""
    tok = T.truncdiv(T.max(pos + 1, 0), block_size) * block_size + t
    return _sel(tok <= pos, tok, -1)


def _pair_id(v):
    """The block id of a sorted (key, complemented id) pair, -1 for a pad (key 0)."""
    return _sel((v >> _u64(32)) == _u64(0), -1, T.Cast("int32", _u32(0xFFFFFFFF) - T.Cast("uint32", v & _u64(0xFFFFFFFF))))


def _pair(u, e):
    """The sort's pair of key u and id e: key high, complemented id low (lower ids first among equal keys)."""
    return (T.Cast("uint64", u) << _u64(32)) | T.Cast("uint64", _u32(0xFFFFFFFF) - T.Cast("uint32", e))


def _block_token(b, t, block_size):
    return _sel(b >= 0, b * block_size + t, -1)


@T.macro
def _warp_totals(n_valid: T.Ref, kmin: T.Ref, kmax: T.Ref):
    """The warp's count, smallest and largest key, in every lane."""
    for d in T.unroll(5):
        n_valid += T.shfl_xor(n_valid, 16 >> d)
        kmax = T.max(kmax, T.shfl_xor(kmax, 16 >> d))
        kmin = T.min(kmin, T.shfl_xor(kmin, 16 >> d))


@T.macro
def _warp_max(v: T.Ref):
    """v becomes the warp's largest v, in every lane."""
    for d in T.unroll(5):
        v = T.max(v, T.shfl_xor(v, 16 >> d))


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


def sort_stages(n):
    """(s, j, buffer) of a bitonic sort of n pairs in order: blocks of 2 << s, stride 1 << j; `buffer` alternates
    over the shared-memory stages (set by the caller's ring)."""
    return [(s, j) for s in range(n.bit_length() - 1) for j in range(s, -1, -1)]


class _Plan(NamedTuple):
    """The compile-time sizes of one `topk` program."""

    max_keys: int
    threads: int
    per: int  # keys a thread holds
    nw: int  # warps
    in_regs: bool  # the keys in registers (else in shared memory, in id order)
    bins_per_thread: int
    groups_per_lane: int  # ballot counts each lane of warp 0 scans
    n_sort: int
    E: int  # pairs a sorting thread holds, in registers
    ST: int  # sorting threads (whole warps: n_sort >= 32)
    ring: int  # exchange buffers
    arena_pairs: int  # 8-byte pairs: the exchange buffers, or the histogram's int32 bins
    stages: list  # (s, j, exchange buffer) of each sort stage
    out_buf: int  # the exchange buffer the bitonic sort's ids go out through
    order_per: int  # gathered pairs a thread takes in the ordering by bins

    def at(self, i, tx):
        """Where key i of a thread lives: its registers, or shared memory in id order."""
        return i if self.in_regs else i * self.threads + tx


def _plan(max_keys, threads, min_blocks, sort_mult, kpow):
    """The sizes of the program of one (max_keys, threads, min_blocks, sort_mult, kpow)."""
    n_sort = sort_size(kpow, sort_mult)
    E = max(n_sort // threads, 1)
    ring = exchange_buffers(max_keys, threads, min_blocks, n_sort)
    # The gathered pairs are in buffer 0; the k-th shared-memory stage writes buffer (k + 1) % ring, and the ids go
    # out through the buffer after the last one. With two buffers a buffer is written again only a barrier after its
    # last reads; with one, every stage ends with a barrier.
    stages, wide_stages = [], 0
    for s, j in sort_stages(n_sort):
        if (1 << j) >= WARP * E:
            wide_stages += 1
        stages.append((s, j, wide_stages % ring))
    return _Plan(max_keys=max_keys, threads=threads, per=max_keys // threads, nw=threads // WARP,
                 in_regs=keys_in_registers(max_keys, threads), bins_per_thread=BINS // threads,
                 groups_per_lane=max_keys // WARP // WARP, n_sort=n_sort, E=E, ST=n_sort // E, ring=ring,
                 arena_pairs=max(ring * n_sort, BINS // 2), stages=stages, out_buf=(wide_stages + 1) % ring,
                 order_per=-(-n_sort // threads))


def _alloc(plan):
    """The CTA's buffers, then its scalars: the row's count of valid keys and their range, the radix rounds'
    range [lo, hi] and state, five scratch integers, and the ordering's state (fits, shift, one scratch)."""
    # One arena for the radix histogram and the sort's exchange buffers, which are never live together (a barrier
    # apart): left to TileLang's allocator, the two took separate space at sorts of 1024 pairs and up (its merge
    # reuses a freed block of about the new one's size), 16 KB more a CTA.
    arena = T.alloc_shared((plan.arena_pairs,), "uint64")
    buffers = (
        arena, T.view(arena, (2 * plan.arena_pairs,), "int32"), T.view(arena, (plan.arena_pairs // plan.n_sort, plan.n_sort), "uint64"),
        T.alloc_shared((plan.max_keys // WARP,), "int32"), T.alloc_shared((4, plan.nw), "uint32"), T.alloc_shared((4,), "int32"),
        T.alloc_local((plan.per,), "float32"),
        T.alloc_local((plan.per,), "uint32") if plan.in_regs else T.alloc_shared((plan.max_keys,), "uint32"),
        T.alloc_local((plan.E,), "uint64"),
    )
    # The ordering's pairs grouped by bin, then its bins (int32, past the pairs): where the keys are in shared
    # memory they are dead by then, and hold both
    if plan.in_regs:
        grouped = T.alloc_shared((plan.n_sort + BINS // 2,), "uint64")
    else:
        assert plan.max_keys >= 2 * plan.n_sort + BINS, "the dead keys hold the ordering's pairs and bins"
        grouped = T.view(buffers[7], (plan.max_keys // 2,), "uint64")
    buffers += (grouped, T.view(grouped, (2 * grouped.shape[0],), "int32"))
    return buffers + alloc_vars(1) + alloc_vars(4, "uint32") + alloc_vars(12)


@T.macro
def _row_keys(plan, S, r, tx, lane, wid, vals, keys, part, n_valid: T.Ref, kmin: T.Ref, kmax: T.Ref):
    """The row's keys, and its count of valid keys and their range in every thread."""
    n_valid = 0
    kmin = _u32(0xFFFFFFFF)
    kmax = _u32(0)
    # every load at a clamped (in-bounds) address, all in flight before the first is used: a load under
    # its bounds test waited for the previous one, a DRAM round trip each (ptxas issues them in batches)
    for i in T.unroll(plan.per):
        vals[i] = S[r, T.min(i * plan.threads + tx, S.shape[1] - 1)]
    for i in T.unroll(plan.per):
        u = _sel(i * plan.threads + tx < S.shape[1], score_key(vals[i]), _u32(0))
        keys[plan.at(i, tx)] = u
        n_valid += T.Cast("int32", u != _u32(0))
        kmax = T.max(kmax, u)
        kmin = T.min(kmin, _sel(u != _u32(0), u, _u32(0xFFFFFFFF)))
    _warp_totals(n_valid, kmin, kmax)
    if lane == 0:
        part[0, wid] = T.Cast("uint32", n_valid)
        part[1, wid] = kmin
        part[2, wid] = kmax
    T.sync_threads()
    # lane l takes warp l's partials, then the warp reduces them: every warp holds the row's totals
    n_valid = T.if_then_else(lane < plan.nw, T.Cast("int32", part[0, lane]), 0)
    kmin = T.if_then_else(lane < plan.nw, part[1, lane], _u32(0xFFFFFFFF))
    kmax = T.if_then_else(lane < plan.nw, part[2, lane], _u32(0))
    _warp_totals(n_valid, kmin, kmax)


@T.macro
def _bins_above(plan, hist, base, part, tx, lane, wid, acc: T.Ref, x: T.Ref, y: T.Ref):
    """acc: the count in the bins hist[base + b] above this thread's (thread t holds bins [t * bins_per_thread,
    ...)), by a suffix scan over the threads; one barrier (after which part[0 .. 3] hold every warp's values)."""
    x = 0
    for j in T.unroll(plan.bins_per_thread):
        x += hist[base + tx * plan.bins_per_thread + j]
    acc = x
    _warp_scan(x, y, lane, True)
    if lane == 0:
        part[3, wid] = T.Cast("uint32", x)
    T.sync_threads()
    # the counts of the warps above this one: lane l takes warp l's, the warp sums them
    y = T.if_then_else((lane > wid) & (lane < plan.nw), T.Cast("int32", part[3, lane]), 0)
    for d in T.unroll(5):
        y += T.shfl_xor(y, 16 >> d)
    acc = x - acc + y


@T.macro
def _radix_round(plan, K, keys, hist, part, found, tx, lane, wid, lo: T.Ref, hi: T.Ref, remaining: T.Ref, n_inside: T.Ref,
                take: T.Ref, done: T.Ref, acc: T.Ref, x: T.Ref, y: T.Ref):
    """Histogram the keys in [lo, hi] on the 11-bit digit at the range's top bits, and narrow the range to the
    bin where the count from the top reaches `remaining`; done once the keys above it and the bin fit the sort."""
    shift = T.max(32 - T.Cast("int32", T.clz(hi - lo)) - RADIX_BITS, 0)
    for j in T.unroll(plan.bins_per_thread):
        hist[j * plan.threads + tx] = 0
    T.sync_threads()
    for i in T.unroll(plan.per):
        u = keys[plan.at(i, tx)]
        if (u >= lo) & (u <= hi):
            T.atomic_add(hist[T.Cast("int32", (u - lo) >> T.Cast("uint32", shift))], 1)
    T.sync_threads()
    _bins_above(plan, hist, 0, part, tx, lane, wid, acc, x, y)
    for j in T.unroll(plan.bins_per_thread):
        b = tx * plan.bins_per_thread + plan.bins_per_thread - 1 - j
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
    n_inside = found[2]
    if K - remaining + found[2] <= plan.n_sort:
        take = found[2]  # the whole bin fits the sort, which orders it: no more rounds
        done = 1
    elif shift == 0:
        take = remaining
        done = 1


@T.macro
def _gather(plan, keys, xb, found, tx, lane, lo, x: T.Ref, y: T.Ref, slot: T.Ref):
    """Every key from lo up as a (key, complemented id) pair into xb[0], in any order (the sort orders the
    pairs, all distinct, so the bits do not depend on it). Each thread counts its own keys first, and a warp
    takes its slots from one shared atomic (found[3], zeroed before the rounds' last barrier): a ballot and an
    atomic for every key group cost 41 instructions a key, under divergent branches."""
    x = 0
    for i in T.unroll(plan.per):
        x += T.Cast("int32", keys[plan.at(i, tx)] >= lo)
    slot = x
    _warp_scan(x, y, lane, False)
    if lane == WARP - 1:
        y = T.atomic_add(found[3], x, return_prev=True)
    slot = T.shfl_sync(y, WARP - 1) + x - slot
    for i in T.unroll(plan.per):
        u = keys[plan.at(i, tx)]
        if u >= lo:
            xb[0, slot] = _pair(u, i * plan.threads + tx)
            slot += 1
    T.sync_threads()


@T.macro
def _gather_in_order(plan, keys, counts, xb, tx, lane, wid, lo, hi, take, x: T.Ref, y: T.Ref, acc: T.Ref):
    """The pairs of the keys above hi and of the first `take` keys in [lo, hi] (ties at one key value, more
    than the sort holds: the lower ids win) into xb[0], in id order: a ballot-and-scan gives the slots."""
    for i in T.unroll(plan.per):
        u = keys[plan.at(i, tx)]
        above = T.ballot(u > hi)
        inside = T.ballot((u >= lo) & (u <= hi))
        if lane == 0:
            counts[i * plan.nw + wid] = (T.Cast("int32", T.popcount(above)) << 16) | T.Cast("int32", T.popcount(inside))
    T.sync_threads()
    if wid == 0:
        # exclusive scan of the packed (above, inside) counts, in id order (key group-major, then warp)
        x = 0
        for j in T.unroll(plan.groups_per_lane):
            x += counts[lane * plan.groups_per_lane + j]
        acc = x
        _warp_scan(x, y, lane, False)
        acc = x - acc
        for j in T.unroll(plan.groups_per_lane):
            c0 = counts[lane * plan.groups_per_lane + j]
            counts[lane * plan.groups_per_lane + j] = acc
            acc += c0
    T.sync_threads()
    lanes_below = (_u64(1) << T.Cast("uint64", lane)) - _u64(1)
    for i in T.unroll(plan.per):
        u = keys[plan.at(i, tx)]
        is_above = u > hi
        is_inside = (u >= lo) & (u <= hi)
        above = T.ballot(is_above)
        inside = T.ballot(is_inside)
        before = counts[i * plan.nw + wid]
        n_above = (before >> 16) + T.Cast("int32", T.popcount(above & lanes_below))
        n_inside = (before & 0xFFFF) + T.Cast("int32", T.popcount(inside & lanes_below))
        if is_above | (is_inside & (n_inside < take)):
            xb[0, n_above + T.min(n_inside, take)] = _pair(u, i * plan.threads + tx)
    T.sync_threads()


def _bin_of(pair, lo, shift):
    """The ordering's bin of a gathered pair: the 11-bit digit of its key's offset from lo."""
    return T.Cast("int32", (T.Cast("uint32", pair >> _u64(32)) - lo) >> T.Cast("uint32", shift))


@T.macro
def _order_by_bins(plan, xb, grouped, ghist, part, tx, lane, wid, lo, kmax, total, fits: T.Ref, shift: T.Ref,
                   acc: T.Ref, x: T.Ref, y: T.Ref, v: T.Ref):
    """The `total` gathered pairs of xb[0] in sorted order back into xb[0] (pads past them), where no bin of the
    11-bit digit at the top of their range [lo, kmax] holds more than ORDER_BIN_MAX of them (`fits`; else xb[0]
    is left as it was, for the bitonic sort): a counting sort on that digit into `grouped`, then each pair's
    rank among the pairs of its bin, by comparing it with each. On indexer-like scores no bin of the top 512
    of 8192 held more than 9: about 1000 comparisons a row, against the bitonic sort's 11520 compare-exchanges
    and its 45 dependent stages. Bins are int32 at ghist[h ..], h = 2 n_sort (past the grouped pairs)."""
    h = 2 * plan.n_sort
    shift = T.max(32 - T.Cast("int32", T.clz(kmax - lo)) - RADIX_BITS, 0)
    for j in T.unroll(plan.bins_per_thread):
        ghist[h + j * plan.threads + tx] = 0
    T.sync_threads()
    for c in T.unroll(plan.order_per):
        if c * plan.threads + tx < total:
            T.atomic_add(ghist[h + _bin_of(xb[0, c * plan.threads + tx], lo, shift)], 1)
    T.sync_threads()
    v = 0
    for j in T.unroll(plan.bins_per_thread):
        v = T.max(v, ghist[h + tx * plan.bins_per_thread + j])
    _warp_max(v)
    if lane == 0:
        part[0, wid] = T.Cast("uint32", v)
    _bins_above(plan, ghist, h, part, tx, lane, wid, acc, x, y)
    v = T.if_then_else(lane < plan.nw, T.Cast("int32", part[0, lane]), 0)
    _warp_max(v)
    fits = T.Cast("int32", v <= ORDER_BIN_MAX)
    if fits != 0:
        # each bin's start (pairs in the bins above it) in the high half-word: an atomic on it returns the start
        # and the pair's place in its bin at once (both below 2^16)
        for j in T.unroll(plan.bins_per_thread):
            b = tx * plan.bins_per_thread + plan.bins_per_thread - 1 - j
            x = ghist[h + b]
            ghist[h + b] = acc << 16
            acc += x
        T.sync_threads()
        for c in T.unroll(plan.order_per):
            if c * plan.threads + tx < total:
                v = T.atomic_add(ghist[h + _bin_of(xb[0, c * plan.threads + tx], lo, shift)], 1, return_prev=True)
                grouped[(v >> 16) + (v & 0xFFFF)] = xb[0, c * plan.threads + tx]
        T.sync_threads()
        # the pairs are distinct: a pair's rank in its bin is how many of the bin's pairs are larger
        for c in T.unroll(plan.order_per):
            i = c * plan.threads + tx
            if i < total:
                v = ghist[h + _bin_of(grouped[i], lo, shift)]
                x = 0
                for t in T.serial(v & 0xFFFF):
                    x += T.Cast("int32", grouped[(v >> 16) + t] > grouped[i])
                xb[0, (v >> 16) + x] = grouped[i]
            elif i < plan.n_sort:
                xb[0, i] = _u64(0)
        T.sync_threads()


@T.macro
def _sort_stage(plan, sv, xb, tx, s, j, buf):
    """One compare-exchange stage of the descending bitonic sort (key high, complemented id low: lower ids
    first among ties) of sorting thread t's pairs t * E .. t * E + E - 1. Strides below E stay in the thread's
    registers, strides below a warp's 32 E go by shuffles, wider ones through shared memory, a barrier each
    (every thread at it). Pair i keeps the larger of it and its partner where bit j of i equals bit s + 1
    (the upper of a descending block, the lower of an ascending one)."""
    if (1 << j) < plan.E:
        if tx < plan.ST:
            for e in [e for e in range(plan.E) if not e & (1 << j)]:
                a = sv[e]
                b = sv[e + (1 << j)]
                # the larger first in a descending block: one compare, one select of each (64-bit) pair
                keep = (a > b) == ((((tx * plan.E + e) >> (s + 1)) & 1) == 0)
                sv[e] = _sel(keep, a, b)
                sv[e + (1 << j)] = _sel(keep, b, a)
    elif (1 << j) < WARP * plan.E:
        if tx < plan.ST:
            for e in list(range(plan.E)):
                a = sv[e]
                b = T.shfl_xor(a, (1 << j) // plan.E)
                i = tx * plan.E + e
                sv[e] = _sel((a > b) == (((i >> j) & 1) == ((i >> (s + 1)) & 1)), a, b)
    else:
        if tx < plan.ST:
            for e in list(range(plan.E)):
                xb[buf, tx * plan.E + e] = sv[e]
        T.sync_threads()
        if tx < plan.ST:
            for e in list(range(plan.E)):
                a = sv[e]
                i = tx * plan.E + e
                b = xb[buf, i ^ (1 << j)]
                sv[e] = _sel((a > b) == (((i >> j) & 1) == ((i >> (s + 1)) & 1)), a, b)
        if plan.ring == 1:
            T.sync_threads()  # one buffer: the next stage's writes wait for these reads


@T.macro
def _write_out(plan, K, O, P, TOK, r, xb, src, tx, block_size, expand, blk: T.Ref, t: T.Ref, dblk: T.Ref, dt: T.Ref):
    """Ids of the sorted pairs in xb[src], -1 past the valid keys; with `expand`, each block's tokens and the
    row's tail tokens. Consecutive threads write consecutive ids and tokens (from a bitonic sort's registers a
    thread would write its E ids and their E * block_size tokens, and a warp's stores would stride over E *
    block_size words: partial-sector writes, each sector many times)."""
    for c in T.serial(T.ceildiv(K, plan.threads)):
        q = c * plan.threads + tx
        if q < K:
            O[r, q] = _pair_id(xb[src, q])
    if expand != 0:
        pos = P[r]
        # slot q = c * threads + tx is token t of block blk: both stepped along (an int32 division of q in every
        # iteration, promoted to 64 bits by the buffer index, was a fifth of the kernel's instructions)
        blk = T.truncdiv(tx, block_size)
        t = T.truncmod(tx, block_size)
        dblk = T.truncdiv(plan.threads, block_size)
        dt = T.truncmod(plan.threads, block_size)
        for c in T.serial(T.ceildiv(K * block_size + block_size - 1, plan.threads)):
            q = c * plan.threads + tx
            if q < K * block_size:
                TOK[r, q] = _block_token(_pair_id(xb[src, blk]), t, block_size)
            elif q < K * block_size + block_size - 1:
                TOK[r, q] = _tail_token(pos, q - K * block_size, block_size)
            blk += dblk
            t += dt
            if t >= block_size:
                t -= block_size
                blk += 1


def topk(max_keys, wide, threads, min_blocks, sort_mult, kpow=512):
    R, N, K, RP, RT, W = T.dynamic("R N K RP RT W")
    ssr, ssn, sor, soc, spr, str_, stc = T.dynamic("ssr ssn sor soc spr str_ stc", "int64")
    plan = _plan(max_keys, threads, min_blocks, sort_mult, kpow)
    n_sort, E, ST = plan.n_sort, plan.E, plan.ST

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
            (arena, hist, xb, counts, part, found, vals, keys, sv, grouped, ghist,
             n_valid, kmin, kmax, lo, hi, remaining, n_inside, take, done, acc, x, y, z, w, fits, shift, v) = _alloc(plan)

            _row_keys(plan, S, r, tx, lane, wid, vals, keys, part, n_valid, kmin, kmax)
            # `take`: how many keys inside [lo, hi] join the sort (by id order) beside every key above hi
            lo = kmin
            hi = kmax
            remaining = K
            take = n_valid
            n_inside = n_valid
            done = T.if_then_else(n_valid <= n_sort, 1, 0)  # every valid key fits the sort
            for _ in T.serial(ROUNDS):
                if done == 0:
                    if lo == hi:
                        take = remaining  # ties: the first `remaining` in id order
                        done = 1
                    else:
                        _radix_round(plan, K, keys, hist, part, found, tx, lane, wid, lo, hi, remaining, n_inside, take, done,
                                     acc, x, y)
            if tx == 0:
                found[3] = 0
            T.sync_threads()  # the round's buffers are dead: the sort's may overlay them
            if take == n_inside:
                _gather(plan, keys, xb, found, tx, lane, lo, x, y, acc)
            else:
                _gather_in_order(plan, keys, counts, xb, tx, lane, wid, lo, hi, take, x, y, acc)
            # pairs past the selected ones (the keys above the range and `take` inside it) sort last
            total = K - remaining + take
            _order_by_bins(plan, xb, grouped, ghist, part, tx, lane, wid, lo, kmax, total, fits, shift, acc, x, y, v)
            if fits == 0:
                if tx < ST:
                    for e in list(range(E)):
                        sv[e] = T.if_then_else(tx * E + e < total, xb[0, tx * E + e], _u64(0))
                if plan.ring == 1:
                    T.sync_threads()
                for s, j, buf in plan.stages:
                    _sort_stage(plan, sv, xb, tx, s, j, buf)
                if tx < ST:
                    for e in list(range(E)):
                        xb[plan.out_buf, tx * E + e] = sv[e]
                T.sync_threads()
            _write_out(plan, K, O, P, TOK, r, xb, T.if_then_else(fits != 0, 0, plan.out_buf), tx, block_size, expand, x, y, z, w)

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
