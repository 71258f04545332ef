"""Record what the native wrappers launch, on a CPU: the host half of a refactor's equivalence check.

    python tests/launch_record.py --save before.json     # at the commit before a refactor
    python tests/launch_record.py --compare before.json  # after it: every launch must be the same

A refactor of the host side (argument resolution, views, flags, split choice) is
behaviour-preserving when every kernel gets the same program (stage, specialization)
and the same arguments. This runs the native path of each public entrypoint on CPU
tensors with the target pinned to sm90 and the kernels replaced by a recorder, so
nothing runs, and writes per call: the stage, its specialization, and each launch
argument, a tensor as (shape, strides, dtype, which input it views and at what element
offset, or a new buffer) and a scalar as its value. Together with byte-identical
generated CUDA (compare `get_kernel_source()` of every config entry) this checks a
refactor without a GPU. Calls: every case of tests/cases.py and the layout/option grid
of tests/test_qsa_attention_gpu.py, and the NSA backward of tests/sanitize.py's EXTRA_CASES.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _describe(x, inputs: list[torch.Tensor]):
    if not isinstance(x, torch.Tensor):
        return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)
    where = "new"
    for i, t in enumerate(inputs):
        if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            where = f"input{i}+{x.storage_offset() - t.storage_offset()}"
            break
    return [list(x.shape), list(x.stride()), str(x.dtype), where]


@contextlib.contextmanager
def recording(records: list, inputs: list, describe=_describe):
    """Inside, the native paths launch nothing and append each launch to `records`, every argument as
    `describe(argument, inputs)` gives it."""
    from mate import _dispatch

    def kernel(stage, spec, target, **options):  # options: gqa_attention's variants (varlen, sinks, softcap)
        def launch(*args):
            records.append(dict(stage=stage, spec={**spec, **options}, target=target, args=[describe(a, inputs) for a in args]))

        return launch

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_dispatch, "kernel", kernel))
        stack.enter_context(mock.patch.object(_dispatch, "target_of", lambda x, name: "sm90"))
        stack.enter_context(mock.patch("torch.cuda.get_device_properties", lambda i: mock.Mock(multi_processor_count=132)))
        yield


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def record_call(fn, *args, **kwargs) -> dict:
    records: list = []
    inputs = _tensors(args) + _tensors(kwargs)
    with recording(records, inputs):
        try:
            fn(*args, **kwargs)
            error = None
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    return dict(launches=records, error=error)


def calls():
    """(name, thunk) for every recorded call."""
    import cases
    from sanitize import EXTRA_CASES
    from test_qsa_attention_gpu import GEOMETRIES, LAYOUTS, option_problem

    import mate

    for name, make in {**cases.CASES, **EXTRA_CASES}.items():  # EXTRA_CASES: the NSA backward's launches
        problem = make("cpu", torch.Generator().manual_seed(2))
        yield f"case:{name}", lambda p=problem: p.call("tilelang")
    for dtype, (hq, hkv), (qf, kf), options, width in itertools.product(
        [torch.bfloat16, torch.float16], GEOMETRIES, LAYOUTS, ["plain", "lens+gate", "positions+gate_head"], [1, 130]
    ):
        tq, k, v, kw = option_problem(7, hq, hkv, width, qf, kf, dtype, options)
        for splits in [None, 1, 3]:
            yield (f"qsa:{dtype}:{hq}/{hkv}:{qf}-{kf}:{options}:{width}:{splits}",
                   lambda q=tq["query"], k=k, v=v, kw=kw, s=splits: mate.qsa_sparse_attention(
                       q, k, v, **kw, num_splits=s, return_lse=True))


def record_all() -> dict:
    torch.manual_seed(0)
    return {name: record_call(thunk) for name, thunk in calls()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--compare", type=Path)
    a = ap.parse_args(argv)
    got = json.loads(json.dumps(record_all()))
    if a.save:
        a.save.write_text(json.dumps(got, indent=0))
        print(f"{len(got)} calls, {sum(len(r['launches']) for r in got.values())} launches -> {a.save}")
        return 0
    want = json.loads(a.compare.read_text())
    bad = [n for n in sorted(set(want) | set(got)) if want.get(n) != got.get(n)]
    for n in bad[:20]:
        print(f"DIFFERS {n}\n  before: {json.dumps(want.get(n))[:600]}\n  after:  {json.dumps(got.get(n))[:600]}")
    print(f"{len(got)} calls compared, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
