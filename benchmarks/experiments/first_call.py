"""First-call latency of native entrypoints in a fresh process: `import mate`, then each call's first and second time.

    TILELANG_CACHE_DIR=<empty dir> python benchmarks/experiments/first_call.py     # the kernels compile at the first call
    mate-precompile; python benchmarks/experiments/first_call.py                 # the kernels load from TileLang's disk cache

Each first call includes loading TileLang (once per process) and compiling or
loading its kernel; the second is the steady state. Prints one line per call.
"""

import time

start = time.perf_counter()
import torch  # noqa: E402

torch_s = time.perf_counter() - start
import mate  # noqa: E402

import_s = time.perf_counter() - start - torch_s


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def timed(fn):
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def gqa():
    q, k = bf16(1, 4096, 64, 128), bf16(1, 4096, 8, 128)
    return lambda: mate.gqa_attention(q, k, k, sliding_window=(-1, 0))


def mqa_decode():
    q, cache = bf16(8, 4, 128), bf16(64, 16, 128)
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(8, 8)
    lens = torch.full((8,), 100, dtype=torch.int32, device="cuda")
    return lambda: mate.qsa_mqa_decode(q, cache, table, lens, 128)


CALLS = {"gqa_attention (bf16, D 128, causal)": gqa, "qsa_mqa_decode (bf16, page 16)": mqa_decode}


def main():
    torch.cuda.init()
    print(f"import torch {torch_s:.2f} s, then import mate {import_s:.2f} s")
    for name, make in CALLS.items():
        fn = make()
        first, second = timed(fn), timed(fn)
        print(f"{name}: first call {first:.2f} s, second {second * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
