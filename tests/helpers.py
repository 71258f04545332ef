"""Shared test helpers."""

import threading
import traceback

import torch

from mate.tuning.measure import capture_graph  # noqa: F401  (the tests capture graphs as the benchmarks do)


def poison_allocator(device, nbytes=1 << 28):
    """Fill free caching-allocator memory with NaN so an output element a kernel forgets to write shows up as NaN."""
    torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(float("nan"))


def poison(x):
    """Fill an output a kernel must rewrite: NaN, or -7 in an index tensor (no kernel writes a negative id but -1)."""
    x.fill_(float("nan") if x.is_floating_point() else -7)


def assert_scores_match(out, ref, rtol=1e-4):
    """Same -inf pattern exactly, no NaN, finite values within an FP32-accumulation tolerance (relative norm)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    out, ref = out.cpu(), ref.cpu()
    inf_out, inf_ref = torch.isinf(out), torch.isinf(ref)
    assert torch.equal(inf_out, inf_ref), f"-inf pattern differs at {torch.nonzero(inf_out != inf_ref)[:5].tolist()}"
    assert torch.equal(out[inf_out], ref[inf_ref]), "infinities of different sign"
    fin = ~inf_ref
    if fin.any():
        a, b = out[fin].double(), ref[fin].double()
        err = (a - b).norm() / b.norm().clamp_min(1e-30)
        assert err <= rtol, f"relative error {err:.3e}"


def at_once(work, n: int) -> list[str]:
    """work(i) for i < n in n threads released together (a threading.Barrier), as a server's first calls come; the
    tracebacks of those that raised."""
    barrier, failures = threading.Barrier(n), []

    def run(i):
        barrier.wait()
        try:
            work(i)
        except Exception:
            failures.append(f"thread {i}: {traceback.format_exc()}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
