"""NSA selection attention for training, on the CPU: the reference backward against autograd through a dense
masked formula, packed sequences (cu_seqlens) against per-sequence padded calls, autograd and torch.compile
of forward + backward, and the errors."""

import math

import pytest
import torch

import mate
from mate.nsa import reference
from inputs import nsa_indices

I32 = torch.int32


def dense(q, k, v, idx, counts, block_size, scale):
    """O of NSA selection as one masked dense softmax (float64), for autograd to differentiate: each key's
    score gains log(occurrences of its block among the row's used slots), unused keys get -inf."""
    B, M, H, D = q.shape
    N, G = k.shape[1], k.shape[2]
    hpg = H // G
    used = reference.used_slots(idx, counts, N, block_size)
    n_blocks = math.ceil(N / block_size)
    mult = torch.zeros(B, M, G, n_blocks, dtype=torch.float64).scatter_add_(-1, idx.long().clamp(0, n_blocks - 1), used.double())
    key_mult = mult[..., torch.arange(N) // block_size]  # [B, M, G, N]
    visible = (key_mult > 0) & (torch.arange(N) <= (N - M + torch.arange(M))[:, None])[None, :, None, :]
    s = torch.einsum("bmghd,bngd->bmghn", q.double().view(B, M, G, hpg, D), k.double()) * scale
    s = torch.where(visible.unsqueeze(3), s + key_mult.log().unsqueeze(3), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    return torch.einsum("bmghn,bngd->bmghd", p, v.double()).reshape(B, M, H, D)


def leaves(gen, B, M, N, G, hpg, D, dtype=torch.float32):
    make = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return make(B, M, G * hpg, D), make(B, N, G, D), make(B, N, G, D)


def grads(fn, inputs, do):
    return torch.autograd.grad(fn(*inputs), inputs, do)


def close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("hpg", [1, 3, 16])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("M, N", [(7, 37), (5, 5), (9, 4), (1, 30)])
def test_reference_gradients_match_dense_autograd(gen, hpg, block_size, M, N):
    """M > N leaves early rows with nothing visible; nsa_indices draws -1, future and out-of-range blocks."""
    B, G, D, T = 2, 2, 16, 6
    q, k, v = leaves(gen, B, M, N, G, hpg, D)
    idx = nsa_indices(gen, B, M, G, T, N, block_size)
    idx[..., 1] = idx[..., 0]  # duplicates
    counts = torch.randint(-1, T + 2, (B, M, G), generator=gen, dtype=I32) if hpg == 3 else None
    do = torch.randn(q.shape, generator=gen)
    got = grads(lambda q, k, v: mate.nsa_selection_attention(q, k, v, idx, block_size=block_size, block_counts=counts, scale=0.3,
                                                             backend="reference")[0], (q, k, v), do)
    want = grads(lambda q, k, v: dense(q, k, v, idx, counts, block_size, 0.3), (q, k, v), do.double())
    close(got, want)


def test_rows_with_nothing_visible_get_zero_gradients(gen):
    B, M, N, G, hpg, D, bs = 1, 6, 8, 1, 2, 8, 4
    q, k, v = leaves(gen, B, M, N, G, hpg, D)
    idx = torch.full((B, M, G, 3), -1, dtype=I32)
    idx[:, 3:, :, 0] = 0  # rows 3.. see block 0; rows 0..2 see nothing
    o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, backend="reference")
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn(o.shape, generator=gen))
    assert torch.all(dq[:, :3] == 0) and dq[:, 3:].abs().sum() > 0
    assert torch.all(dk[:, bs:] == 0) and torch.all(dv[:, bs:] == 0)  # block 1 is never used
    o, lse = mate.nsa_selection_attention(q, k, v, torch.full_like(idx, -1), block_size=bs, backend="reference")
    assert all(torch.all(g == 0) for g in torch.autograd.grad(o.sum(), (q, k, v)))


def test_garbage_in_unused_keys_does_not_reach_gradients(gen):
    B, M, N, G, hpg, D, bs = 1, 9, 40, 2, 2, 8, 8
    q, k, v = leaves(gen, B, M, N, G, hpg, D)
    idx = nsa_indices(gen, B, M, G, 4, N, bs)
    used = torch.zeros(N, dtype=torch.bool)
    for j in idx[reference.used_slots(idx, None, N, bs)].tolist():
        used[j * bs : (j + 1) * bs] = True
    used &= torch.arange(N) <= N - 1  # every key up to the last position may be visible
    kn, vn = k.detach().clone(), v.detach().clone()
    kn[:, ~used], vn[:, ~used] = float("nan"), float("inf")
    kn, vn = kn.requires_grad_(), vn.requires_grad_()
    do = torch.randn(q.shape, generator=gen)
    f = lambda q, k, v: mate.nsa_selection_attention(q, k, v, idx, block_size=bs, backend="reference")[0]  # noqa: E731
    clean, dirty = grads(f, (q, k, v), do), grads(f, (q, kn, vn), do)
    for c, d in zip(clean, dirty):
        assert torch.isfinite(d).all()
    close(dirty[:1], clean[:1])
    close([dirty[1][:, used], dirty[2][:, used]], [clean[1][:, used], clean[2][:, used]])


def test_lse_and_indices_are_not_differentiable_and_no_grad_stays_plain(gen):
    q, k, v = leaves(gen, 1, 5, 16, 1, 2, 8)
    idx = nsa_indices(gen, 1, 5, 1, 3, 16, 4)
    o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=4, backend="reference")
    assert o.requires_grad and not lse.requires_grad and o.grad_fn is not None
    with torch.no_grad():
        o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=4, backend="reference")
    assert not o.requires_grad and o.grad_fn is None
    o, _ = mate.nsa_selection_attention(q.detach(), k.detach(), v.detach(), idx, block_size=4, backend="reference")
    assert o.grad_fn is None
    # only k requires grad: dq is not computed, dk is
    o, _ = mate.nsa_selection_attention(q.detach(), k, v.detach(), idx, block_size=4, backend="reference")
    (dk,) = torch.autograd.grad(o.sum(), (k,))
    assert dk.shape == k.shape and dk.abs().sum() > 0


def test_no_double_backward(gen):
    q, k, v = leaves(gen, 1, 5, 16, 1, 2, 8)
    idx = nsa_indices(gen, 1, 5, 1, 3, 16, 4)
    o, _ = mate.nsa_selection_attention(q, k, v, idx, block_size=4, backend="reference")
    (dq,) = torch.autograd.grad(o.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dq.sum().backward()


def test_out_buffers_are_refused_when_recording_for_autograd(gen):
    q, k, v = leaves(gen, 1, 5, 16, 1, 2, 8)
    idx = nsa_indices(gen, 1, 5, 1, 3, 16, 4)
    with pytest.raises(ValueError, match="out and lse buffers are not supported when q, k or v require grad"):
        mate.nsa_selection_attention(q, k, v, idx, block_size=4, out=torch.empty(q.shape), backend="reference")
    with torch.no_grad():
        out = torch.empty(q.shape)
        assert mate.nsa_selection_attention(q, k, v, idx, block_size=4, out=out, backend="reference")[0] is out


# ---------------------------------------------------------------- packed sequences


def packed(gen, lens, G=2, hpg=2, D=8, T=4, bs=4, dtype=torch.float32):
    total = sum(lens)
    q, k, v = (x[0] for x in leaves(gen, 1, total, total, G, hpg, D, dtype))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    idx = torch.full((total, G, T), -1, dtype=I32)
    start = 0
    for n in lens:
        if n:
            idx[start : start + n] = nsa_indices(gen, 1, n, G, T, n, bs)[0]
        start += n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    return q, k, v, idx, cu


@pytest.mark.parametrize("lens", [[5], [3, 9, 1], [0, 7, 0, 2], [13, 4]])
def test_packed_sequences_are_padded_problems_of_their_own(gen, lens):
    """Forward and gradients: each sequence as its own padded call (M = N = its length); sequences shorter
    than one block, and empty ones."""
    bs = 4
    q, k, v, idx, cu = packed(gen, lens, bs=bs)
    counts = torch.randint(0, 5, idx.shape[:2], generator=gen, dtype=I32)
    o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, block_counts=counts, cu_seqlens=cu, backend="reference")
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    do = torch.randn(o.shape, generator=gen)
    got = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        sl = lambda x: x[None, a:b]  # noqa: E731
        o1, l1 = mate.nsa_selection_attention(sl(q), sl(k), sl(v), sl(idx), block_size=bs, block_counts=sl(counts), backend="reference")
        torch.testing.assert_close(o[a:b], o1[0])
        torch.testing.assert_close(lse[:, a:b], l1[0])
        want = torch.autograd.grad(o1, (q, k, v), sl(do))
        close([g[a:b] for g in got], [w[a:b] for w in want])


def test_packed_against_dense_autograd(gen):
    bs = 4
    q, k, v, idx, cu = packed(gen, [6, 11], bs=bs)
    do = torch.randn(q.shape, generator=gen)
    got = grads(lambda q, k, v: mate.nsa_selection_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu, backend="reference")[0],
                (q, k, v), do)

    def both(q, k, v):
        return torch.cat([dense(q[None, a:b], k[None, a:b], v[None, a:b], idx[None, a:b], None, bs, 1 / math.sqrt(q.shape[-1]))[0]
                          for a, b in ((0, 6), (6, 17))])

    close(got, grads(both, (q, k, v), do.double()))


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), TypeError, "cu_seqlens must be an int32"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), ValueError, "cu_seqlens must have rank 1"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"][:1]), ValueError, "cu_seqlens must hold S \\+ 1 >= 2 offsets"),
        (lambda a: a.update(cu_seqlens=[0, 4]), TypeError, "cu_seqlens must be a torch.Tensor"),
        (lambda a: a.update(q=a["q"][None]), ValueError, "q must have rank 3"),
        (lambda a: a.update(k=a["k"][:5]), ValueError, "k must be \\[T_total, G, D\\]"),
        (lambda a: a.update(block_indices=a["block_indices"][:5]), ValueError, "block_indices must be \\[T_total, G, T\\]"),
        (lambda a: a.update(block_counts=torch.zeros(9, 3, dtype=I32)), ValueError, "block_counts must have shape \\(9, 2\\)"),
        (lambda a: a.update(lse=torch.empty(9, 4)), ValueError, "lse must have shape \\(4, 9\\)"),
        (lambda a: a.update(out=torch.empty(9, 4, 4)), ValueError, "out must have shape \\(9, 4, 8\\)"),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "tilelang"])
def test_packed_errors(gen, change, exc, match, backend):
    q, k, v, idx, cu = packed(gen, [4, 5])
    a = dict(q=q.detach(), k=k.detach(), v=v.detach(), block_indices=idx, cu_seqlens=cu, block_size=4, backend=backend)
    change(a)
    with pytest.raises(exc, match=match):
        mate.nsa_selection_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("block_indices"), **a)


def test_packed_offsets_are_checked_in_debug_mode(gen):
    q, k, v, idx, _ = packed(gen, [4, 5])
    bad = torch.tensor([0, 6, 5], dtype=I32)
    with mate.debug_checks(), pytest.raises(ValueError, match="cu_seqlens must be nondecreasing"):
        mate.nsa_selection_attention(q, k, v, idx, block_size=4, cu_seqlens=bad, backend="reference")
    with mate.debug_checks(), pytest.raises(ValueError, match="cu_seqlens must run from 0 to the row count 9"):
        mate.nsa_selection_attention(q, k, v, idx, block_size=4, cu_seqlens=torch.tensor([0, 4, 8], dtype=I32), backend="reference")


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_compile_fullgraph_forward_and_backward_match_eager(gen, varlen):
    torch._dynamo.reset()
    bs = 4
    if varlen:
        q, k, v, idx, cu = packed(gen, [3, 10], bs=bs)
    else:
        (q, k, v), idx, cu = leaves(gen, 2, 9, 23, 2, 3, 8), nsa_indices(gen, 2, 9, 2, 4, 23, bs), None

    def loss(q, k, v):
        o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu, backend="reference")
        return (o * o).sum() + lse.nan_to_num(neginf=0).sum()

    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(q, k, v), (q, k, v))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert torch.ops.mate.nsa_selection_attention_train.default in seen


def test_training_ops_pass_opcheck(gen):
    (q, k, v), idx = leaves(gen, 1, 6, 12, 2, 2, 8), nsa_indices(gen, 1, 6, 2, 3, 12, 4)
    counts = torch.randint(0, 4, (1, 6, 2), generator=gen, dtype=I32)
    args = (q, k, v, idx, 4, counts, None, None, "reference")
    torch.library.opcheck(torch.ops.mate.nsa_selection_attention_train.default, args)
    o, lse = torch.ops.mate.nsa_selection_attention_train(*args)
    bwd = (torch.randn(o.shape, generator=gen), q.detach(), k.detach(), v.detach(), o.detach(), lse, idx, 4, counts, None, None, "reference")
    torch.library.opcheck(torch.ops.mate.nsa_selection_attention_backward.default, bwd)
    qp, kp, vp, ip, cu = packed(gen, [3, 5])
    torch.library.opcheck(torch.ops.mate.nsa_selection_attention_train.default, (qp, kp, vp, ip, 4, None, cu, 0.5, "reference"))
