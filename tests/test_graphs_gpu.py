"""Every native path of tests/cases.py in a CUDA Graph with its metadata rewritten between replays, and
under torch.cuda.set_sync_debug_mode("error") (run with `pytest -m gpu`)."""

import pytest
import torch

from cases import CASES, assert_matches, bitwise_equal, native
from helpers import capture_graph, poison

pytestmark = pytest.mark.gpu


def problem(name):
    return CASES[name]("cuda", torch.Generator().manual_seed(11))


@pytest.mark.parametrize("name", CASES)
def test_graph_replay_follows_new_metadata(name):
    """Replays read the current metadata and inputs: each equals the reference and, bitwise, an eager native call."""
    p = problem(name)
    native(p)  # compiles outside the capture; skips a stage with no native path yet
    graph, outs = capture_graph(lambda: p.call("tilelang"))
    for _ in range(3):
        p.refresh()
        for o in outs:
            poison(o)
        graph.replay()
        torch.cuda.synchronize()
        replayed = tuple(o.clone() for o in outs)
        assert_matches(replayed, p.call("reference"), p.tol)
        assert bitwise_equal(replayed, p.call("tilelang"))


def test_sync_debug_mode_catches_a_sync():
    """The mode the next test relies on does raise on a host synchronisation."""
    x = torch.ones(3, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", CASES)
def test_no_host_sync(name):
    """From the public call to the kernel launch nothing waits for the GPU (after the first call compiled the kernel)."""
    p = problem(name)
    native(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = p.call("tilelang")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches(outs, p.call("reference"), p.tol)
