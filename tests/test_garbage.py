"""Garbage (NaN, Inf, huge values) in unused cache memory never changes a reference result (issue 18).

The native paths run the same cases in tests/test_garbage_gpu.py.
"""

import pytest
import torch

import garbage as G

CASES = {
    "qsa-padded": G.qsa_padded(),
    "qsa-paged": G.qsa_paged(),
    "qsa-paged-cu_seqlens": G.qsa_paged("cu_seqlens"),
    "qsa-paged-token_to_req": G.qsa_paged("token_to_req"),
    "qsa-physical": G.qsa_physical,
    "qsa-paged-e4m3-splits": G.qsa_paged(splits=3, kv_dtype=torch.float8_e4m3fn),
    "qsa-paged-cu_seqlens-e5m2-tensor-scale": G.qsa_paged("cu_seqlens", kv_dtype=torch.float8_e5m2, tensor_scale=True),
    "qsa-physical-e4m3": lambda device, gen: G.qsa_physical(device, gen, kv_dtype=torch.float8_e4m3fn),
    "qsa-varlen-kv": G.qsa_varlen_kv,
    "nsa": G.nsa(),
    "gqa-(64,0)": G.gqa((64, 0)),
    "gqa-(31,5)": G.gqa((31, 5)),
    "gqa-causal": G.gqa((-1, 0), Sq=130, Sk=130),
    "gqa-(0,40)": G.gqa((0, 40), Sq=300, Sk=200),
    "mqa-score": G.mqa_score,
    "mqa-score-paged": G.mqa_score_paged,
    "mqa-prefill": G.mqa_prefill,
    "mqa-decode": G.mqa_decode,
    "mqa-decode-e4m3": G.mqa_decode_fp8(torch.float8_e4m3fn, 0.02),
    "mqa-decode-e5m2-tensor-scale": G.mqa_decode_fp8(torch.float8_e5m2, 0.03, tensor_scale=True),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_ignores_unused_memory(name, gen):
    G.assert_ignores_unused(CASES[name], "cpu", gen, "reference", name)


@pytest.mark.parametrize("window", [(64, 0), (31, 5), (-1, 0), (3, 200)], ids=str)
def test_reference_gqa_is_exact_per_row(window, gen):
    """The oracle holds per row: keys outside one row's own window never matter to it."""
    import mate

    Sq, Sk = 40, 300
    q = G.randn(gen, 1, Sq, 2, 32, device="cpu")
    k = G.randn(gen, 1, Sk, 1, 32, device="cpu")
    v = G.randn(gen, 1, Sk, 1, 32, device="cpu")
    out, lse = mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, backend="reference")
    for i in (0, 17, Sq - 1):
        seen = G.window_keys(Sq, Sk, window, rows=[i])
        kp, vp = k.clone(), v.clone()
        G.poison_unused(kp[0], seen)
        G.poison_unused(vp[0], seen)
        o, l = mate.gqa_attention(q, kp, vp, sliding_window=window, return_lse=True, backend="reference")
        assert torch.equal(o[:, i], out[:, i]) and torch.equal(l[:, :, i], lse[:, :, i]), f"row {i}"


@pytest.mark.parametrize("name", CASES)
def test_poisoning_can_fail(name, gen):
    """The check itself can fail: garbage in the used places too does reach the result."""
    case = CASES[name]("cpu", gen)
    clean = G.outputs(case, "reference")
    case.poison(used_too=True)
    assert not all(torch.equal(a, b) for a, b in zip(clean, G.outputs(case, "reference")))


def test_gqa_configs_keep_the_band_guarantee():
    """The native GQA kernel loads no key outside a query tile's band only while block_n <= block_m
    (mate/swa/kernels/gqa.py); every shipped config must keep that."""
    from mate import _dispatch

    for target in ("sm90",):
        for key, tiles in _dispatch.load_config(target)["gqa_fwd"].items():
            assert tiles["block_n"] <= tiles["block_m"], f"{target} gqa_fwd[{key}]: block_n {tiles['block_n']} > block_m {tiles['block_m']}"
