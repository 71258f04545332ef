"""The public entrypoints as `torch.library` custom ops (`torch.ops.mate.*`), for torch.compile.

Each public function here is the stage's entrypoint (same signature and
docstring). Eager calls go straight to it: no dispatcher overhead on
launch-bound decode calls, and errors exactly as documented. Under
torch.compile the call becomes one opaque `torch.ops.mate.<name>` node, so
`fullgraph=True` compiles with no graph break. The op's real implementation is
the same entrypoint, so its checks (some read data pointers, which FakeTensors
lack) run when the compiled graph runs, before any kernel; the fake
implementation only gives output shapes.

Custom ops may not return their inputs, so an entrypoint with `out`/`lse`
buffers is registered as an op that writes both (declared in mutates_args)
and returns nothing; under torch.compile the wrapper allocates the buffers the
caller did not pass, as the entrypoint would, and returns them.

`build_gqa_attn` builds its launcher eagerly (checking the geometry then); the
launch it returns becomes the `mate::gqa_launch` op under torch.compile.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from mate.nsa import selection
from mate.qsa import attention, indexer, merge
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


# ---------------------------------------------------------------- MQA indexer: functional ops

_prefill_op = torch.library.custom_op("mate::qsa_mqa_prefill", indexer.qsa_mqa_prefill, mutates_args=())
_decode_op = torch.library.custom_op("mate::qsa_mqa_decode", indexer.qsa_mqa_decode, mutates_args=())


# Custom ops take no keyword-only tensors: the same parameters, positional-or-keyword.
@torch.library.custom_op("mate::qsa_indexer_mqa_score", mutates_args=())
def _score_op(
    q_idx: Tensor, block_keys: Tensor, block_table: Tensor | None = None, page_size: int | None = None,
    cu_seqlens_q: Tensor | None = None, token_to_req: Tensor | None = None, num_requests: int | None = None,
    query_positions: Tensor | None = None, seq_lens_q: Tensor | None = None, block_size: int = 4,
    scale: float | None = None, score_scale: float | None = None, backend: str = "tilelang",
) -> Tensor:
    return indexer.qsa_indexer_mqa_score(
        q_idx, block_keys, block_table=block_table, page_size=page_size, cu_seqlens_q=cu_seqlens_q,
        token_to_req=token_to_req, num_requests=num_requests, query_positions=query_positions, seq_lens_q=seq_lens_q,
        block_size=block_size, scale=scale, score_scale=score_scale, backend=backend,
    )


@_score_op.register_fake
def _(q_idx, block_keys, block_table=None, *_, **__):
    n_keys = block_keys.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    return _fake_scores((*q_idx.shape[:-2], n_keys), q_idx)


@_prefill_op.register_fake
def _(q, k, *_, **__):
    return _fake_scores((q.shape[0], k.shape[0]), q)


@_decode_op.register_fake
def _(q, k_cache, page_table, context_lens, max_model_len, *_, **__):
    return _fake_scores((q.shape[0], max_model_len), q)


qsa_indexer_mqa_score = _entry(indexer.qsa_indexer_mqa_score, _score_op)
qsa_mqa_prefill = qsa_mqa = _entry(indexer.qsa_mqa_prefill, _prefill_op)
qsa_mqa_decode = _entry(indexer.qsa_mqa_decode, _decode_op)


# ---------------------------------------------------------------- entrypoints with out / lse buffers


@torch.library.custom_op("mate::nsa_selection_attention", mutates_args=("out", "lse"))
def _nsa_op(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, out: Tensor, lse: Tensor,
    block_size: int, block_counts: Tensor | None, scale: float | None, backend: str,
) -> None:
    selection.nsa_selection_attention(q, k, v, block_indices, block_size=block_size, block_counts=block_counts,
                                      scale=scale, out=out, lse=lse, backend=backend)


def _nsa_compiled(q, k, v, block_indices, *, block_size=64, block_counts=None, scale=None, out=None, lse=None, backend="tilelang"):
    B, M, H, _ = q.shape
    out = q.new_empty(q.shape) if out is None else out
    lse = q.new_empty((B, H, M), dtype=torch.float32) if lse is None else lse
    _nsa_op(q, k, v, block_indices, out, lse, block_size, block_counts, scale, backend)
    return out, lse


@torch.library.custom_op("mate::gqa_attention", mutates_args=("out", "lse"))
def _gqa_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sliding_window: list[int] | None, scale: float | None, backend: str
) -> None:
    _, res_lse = swa.gqa_attention(q, k, v, sliding_window=sliding_window, scale=scale, out=out, return_lse=True, backend=backend)
    lse.copy_(res_lse)


def _gqa_compiled(q, k, v, *, sliding_window=None, scale=None, out=None, return_lse=False, backend="tilelang"):
    B, Sq, H, _ = q.shape
    out = q.new_empty(q.shape) if out is None else out
    lse = q.new_empty((B, H, Sq), dtype=torch.float32)
    _gqa_op(q, k, v, out, lse, _window(sliding_window), scale, backend)
    return (out, lse) if return_lse else out


def _window(sliding_window):
    # The op schema holds int[]?; anything else goes through as is, for the entrypoint's own TypeError.
    return list(sliding_window) if isinstance(sliding_window, tuple) else sliding_window


@torch.library.custom_op("mate::merge_attention_states", mutates_args=("out", "lse"))
def _merge_op(
    partial_out: Tensor, partial_lse: Tensor, out: Tensor, lse: Tensor, gate: Tensor | None, out_dtype: torch.dtype | None, backend: str
) -> None:
    merge.merge_attention_states(partial_out, partial_lse, gate=gate, out=out, lse=lse, out_dtype=out_dtype, backend=backend)


def _merge_compiled(partial_out, partial_lse, *, gate=None, out=None, lse=None, out_dtype=None, backend="tilelang"):
    out = partial_out.new_empty(partial_out.shape[1:], dtype=out_dtype or partial_out.dtype) if out is None else out
    lse = partial_out.new_empty(partial_out.shape[1:-1], dtype=torch.float32) if lse is None else lse
    _merge_op(partial_out, partial_lse, out, lse, gate, out_dtype, backend)
    return out, lse


@torch.library.custom_op("mate::qsa_sparse_attention", mutates_args=("out", "lse"))
def _qsa_op(
    query: Tensor, key: Tensor, value: Tensor, token_indices: Tensor | None, out: Tensor, lse: Tensor,
    block_indices: Tensor | None, cu_seqlens_q: Tensor | None, token_to_req: Tensor | None, num_requests: int | None,
    cu_seqlens_k: Tensor | None, seq_lens_q: Tensor | None, seq_lens_k: Tensor | None, query_positions: Tensor | None,
    block_table: Tensor | None, page_size: int | None, scale: float | None, gate: Tensor | None, num_splits: int | None,
    backend: str, warp_specialized: bool, assume_compact_blocks: bool, selected_kv_indices: Tensor | None,
    softmax_scale: float | None, k_scale: float, v_scale: float, compute_dtype: torch.dtype | None, caller_lse: bool,
) -> None:
    # The entrypoint takes an lse buffer with physical ids only (and rejects one the caller gave otherwise).
    physical = selected_kv_indices is not None
    _, res_lse = attention.qsa_sparse_attention(
        query, key, value, token_indices, block_indices=block_indices, cu_seqlens_q=cu_seqlens_q,
        token_to_req=token_to_req, num_requests=num_requests, cu_seqlens_k=cu_seqlens_k, seq_lens_q=seq_lens_q,
        seq_lens_k=seq_lens_k, query_positions=query_positions, block_table=block_table, page_size=page_size,
        scale=scale, gate=gate, num_splits=num_splits, return_lse=True, backend=backend,
        warp_specialized=warp_specialized, assume_compact_blocks=assume_compact_blocks, out=out,
        selected_kv_indices=selected_kv_indices, softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale,
        compute_dtype=compute_dtype, lse=lse if physical or caller_lse else None,
    )
    if not physical:
        lse.copy_(res_lse)


def _qsa_compiled(
    query, key, value, token_indices=None, *, block_indices=None, cu_seqlens_q=None, token_to_req=None,
    num_requests=None, cu_seqlens_k=None, seq_lens_q=None, seq_lens_k=None, query_positions=None, block_table=None,
    page_size=None, scale=None, gate=None, num_splits=None, return_lse=False, backend="tilelang",
    warp_specialized=False, assume_compact_blocks=False, out=None, selected_kv_indices=None, softmax_scale=None,
    k_scale=1.0, v_scale=1.0, compute_dtype=None, lse=None,
):
    caller_lse = lse is not None
    out = query.new_empty(query.shape) if out is None else out
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32) if lse is None else lse
    _qsa_op(query, key, value, token_indices, out, lse, block_indices, cu_seqlens_q, token_to_req, num_requests,
            cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions, block_table, page_size, scale, gate, num_splits,
            backend, warp_specialized, assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, caller_lse)
    return (out, lse) if return_lse else out


nsa_selection_attention = _entry(selection.nsa_selection_attention, _nsa_compiled)
gqa_attention = _entry(swa.gqa_attention, _gqa_compiled)
merge_attention_states = _entry(merge.merge_attention_states, _merge_compiled)
qsa_sparse_attention = _entry(attention.qsa_sparse_attention, _qsa_compiled)


# ---------------------------------------------------------------- the GQA launcher


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
