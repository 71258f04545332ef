"""The torch.library ops behind the public entrypoints: schemas and fake kernels (opcheck), torch.compile
with fullgraph=True against eager, out buffers and errors under compile.

CPU tests run the reference backend on the cases of tests/cases.py; the GPU
test (`pytest -m gpu`) compiles every native case.
"""

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mate
from cases import CASES, bitwise_equal, native
from mate import _ops
from mate.nsa import selection
from mate import merge
from mate.qsa import attention, indexer
from mate.qsa import selection as qsa_selection
from mate.swa import attention as swa

OPS = {
    "qsa_indexer_mqa_score": indexer.qsa_indexer_mqa_score,
    "qsa_mqa_prefill": indexer.qsa_mqa_prefill,
    "qsa_mqa_decode": indexer.qsa_mqa_decode,
    "nsa_selection_attention": selection.nsa_selection_attention,
    "gqa_attention": swa.gqa_attention,
    "merge_attention_states": merge.merge_attention_states,
    "qsa_sparse_attention": attention.qsa_sparse_attention,
    "qsa_topk_blocks": qsa_selection.qsa_topk_blocks,
    "qsa_topk_tokens": qsa_selection.qsa_topk_tokens,
    "qsa_expand_blocks": qsa_selection.qsa_expand_blocks,
}


def fresh(name, device="cpu"):
    return CASES[name](device, torch.Generator().manual_seed(7))


def clone(outs):
    return tuple(o.clone() for o in outs)


class RecordMateOps(TorchDispatchMode):
    """Records every torch.ops.mate call with its (real) arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mate":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


# The op schemas as they were written out by hand (main f206cbc): generating them from the signatures changes none.
# Since then qsa_mqa_decode took k_scale (issue 38): a float or a tensor, so two op arguments, and a tensor among its
# keywords makes every argument positional-or-keyword (custom ops take no keyword-only tensors); gqa_attention's
# k_scale / v_scale (FP8 K/V) the same way.
SCHEMAS = {
    "qsa_indexer_mqa_score": "mate::qsa_indexer_mqa_score(Tensor q_idx, Tensor block_keys, Tensor? block_table=None, SymInt? page_size=None, Tensor? cu_seqlens_q=None, Tensor? token_to_req=None, SymInt? num_requests=None, Tensor? query_positions=None, Tensor? seq_lens_q=None, SymInt block_size=4, float? scale=None, float? score_scale=None, str backend=\"tilelang\") -> Tensor",
    "qsa_mqa_prefill": "mate::qsa_mqa_prefill(Tensor q, Tensor k, Tensor row_starts, Tensor row_ends, float? score_scale=None, float? scale=None, SymInt? topk=None, Tensor? query_positions=None, SymInt block_size=4, str backend=\"tilelang\") -> Tensor[]",
    "qsa_mqa_decode": "mate::qsa_mqa_decode(Tensor q, Tensor k_cache, Tensor page_table, Tensor context_lens, SymInt max_model_len, float? score_scale=None, float? scale=None, Tensor? k_scale=None, float? k_scale_value=None, SymInt? topk=None, Tensor? query_positions=None, SymInt block_size=4, str backend=\"tilelang\") -> Tensor[]",
    "nsa_selection_attention": "mate::nsa_selection_attention(Tensor q, Tensor k, Tensor v, Tensor block_indices, Tensor(a4!) out, Tensor(a5!) lse, SymInt block_size, Tensor? block_counts, Tensor? cu_seqlens, float? scale, str backend) -> ()",
    "nsa_selection_attention_train": "mate::nsa_selection_attention_train(Tensor q, Tensor k, Tensor v, Tensor block_indices, SymInt block_size, Tensor? block_counts, Tensor? cu_seqlens, float? scale, str backend) -> (Tensor, Tensor)",
    "nsa_selection_attention_backward": "mate::nsa_selection_attention_backward(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor block_indices, SymInt block_size, Tensor? block_counts, Tensor? cu_seqlens, float? scale, str backend) -> (Tensor, Tensor, Tensor)",
    "gqa_attention": "mate::gqa_attention(Tensor q, Tensor k, Tensor v, Tensor(a3!) out, Tensor(a4!) lse, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, Tensor? block_table, Tensor? seq_lens_k, SymInt[]? sliding_window, Tensor? sinks, float? softcap, float? scale, Tensor? k_scale, float? k_scale_value, Tensor? v_scale, float? v_scale_value, str backend) -> ()",
    "merge_attention_states": "mate::merge_attention_states(Tensor partial_out, Tensor partial_lse, Tensor(a2!) out, Tensor(a3!) lse, Tensor? gate, ScalarType? out_dtype, str backend) -> ()",
    "qsa_sparse_attention": "mate::qsa_sparse_attention(Tensor query, Tensor key, Tensor value, Tensor? token_indices, Tensor(a4!) out, Tensor(a5!) lse, Tensor? block_indices, Tensor? cu_seqlens_q, Tensor? token_to_req, SymInt? num_requests, Tensor? cu_seqlens_k, Tensor? seq_lens_q, Tensor? seq_lens_k, Tensor? query_positions, Tensor? block_table, SymInt? page_size, float? scale, Tensor? gate, SymInt? num_splits, str backend, bool warp_specialized, bool assume_compact_blocks, Tensor? selected_kv_indices, float? softmax_scale, Tensor? k_scale, float? k_scale_value, Tensor? v_scale, float? v_scale_value, ScalarType? compute_dtype, bool caller_lse) -> ()",
    "qsa_topk_blocks": "mate::qsa_topk_blocks(Tensor scores, SymInt k, Tensor(a2!) out, str backend) -> ()",
    "qsa_topk_tokens": "mate::qsa_topk_tokens(Tensor scores, SymInt k, Tensor query_positions, *, SymInt block_size=4, str backend=\"tilelang\") -> (Tensor, Tensor)",
    "qsa_expand_blocks": "mate::qsa_expand_blocks(Tensor block_indices, Tensor query_positions, Tensor(a2!) out, SymInt block_size, str backend) -> ()",
    "gqa_launch": "mate::gqa_launch(Tensor Q, Tensor K, Tensor V, Tensor(a3!) O, SymInt[] geometry, SymInt[]? sliding_window, SymInt[] strides, SymInt seq_len_q, SymInt seq_len_kv) -> ()",
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_op_schemas_are_pinned(name):
    assert str(getattr(torch.ops.mate, name).default._schema) == SCHEMAS[name]


def test_register_makes_the_op_from_the_signature():
    """A keyword is one edit, in the entrypoint: the schema, the op's call of the entrypoint and the compiled route follow."""
    def scaled(x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None, backend: str = "reference"):
        out = torch.empty_like(x) if out is None else out
        torch.mul(x, alpha, out=out)
        return out, x.sum(-1)

    entry = _ops.register("_test_scaled", scaled, returns=lambda a, out, sums: (out, sums),
                          buffers={"out": lambda a: torch.empty_like(a["x"]), "sums": lambda a: a["x"].new_empty(a["x"].shape[:-1])})
    assert str(torch.ops.mate._test_scaled.default._schema) == \
        "mate::_test_scaled(Tensor x, Tensor(a1!) out, Tensor(a2!) sums, float alpha, str backend) -> ()"
    assert inspect.signature(entry) == inspect.signature(scaled)
    torch._dynamo.reset()
    x, buf = torch.randn(3, 4), torch.full((3, 4), float("nan"))
    out, sums = torch.compile(lambda: entry(x, alpha=3.0, out=buf), fullgraph=True, backend="aot_eager")()
    assert out is buf and torch.equal(out, x * 3) and torch.equal(sums, x.sum(-1))  # sums: copied from the result


def test_trainable_makes_the_training_ops_from_the_signature():
    """The training route of an entrypoint with buffers: a keyword is one edit, in the entrypoint (and the
    forward and backward that take it by name); under torch.compile the gradients are eager's."""
    def scaled(x: torch.Tensor, w: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None, sums: torch.Tensor | None = None):
        y = x * w * alpha
        return y if out is None else out.copy_(y), y.detach().sum(-1) if sums is None else sums.copy_(y.sum(-1))

    def forward(**a):
        with torch.no_grad():
            return scaled(**a)

    def backward(do, x, w, o, s, alpha):
        return do * w * alpha, (do * x * alpha).sum(0)

    bufs = {"out": lambda a: torch.empty_like(a["x"]), "sums": lambda a: a["x"].new_empty(a["x"].shape[:-1])}
    public = _ops.register("_test_trained", scaled, buffers=bufs, returns=lambda a, out, sums: (out, sums))
    entry = _ops.trainable("_test_trained", public, forward, backward, grads=("x", "w"), buffers=bufs, outputs=("o", "s"))
    assert str(torch.ops.mate._test_trained_train.default._schema) == \
        "mate::_test_trained_train(Tensor x, Tensor w, float alpha) -> (Tensor, Tensor)"
    assert str(torch.ops.mate._test_trained_backward.default._schema) == \
        "mate::_test_trained_backward(Tensor do, Tensor x, Tensor w, Tensor o, Tensor s, float alpha) -> (Tensor, Tensor)"
    assert inspect.signature(entry) == inspect.signature(scaled)
    torch._dynamo.reset()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    o, sums = torch.compile(lambda: entry(x, w, alpha=3.0), fullgraph=True, backend=backend)()
    assert torch.ops.mate._test_trained_train.default in seen and not sums.requires_grad
    assert torch.equal(o, x * w * 3) and torch.equal(sums, (x * w * 3).sum(-1))
    want = torch.autograd.grad((x * w * 3).pow(2).sum(), (x, w))
    assert all(torch.allclose(a, b) for a, b in zip(torch.autograd.grad(o.pow(2).sum(), (x, w)), want))


def test_every_entrypoint_is_an_op_with_its_signature_and_docstring():
    public = set(mate.__all__) - {"build_gqa_attn", "qsa_mqa", "debug_checks"}
    assert public == set(OPS)
    for name, impl in OPS.items():
        assert isinstance(getattr(torch.ops.mate, name).default, torch._ops.OpOverload)
        entry = getattr(mate, name)
        assert entry is not impl and entry.__doc__ == impl.__doc__
        assert inspect.signature(entry) == inspect.signature(impl)
    assert mate.qsa_mqa is mate.qsa_mqa_prefill
    for name in ("qsa_indexer_mqa_score", "qsa_mqa_prefill", "qsa_mqa_decode"):  # the op is called with the public arguments
        schema = getattr(torch.ops.mate, name).default._schema
        # a dequant scale (float or tensor, which no schema type is) is two op arguments: the tensor, then the float
        public = [m for n in inspect.signature(OPS[name]).parameters for m in ((n, f"{n}_value") if n in ("k_scale", "v_scale") else (n,))]
        assert [a.name for a in schema.arguments] == public, name
    assert mate.build_gqa_attn.__doc__ == swa.build_gqa_attn.__doc__
    assert inspect.signature(mate.build_gqa_attn) == inspect.signature(swa.build_gqa_attn)
    assert isinstance(torch.ops.mate.gqa_launch.default, torch._ops.OpOverload)


@pytest.mark.parametrize("name", [n for n in CASES if n != "gqa_launcher"])  # the launcher is native only
def test_op_route_matches_direct_call_and_passes_opcheck(name, monkeypatch):
    """Through torch.ops.mate the results are bitwise those of the direct call; each op call passes opcheck
    (declared mutations are the real ones, the fake kernel gives the real shapes, AOT dispatch works)."""
    direct = fresh(name).call("reference")
    with monkeypatch.context() as m, RecordMateOps() as rec:
        m.setattr(_ops, "_compiling", lambda: True)  # the path the wrappers take under torch.compile, in eager mode
        via_op = fresh(name).call("reference")
    assert bitwise_equal(via_op, direct)
    assert len(rec.calls) == 1
    func, args, kwargs = rec.calls[0]
    for arg, x in zip(func._schema.arguments, args):
        if arg.name in ("out", "lse"):
            x.fill_(7.0)  # the recorded call left its results there: a rerun must visibly change them
    fp8 = [x for x in args if isinstance(x, torch.Tensor) and x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if not fp8:
        torch.library.opcheck(func, args, kwargs)
        return
    # opcheck's schema check compares each input before and after with torch.allclose, which has no CPU FP8
    # kernel; so the other checks, and that one by hand for the FP8 inputs (bitwise, as bytes).
    before = [x.view(torch.uint8).clone() for x in fp8]
    torch.library.opcheck(func, args, kwargs, test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    func(*args, **kwargs)
    assert all(torch.equal(x.view(torch.uint8), b) for x, b in zip(fp8, before))


def compile_and_count(fn, seen, dynamic=None):
    """torch.compile(fullgraph=True) through AOT dispatch (functionalization of the out/lse mutations).

    `seen` gets the calls of the graph compiled last (with dynamic shapes Dynamo may trace twice,
    the second time with a size it chose to specialize).
    """

    def backend(gm, example_inputs):
        seen[:] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", [n for n in CASES if n != "gqa_launcher"])
def test_compile_fullgraph_matches_eager(name, dynamic):
    torch._dynamo.reset()
    p = fresh(name)
    eager = clone(p.call("reference"))
    seen = []
    got = compile_and_count(lambda: p.call("reference"), seen, dynamic=dynamic)()
    assert bitwise_equal(got, eager)
    assert sum(getattr(t, "namespace", None) == "mate" for t in seen) == 1, seen


class Pipeline(torch.nn.Module):
    """A decode step calling several entrypoints, for the default (inductor) backend."""

    def forward(self, q_idx, k_cache, table, ctx, q, k, v, idx):
        scores = mate.qsa_mqa_decode(q_idx, k_cache, table, ctx, 64, backend="reference")
        o, lse = mate.nsa_selection_attention(q, k, v, idx, block_size=16, backend="reference")
        g = mate.gqa_attention(q, k, v, sliding_window=(8, 0), backend="reference")
        return scores.amax(-1), o + g, lse


def test_module_compiles_with_inductor_without_graph_breaks():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    args = (
        torch.randn(3, 4, 32, generator=gen), torch.randn(6, 16, 32, generator=gen),
        torch.tensor([[0, 5, -1, 2], [1, 9, 3, 4], [-1, -1, -1, -1]], dtype=torch.int32), torch.tensor([40, 64, 10], dtype=torch.int32),
        torch.randn(2, 24, 4, 16, generator=gen), torch.randn(2, 40, 2, 16, generator=gen), torch.randn(2, 40, 2, 16, generator=gen),
        torch.randint(-1, 3, (2, 24, 2, 3), generator=gen, dtype=torch.int32),
    )
    model = Pipeline()
    eager = model(*args)
    got = torch.compile(model, fullgraph=True)(*args)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_compile_writes_out_buffers_in_place():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 4, 16, generator=gen) for _ in range(3))
    idx = torch.randint(-1, 3, (1, 9, 4, 2), generator=gen, dtype=torch.int32)
    out_big = torch.full((1, 9, 4, 20), float("nan"))
    lse_big = torch.full((1, 4, 12), float("nan"))
    out, lse = out_big[..., 2:18], lse_big[..., 3:]
    po = torch.randn(3, 9, 4, 16, generator=gen)
    pl = torch.randn(3, 9, 4, generator=gen)
    m_big = torch.full((9, 4, 17), float("nan"))
    m_out = m_big[..., 1:]

    def step(out, lse, m_out):
        a = mate.nsa_selection_attention(q, k, v, idx, block_size=4, out=out, lse=lse, backend="reference")
        b = mate.gqa_attention(q, k, v, sliding_window=(-1, 0), out=out_g, backend="reference")
        c = mate.merge_attention_states(po, pl, out=m_out, backend="reference")
        return a, b, c

    out_g = torch.empty(1, 9, 4, 16)
    (o, l), g, (mo, ml) = torch.compile(step, fullgraph=True, backend="aot_eager")(out, lse, m_out)
    assert o is out and l is lse and g is out_g and mo is m_out
    ref_o, ref_l = mate.nsa_selection_attention(q, k, v, idx, block_size=4, backend="reference")
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l)
    assert torch.equal(out_g, mate.gqa_attention(q, k, v, sliding_window=(-1, 0), backend="reference"))
    assert torch.equal(m_out, mate.merge_attention_states(po, pl, backend="reference")[0])
    assert torch.isnan(out_big[..., :2]).all() and torch.isnan(out_big[..., 18:]).all()
    assert torch.isnan(lse_big[..., :3]).all() and torch.isnan(m_big[..., 0]).all()


@pytest.mark.parametrize("bad, exc, match", [
    (dict(block_indices=torch.zeros(1, 4, 2, 3, dtype=torch.int64)), TypeError, "block_indices must be an int32"),
    (dict(block_indices=torch.zeros(1, 5, 2, 3, dtype=torch.int32)), ValueError, "block_indices must be"),
    (dict(out=torch.empty(1, 4, 4, 8)), ValueError, "out must have shape"),
    (dict(scale=-1.0), ValueError, "scale must be a positive"),
])
def test_compile_raises_the_documented_errors(bad, exc, match):
    """The checks run in the op's real kernel: a compiled call raises what the eager call raises."""
    torch._dynamo.reset()
    kw = dict(q=torch.randn(1, 4, 4, 16), k=torch.randn(1, 8, 2, 16), v=torch.randn(1, 8, 2, 16),
              block_indices=torch.zeros(1, 4, 2, 3, dtype=torch.int32), block_size=4, backend="reference")
    kw.update(bad)
    with pytest.raises(exc, match=match):
        mate.nsa_selection_attention(**kw)
    with pytest.raises(exc, match=match):
        torch.compile(lambda: mate.nsa_selection_attention(**kw), fullgraph=True, backend="aot_eager")()


def test_qsa_logical_lse_buffer_rejected_under_compile():
    torch._dynamo.reset()
    p = dict(query=torch.randn(1, 3, 2, 8), key=torch.randn(1, 5, 1, 8), value=torch.randn(1, 5, 1, 8),
             token_indices=torch.zeros(1, 3, 2, dtype=torch.int32), lse=torch.empty(1, 3, 2), backend="reference")
    with pytest.raises(ValueError, match="lse= is the output buffer of selected_kv_indices"):
        torch.compile(lambda: mate.qsa_sparse_attention(**p), fullgraph=True, backend="aot_eager")()


def test_launcher_traces_as_one_op():
    """The launch is native only: on the CPU the compiled call reaches the op and raises its ValueError (no graph break)."""
    torch._dynamo.reset()
    launch = mate.build_gqa_attn(1, 2, 1, 64)
    q, k, v, o = (torch.zeros(4, n, dtype=torch.bfloat16) for n in (128, 64, 64, 128))
    seen = []
    fn = compile_and_count(lambda: launch(q, k, v, o, 128, 64, 64, 128, 4, 4), seen)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fn()
    assert torch.ops.mate.gqa_launch.default in seen


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_compiled_native_is_bitwise_eager(name):
    torch._dynamo.reset()
    p = fresh(name, "cuda")
    eager = clone(native(p))
    seen = []
    got = compile_and_count(lambda: p.call("tilelang"), seen)()
    assert bitwise_equal(got, eager)
    assert sum(getattr(t, "namespace", None) == "mate" for t in seen) == 1, seen
