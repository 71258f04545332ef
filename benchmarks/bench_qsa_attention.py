"""QSA sparse core attention at the serving shapes of issue 37, beside the kernels servers ship.

24 Q / 2 KV heads, D 256, BF16, 64-token pages in random pool order; each row selects 512 distinct complete
causal 4-token blocks at random, in random order, expanded to 2048 tokens, then its own incomplete tail block
(-1 where absent): 2051 slots (common.qsa_serving_problem). A per-element BF16 gate [rows, 24, 256].

  decode rows=1 / 8 / 64   request r holds 32768 - 1 - (r mod 4) tokens, one row at its last position, every
                           request its own pages (rows 64: a 4.3 GB pool)
  decode rows=256          the requests draw their pages from a 65000-page pool (8.5 GB)
  prefill                  the last 4096 rows of one 32768-token request
  extra rows (--extra)     rows=256 on a 512-page pool the requests share (L2-resident); prefill with the
                           block_indices hint; the gate per head and none (the gate's cost)

  python benchmarks/bench_qsa_attention.py [--cases ...] [--upstream .gpu/upstream] [--extra] [--sweep [16/2 ...]]
  python benchmarks/bench_qsa_attention.py --variants main=old_sparse_warp.py new=- [--variant-splits 1 2]

Every time is one call per CUDA-graph replay with L2 flushed before each (triton's do_bench median,
`cold_us`). Each implementation's output is first checked against mate's reference backend (relative L2
error < 1e-2; SGLang, which has no gate, against the ungated reference). Implementations: `mate` (the
shipped dispatch), `mate-wgmma` (the warp-specialized wgmma family, mate.qsa.kernels.sparse, forced),
and with --upstream DIR the real vLLM and SGLang Triton kernels (benchmarks/upstream_qsa.py: files
DIR/vllm_qsa.py and DIR/sglang_qsa.py, copies of their sources, not in this repository).
`--sweep` also times the small-CTA family's tiles (block_n x num_stages, or BLOCK_N/STAGES/WARPS with several warps a
tile: the program's `warps`, not a config key) and split counts, each checked against the reference first.
`--variants NAME=FILE ...`: the same-run A/B of small-CTA programs (FILE: another version of
mate/qsa/kernels/sparse_warp.py, `-` the shipped one), at `--variant-gates` (element, head, none) and
`--variant-splits`; with --kv-dtype, each version's FP8 timings.
`--kv-dtype e4m3|e5m2 ...` (issue 38): each case's K/V quantized to that FP8 kind at k_scale 0.02 / v_scale 0.03
(the issue's), timed as `mate <kind>` beside mate on the BF16 cache in the same run (and `mate <kind> tensor-scale`
with the scales as device tensors); the FP8 output is checked against the reference on the same FP8 inputs, and
its error against the BF16 call's reference (the quantization's own cost) is recorded as `vs_bf16`.

Bytes = selected tokens that exist x 2 KV heads x 256 x 2 tensors x 2 bytes (the K/V rows gathered; 1 byte an
element for FP8, in `fp8_gbytes`).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
from common import RESULTS, SERVING_D, SERVING_HKV, cold_graph_us, environment, qsa_serving_problem, write_json
from overrides import program_variants, qsa_family, qsa_warp_tiles, qsa_warp_tiles_arg, stage_card

import mate

REPORT = dict(stage="qsa_attention", quick=["--cases", "decode1", "decode64", "--no-hbm-pools"], full=[])

CASES = {  # name -> (rows, rows a request, pool pages or None: own pages)
    "decode1": (1, 1, None),
    "decode8": (8, 1, None),
    "decode64": (64, 1, None),
    "decode256": (256, 1, 65000),
    "prefill": (4096, 4096, None),
}


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


def checked(name, call, ref, tol=1e-2):
    out = call()
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert err < tol, f"{name}: relative error {err:.2e} against the reference"
    return err


def build(case, gen, pool_override=None, gate="element"):
    rows, per_req, pool = CASES[case]
    batch = rows // per_req
    p, hint = qsa_serving_problem(gen, batch, per_req, pool=pool_override or pool, gate=gate)
    return p, hint


def gbytes(p) -> float:
    return int((p["token_indices"] >= 0).sum()) * SERVING_HKV * SERVING_D * 2 * 2 / 1e9


# the gate kinds timed: the cases' per-element gate, its first element per head, none
GATES = {"element": lambda g: g, "head": lambda g: g[..., 0].contiguous(), "none": lambda g: None}


def time_case(label, p, hint, args, upstream):
    """One case: every implementation checked, then timed cold."""
    ref = mate.qsa_sparse_attention(**p, backend="reference")
    res = dict(case=label, rows=p["query"].shape[0], gbytes=gbytes(p), us={}, rel_err={})

    def run(name, call, reference=ref):
        res["rel_err"][name] = checked(f"{label} {name}", call, reference)
        res["us"][name] = cold_graph_us(call)

    run("mate", lambda: mate.qsa_sparse_attention(**p))
    for fam in args.families:
        with qsa_family(fam):
            run(f"mate-{fam}", lambda: mate.qsa_sparse_attention(**p))
    if hint is not None and args.extra:
        run("mate hint", lambda: mate.qsa_sparse_attention(**p, block_indices=hint))
    if upstream:
        import upstream_qsa

        vllm, sglang = upstream
        run("vllm", upstream_qsa.vllm_call(vllm, p))
        ungated = dict(p, gate=None)
        run("sglang", upstream_qsa.sglang_call(sglang, ungated), mate.qsa_sparse_attention(**ungated, backend="reference"))
    if args.extra and p["gate"] is not None:
        for gate_name, g in (("ungated", None), ("gate per head", GATES["head"](p["gate"]))):
            q = dict(p, gate=g)
            run(f"mate {gate_name}", lambda q=q: mate.qsa_sparse_attention(**q),
                mate.qsa_sparse_attention(**q, backend="reference"))
    if args.sweep:
        res["sweep"] = sweep(p, ref, [qsa_warp_tiles_arg(t) for t in args.sweep])
    res["tb_s"] = {k: res["gbytes"] / v * 1e3 for k, v in res["us"].items()}
    print(f"{label}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res["us"].items()), flush=True)
    return res


FP8_KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
K_SCALE, V_SCALE = 0.02, 0.03


def time_fp8(label, p, kinds, splits=()) -> dict:
    """One case on FP8 caches of each kind beside the BF16 cache: checked, then timed cold; with `splits`, the
    float-scale call also at those split counts (`mate <kind>/s<n>`)."""
    ref = mate.qsa_sparse_attention(**p, backend="reference")
    res = dict(case=label, rows=p["query"].shape[0], gbytes=gbytes(p), fp8_gbytes=gbytes(p) / 2, us={}, rel_err={}, vs_bf16={})
    res["rel_err"]["mate bf16"] = checked(f"{label} bf16", lambda: mate.qsa_sparse_attention(**p), ref)
    res["us"]["mate bf16"] = cold_graph_us(lambda: mate.qsa_sparse_attention(**p))
    for kind in kinds:
        dt = FP8_KINDS[kind]
        k8, v8 = (p["key"] / K_SCALE).to(dt), (p["value"] / V_SCALE).to(dt)
        tensors = dict(k_scale=torch.tensor([K_SCALE], device="cuda"), v_scale=torch.tensor([V_SCALE], device="cuda"))
        for name, scales in ((f"mate {kind}", dict(k_scale=K_SCALE, v_scale=V_SCALE)), (f"mate {kind} tensor-scale", tensors)):
            p8 = dict(p, key=k8, value=v8, **scales)
            ref8 = mate.qsa_sparse_attention(**p8, backend="reference")
            call = lambda p8=p8: mate.qsa_sparse_attention(**p8)  # noqa: E731
            res["rel_err"][name] = checked(f"{label} {name}", call, ref8)
            res["vs_bf16"][name] = rel_err(call(), ref)
            res["us"][name] = cold_graph_us(call)
            for n in splits if "tensor" not in name else ():
                call = lambda p8=p8, n=n: mate.qsa_sparse_attention(**p8, num_splits=n)  # noqa: E731
                checked(f"{label} {name}/s{n}", call, ref8)
                res["us"][f"{name}/s{n}"] = cold_graph_us(call)
            del ref8
        del k8, v8
    res["tb_s"] = {k: (res["fp8_gbytes"] if k != "mate bf16" else res["gbytes"]) / v * 1e3 for k, v in res["us"].items()}
    print(f"{label}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res["us"].items())
          + "; error vs the BF16 reference " + ", ".join(f"{k} {v:.1e}" for k, v in res["vs_bf16"].items()), flush=True)
    return res


def sweep(p, ref, tile_args) -> dict:
    """The small-CTA family at each (tiles, label) of `tile_args` (overrides.qsa_warp_tiles_arg's; both split keys)
    and split counts: cold us, keyed label/splits."""
    card = stage_card("qsa_attention_warp")
    out = {}
    for tiles, tag in tile_args:
        bn = tiles["block_n"]
        if card.limits({"dtype": "bfloat16", "split": 1}, tiles):
            continue
        with qsa_warp_tiles(tiles):
            width = p["token_indices"].shape[-1]
            for s in sorted({None, 1, 2, 4, 8, 16, 33, -(-width // bn)}, key=lambda x: (x is not None, x or 0)):
                if s is not None and s > -(-width // bn):
                    continue
                call = (lambda s=s: mate.qsa_sparse_attention(**p, num_splits=s))
                try:
                    checked(f"sweep {tag}/{s}", call, ref)
                    t = cold_graph_us(call)
                except Exception as e:  # a tile pair that does not compile is reported, not fatal
                    print(f"  tiles {tag} splits {s}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                out[f"{tag}/{s}"] = t
                print(f"  tiles {tag} splits {s or 'auto'}: {t:.1f} us", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--families", nargs="*", default=["wgmma"], help="kernel families also timed forced")
    ap.add_argument("--upstream", default=None, help="folder with vllm_qsa.py and sglang_qsa.py (copies of upstream)")
    ap.add_argument("--extra", action="store_true", help="shared 512-page pool, block hint, gate per head / none")
    ap.add_argument("--sweep", nargs="*", default=None, metavar="BLOCK_N/STAGES[/WARPS]",
                    help="the small-CTA family at these tiles (default: every pair of its space), each at several split counts")
    ap.add_argument("--no-hbm-pools", action="store_true", help="rows 64 / 256 on small pools (a quick report)")
    ap.add_argument("--variants", nargs="*", default=[], metavar="NAME=FILE")
    ap.add_argument("--variant-splits", nargs="*", type=int, default=[], metavar="N",
                    help="with --variants (or --kv-dtype, decode cases): also time at these split counts (NAME/sN)")
    ap.add_argument("--variant-gates", nargs="*", default=["element"], choices=list(GATES),
                    help="with --variants: time each version with these gates (the cases' per-element gate, its first "
                    "element per head, none)")
    ap.add_argument("--kv-dtype", nargs="*", default=[], choices=list(FP8_KINDS), help="FP8 caches of these kinds (issue 38)")
    ap.add_argument("--out", default=str(RESULTS / "qsa_attention_h200.json"))
    args = ap.parse_args(argv)
    if args.sweep == []:
        card = stage_card("qsa_attention_warp")
        args.sweep = [f"{b}/{n}" for b, n in itertools.product(card.space["block_n"], card.space["num_stages"])]
    upstream = None
    if args.upstream:
        import upstream_qsa

        upstream = (upstream_qsa.load(os.path.join(args.upstream, "vllm_qsa.py"), "upstream_vllm_qsa"),
                    upstream_qsa.load(os.path.join(args.upstream, "sglang_qsa.py"), "upstream_sglang_qsa"))
    gen = torch.Generator().manual_seed(0)
    sources = {k: None if f == "-" else f for k, f in (v.split("=", 1) for v in args.variants)}
    cases = []
    for case in args.cases:
        p, hint = build(case, gen, 512 if args.no_hbm_pools and case in ("decode64", "decode256") else None)
        labels = [(case, p)]
        if args.extra and case == "decode256":
            labels.append(("decode256 shared 512-page pool", build(case, gen, 512)[0]))
        for label, q in labels:
            fp8_splits = args.variant_splits if case.startswith("decode") else ()
            if args.kv_dtype and sources:  # each version's FP8 (and BF16) calls, one version after another
                with program_variants("qsa_attention_warp", sources) as use:
                    for name in sources:
                        use(name)
                        cases.append(time_fp8(f"{label} [{name}]", q, args.kv_dtype, fp8_splits))
                continue
            if args.kv_dtype:
                res = time_fp8(label, q, args.kv_dtype, fp8_splits)
            elif sources:
                with program_variants("qsa_attention_warp", sources) as use:
                    res = dict(case=label, us={})
                    gated = {g: dict(q, gate=GATES[g](q["gate"])) for g in args.variant_gates}
                    refs = {g: mate.qsa_sparse_attention(**qg, backend="reference") for g, qg in gated.items()}
                    for name in sources:
                        use(name)
                        for (g, qg), s in itertools.product(gated.items(), [None, *args.variant_splits]):
                            call = lambda qg=qg, s=s: mate.qsa_sparse_attention(**qg, num_splits=s)  # noqa: E731
                            key = name + ("" if s is None else f"/s{s}") + ("" if g == "element" else f" gate {g}")
                            checked(f"{label} {key}", call, refs[g])
                            res["us"][key] = cold_graph_us(call)
                    print(f"{label}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res["us"].items()), flush=True)
            else:
                res = time_case(label, q, hint if case == "prefill" else None, args, upstream)
            cases.append(res)
        del p, labels
        torch.cuda.empty_cache()
    names = list(dict.fromkeys(k for c in cases for k in c["us"]))
    print("\n| case (us, cold graph) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for c in cases:
        print(f"| {c['case']} | " + " | ".join(f"{c['us'][n]:.1f}" if n in c["us"] else "-" for n in names) + " |")
    result = dict(environment(), command="python benchmarks/bench_qsa_attention.py " + " ".join(argv or []), cases=cases)
    write_json(args.out, result)
    return result


def figures(result):
    from common import figure

    decode = [c for c in result["cases"] if c["case"].startswith("decode") and "pool" not in c["case"]]
    names = list(dict.fromkeys(k for c in decode for k in c["us"]))
    lines = {n: [(c["rows"], c["us"][n]) for c in decode if n in c["us"]] for n in names}
    return [figure("QSA sparse attention decode (24/2/256, 2051 tokens, cold graph)", "rows", "time (us)", lines, logy=True)]


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
