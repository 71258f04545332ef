"""The QSA sparse-attention kernels that servers ship, as baselines beside mate: vLLM's and SGLang's Triton kernels,
loaded unchanged from copies of their source files (never committed here; read them at the commits issue 37 names,
vLLM vllm/models/qwen4_exp/nvidia/ops/qsa.py @ 010efafd and SGLang
python/sglang/srt/layers/attention/qsa/sparse_attn.py @ 0a8037da, into the ignored .gpu/upstream/).

vLLM's module imports three vLLM helpers; `load` stands them in with the few names it reads (the device capability
and Triton itself). Each baseline takes mate's problem dict (benchmarks/common.py, qsa_serving_problem: paged K/V, cu_seqlens_q,
2051 request-local token ids a row, a per-element gate) and returns a call that writes its output:

- vLLM: `qsa_sparse_paged_attention` as vLLM calls it: the packed [rows, W + 1] index buffer (its last column the
  row's entry count), token_to_req, the per-element output gate, `use_prefill_config` for a prefill;
- SGLang: `_sparse_gqa_chunk_prefill` on physical slot ids (page * page_size + slot, -1 for none) into the flattened
  pool, launched with the arguments of its interface `sparse_gqa_fwd_interface_triton_ck` and its config table
  (which on an H200 is the H20 table: "H20" is in "NVIDIA H200"); the interface itself reads max_q with .item(),
  which a CUDA graph cannot capture, so the launch takes max_q from the host. SGLang has no gate: its output is
  compared with mate's ungated result.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch


def _stub_vllm():
    import triton
    import triton.language as tl

    class Platform:
        @staticmethod
        def get_device_capability():
            return torch.cuda.get_device_capability()

    mods = {
        "vllm": types.ModuleType("vllm"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.warmup": types.ModuleType("vllm.model_executor.warmup"),
        "vllm.model_executor.warmup.jit_warmup_triton_helper": types.ModuleType("jit_warmup_triton_helper"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
    }
    mods["vllm.model_executor.warmup.jit_warmup_triton_helper"].TritonWarmupTensor = object
    mods["vllm.model_executor.warmup.jit_warmup_triton_helper"].triton_scalar_specialization_rep = lambda x: x
    mods["vllm.platforms"].current_platform = Platform()
    mods["vllm.triton_utils"].HAS_TRITON, mods["vllm.triton_utils"].tl, mods["vllm.triton_utils"].triton = True, tl, triton
    for name, m in mods.items():
        sys.modules.setdefault(name, m)


def load(path: str, name: str):
    """The module in file `path` (vLLM's helpers stood in first)."""
    _stub_vllm()
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _token_to_req(p) -> torch.Tensor:
    cu = p["cu_seqlens_q"].long()
    rows = p["query"].shape[0]
    return (torch.searchsorted(cu, torch.arange(rows, device=cu.device), right=True) - 1).to(torch.int32)


def vllm_call(module, p):
    """vLLM's sparse attention on mate's problem `p`: a call returning its output (gated)."""
    ti = p["token_indices"]
    rows, width = ti.shape
    packed = torch.cat([ti, torch.full((rows, 1), width, dtype=torch.int32, device=ti.device)], 1).contiguous()
    t2r = _token_to_req(p)
    gate = p["gate"].contiguous()
    out = torch.empty_like(p["query"])
    prefill = rows > int(p["cu_seqlens_q"].numel() - 1)  # several rows a request
    return lambda: module.qsa_sparse_paged_attention(p["query"], p["key"], p["value"], packed, p["block_table"], t2r,
                                                      prefill, out=out, output_gate=gate)


def sglang_call(module, p):
    """SGLang's chunked-prefill sparse attention on mate's problem `p` (no gate): a call returning its output."""
    q, k, v, ti, table = p["query"], p["key"], p["value"], p["token_indices"], p["block_table"]
    page = k.shape[1]
    t2r = _token_to_req(p).long()
    phys = table.long()[t2r[:, None], ti.clamp_min(0).long() // page] * page + ti.clamp_min(0).long() % page
    slots = torch.where(ti >= 0, phys, -1).to(torch.int32).contiguous()
    kf, vf = k.flatten(0, 1), v.flatten(0, 1)
    cu_q = p["cu_seqlens_q"]
    cu_k = torch.zeros_like(cu_q)  # physical ids index the flattened pool from its start
    kv_lens = p["seq_lens_k"]
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    hq, d = q.shape[1:]
    hkv = k.shape[2]
    group = hq // hkv
    block_n, warps, stages = module._get_best_config(q.shape[0])
    out = torch.empty_like(q)
    grid = (max_q, (cu_q.shape[0] - 1) * hkv)

    def call():
        module._sparse_gqa_chunk_prefill[grid](
            q, kf, vf, out, slots, cu_q, cu_k, kv_lens, p.get("scale", d ** -0.5), slots.shape[-1],
            q.stride(0), q.stride(1), q.stride(2), kf.stride(0), kf.stride(1), kf.stride(2),
            vf.stride(0), vf.stride(1), vf.stride(2), out.stride(0), out.stride(1), out.stride(2),
            slots.stride(0), 0, slots.stride(1),
            NUM_KV_HEADS=hkv, GROUP_SIZE=group, BLOCK_M=max(16, 1 << (group - 1).bit_length()), BLOCK_N=block_n,
            HEAD_DIM=d, num_warps=warps, num_stages=stages)
        return out

    return call
