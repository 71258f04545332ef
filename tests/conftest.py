"""Test setup: GPU tests skip unless a CUDA GPU with a mate target is present.

Run the GPU tests on a GPU host with `pytest -m gpu`.
"""

import pytest
import torch


def _native_target():
    if not torch.cuda.is_available():
        return None
    from mate import _dispatch

    try:
        return _dispatch.target_of(torch.empty(0, device="cuda"), "probe")
    except ValueError:
        return None


NATIVE = _native_target()


def pytest_collection_modifyitems(config, items):
    if NATIVE is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with a mate target (sm90)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A seeded generator per test, so failures reproduce."""
    return torch.Generator().manual_seed(1234)
