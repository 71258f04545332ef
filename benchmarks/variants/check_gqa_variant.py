"""The GQA forward GPU tests, run with another version of mate/swa/kernels/gqa.py's program.

    python benchmarks/variants/check_gqa_variant.py VARIANT.py [pytest arguments ...]
    python benchmarks/variants/check_gqa_variant.py --precompile VARIANT.py [JOBS]

Inside mate.testing.program_variants, so every gqa_fwd kernel the tests compile (plain and the
varlen/sinks/softcap options) is built from VARIANT.py's `gqa_fwd`; the other stages stay the
shipped ones. Fails if a test fails, or if none of the kernels the tests ran came from the variant
(its generated CUDA must contain the variant's `MARK`): a run on the shipped program is no check.
Fixtures that precompile in worker processes (option_kernels) still fill the cache with the
shipped program, which the tests here then do not use; deselect tests that pin their own tiles
(test_tile_variants), which bypass the switch.

--precompile compiles, in JOBS processes (default 2), the variant's kernels those tests use (every
gqa_fwd config entry, plain, and tests/test_gqa_options_gpu.py's VARIANTS) into TileLang's disk
cache (TILELANG_CACHE_DIR): done on a CPU host with nvcc, the folder travels to the GPU host, where
they load instead of compiling one after another in the test process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mate.testing import compile_variants, config_specs, program_variants, shipped_tiles, stage_kernels  # noqa: E402


def precompile(source: Path, jobs: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_gqa_options_gpu import VARIANTS

    todo = [(spec, {}) for spec in config_specs("sm90", "gqa_fwd")]
    todo += [(dict(dtype=str(dt).removeprefix("torch."), dim=d, window=w), dict(varlen=vl, sinks=sk, softcap=sc))
             for dt, d, w, vl, sk, sc in VARIANTS]
    compile_variants([("gqa_fwd", spec, {**shipped_tiles("sm90", "gqa_fwd", spec), **opts}, source) for spec, opts in todo], jobs)
    print(f"check_gqa_variant: {len(todo)} kernels of {source.name} in the cache")


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "--precompile":
        precompile(Path(argv[1]).resolve(), int(argv[2]) if len(argv) > 2 else 2)
        return 0
    source = Path(argv[0]).resolve()
    spec = importlib.util.spec_from_file_location("variant_mark", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mark = module.MARK
    with program_variants("gqa_fwd", {source.stem: source}) as use:
        use(source.stem)
        rc = pytest.main(argv[1:])
        used = stage_kernels("gqa_fwd")
        mine = [k for k, v in used.items() if mark in v.get_kernel_source()]
    print(f"check_gqa_variant: {len(mine)} of {len(used)} gqa_fwd kernels the tests ran carry {mark!r}")
    for k in used:
        print("   ", "variant" if k in mine else "OTHER  ", dict(k[0]), dict(k[2]))
    if not mine or len(mine) != len(used):
        print("check_gqa_variant: FAILED, the tests did not run (only) the variant")
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
