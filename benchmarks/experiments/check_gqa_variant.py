"""The GQA GPU tests, run with another version of a GQA kernel module's program.

    python benchmarks/experiments/check_gqa_variant.py [--decode] VARIANT.py [pytest arguments ...]
    python benchmarks/experiments/check_gqa_variant.py [--decode] --precompile VARIANT.py [JOBS]

Without --decode, VARIANT.py is a version of mate/swa/kernels/gqa.py (stage gqa_fwd); with it, of
mate/swa/kernels/gqa_decode.py (gqa_decode, the split-KV kernel of decode and paged prefill). Inside
benchmarks/overrides.py's program_variants, every kernel of that stage the tests compile (for gqa_fwd, the
varlen/sinks/softcap options too) is built from VARIANT.py's program; the other stages stay the
shipped ones. Fails if a test fails, or if a kernel of the stage the tests ran did not come from the
variant (its generated CUDA must contain the variant's `MARK`): a run on the shipped program is no
check. Fixtures that precompile in worker processes (option_kernels) still fill the cache with the
shipped program, which the tests here then do not use; deselect tests that pin their own tiles
(test_tile_variants), which bypass the switch.

--decode without pytest arguments runs the tests that reach the split-KV kernel (paged caches of 16 /
32 / 64 with windows, sinks, softcap, -1 and out-of-range pages, NaN / Inf in every unowned slot, padded
decode, graph replay with new tables and lengths: tests/test_gqa_options_gpu.py, tests/test_gqa_gpu.py's
one-row cases), then LAUNCHES back-to-back launches of the variant at each page size, dense and windowed,
with one synchronize at the end, checked against the reference: a ring whose barrier phases were wrong
hangs there (run it under `timeout`). `--no-launches` skips them.

--precompile compiles, in JOBS processes (default 2), the variant's kernels those tests use (every config
entry of the stage at its shipped tiles; for gqa_fwd also tests/test_gqa_options_gpu.py's VARIANTS) into
TileLang's disk cache (TILELANG_CACHE_DIR): done on a CPU host with nvcc, the folder travels to the GPU
host, where they load instead of compiling one after another in the test process.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from overrides import compile_variants, config_specs, program_variants, shipped_tiles, stage_kernels  # noqa: E402

DECODE_TESTS = [str(ROOT / "tests/test_gqa_options_gpu.py"), str(ROOT / "tests/test_gqa_gpu.py"),
                "-k", "paged or decode or unequal_lengths", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
LAUNCHES = 2000


def precompile(stage: str, source: Path, jobs: int) -> None:
    todo = [(spec, {}) for spec in config_specs("sm90", stage)]
    if stage == "gqa_fwd":
        sys.path.insert(0, str(ROOT / "tests"))
        from test_gqa_options_gpu import VARIANTS

        todo += [(dict(dtype=str(dt).removeprefix("torch."), dim=d, window=w), dict(varlen=vl, sinks=sk, softcap=sc))
                 for dt, d, w, vl, sk, sc in VARIANTS]
    compile_variants([(stage, spec, {**shipped_tiles("sm90", stage, spec), **opts}, source) for spec, opts in todo], jobs)
    print(f"check_gqa_variant: {len(todo)} {stage} kernels of {source.name} in the cache")


def decode_launches(n: int) -> None:
    """n launches a case, back to back: B 16 x 1 (and 4) rows over up to 3000 keys, pages in random order, NaN
    in every slot past a sequence's length."""
    import torch

    import mate

    torch.manual_seed(0)
    H, Hkv, D, B = 64, 8, 128, 16
    for ps in (16, 32, 64):
        for sq in (1, 4):
            lens = torch.randint(1, 3000, (B,), dtype=torch.int32, device="cuda")
            maxp = -(-3000 // ps) + 1
            kc = torch.randn(B * maxp, ps, Hkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = torch.randperm(B * maxp, device="cuda").int().view(B, maxp)
            for b, length in enumerate(lens.tolist()):
                for p in range(maxp):
                    if (first := max(length - p * ps, 0)) < ps:
                        kc[table[b, p], first:] = float("nan")
                        vc[table[b, p], first:] = float("nan")
            q = torch.randn(B, sq, H, D, device="cuda", dtype=torch.bfloat16)
            for window in (None, (1000, 0)):
                kw = dict(block_table=table, seq_lens_k=lens, sliding_window=window)
                out = torch.empty_like(q)
                ref = mate.gqa_attention(q, kc, vc, **kw, backend="reference")
                start = time.time()
                for _ in range(n):
                    mate.gqa_attention(q, kc, vc, out=out, **kw)
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                print(f"launches: page {ps} rows {sq} window {window}: {n} in {time.time() - start:.2f} s, max |err| {err:.3g}",
                      flush=True)
                assert torch.isfinite(out).all() and err < 5e-2, err


def main(argv: list[str]) -> int:
    stage = "gqa_decode" if "--decode" in argv else "gqa_fwd"
    argv = [a for a in argv if a != "--decode"]
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "--precompile":
        precompile(stage, Path(argv[1]).resolve(), int(argv[2]) if len(argv) > 2 else 2)
        return 0
    source = Path(argv[0]).resolve()
    launches = stage == "gqa_decode" and "--no-launches" not in argv
    args = [a for a in argv[1:] if a != "--no-launches"] or (DECODE_TESTS if stage == "gqa_decode" else [])
    spec = importlib.util.spec_from_file_location("variant_mark", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mark = module.MARK
    with program_variants(stage, {source.stem: source}) as use:
        use(source.stem)
        rc = pytest.main(args)
        if launches:
            decode_launches(LAUNCHES)
        used = stage_kernels(stage)
        mine = [k for k, v in used.items() if mark in v.get_kernel_source()]
    print(f"check_gqa_variant: {len(mine)} of {len(used)} {stage} kernels the tests ran carry {mark!r}")
    for k in used:
        print("   ", "variant" if k in mine else "OTHER  ", dict(k[0]), dict(k[2]))
    if not mine or len(mine) != len(used):
        print("check_gqa_variant: FAILED, the tests did not run (only) the variant")
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
