"""Garbage (NaN, Inf, huge values) in unused cache memory never changes a native result (issue 18).

The cases of tests/garbage.py on the GPU: clean run, poison every unused place, run again,
compare bit for bit. Run with `pytest -m gpu`.
"""

import pytest
import torch

import garbage as G
import mate
from mate import _dispatch
from mate.swa import attention as swa

pytestmark = pytest.mark.gpu

CASES = {
    "qsa-padded": G.qsa_padded(),
    "qsa-padded-fp16-group12": G.qsa_padded(torch.float16, hq=24, hkv=2),
    "qsa-paged": G.qsa_paged(splits=1),
    "qsa-paged-splits": G.qsa_paged(splits=3),
    "qsa-paged-cu_seqlens": G.qsa_paged("cu_seqlens"),
    "qsa-paged-token_to_req-splits": G.qsa_paged("token_to_req", splits=2),
    "qsa-physical": G.qsa_physical,
    "qsa-paged-e4m3-splits": G.qsa_paged(splits=3, kv_dtype=torch.float8_e4m3fn),
    "qsa-paged-cu_seqlens-e5m2-tensor-scale": G.qsa_paged("cu_seqlens", kv_dtype=torch.float8_e5m2, tensor_scale=True),
    "qsa-physical-e4m3": lambda device, gen: G.qsa_physical(device, gen, kv_dtype=torch.float8_e4m3fn),
    "nsa-64-32": G.nsa(64, 32),
    "nsa-128-64-fp16": G.nsa(128, 64, torch.float16),
    "mqa-score": G.mqa_score,
    "mqa-prefill": G.mqa_prefill,
    "mqa-decode": G.mqa_decode,
    "mqa-decode-e4m3": G.mqa_decode_fp8(torch.float8_e4m3fn, 0.02),
    "mqa-decode-e5m2-tensor-scale": G.mqa_decode_fp8(torch.float8_e5m2, 0.03, tensor_scale=True),
}
for _w in [(64, 0), (31, 5), (-1, 0), None, (0, 300)]:
    for _d in (64, 128):
        CASES[f"gqa-{_w}-d{_d}"] = G.gqa(_w, Sq=130, Sk=1000, D=_d)
CASES["gqa-causal-square-d64"] = G.gqa((-1, 0), Sq=1000, Sk=1000, D=64)
CASES["gqa-(100,-1)-long-q-d128"] = G.gqa((100, -1), Sq=1100, Sk=300, D=128)


@pytest.mark.parametrize("name", CASES)
def test_native_ignores_unused_memory(name, gen):
    G.assert_ignores_unused(CASES[name], "cuda", gen, "tilelang", name)


@pytest.mark.parametrize("window", [(-1, 0), (64, 0), (31, 5), (3, 200)], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_gqa_garbage_stays_in_its_query_tile(window, dim, gen):
    """The documented native guarantee (mate/swa/kernels/gqa.py): garbage at a key reaches only the
    query tiles (block_m rows) of which some row sees it. Dense causal included: keys some later
    tile sees are garbage here."""
    Sq, Sk, B = 1000, 1000, 1
    q = G.randn(gen, B, Sq, 4, dim, device="cuda")
    k = G.randn(gen, B, Sk, 2, dim, device="cuda")
    v = G.randn(gen, B, Sk, 2, dim, device="cuda")
    block_m = _dispatch.tiles(swa.STAGE.name, swa._spec(q.dtype, dim, *window), "sm90")["block_m"]
    out, lse = mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True)
    cut = 517  # garbage in keys [cut, cut + 40)
    kp, vp = k.clone(), v.clone()
    bad = torch.zeros(Sk, dtype=torch.bool)
    bad[cut : cut + 40] = True
    G.poison_unused(kp[0], ~bad)
    G.poison_unused(vp[0], ~bad)
    o, l = mate.gqa_attention(q, kp, vp, sliding_window=window, return_lse=True)
    torch.cuda.synchronize()
    protected = 0
    for t0 in range(0, Sq, block_m):
        rows = list(range(t0, min(t0 + block_m, Sq)))
        if (G.window_keys(Sq, Sk, window, rows) & bad).any():
            continue
        protected += len(rows)
        assert torch.equal(o[:, t0 : t0 + block_m], out[:, t0 : t0 + block_m]), f"rows {t0}.. changed"
        assert torch.equal(l[:, :, t0 : t0 + block_m], lse[:, :, t0 : t0 + block_m]), f"lse of rows {t0}.. changed"
    assert protected > 0
