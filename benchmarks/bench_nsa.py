"""NSA selection forward benchmark: native TileLang vs dense causal SDPA (cuDNN and flash backends).

Two selection generators (--selection uniform|smooth|both; both by default, and every table has
a row of each):
- uniform: as the public NSA benchmarks draw them: for each query and KV group, T distinct
  random blocks among the causally visible ones (blocks whose first token is at or before the
  query), sorted, -1 where fewer exist (mate.tuning.workloads.draw_block_indices). The worst
  case for sharing: 8 consecutive queries have 17% of their blocks in common at the seed shape.
- smooth: real-looking selections (smooth_block_indices, whose docstring defines them exactly):
  per (query, group) block scores from a random field interpolated every 64 queries plus small
  per-query noise, causal, the first block and the two blocks ending at the query always
  selected, top T. As NSA's own compression branch selects, neighbouring queries pick mostly
  the same blocks: 82% shared at W = 8, 90% at W = 16 at the seed shape.

Gathered bytes at CTA width W (gathered_bytes): the K/V bytes a kernel gathers when each CTA of
W consecutive queries of one KV group gathers the union of their selected blocks once. W = 1 is
the shipped kernel (every used slot, a duplicate each time); the rows report W = 1, 4, 8, 16 and
the tables the fraction W = 8 and 16 save.

Shapes (issue 5): B=1, M=N=L, D=128, T=16, block_size=64, BF16, for
(H, G) in (128, 8), (64, 8), (64, 4) and L in 8192, 16384, 32768, 65536,
131072. The seed's configuration is H=128, G=8, L=65536.

Reported per shape: the native time (median of triton.testing.do_bench), the
dense causal time of torch.nn.functional.scaled_dot_product_attention
(is_causal=True, enable_gqa=True) under the cuDNN and the flash backends
(median of a few timed calls: they are long), the speedups, and the gathered
bytes per second: every used slot loads a K and a V block of
block_size x D elements, so gathered bytes = used slots x 2 x block_size x D
x 2 bytes. Correctness is checked against the reference on the last 64
queries of every shape.

--probe (without --train) adds, at the seed shape, runs that locate the time: T = 1, 4, 16
(the slope is the cost of one gathered block, the intercept the per-query
cost), "hot" indices that keep every query on the same 16 blocks, D = 64
(half the bytes, the same MMA and softmax steps), other tile configurations
(num_stages / CTAs per SM), and a plain Triton kernel that gathers random
32 KB tiles from an L2-resident pool with no attention math (the gather's
ceiling on this GPU).

--train times training instead (forward + backward, autograd, the same
indices) beside FLA's selection attention (fla-core 0.6.0's
ParallelNSAFunction: its Triton selection forward and backward, H/G >= 16
and a power of 2 only; needs fla and einops importable, --no-fla skips it),
forward alone and forward + backward, with FLOPs counted exactly over the
visible (query, key) pairs of each used slot (duplicates as often as they
occur): forward 4 D per pair and head (QK^T, PV), backward 10 D (S and dP
recomputed, dV, dQ, dK). mate's and FLA's gradients are compared with each
other at every shape (relative norm error); the tests compare mate's with
the reference. With --probe, the backward's time split (preparation and
sort, dq kernel, dk/dv kernel) at the last length and first H:G, and other
tiles of its two kernels.

  python benchmarks/bench_nsa.py [--lengths 8192 65536] [--heads 128:8] [--probe] [--out FILE]
  python benchmarks/bench_nsa.py --train [--lengths 65536] [--heads 128:8 64:4] [--no-fla] [--probe] [--out FILE]
  python benchmarks/bench_nsa.py --train --compile-only JOBS   (the kernels of the line above, into the disk cache)
  python benchmarks/bench_nsa.py --queries 4 8 [--fla] [--no-dense] [--lengths 65536] [--heads 128:8]
  python benchmarks/bench_nsa.py --queries 4 8 --compile-only JOBS   (the shared kernels, into the disk cache)

--queries W ... (forward) also times the shared program (mate/nsa/kernels/selection_shared.py: a CTA of W
queries gathers the union of their blocks once; not in the shipped configs) at each W, on the same
inputs, with SHARED_TILES[W], through a patched config (queries = W), checked on the tail like the
shipped kernel; --fla times FLA's forward (fla-core's ParallelNSAFunction, H/G >= 16, a power of 2)
beside; the table after the main one gives W = 1, each W, FLA, and the GB each W gathers.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from common import RESULTS, environment, few_ms, figure, median_ms, rel_err, write_json

import mate
from mate.tuning.measure import using_tiles
from mate.tuning.workloads import draw_block_indices, nsa_backward_parts
from overrides import compile_kernels, shipped_tiles

D, T_SEL, BS = 128, 16, 64
KEY = f"dtype=bfloat16,dim={D},block_size={BS}"  # the config key of the stages at D and BS
DTYPE = torch.bfloat16
# The shared program's tiles at each W (--queries): one consumer warpgroup; 2 CTAs an SM up to W = 4 (the
# producer gives registers to the consumer: setmaxnreg), 1 at W = 8 (255 registers for 8 queries' state).
SHARED_TILES = {W: dict(head_tile=16, threads=128, num_stages=2, min_blocks=2 if W <= 4 else 1, queries=W) for W in (2, 4, 8)}
REPORT = dict(stage="nsa_selection", quick=["--lengths", "8192", "16384", "32768", "--heads", "128:8"], full=[])


# ---------------------------------------------------------------- selections: the uniform and the smooth generator

SELECTIONS = ("uniform", "smooth")
SMOOTH_INTERVAL = 64  # queries between two anchors of the smooth field
SMOOTH_NOISE = 0.1  # standard deviation of the per-query noise (the field's is 1)
SMOOTH_CHUNK = 2048  # queries drawn at a time (fixed: it orders the generator's stream)


def smooth_block_indices(B, M, N, G, T, bs, seed=0, device="cpu", interval=SMOOTH_INTERVAL, noise=SMOOTH_NOISE):
    """Real-looking NSA selections: [B, M, G, T] int32, sorted, -1 where fewer than T blocks are visible.

    Per (query m, group g), block j's score is a random field interpolated along the queries plus a little
    per-query noise, so that neighbouring queries rank the blocks alike (as NSA's compressed-attention
    scores do):

        F = randn(B, A, G, n_blocks)             A = M // interval + 2 anchors, anchor a at query a * interval
        score[b, m, g, j] = lerp(F[b, a, g, j], F[b, a + 1, g, j], w) + noise * Z[b, m, g, j]
                            a = m // interval, w = (m % interval) / interval, Z standard normal

    (interval 64, noise 0.1), drawn from one CPU torch.Generator seeded with `seed`: F first, then Z of
    queries [m0, m0 + SMOOTH_CHUNK) for m0 = 0, SMOOTH_CHUNK, ... as randn(B, chunk, G, n_blocks). Causal
    (bottom-right aligned, query m at position p = N - M + m): only blocks j <= p // bs are candidates, and
    the first block (0) and the two blocks ending at the query (p // bs and p // bs - 1) are always
    selected (score +inf); the top T of the rest fill the row. Query positions p < 0 select nothing.
    """
    n_blocks = -(-N // bs)
    gen = torch.Generator().manual_seed(seed)
    A = M // interval + 2
    field = torch.randn(B, A, G, n_blocks, generator=gen)
    idx = torch.full((B, M, G, T), -1, dtype=torch.int32)
    blocks = torch.arange(n_blocks)
    for m0 in range(0, M, SMOOTH_CHUNK):
        m1 = min(M, m0 + SMOOTH_CHUNK)
        m = torch.arange(m0, m1)
        noise_c = torch.randn(B, m1 - m0, G, n_blocks, generator=gen)  # drawn whole, whatever is visible
        last = torch.div(N - M + m, bs, rounding_mode="floor").clamp_max(n_blocks - 1)  # < 0: nothing visible
        cols = int(last.max()) + 1  # the chunk's candidates are blocks 0 .. cols - 1
        if cols <= 0:
            continue
        a, w = m // interval, ((m % interval).float() / interval).view(1, -1, 1, 1)
        score = torch.lerp(field[:, a, :, :cols], field[:, a + 1, :, :cols], w)
        score.add_(noise_c[..., :cols], alpha=noise)
        # Blocks past a query and the forced ones lie in the window lo .. cols - 1 (and block 0).
        lo = max(int(last.min()) - 1, 0)
        win, lw = blocks[lo:cols].view(1, -1), last.view(-1, 1)
        sub = score[..., lo:cols]
        sub.masked_fill_(((win == lw) | (win == lw - 1)).view(1, -1, 1, cols - lo), float("inf"))
        sub.masked_fill_((win > lw).view(1, -1, 1, cols - lo), float("-inf"))
        score[..., 0].masked_fill_((last >= 0).view(1, -1, 1), float("inf"))
        k = min(T, cols)
        val, sel = score.topk(k, dim=-1)
        sel = torch.where(val > float("-inf"), sel, n_blocks).sort(-1).values  # invisible picks sort last
        idx[:, m0:m1, :, :k] = torch.where(sel >= n_blocks, -1, sel).to(torch.int32)
    return idx.to(device)


SETUP_INDICES = ("uniform: T distinct random visible blocks, sorted, -1 pads; smooth: smooth_block_indices (seed 0), "
                 "a field interpolated every 64 queries + 0.1 noise, blocks 0 and the two ending at the query forced, top T")


def selections(a) -> tuple[str, ...]:
    return SELECTIONS if a.selection == "both" else (a.selection,)


def block_indices(selection, B, M, N, G, T, bs, seed=0, device="cuda"):
    """The selection of the named generator: 'uniform' (draw_block_indices, from torch's global RNG) or 'smooth'."""
    if selection == "smooth":
        return smooth_block_indices(B, M, N, G, T, bs, seed=seed, device=device)
    return draw_block_indices(B, M, N, G, T, bs, device=device)


def gathered_blocks(idx, N, bs, W, block_counts=None, chunk=1 << 22):
    """K/V blocks one (b, g) gathers when each CTA of W consecutive queries (rows W c .. W c + W - 1, positions
    bottom-right aligned) gathers the union of its queries' used blocks once; summed over b and g.

    W = 1 is today's kernel, which gathers every used slot (a duplicate as often as it occurs); W > 1 counts
    the distinct blocks of each union. A slot is used as the kernels decide: inside block_counts (when given),
    >= 0 and its block's first token at or before the query's position. Bytes = this x 2 (K and V) x bs x D x
    element size (gathered_bytes)."""
    B, M, G, T = idx.shape
    pos = N - M + torch.arange(M, device=idx.device)
    last = torch.where(pos >= 0, torch.div(pos, bs, rounding_mode="floor"), -1).view(1, M, 1, 1)
    e = idx.long()
    used = (e >= 0) & (e <= last)
    if block_counts is not None:
        used &= torch.arange(T, device=idx.device) < block_counts.long().unsqueeze(-1)
    if W == 1:
        return int(used.sum())
    C = -(-M // W)
    e = torch.where(used, e, -1)
    e = torch.cat([e, e.new_full((B, C * W - M, G, T), -1)], 1)  # the last CTA's missing rows select nothing
    e = e.view(B, C, W, G, T).permute(0, 1, 3, 2, 4).reshape(B * C * G, W * T)
    total = 0
    step = max(1, chunk // (W * T))
    for r0 in range(0, e.shape[0], step):
        s = e[r0 : r0 + step].sort(-1).values
        first = torch.ones_like(s, dtype=torch.bool)
        first[:, 1:] = s[:, 1:] != s[:, :-1]
        total += int((first & (s >= 0)).sum())
    return total


def gathered_bytes(idx, N, bs, D, W, element_size=2, block_counts=None):
    """Bytes of K and V gathered at CTA width W (gathered_blocks)."""
    return gathered_blocks(idx, N, bs, W, block_counts) * 2 * bs * D * element_size


def sharing(idx, N, bs, widths=(4, 8, 16)) -> dict:
    """Per W: the fraction of W = 1's gathered blocks that a CTA of W queries saves, 1 - blocks(W) / blocks(1)."""
    one = gathered_blocks(idx, N, bs, 1)
    return {W: (1 - gathered_blocks(idx, N, bs, W) / one) if one else 0.0 for W in widths}


def check_tail(q, k, v, idx, out, lse, tail=64):
    """Native rows against the reference on the last `tail` queries (same positions: the rows end at N)."""
    ro, rl = mate.nsa_selection_attention(q[:, -tail:], k, v, idx[:, -tail:], block_size=BS, backend="reference")
    return max(rel_err(out[:, -tail:], ro), rel_err(lse[:, :, -tail:], rl))


def dense_ms(q, k, v, backend_name):
    """Dense causal SDPA time in ms, or an error string; K/V expanded to H heads only if GQA is refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    qd = q.transpose(1, 2).contiguous()
    kd, vd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    note = "enable_gqa=True"
    try:
        with sdpa_kernel([backend]):
            fn = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)  # noqa: E731
            t = few_ms(fn)
    except RuntimeError as e:
        first = str(e).splitlines()[0][:160]
        rep = qd.shape[1] // kd.shape[1]
        kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
        note = f"K/V expanded to H heads (enable_gqa refused: {first})"
        try:
            with sdpa_kernel([backend]):
                fn = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)  # noqa: E731
                t = few_ms(fn)
        except RuntimeError as e2:
            return None, f"failed: {str(e2).splitlines()[0][:200]}"
    del qd, kd, vd
    torch.cuda.empty_cache()
    return t, note


WIDTHS = (1, 4, 8, 16)  # the CTA widths whose gathered bytes each row reports


def gathered_by_width(idx, L, D, element_size=2) -> dict:
    """{W: GB of K/V gathered at CTA width W} for W in WIDTHS."""
    return {W: gathered_bytes(idx, L, BS, D, W, element_size) / 1e9 for W in WIDTHS}


def shared_pct(row, W) -> float:
    """Percent of W = 1's gathered bytes that CTAs of W queries save."""
    g = row["gathered_GB_at_W"]
    return 100 * (1 - g[W] / g[1]) if g[1] else 0.0


def fla_forward_ms(q, k, v, idx, T):
    """FLA's selection forward (fla-core's ParallelNSAFunction under no_grad) in ms, or an error string."""
    try:
        from fla.ops.nsa.parallel import ParallelNSAFunction

        def fwd():
            with torch.no_grad():
                return ParallelNSAFunction.apply(q, k, v, idx, T, BS, D ** -0.5, None)

        fwd()
        torch.cuda.synchronize()
        return median_ms(fwd)
    except Exception as e:  # the baseline is context, never a reason to lose mate's numbers
        return repr(e)[:200]


def run_shared(row, call, check, out, queries):
    """Time the shared program at each W of `queries` on the row's inputs (call / check: the shipped kernel's)."""
    row["shared"] = {}
    for W in queries:
        tiles = SHARED_TILES[W]
        try:
            with using_tiles("sm90", "nsa_selection", KEY, tiles):
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                r = dict(tiles=tiles, rel_err=check(), ms=median_ms(call))
        except Exception as e:  # a failing candidate is reported, never chosen
            r = dict(tiles=tiles, error=repr(e)[:300])
        row["shared"][W] = r
        print("shared", W, json.dumps(r), flush=True)


def run_shape(L, H, G, T=T_SEL, hot=False, dense=True, D=D, selection="uniform", queries=(), fla=False):
    B = 1
    q = torch.randn(B, L, H, D, device="cuda").to(DTYPE)
    k = torch.randn(B, L, G, D, device="cuda").to(DTYPE)
    v = torch.randn(B, L, G, D, device="cuda").to(DTYPE)
    idx = draw_block_indices(B, L, L, G, T, BS, hot=True) if hot else block_indices(selection, B, L, L, G, T, BS)
    used = int((idx >= 0).sum())
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, device="cuda")
    call = lambda: mate.nsa_selection_attention(q, k, v, idx, block_size=BS, out=out, lse=lse)  # noqa: E731
    call()
    torch.cuda.synchronize()
    err = check_tail(q, k, v, idx, out, lse)
    ms = median_ms(call)
    gathered = used * 2 * BS * D * q.element_size()
    compulsory = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size() + idx.numel() * 4 + lse.numel() * 4
    row = dict(L=L, H=H, G=G, group_heads=H // G, D=D, T=T, hot=hot, selection="hot" if hot else selection, ms=ms, rel_err=err,
               used_slots=used, gathered_GB=gathered / 1e9, gathered_GBps=gathered / ms / 1e6, compulsory_GB=compulsory / 1e9,
               gathered_GB_at_W=gathered_by_width(idx, L, D, q.element_size()),
               per_slot_ns=ms * 1e6 / (used / 1), dense_ms={}, dense_note={}, speedup={})
    for W in queries:
        row["gathered_GB_at_W"].setdefault(W, gathered_bytes(idx, L, BS, D, W, q.element_size()) / 1e9)
    if queries and D == 128 and not hot:
        run_shared(row, call, lambda: check_tail(q, k, v, idx, out, lse), out, queries)
    if fla and H // G >= 16 and (H // G) & (H // G - 1) == 0:
        row["fla_fwd_ms"] = fla_forward_ms(q, k, v, idx, T)
    if dense:
        for name in ("cudnn", "flash"):
            t, note = dense_ms(q, k, v, name)
            row["dense_ms"][name] = t
            row["dense_note"][name] = note
            row["speedup"][name] = None if t is None else t / ms
    del q, k, v, idx, out, lse
    torch.cuda.empty_cache()
    print("row", json.dumps(row), flush=True)
    return row


def tile_variants(L, H, G, variants):
    """Time other tile configs of the seed specialization through a patched copy of configs/sm90.yaml."""
    rows = []
    for tiles in variants:
        try:
            with using_tiles("sm90", "nsa_selection", KEY, tiles):
                r = run_shape(L, H, G, dense=False)
            rows.append(dict(tiles=tiles, ms=r["ms"], rel_err=r["rel_err"], gathered_GBps=r["gathered_GBps"]))
        except Exception as e:  # a failing candidate is reported, never chosen
            rows.append(dict(tiles=tiles, error=repr(e)[:300]))
        print("variant", json.dumps(rows[-1]), flush=True)
    return rows


VARIANTS = [
    {"head_tile": 16, "threads": 128, "num_stages": 1, "min_blocks": 4},
    {"head_tile": 16, "threads": 128, "num_stages": 3, "min_blocks": 2},
]


def l2_gather_probe(tiles=1024, T=16, programs=524288):
    """The rate a plain Triton kernel gathers random 32 KB tiles (a K and a V block) from an L2-resident pool.

    Same bytes as the seed shape (programs x T tiles of 128 x 128 BF16), no attention math: a ceiling
    for the gather itself, for several warps / pipeline depths.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum(src, idx, out, T: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        for t in range(T):
            j = tl.load(idx + pid * T + t).to(tl.int64)
            acc += tl.load(src + j * (ROWS * COLS) + offs).to(tl.float32)
        tl.store(out + pid, tl.sum(acc))

    src = torch.randn(tiles * 128 * 128, device="cuda").to(DTYPE)
    idx = torch.randint(0, tiles, (programs * T,), device="cuda", dtype=torch.int32)
    out = torch.empty(programs, device="cuda")
    nbytes = programs * T * 128 * 128 * 2
    rows = []
    for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4)):
        try:
            fn = lambda: gather_sum[(programs,)](src, idx, out, T, 128, 128, num_warps=warps, num_stages=stages)  # noqa: E731
            ms = median_ms(fn)
            rows.append(dict(num_warps=warps, num_stages=stages, ms=ms, GBps=nbytes / ms / 1e6))
        except Exception as e:
            rows.append(dict(num_warps=warps, num_stages=stages, error=repr(e)[:200]))
        print("l2probe", json.dumps(rows[-1]), flush=True)
    return dict(pool_MB=src.numel() * 2 / 1e6, tile_KB=32, per_program_tiles=T, programs=programs, rows=rows)


def copy_tbps():
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9


def figures(result):
    figs = []
    for hg in sorted({(r["H"], r["G"]) for r in result["rows"]}, reverse=True):
        rows = [r for r in result["rows"] if (r["H"], r["G"]) == hg]
        lines = {}
        for sel in SELECTIONS:
            pts = [(r["L"], r["ms"]) for r in rows if r.get("selection", "uniform") == sel]
            if pts:
                lines["mate" if sel == "uniform" else f"mate ({sel} selection)"] = pts
        for name in ("cudnn", "flash"):
            lines[f"dense causal SDPA ({name})"] = [(r["L"], r["dense_ms"][name]) for r in rows if r["dense_ms"].get(name)]
        figs.append(figure(f"NSA selection, H={hg[0]} G={hg[1]}, T=16, block 64", "tokens (M = N)", "time (ms)", lines, logy=True))
        # No roofline: the gathered blocks are L2 hits (faster than HBM), and L2's rate is not one number.
        figs.append(figure(f"NSA selection, H={hg[0]} G={hg[1]}: gathered K/V", "tokens (M = N)", "GB/s",
                           {"mate" if sel == "uniform" else f"mate ({sel} selection)":
                            [(r["L"], r["gathered_GBps"]) for r in rows if r.get("selection", "uniform") == sel]
                            for sel in SELECTIONS if any(r.get("selection", "uniform") == sel for r in rows)}))
    return figs


def visible_pairs(idx, N, bs):
    """(query, key) pairs per KV group summed over the used slots: a slot of block j at position p sees
    min(bs, p - j*bs + 1, N - j*bs) keys, 0 if unused."""
    M = idx.shape[1]
    pos = (N - M + torch.arange(M, device=idx.device)).view(1, M, 1, 1).long()
    start = idx.long() * bs
    seen = torch.minimum(torch.minimum(pos - start + 1, torch.full_like(start, bs)), N - start)
    return int(torch.where((idx >= 0) & (start <= pos), seen, 0).sum())


def run_train(L, H, G, T=T_SEL, fla=True, selection="uniform"):
    B = 1
    q, k, v = (torch.randn(B, L, n, D, device="cuda").to(DTYPE).requires_grad_() for n in (H, G, G))
    idx = block_indices(selection, B, L, L, G, T, BS)
    do = torch.randn(q.shape, device="cuda").to(DTYPE)
    pairs = visible_pairs(idx, L, BS) * (H // G)
    flops = dict(fwd=4 * D * pairs, bwd=10 * D * pairs)

    def mate_fwd():
        with torch.no_grad():
            return mate.nsa_selection_attention(q, k, v, idx, block_size=BS)

    def mate_train():
        o, _ = mate.nsa_selection_attention(q, k, v, idx, block_size=BS)
        return torch.autograd.grad(o, (q, k, v), do)

    row = dict(L=L, H=H, G=G, group_heads=H // G, D=D, T=T, selection=selection, visible_pairs=pairs, flops=flops,
               gathered_GB_at_W=gathered_by_width(idx, L, D, q.element_size()))
    grads = mate_train()
    torch.cuda.synchronize()
    row["mate"] = dict(fwd_ms=median_ms(mate_fwd), fwd_bwd_ms=median_ms(mate_train))
    row["mate"]["bwd_ms"] = row["mate"]["fwd_bwd_ms"] - row["mate"]["fwd_ms"]
    if fla and H // G >= 16 and (H // G) & (H // G - 1) == 0:
        try:
            from fla.ops.nsa.parallel import ParallelNSAFunction

            scale = D ** -0.5

            def fla_fwd():
                with torch.no_grad():
                    return ParallelNSAFunction.apply(q, k, v, idx, T, BS, scale, None)

            def fla_train():
                return torch.autograd.grad(ParallelNSAFunction.apply(q, k, v, idx, T, BS, scale, None), (q, k, v), do)

            fgrads = fla_train()
            torch.cuda.synchronize()
            row["fla"] = dict(fwd_ms=median_ms(fla_fwd), fwd_bwd_ms=median_ms(fla_train))
            row["fla"]["bwd_ms"] = row["fla"]["fwd_bwd_ms"] - row["fla"]["fwd_ms"]
            row["grad_rel_err_vs_fla"] = {n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, fgrads)}
            row["speedup_fwd_bwd"] = row["fla"]["fwd_bwd_ms"] / row["mate"]["fwd_bwd_ms"]
            del fgrads
        except Exception as e:  # the baseline is context, never a reason to lose mate's numbers
            row["fla"] = dict(error=repr(e)[:300])
    for name in ("mate", "fla"):
        r = row.get(name, {})
        if "fwd_ms" in r:
            r["fwd_TFLOPs"] = flops["fwd"] / r["fwd_ms"] / 1e9
            r["fwd_bwd_TFLOPs"] = (flops["fwd"] + flops["bwd"]) / r["fwd_bwd_ms"] / 1e9
    del q, k, v, idx, do, grads
    torch.cuda.empty_cache()
    print("train", json.dumps(row), flush=True)
    return row


BWD_VARIANTS = [  # the shipped tiles' ring-depth neighbours (every other ring depth of each kernel)
    ("nsa_selection_bwd_dq", {"head_tile": 16, "threads": 128, "num_stages": 1, "min_blocks": 2}),
    ("nsa_selection_bwd_dq", {"head_tile": 16, "threads": 128, "num_stages": 2, "min_blocks": 2}),
    ("nsa_selection_bwd_dq", {"head_tile": 16, "threads": 128, "num_stages": 3, "min_blocks": 2}),
] + [("nsa_selection_bwd_dkv", {"head_tile": 16, "threads": 128, "queries": q, "num_stages": s, "min_blocks": b})
     for q, s, b in ((2, 1, 2), (2, 2, 2), (2, 4, 2), (2, 3, 1), (4, 1, 1), (4, 2, 1), (4, 3, 1), (4, 4, 1))]


def precompile_train(jobs: int) -> None:
    """Compile every kernel a --train --probe run takes at KEY (the shipped tiles of the three stages and
    BWD_VARIANTS) into TileLang's disk cache, in `jobs` processes, so the timed run compiles nothing."""
    todo = [(s, KEY, None, True) for s in ("nsa_selection", "nsa_selection_bwd_dq", "nsa_selection_bwd_dkv")]
    todo += [(s, KEY, t, True) for s, t in BWD_VARIANTS]
    for (stage, _, tiles, _), (_, error) in compile_kernels(todo, jobs):
        print("compiled", stage, tiles or "shipped", error or "ok", flush=True)


def train_probe(L, H, G, T=T_SEL):
    """Where the backward's time goes at one shape: the preparation (per-row metadata, the sort of the used
    slots), the dq kernel, the dk/dv kernel; then other tiles of the two kernels, each checked against the
    shipped tiles' gradients."""
    q, k, v = (torch.randn(1, L, n, D, device="cuda").to(DTYPE) for n in (H, G, G))
    idx = draw_block_indices(1, L, L, G, T, BS)
    do = torch.randn(q.shape, device="cuda").to(DTYPE)
    parts = nsa_backward_parts(q, k, v, idx, do, block_size=BS)
    bufs = parts.grads
    parts.dq()
    parts.dkv()
    torch.cuda.synchronize()
    shipped = [x.clone() for x in bufs]
    row = dict(L=L, H=H, G=G, T=T, prep_ms=median_ms(parts.prep), dq_ms=median_ms(parts.dq), dkv_ms=median_ms(parts.dkv), variants=[])
    print("probe", json.dumps(row), flush=True)
    for stage, tiles in BWD_VARIANTS:
        dq_stage = stage.endswith("dq")
        launch, outs = (parts.dq, (0,)) if dq_stage else (parts.dkv, (1, 2))
        try:
            with using_tiles("sm90", stage, KEY, tiles):
                for i in outs:
                    bufs[i].fill_(float("nan") if dq_stage else 0.0)  # dk/dv rows no block covers stay the caller's zeros
                launch()
                torch.cuda.synchronize()
                errs = {("dq", "dk", "dv")[i]: rel_err(bufs[i], shipped[i]) for i in outs}
                r = dict(stage=stage, tiles=tiles, ms=median_ms(launch), rel_err_vs_shipped=errs)
        except Exception as e:  # a failing candidate is reported, never chosen
            r = dict(stage=stage, tiles=tiles, error=repr(e)[:300])
        row["variants"].append(r)
        print("variant", json.dumps(r), flush=True)
    del q, k, v, idx, do, parts, bufs, shipped
    torch.cuda.empty_cache()
    return row


def train_main(a):
    res = dict(environment(), setup=dict(B=1, D=D, T=a.T, block_size=BS, dtype="bfloat16",
                                         indices=SETUP_INDICES, selections=selections(a),
                                         tiles={s: shipped_tiles("sm90", s, KEY)
                                                for s in ("nsa_selection", "nsa_selection_bwd_dq", "nsa_selection_bwd_dkv")}),
               rows=[])
    try:
        import fla

        res["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        res["fla"] = None
    for sel in selections(a):
        for hg in a.heads:
            H, G = map(int, hg.split(":"))
            for L in a.lengths:
                res["rows"].append(run_train(L, H, G, T=a.T, fla=not a.no_fla and res["fla"] is not None, selection=sel))
    if a.probe:
        res["probe"] = train_probe(a.lengths[-1], *map(int, a.heads[0].split(":")), T=a.T)
    out = write_json(a.out or RESULTS / f"nsa_train_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"\nGPU {res['gpu']}  commit {res['commit']}  fla {res['fla']}  -> {out}")
    print(f"{'selection':>9} {'H':>4} {'G':>2} {'L':>7} {'mate fwd':>9} {'mate f+b':>9} {'FLA fwd':>9} {'FLA f+b':>9} {'x FLA':>6} "
          f"{'TFLOP/s':>8} {'GB W=1':>7} {'W8 save':>7} {'W16 save':>8}  grad err vs FLA")
    for r in res["rows"]:
        m, f = r["mate"], r.get("fla", {})
        fmt = lambda x, p="9.2f": ("-" if x is None else format(x, p))  # noqa: E731
        print(f"{r['selection']:>9} {r['H']:>4} {r['G']:>2} {r['L']:>7} {m['fwd_ms']:>9.2f} {m['fwd_bwd_ms']:>9.2f} {fmt(f.get('fwd_ms'))} "
              f"{fmt(f.get('fwd_bwd_ms'))} {fmt(r.get('speedup_fwd_bwd'), '6.2f')} {m['fwd_bwd_TFLOPs']:>8.0f} "
              f"{r['gathered_GB_at_W'][1]:>7.1f} {shared_pct(r, 8):>6.1f}% {shared_pct(r, 16):>7.1f}%  "
              f"{r.get('grad_rel_err_vs_fla') or f.get('error', '')}")
    if "probe" in res:
        r = res["probe"]
        print(f"backward at L={r['L']} H={r['H']} G={r['G']}: prep {r['prep_ms']:.2f} ms, dq {r['dq_ms']:.2f} ms, dk/dv {r['dkv_ms']:.2f} ms")
        for v in r["variants"]:
            print("  ", v["stage"], v["tiles"], f"{v['ms']:.2f} ms" if "ms" in v else v["error"], v.get("rel_err_vs_shipped", ""))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--heads", nargs="*", default=["128:8", "64:8", "64:4"], help="H:G pairs")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--train", action="store_true", help="forward + backward beside FLA")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--T", type=int, default=T_SEL)
    ap.add_argument("--queries", type=int, nargs="*", default=[], choices=sorted(SHARED_TILES),
                    help="forward: also time the shared program at these W (a CTA of W queries)")
    ap.add_argument("--fla", action="store_true", help="forward: time FLA's selection forward beside")
    ap.add_argument("--no-dense", action="store_true", help="forward: skip the dense SDPA baselines")
    ap.add_argument("--selection", choices=("uniform", "smooth", "both"), default="both",
                    help="the selection generator(s): every table has a row of each")
    ap.add_argument("--compile-only", type=int, metavar="JOBS", help="with --train: compile its kernels in JOBS processes and stop")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.train and a.compile_only:
        return precompile_train(a.compile_only)
    if a.compile_only:
        todo = [("nsa_selection", KEY, SHARED_TILES[W], True) for W in a.queries]
        for (stage, _, tiles, _), (_, error) in compile_kernels(todo, a.compile_only):
            print("compiled", stage, tiles, error or "ok", flush=True)
        return None
    if a.train:
        return train_main(a)
    res = dict(
        environment(),
        cudnn=torch.backends.cudnn.version(),
        setup=dict(B=1, D=D, T=T_SEL, block_size=BS, dtype="bfloat16", indices=SETUP_INDICES, selections=selections(a),
                   tiles=shipped_tiles("sm90", "nsa_selection", KEY), shared_tiles={W: SHARED_TILES[W] for W in a.queries}),
        copy_TBps=copy_tbps(),
        rows=[],
    )
    for i, sel in enumerate(selections(a)):
        for hg in a.heads:
            H, G = map(int, hg.split(":"))
            for L in a.lengths:
                # dense attention: once a shape
                res["rows"].append(run_shape(L, H, G, dense=i == 0 and not a.no_dense, selection=sel, queries=a.queries, fla=a.fla))
    if a.probe:
        probe = []
        for T in (1, 4):
            probe.append(run_shape(65536, 128, 8, T=T, dense=False))
        probe.append(run_shape(65536, 128, 8, hot=True, dense=False))
        probe.append(run_shape(65536, 128, 8, D=64, dense=False))
        res["probe"] = probe
        try:
            res["l2_gather_probe"] = l2_gather_probe()
        except Exception as e:  # the probe is context, never a reason to lose the table
            res["l2_gather_probe"] = dict(error=repr(e)[:300])
        res["tile_variants"] = tile_variants(65536, 128, 8, VARIANTS)
    out = write_json(a.out or RESULTS / f"nsa_selection_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"\nGPU {res['gpu']}  copy {res['copy_TBps']:.2f} TB/s  commit {res['commit']}  -> {out}")
    print(f"{'selection':>9} {'H':>4} {'G':>2} {'L':>7} {'mate ms':>9} {'cuDNN ms':>9} {'flash ms':>9} {'x cuDNN':>8} {'x flash':>8} "
          f"{'GB/s gath':>10} {'GB W=1':>7} {'W4 save':>7} {'W8 save':>7} {'W16 save':>8} {'err':>8}")
    for r in res["rows"]:
        c, f = r["dense_ms"].get("cudnn"), r["dense_ms"].get("flash")
        sc, sf = r["speedup"].get("cudnn"), r["speedup"].get("flash")
        fmt = lambda x, p="9.2f": ("-" if x is None else format(x, p))  # noqa: E731
        print(f"{r['selection']:>9} {r['H']:>4} {r['G']:>2} {r['L']:>7} {r['ms']:>9.3f} {fmt(c)} {fmt(f)} {fmt(sc, '8.1f')} {fmt(sf, '8.1f')} "
              f"{r['gathered_GBps']:>10.0f} {r['gathered_GB_at_W'][1]:>7.1f} {shared_pct(r, 4):>6.1f}% {shared_pct(r, 8):>6.1f}% "
              f"{shared_pct(r, 16):>7.1f}% {r['rel_err']:>8.1e}")
    if a.queries or a.fla:
        print(f"\n{'selection':>9} {'H':>4} {'G':>2} {'L':>7} {'W=1 ms':>8} " + " ".join(f"{f'W={W} ms':>8}" for W in a.queries)
              + f" {'FLA ms':>8} {'GB W=1':>7} " + " ".join(f"{f'GB W={W}':>7}" for W in a.queries) + "  err")
        for r in res["rows"]:
            sh = r.get("shared", {})
            ms = " ".join(f"{sh[W]['ms']:>8.3f}" if "ms" in sh.get(W, {}) else f"{'failed':>8}" for W in a.queries)
            f = r.get("fla_fwd_ms")
            gb = " ".join(f"{r['gathered_GB_at_W'][W]:>7.1f}" for W in a.queries)
            errs = {W: (f"{sh[W]['rel_err']:.1e}" if "rel_err" in sh.get(W, {}) else sh.get(W, {}).get("error", "")) for W in a.queries}
            print(f"{r['selection']:>9} {r['H']:>4} {r['G']:>2} {r['L']:>7} {r['ms']:>8.3f} {ms} "
                  f"{f if isinstance(f, str) else format(f, '8.3f') if f is not None else '-':>8} {r['gathered_GB_at_W'][1]:>7.1f} {gb}  {errs}")
    for r in res.get("probe", []):
        print(f"probe T={r['T']} D={r['D']} {r['selection']}: {r['ms']:.3f} ms, {r['per_slot_ns']:.2f} ns/slot, {r['gathered_GBps']:.0f} GB/s")
    for r in res.get("l2_gather_probe", {}).get("rows", []):
        print("triton L2 gather", r)
    for r in res.get("tile_variants", []):
        print("variant", r)
    return res


if __name__ == "__main__":
    main()
