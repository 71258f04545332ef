"""An `out=` or `lse=` buffer that requires grad is refused with one ValueError by every entrypoint that takes
buffers, on both backends (mate._checks.out_buffer, before the backend runs; the reference used to raise
autograd's RuntimeError about a leaf used in an in-place operation). Under torch.no_grad() the buffer is
written as any other."""

import pytest
import torch

import mate

BF16, I32 = torch.bfloat16, torch.int32


def _gqa(gen):
    q, k = torch.randn(1, 8, 2, 64, generator=gen).to(BF16), torch.randn(1, 8, 1, 64, generator=gen).to(BF16)
    return (lambda **kw: mate.gqa_attention(q, k, k, return_lse=True, **kw)), {"out": q.shape}


def _qsa(gen):
    """Physical ids (the layout that takes an lse buffer)."""
    q, k = torch.randn(3, 4, 256, generator=gen).to(BF16), torch.randn(16, 2, 256, generator=gen).to(BF16)
    ids = torch.randint(-1, 16, (3, 5), generator=gen, dtype=I32)
    return (lambda **kw: mate.qsa_sparse_attention(q, k, k, selected_kv_indices=ids, return_lse=True, **kw)), \
        {"out": q.shape, "lse": q.shape[:-1]}


def _merge(gen):
    po, pl = torch.randn(3, 5, 4, 32, generator=gen).to(BF16), torch.randn(3, 5, 4, generator=gen)
    return (lambda **kw: mate.merge_attention_states(po, pl, **kw)), {"out": po.shape[1:], "lse": pl.shape[1:]}


def _nsa(gen):
    q, k = torch.randn(1, 16, 2, 64, generator=gen).to(BF16), torch.randn(1, 16, 1, 64, generator=gen).to(BF16)
    blocks = torch.zeros(1, 16, 1, 1, dtype=I32)
    return (lambda **kw: mate.nsa_selection_attention(q, k, k, blocks, block_size=32, **kw)), {"out": q.shape, "lse": (1, 2, 16)}


PROBLEMS = {"gqa_attention": _gqa, "qsa_sparse_attention": _qsa, "merge_attention_states": _merge, "nsa_selection_attention": _nsa}
CASES = [(name, buf) for name, make in PROBLEMS.items() for buf in make(torch.Generator().manual_seed(0))[1]]


@pytest.mark.parametrize("backend", ["reference", "tilelang"])
@pytest.mark.parametrize("name,buf", CASES)
def test_a_buffer_that_requires_grad_is_refused_on_both_backends(name, buf, backend, gen):
    call, shapes = PROBLEMS[name](gen)
    dtype = torch.float32 if buf == "lse" else BF16
    given = torch.zeros(shapes[buf], dtype=dtype, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^{buf} requires grad, but an output buffer is written in place outside autograd; "
                                         rf"pass one that does not require grad \(e\.g\. {buf}\.detach\(\)\), or call under torch\.no_grad\(\)$"):
        call(**{buf: given}, backend=backend)
    assert given.grad is None and not given.any()  # refused before anything was written


@pytest.mark.parametrize("name,buf", CASES)
def test_under_no_grad_the_buffer_is_written(name, buf, gen):
    call, shapes = PROBLEMS[name](gen)
    dtype = torch.float32 if buf == "lse" else BF16
    given = torch.full(shapes[buf], float("nan"), dtype=dtype, requires_grad=True)
    want = call(backend="reference")
    with torch.no_grad():
        got = call(**{buf: given}, backend="reference")
    out, lse = got
    assert (out if buf == "out" else lse) is given
    assert torch.equal(given.detach(), want[0] if buf == "out" else want[1])
