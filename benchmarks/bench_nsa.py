"""NSA selection forward benchmark: native TileLang vs dense causal SDPA (cuDNN and flash backends).

Indices are drawn as the public NSA benchmarks draw them: for each query and
KV group, T distinct random blocks among the causally visible ones (blocks
whose first token is at or before the query), sorted, -1 where fewer exist.

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
REPORT = dict(stage="nsa_selection", quick=["--lengths", "8192", "16384", "32768", "--heads", "128:8"], full=[])


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


def run_shape(L, H, G, T=T_SEL, hot=False, dense=True, D=D):
    B = 1
    q = torch.randn(B, L, H, D, device="cuda").to(DTYPE)
    k = torch.randn(B, L, G, D, device="cuda").to(DTYPE)
    v = torch.randn(B, L, G, D, device="cuda").to(DTYPE)
    idx = draw_block_indices(B, L, L, G, T, BS, hot=hot)
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
    row = dict(L=L, H=H, G=G, group_heads=H // G, D=D, T=T, hot=hot, ms=ms, rel_err=err, used_slots=used,
               gathered_GB=gathered / 1e9, gathered_GBps=gathered / ms / 1e6, compulsory_GB=compulsory / 1e9,
               per_slot_ns=ms * 1e6 / (used / 1), dense_ms={}, dense_note={}, speedup={})
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
        lines = {"mate": [(r["L"], r["ms"]) for r in rows]}
        for name in ("cudnn", "flash"):
            lines[f"dense causal SDPA ({name})"] = [(r["L"], r["dense_ms"][name]) for r in rows if r["dense_ms"].get(name)]
        figs.append(figure(f"NSA selection, H={hg[0]} G={hg[1]}, T=16, block 64", "tokens (M = N)", "time (ms)", lines, logy=True))
        # No roofline: the gathered blocks are L2 hits (faster than HBM), and L2's rate is not one number.
        figs.append(figure(f"NSA selection, H={hg[0]} G={hg[1]}: gathered K/V", "tokens (M = N)", "GB/s",
                           {"mate": [(r["L"], r["gathered_GBps"]) for r in rows]}))
    return figs


def visible_pairs(idx, N, bs):
    """(query, key) pairs per KV group summed over the used slots: a slot of block j at position p sees
    min(bs, p - j*bs + 1, N - j*bs) keys, 0 if unused."""
    M = idx.shape[1]
    pos = (N - M + torch.arange(M, device=idx.device)).view(1, M, 1, 1).long()
    start = idx.long() * bs
    seen = torch.minimum(torch.minimum(pos - start + 1, torch.full_like(start, bs)), N - start)
    return int(torch.where((idx >= 0) & (start <= pos), seen, 0).sum())


def run_train(L, H, G, T=T_SEL, fla=True):
    B = 1
    q, k, v = (torch.randn(B, L, n, D, device="cuda").to(DTYPE).requires_grad_() for n in (H, G, G))
    idx = draw_block_indices(B, L, L, G, T, BS)
    do = torch.randn(q.shape, device="cuda").to(DTYPE)
    pairs = visible_pairs(idx, L, BS) * (H // G)
    flops = dict(fwd=4 * D * pairs, bwd=10 * D * pairs)

    def mate_fwd():
        with torch.no_grad():
            return mate.nsa_selection_attention(q, k, v, idx, block_size=BS)

    def mate_train():
        o, _ = mate.nsa_selection_attention(q, k, v, idx, block_size=BS)
        return torch.autograd.grad(o, (q, k, v), do)

    row = dict(L=L, H=H, G=G, group_heads=H // G, D=D, T=T, visible_pairs=pairs, flops=flops)
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
                                         indices="T distinct random visible blocks, sorted, -1 pads",
                                         tiles={s: shipped_tiles("sm90", s, KEY)
                                                for s in ("nsa_selection", "nsa_selection_bwd_dq", "nsa_selection_bwd_dkv")}),
               rows=[])
    try:
        import fla

        res["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        res["fla"] = None
    for hg in a.heads:
        H, G = map(int, hg.split(":"))
        for L in a.lengths:
            res["rows"].append(run_train(L, H, G, T=a.T, fla=not a.no_fla and res["fla"] is not None))
    if a.probe:
        res["probe"] = train_probe(a.lengths[-1], *map(int, a.heads[0].split(":")), T=a.T)
    out = write_json(a.out or RESULTS / f"nsa_train_{res['gpu'].replace(' ', '_')}.json", res)
    print(f"\nGPU {res['gpu']}  commit {res['commit']}  fla {res['fla']}  -> {out}")
    print(f"{'H':>4} {'G':>2} {'L':>7} {'mate fwd':>9} {'mate f+b':>9} {'FLA fwd':>9} {'FLA f+b':>9} {'x FLA':>6} {'TFLOP/s':>8}  grad err vs FLA")
    for r in res["rows"]:
        m, f = r["mate"], r.get("fla", {})
        fmt = lambda x, p="9.2f": ("-" if x is None else format(x, p))  # noqa: E731
        print(f"{r['H']:>4} {r['G']:>2} {r['L']:>7} {m['fwd_ms']:>9.2f} {m['fwd_bwd_ms']:>9.2f} {fmt(f.get('fwd_ms'))} "
              f"{fmt(f.get('fwd_bwd_ms'))} {fmt(r.get('speedup_fwd_bwd'), '6.2f')} {m['fwd_bwd_TFLOPs']:>8.0f}  "
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
    ap.add_argument("--compile-only", type=int, metavar="JOBS", help="with --train: compile its kernels in JOBS processes and stop")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.train and a.compile_only:
        return precompile_train(a.compile_only)
    if a.train:
        return train_main(a)
    res = dict(
        environment(),
        cudnn=torch.backends.cudnn.version(),
        setup=dict(B=1, D=D, T=T_SEL, block_size=BS, dtype="bfloat16", indices="T distinct random visible blocks, sorted, -1 pads",
                   tiles=shipped_tiles("sm90", "nsa_selection", KEY)),
        copy_TBps=copy_tbps(),
        rows=[],
    )
    for hg in a.heads:
        H, G = map(int, hg.split(":"))
        for L in a.lengths:
            res["rows"].append(run_shape(L, H, G))
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
    print(f"{'H':>4} {'G':>2} {'L':>7} {'mate ms':>9} {'cuDNN ms':>9} {'flash ms':>9} {'x cuDNN':>8} {'x flash':>8} {'GB/s gath':>10} {'err':>8}")
    for r in res["rows"]:
        c, f = r["dense_ms"].get("cudnn"), r["dense_ms"].get("flash")
        sc, sf = r["speedup"].get("cudnn"), r["speedup"].get("flash")
        fmt = lambda x, p="9.2f": ("-" if x is None else format(x, p))  # noqa: E731
        print(f"{r['H']:>4} {r['G']:>2} {r['L']:>7} {r['ms']:>9.3f} {fmt(c)} {fmt(f)} {fmt(sc, '8.1f')} {fmt(sf, '8.1f')} "
              f"{r['gathered_GBps']:>10.0f} {r['rel_err']:>8.1e}")
    for r in res.get("probe", []):
        print(f"probe T={r['T']} D={r['D']} hot={r['hot']}: {r['ms']:.3f} ms, {r['per_slot_ns']:.2f} ns/slot, {r['gathered_GBps']:.0f} GB/s")
    for r in res.get("l2_gather_probe", {}).get("rows", []):
        print("triton L2 gather", r)
    for r in res.get("tile_variants", []):
        print("variant", r)
    return res


if __name__ == "__main__":
    main()
