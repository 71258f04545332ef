"""The public entrypoints as `torch.library` custom ops (`torch.ops.mate.*`), for torch.compile.

Each public function here is the stage's entrypoint (same signature and
docstring). Eager calls go straight to it: no dispatcher overhead on
launch-bound decode calls, and errors exactly as documented. Under
torch.compile the call becomes one opaque `torch.ops.mate.<name>` node, so
`fullgraph=True` compiles with no graph break. The op's real implementation is
the same entrypoint, so its checks (some read data pointers, which FakeTensors
lack) run when the compiled graph runs, before any kernel; the fake
implementation only gives output shapes.

`register` makes each op from its entrypoint's signature (schema, real and
fake implementation, the compiled route) plus a few lines saying what differs:
a new keyword of an entrypoint is one edit, in the entrypoint. Custom ops may
not return their inputs, so an entrypoint with `out`/`lse` buffers is
registered as an op that writes both (declared in mutates_args) and returns
nothing; under torch.compile the wrapper allocates the buffers the caller did
not pass, as the entrypoint would, and returns them. tests/test_torch_ops.py
pins the schemas.

`trainable` adds, from the same signature, the functional op and its registered backward that
autograd takes under torch.compile when the inputs require grad (NSA selection's training).

`build_gqa_attn` builds its launcher eagerly (checking the geometry then); the
launch it returns becomes the `mate::gqa_launch` op under torch.compile.
"""

from __future__ import annotations

import functools
import inspect
import typing

import torch
from torch import Tensor

from mate.nsa import selection
from mate import merge
from mate.qsa import attention, indexer
from mate.qsa import selection as qsa_selection
from mate.swa import attention as swa


def _compiling() -> bool:
    # A hook of its own: tests patch it to take the op path in eager mode (patching torch.compiler
    # itself confuses Dynamo's rules for is_compiling later in the process).
    return torch.compiler.is_compiling()


def _entry(impl, compiled):
    """impl in eager mode, compiled (which calls the op) while torch.compile traces."""

    @functools.wraps(impl)
    def entry(*args, **kwargs):
        if _compiling():
            return compiled(*args, **kwargs)
        return impl(*args, **kwargs)

    return entry


def _fake_scores(shape, like: Tensor) -> Tensor:
    return like.new_empty(shape, dtype=torch.float32)


def _is_tensor(annotation) -> bool:
    return annotation is Tensor or Tensor in typing.get_args(annotation)


def _is_list(annotation) -> bool:
    return any(typing.get_origin(t) is list for t in (annotation, *typing.get_args(annotation)))


def _is_scale(annotation) -> bool:
    """A dequant scale (k_scale / v_scale of an FP8 cache): a float or a tensor, which no schema type is."""
    return float in typing.get_args(annotation) and Tensor in typing.get_args(annotation)


def _split_scales(op_sig: inspect.Signature) -> tuple[inspect.Signature, list[str]]:
    """The op's signature with each scale parameter `n` as two: `n` (Tensor?) and `n_value` (float?)."""
    params, scales = [], []
    for n, p in op_sig.parameters.items():
        if not _is_scale(p.annotation):
            params.append(p)
            continue
        scales.append(n)
        default = {} if p.default is inspect.Parameter.empty else {"default": None}
        params += [p.replace(annotation=Tensor | None, **default),
                   inspect.Parameter(f"{n}_value", p.kind, annotation=float | None, **default)]
    return op_sig.replace(parameters=params), scales


def _bind(sig: inspect.Signature, args, kwargs) -> dict:
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def register(name, entrypoint, *, fake=None, buffers=None, fixed=None, extra=None, passes=None, returns=None, types=None, listed=False):
    """torch.ops.mate.<name> from the entrypoint's signature, and the public function (eager: the entrypoint itself).

    A functional op (no `buffers`) has the entrypoint's parameters and defaults; custom ops
    take no keyword-only tensors, so if one is a tensor all become positional-or-keyword.
    `fake(args)` gives its output's shape from the bound arguments.

    An op with buffers writes them (declared mutated) and returns nothing, since a custom
    op may not return its inputs. Its parameters: the entrypoint's positional ones, the
    `buffers`, the keyword-only ones (less the buffers and `fixed`), then `extra`; no
    defaults (the buffers, which have none, follow arguments that do).
    - buffers: {name: allocate(args)}, the output buffers in the entrypoint's result order;
      under torch.compile the caller's buffer, or one allocated as the entrypoint would;
    - fixed: {parameter: value} the op passes to the entrypoint (return_lse=True);
    - extra: {name: (type, value(args))} op parameters computed from the caller's arguments;
    - passes: {buffer: when(op_args)} whether the op hands that buffer to the entrypoint
      (default: if it is a parameter); a buffer it does not hand over gets the result copied in;
    - returns(args, *buffers): the public result under torch.compile;
    - types: {parameter: type} where the entrypoint's annotation is no schema type;
    - listed: the entrypoint returns a tensor or a tuple of tensors, by its arguments (no schema type):
      the op returns them as a list (`fake` too), the public function as the entrypoint does.
    A tuple given for a list parameter goes through as a list; a scale parameter (float | Tensor, an FP8
    cache's k_scale / v_scale) is two op parameters, `n` (the tensor) and `n_value` (the float).
    """
    sig = inspect.signature(entrypoint, eval_str=True)
    types = {n: (types or {}).get(n, p.annotation) for n, p in sig.parameters.items()}
    P = inspect.Parameter
    if buffers is None:
        kw_tensors = any(p.kind is P.KEYWORD_ONLY and _is_tensor(types[n]) for n, p in sig.parameters.items())
        params = [p.replace(annotation=types[n], kind=P.POSITIONAL_OR_KEYWORD if kw_tensors else p.kind) for n, p in sig.parameters.items()]
        op_sig = sig.replace(parameters=params, return_annotation=list[Tensor] if listed else sig.return_annotation)
    else:
        fixed, extra, passes = fixed or {}, extra or {}, passes or {}
        given = [n for n, p in sig.parameters.items() if p.kind is P.POSITIONAL_OR_KEYWORD]
        rest = [n for n, p in sig.parameters.items() if p.kind is P.KEYWORD_ONLY and n not in buffers and n not in fixed]
        annotated = {**{n: types[n] for n in given + rest}, **dict.fromkeys(buffers, Tensor), **{n: t for n, (t, _) in extra.items()}}
        order = given + list(buffers) + rest + list(extra)
        op_sig = inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD, annotation=annotated[n]) for n in order], return_annotation=None)
    op_sig, scales = _split_scales(op_sig)
    lists = {n for n, p in op_sig.parameters.items() if _is_list(p.annotation)}

    def implementation(*args, **kwargs):
        a = _bind(op_sig, args, kwargs)
        for n in scales:
            value = a.pop(f"{n}_value")
            a[n] = value if a[n] is None else a[n]
        if buffers is None:
            result = entrypoint(**a)
            return (list(result) if isinstance(result, tuple) else [result]) if listed else result
        handed = {b: b in sig.parameters and passes.get(b, lambda _: True)(a) for b in buffers}
        kw = {n: a[n] for n in sig.parameters if n in a and n not in buffers}
        kw.update(fixed, **{b: a[b] if handed[b] else None for b in buffers if b in sig.parameters})
        result = entrypoint(**kw)
        for i, b in enumerate(buffers):
            if not handed[b]:
                a[b].copy_(result[i])

    implementation.__signature__ = op_sig
    op = torch.library.custom_op(f"mate::{name}", implementation, mutates_args=tuple(buffers or ()))
    if fake is not None:
        op.register_fake(lambda *args, **kwargs: fake(_bind(op_sig, args, kwargs)))

    def compiled(*args, **kwargs):
        a = _bind(sig, args, kwargs)
        if buffers is not None:
            a.update({n: value(a) for n, (_, value) in extra.items()})  # from the caller's arguments, before allocating
            a.update({b: alloc(a) if a.get(b) is None else a[b] for b, alloc in buffers.items()})
        for n in scales:
            a[n], a[f"{n}_value"] = (a[n], None) if isinstance(a[n], Tensor) else (None, a[n])
        values = {n: list(a[n]) if n in lists and isinstance(a[n], tuple) else a[n] for n in op_sig.parameters}
        positional = [values[n] for n, p in op_sig.parameters.items() if p.kind is P.POSITIONAL_OR_KEYWORD]
        result = op(*positional, **{n: values[n] for n, p in op_sig.parameters.items() if p.kind is P.KEYWORD_ONLY})
        if listed:
            return result[0] if len(result) == 1 else tuple(result)
        return result if buffers is None else returns(a, *(a[b] for b in buffers))

    return _entry(entrypoint, compiled)


def _out_like(name):
    return lambda a: a[name].new_empty(a[name].shape)


def _lse(name, shape):
    return lambda a: a[name].new_empty(shape(a[name].shape), dtype=torch.float32)


# ---------------------------------------------------------------- MQA indexer: functional ops

qsa_indexer_mqa_score = register(
    "qsa_indexer_mqa_score", indexer.qsa_indexer_mqa_score,
    fake=lambda a: _fake_scores(
        (*a["q_idx"].shape[:-2], a["block_keys"].shape[1] * (a["block_table"].shape[1] if a["block_table"] is not None else 1)),
        a["q_idx"]),
)


def _fake_selected(keys):
    """The scores of `keys(a)` keys a row, or with topk the selection's block and token ids."""

    def fake(a):
        rows = a["q"].shape[0]
        if a["topk"] is None:
            return [_fake_scores((rows, keys(a)), a["q"])]
        k, bs = a["topk"], a["block_size"]
        return [a["q"].new_empty((rows, k), dtype=torch.int32), a["q"].new_empty((rows, bs * k + bs - 1), dtype=torch.int32)]

    return fake


qsa_mqa_prefill = qsa_mqa = register(
    "qsa_mqa_prefill", indexer.qsa_mqa_prefill, fake=_fake_selected(lambda a: a["k"].shape[0]), listed=True)
qsa_mqa_decode = register("qsa_mqa_decode", indexer.qsa_mqa_decode, fake=_fake_selected(lambda a: a["max_model_len"]), listed=True)


# ---------------------------------------------------------------- entrypoints with out / lse buffers


def _out_lse(a, out, lse):
    return out, lse


def _out_or_both(a, out, lse):
    return (out, lse) if a["return_lse"] else out


# lse: [H, T_total] for packed sequences (q [T_total, H, D]), else [B, H, M]
_NSA_BUFFERS = {"out": _out_like("q"), "lse": _lse("q", lambda s: (s[1], s[0]) if len(s) == 3 else (s[0], s[2], s[1]))}
_nsa_selection_attention = register("nsa_selection_attention", selection.nsa_selection_attention, buffers=_NSA_BUFFERS,
                                    returns=_out_lse)


def trainable(name, public, forward, backward, *, grads, buffers, outputs):
    """`public` (what register made of an entrypoint with buffers) with the route autograd takes under
    torch.compile when one of `grads` requires grad (then the entrypoint refuses the `buffers`).

    Autograd does not differentiate ops that write their arguments, so that route is a functional op
    `mate::<name>_train`, whose parameters are the entrypoint's less the buffers (no defaults) and whose
    `forward(**args)` returns `outputs`, with its backward registered: the op `mate::<name>_backward`
    of the first output's gradient `do`, the `grads` inputs, the `outputs`, then the other parameters,
    whose `backward(**args)` returns the gradients of `grads`. Only the first output is differentiable.
    `buffers` are register's: {name: allocate(args)}, which give the outputs' fake shapes too. Both ops
    are generated from the entrypoint's signature, so a new keyword needs no edit here (forward and
    backward take it by name).
    """
    entrypoint = public.__wrapped__
    sig = inspect.signature(entrypoint, eval_str=True)
    P = inspect.Parameter
    names = [n for n in sig.parameters if n not in buffers]
    annotation = {n: sig.parameters[n].annotation for n in names}
    tensors = [n for n in names if _is_tensor(annotation[n])]
    rest = [n for n in names if n not in grads]

    def params(order, types):
        return [P(n, P.POSITIONAL_OR_KEYWORD, annotation=types[n]) for n in order]

    fwd_sig = inspect.Signature(params(names, annotation), return_annotation=tuple[(Tensor,) * len(outputs)])
    bwd_types = {"do": Tensor, **annotation, **dict.fromkeys(outputs, Tensor)}
    bwd_sig = inspect.Signature(params(["do", *grads, *outputs, *rest], bwd_types), return_annotation=tuple[(Tensor,) * len(grads)])

    def train_impl(*args, **kwargs):
        return forward(**_bind(fwd_sig, args, kwargs))

    def train_fake(*args, **kwargs):
        a = _bind(fwd_sig, args, kwargs)
        return tuple(alloc(a) for alloc in buffers.values())

    def backward_impl(*args, **kwargs):
        return backward(**_bind(bwd_sig, args, kwargs))

    def backward_fake(*args, **kwargs):
        a = _bind(bwd_sig, args, kwargs)
        return tuple(torch.empty_like(a[n]) for n in grads)

    train_impl.__signature__, backward_impl.__signature__ = fwd_sig, bwd_sig
    train_op = torch.library.custom_op(f"mate::{name}_train", train_impl, mutates_args=())
    train_op.register_fake(train_fake)
    backward_op = torch.library.custom_op(f"mate::{name}_backward", backward_impl, mutates_args=())
    backward_op.register_fake(backward_fake)

    def setup(ctx, inputs, output):
        a = dict(zip(names, inputs))
        ctx.save_for_backward(*(a[n] for n in tensors), *output)
        ctx.others = {n: a[n] for n in names if n not in tensors}
        ctx.mark_non_differentiable(*output[1:])

    def grad(ctx, do, *_):
        a = {**dict(zip([*tensors, *outputs], ctx.saved_tensors)), **ctx.others, "do": do.contiguous()}
        g = dict(zip(grads, backward_op(*(a[n] for n in bwd_sig.parameters))))
        return tuple(g.get(n) for n in names)

    train_op.register_autograd(grad, setup_context=setup)

    @functools.wraps(entrypoint)
    def entry(*args, **kwargs):
        if _compiling():
            a = _bind(sig, args, kwargs)
            if torch.is_grad_enabled() and any(isinstance(a[n], Tensor) and a[n].requires_grad for n in grads) and \
                    all(a[b] is None for b in buffers):
                return train_op(*(a[n] for n in names))
        return public(*args, **kwargs)

    return entry


nsa_selection_attention = trainable(
    "nsa_selection_attention", _nsa_selection_attention, selection.training_forward, selection.training_backward,
    grads=("q", "k", "v"), buffers=_NSA_BUFFERS, outputs=("o", "lse"),
)


# gqa_attention takes no lse buffer: the op copies the one it returns into its own ([B, H, Sq], varlen [H, total_q]).
gqa_attention = register(
    "gqa_attention", swa.gqa_attention,
    buffers={"out": _out_like("q"), "lse": _lse("q", lambda s: (s[0], s[2], s[1]) if len(s) == 4 else (s[1], s[0]))},
    fixed={"return_lse": True},
    returns=_out_or_both, types={"sliding_window": list[int] | None},
)
merge_attention_states = register(
    "merge_attention_states", merge.merge_attention_states,
    buffers={"out": lambda a: a["partial_out"].new_empty(a["partial_out"].shape[1:], dtype=a["out_dtype"] or a["partial_out"].dtype),
             "lse": _lse("partial_out", lambda s: s[1:-1])},
    returns=_out_lse,
)
# The entrypoint takes an lse buffer with physical ids only (and rejects one the caller gave otherwise),
# so the op hands it over then, or when the caller gave one (for that error); else it copies the result in.
qsa_sparse_attention = register(
    "qsa_sparse_attention", attention.qsa_sparse_attention,
    buffers={"out": _out_like("query"), "lse": _lse("query", lambda s: s[:-1])}, fixed={"return_lse": True},
    extra={"caller_lse": (bool, lambda a: a["lse"] is not None)},
    passes={"lse": lambda a: a["selected_kv_indices"] is not None or a["caller_lse"]},
    returns=_out_or_both,
)




# ---------------------------------------------------------------- QSA selection


def _ids(rows, width):
    return lambda a: a[rows].new_empty((a[rows].shape[0], width(a)), dtype=torch.int32)


def _token_width(a):
    k = a["block_indices"].shape[1] if "block_indices" in a else a["k"]
    return a["block_size"] * k + a["block_size"] - 1


qsa_topk_blocks = register("qsa_topk_blocks", qsa_selection.qsa_topk_blocks, buffers={"out": _ids("scores", lambda a: a["k"])},
                           returns=lambda a, out: out)
qsa_expand_blocks = register("qsa_expand_blocks", qsa_selection.qsa_expand_blocks, buffers={"out": _ids("block_indices", _token_width)},
                             returns=lambda a, out: out)
qsa_topk_tokens = register(
    "qsa_topk_tokens", qsa_selection.qsa_topk_tokens,
    fake=lambda a: (_ids("scores", lambda a: a["k"])(a), _ids("scores", _token_width)(a)),
)


# ---------------------------------------------------------------- the GQA launcher


def _window(sliding_window):
    # The op schema holds int[]?; anything else goes through as is, for the entrypoint's own TypeError.
    return list(sliding_window) if isinstance(sliding_window, tuple) else sliding_window


@torch.library.custom_op("mate::gqa_launch", mutates_args=("O",))
def _gqa_launch_op(
    Q: Tensor, K: Tensor, V: Tensor, O: Tensor, geometry: list[int], sliding_window: list[int] | None,
    strides: list[int], seq_len_q: int, seq_len_kv: int,
) -> None:
    swa.build_gqa_attn(*geometry, sliding_window=sliding_window)(Q, K, V, O, *strides, seq_len_q, seq_len_kv)


@functools.wraps(swa.build_gqa_attn)
def build_gqa_attn(ATTN_B, ATTN_H, ATTN_H_KV, ATTN_D, sliding_window=None):
    launch = swa.build_gqa_attn(ATTN_B, ATTN_H, ATTN_H_KV, ATTN_D, sliding_window=sliding_window)
    geometry, window = [ATTN_B, ATTN_H, ATTN_H_KV, ATTN_D], _window(sliding_window)

    def compiled(Q, K, V, O, Q_stride1, K_stride1, V_stride1, O_stride1, seq_len_q, seq_len_kv):
        _gqa_launch_op(Q, K, V, O, geometry, window, [Q_stride1, K_stride1, V_stride1, O_stride1], seq_len_q, seq_len_kv)
        return O

    return _entry(launch, compiled)


# What `import mate` exports (mate/__init__.py takes this list): every public function above, each a wrapper
# (functools.wraps) of its stage's entrypoint, aliases included; so a new entrypoint is its register(...) call.
__all__ = sorted(n for n, v in list(globals().items()) if not n.startswith("_") and hasattr(v, "__wrapped__"))
