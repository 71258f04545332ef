"""Property-based tests (hypothesis) of every entrypoint.

- CPU (CI): random valid shapes, geometries, selections and options; the
  reference against the naive float64 oracles of the stage tests.
- GPU (`pytest -m gpu`): the same draws in native geometries; native against
  the reference (a stage with no native path yet skips).
- Argument checks: random invalid inputs raise TypeError or ValueError naming
  the argument, before any kernel runs (on the GPU: nothing launched, no CUDA
  error left behind).

Examples are derandomized (a fixed seed) and bounded, so CI runs the same
examples every time.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inputs
import mate
import test_gqa
import test_mqa
import test_nsa
import test_qsa_attention as qsa_tests
import test_qsa_merge
from cases import NOT_YET, assert_matches
from helpers import poison_allocator

I32 = torch.int32
CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
CPU = settings(derandomize=True, database=None, max_examples=40, deadline=None, suppress_health_check=CHECKS)
GPU = settings(derandomize=True, database=None, max_examples=25, deadline=None, suppress_health_check=CHECKS)


class Draw:
    """Tensors for one example: shapes and options from hypothesis, values from a seeded generator."""

    def __init__(self, data, native, device):
        self.data, self.native, self.device = data, native, device
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        self.dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="dtype") if native else torch.float32

    def int(self, lo, hi, label):
        return self.data.draw(st.integers(lo, hi), label=label)

    def pick(self, options, label):
        return self.data.draw(st.sampled_from(options), label=label)

    def flag(self, label):
        return self.data.draw(st.booleans(), label=label)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def ints(self, lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=self.gen, dtype=I32).to(self.device)

    def scale_kw(self, *names):
        name = self.pick([None, *names], "scale option")
        return {} if name is None else {name: self.data.draw(st.floats(0.05, 4.0), label=name)}


def scale_of(kw, dim):
    if "score_scale" in kw:
        return 1 / kw["score_scale"]
    return kw.get("scale", 1 / math.sqrt(dim))


def cpu(*xs):
    return [x.cpu() if isinstance(x, torch.Tensor) else x for x in xs]


# ---------------------------------------------------------------- draws: (call(backend) -> outputs, naive() -> outputs)


def mqa_score(d: Draw):
    B = d.int(1, 3, "B")
    Q, N = (d.int(1, 300, "Q"), d.int(1, 1100, "N")) if d.native else (d.int(1, 5, "Q"), d.int(1, 7, "N"))
    H, D = (4, 128) if d.native else (d.int(1, 4, "H"), d.pick([4, 8], "D"))
    q, k = d.randn(B, Q, H, D), d.randn(B, N, D)
    kw = dict(block_size=d.pick([1, 2, 4], "block_size"), **d.scale_kw("scale", "score_scale"))
    if d.flag("positions"):
        kw["query_positions"] = d.ints(-3, 4 * N + 8, (B, Q))
    if d.flag("seq_lens_q"):
        kw["seq_lens_q"] = d.ints(0, Q + 1, (B,))

    def call(backend):
        return (mate.qsa_indexer_mqa_score(q, k, **kw, backend=backend),)

    def naive():
        pos, lens = kw.get("query_positions"), kw.get("seq_lens_q")
        bs, out = kw["block_size"], torch.empty(B, Q, N, dtype=torch.float64)
        for b in range(B):
            for i in range(Q):
                p = int(pos[b, i]) if pos is not None else i
                live = lens is None or i < int(lens[b])
                out[b, i] = test_mqa.naive_row(q[b, i], lambda j: k[b, j], lambda j: live and bs * j + bs - 1 <= p, N, scale_of(kw, D))
        return (out,)

    return call, naive


def mqa_prefill(d: Draw):
    rows, keys = (d.int(1, 700, "rows"), d.int(1, 2000, "keys")) if d.native else (d.int(1, 6, "rows"), d.int(1, 9, "keys"))
    H, D = (4, 128) if d.native else (d.int(1, 4, "H"), d.pick([4, 8], "D"))
    q, k = d.randn(rows, H, D), d.randn(keys, D)
    starts = d.ints(-4, keys + 2, (rows,))
    ends = starts + d.ints(-3, keys + 3, (rows,))
    kw = d.scale_kw("scale", "score_scale")
    k_arg = k.unsqueeze(1) if d.flag("k as [keys, 1, dim]") else k

    def call(backend):
        return (mate.qsa_mqa_prefill(q, k_arg, starts, ends, **kw, backend=backend),)

    def naive():
        out = torch.stack([test_mqa.naive_row(q[r], lambda j: k[j], lambda j: int(starts[r]) <= j < int(ends[r]), keys, scale_of(kw, D))
                           for r in range(rows)])
        return (out,)

    return call, naive


def mqa_decode(d: Draw):
    B = d.int(1, 9 if d.native else 3, "B")
    ps = d.pick([8, 16, 32, 64], "page_size") if d.native else d.int(1, 4, "page_size")
    pages, max_pages = d.int(1, 40 if d.native else 5, "pages"), d.int(1, 20 if d.native else 4, "max_pages")
    H, D = (4, 128) if d.native else (d.int(1, 4, "H"), d.pick([4, 8], "D"))
    q, cache = d.randn(B, H, D), d.randn(pages, ps, D)
    table = d.ints(-1, pages + 2, (B, max_pages))
    cap = max_pages * ps
    ctx = d.ints(0, cap + 10, (B,))
    max_len = d.int(1, cap + 20, "max_model_len")
    kw = d.scale_kw("scale", "score_scale")
    cache_arg = cache.unsqueeze(2) if d.flag("k_cache as [pages, page_size, 1, dim]") else cache

    def call(backend):
        return (mate.qsa_mqa_decode(q, cache_arg, table, ctx, max_len, **kw, backend=backend),)

    def naive():
        rows = []
        for b in range(B):
            key_of, exists = test_mqa.paged_key(cache, table[b], ps)
            rows.append(test_mqa.naive_row(q[b], key_of, lambda j: j < int(ctx[b]) and exists(j), max_len, scale_of(kw, D)))
        return (torch.stack(rows),)

    return call, naive


def nsa_selection(d: Draw):
    if d.native:
        D, bs, G, hpg = d.pick([64, 128], "D"), d.pick([32, 64], "block_size"), d.int(1, 2, "G"), d.int(1, 16, "H/G")
        B, M, N, T = 1, d.int(1, 200, "M"), d.int(1, 600, "N"), d.int(1, 16, "T")
    else:
        D, bs, G, hpg = d.pick([4, 8], "D"), d.int(1, 8, "block_size"), d.int(1, 2, "G"), d.int(1, 3, "H/G")
        B, M, N, T = d.int(1, 2, "B"), d.int(1, 6, "M"), d.int(1, 20, "N"), d.int(1, 5, "T")
    q, k, v = d.randn(B, M, G * hpg, D), d.randn(B, N, G, D), d.randn(B, N, G, D)
    idx = d.ints(-2, math.ceil(N / bs) + 3, (B, M, G, T))
    counts = d.ints(-1, T + 2, (B, M, G)) if d.flag("block_counts") else None
    kw = d.scale_kw("scale")

    def call(backend):
        return mate.nsa_selection_attention(q, k, v, idx, block_size=bs, block_counts=counts, **kw, backend=backend)

    def naive():
        return test_nsa.naive(q, k, v, idx, counts, bs, scale_of(kw, D))

    return call, naive


def gqa(d: Draw):
    H, Hkv = d.pick([(8, 8), (8, 2), (6, 3), (16, 1)] if d.native else [(2, 2), (4, 2), (3, 1)], "H, Hkv")
    D = d.pick([64, 128], "D") if d.native else d.pick([4, 8], "D")
    Sq, Sk = (d.int(1, 400, "Sq"), d.int(0, 400, "Sk")) if d.native else (d.int(1, 7, "Sq"), d.int(0, 9, "Sk"))
    B = d.int(1, 2, "B")
    q, k, v = d.randn(B, Sq, H, D), d.randn(B, Sk, Hkv, D), d.randn(B, Sk, Hkv, D)
    side = st.one_of(st.just(-1), st.integers(0, 300 if d.native else 8))
    window = d.data.draw(st.one_of(st.none(), st.tuples(side, side)), label="sliding_window")
    kw = d.scale_kw("scale")

    def call(backend):
        return mate.gqa_attention(q, k, v, sliding_window=window, return_lse=True, **kw, backend=backend)

    def naive():
        left, right = (-1, -1) if window is None else window
        return test_gqa.naive(q, k, v, left, right, scale_of(kw, D))

    return call, naive


def merge_states(d: Draw):
    splits, rows, heads = d.int(0, 4, "splits"), d.int(1, 40 if d.native else 5, "rows"), d.int(1, 8 if d.native else 3, "heads")
    D = d.pick([64, 128], "D") if d.native else d.int(1, 6, "D")
    po = d.randn(splits, rows, heads, D)
    pl = (torch.randn(splits, rows, heads, generator=d.gen) * 4).masked_fill(
        torch.rand(splits, rows, heads, generator=d.gen) < 0.3, float("-inf")).to(d.device)
    po = po.masked_fill(torch.isinf(pl).unsqueeze(-1), float("nan"))
    gate_kind = d.pick([None, "head", "element"], "gate")
    gate = None if gate_kind is None else d.randn(*((rows, heads) if gate_kind == "head" else (rows, heads, D)))

    def call(backend):
        return mate.merge_attention_states(po, pl, gate=gate, backend=backend)

    def naive():
        return test_qsa_merge.naive_merge(*cpu(po, pl, gate))

    return call, naive


def qsa_attention(d: Draw):
    hq, hkv = d.pick([(8, 1), (16, 1), (24, 2)] if d.native else [(2, 2), (4, 2), (6, 1)], "Hq, Hkv")
    q_form = d.pick(["padded", "cu_seqlens", "token_to_req"], "query layout")
    kv_forms = ["padded", "paged"] if d.native else ["padded", "paged", "varlen"]
    kv_form = "paged" if d.native and q_form != "padded" else d.pick(kv_forms, "kv layout")
    reqs = inputs.qsa_requests(d.gen, n_req=d.int(1, 3, "requests"), hq=hq, hkv=hkv, d=256 if d.native else 8,
                                  width=d.int(1, 19, "width"), dtype=torch.float32)
    qt, qkw, _ = inputs.qsa_query_layout(reqs, q_form, d.gen)
    key, value, kvkw = inputs.qsa_kv_layout(reqs, kv_form, d.gen, page_size=d.pick([1, 4, 16], "page_size"))
    kw = dict(token_indices=qt["token_indices"], **qkw, **kvkw)
    if q_form == "padded" or d.flag("seq_lens_q"):
        kw["seq_lens_q"] = torch.tensor([r["rows"] for r in reqs], dtype=I32)
    if d.flag("seq_lens_k"):
        kw["seq_lens_k"] = torch.tensor([r["seq_k"] for r in reqs], dtype=I32)
    if d.flag("query_positions"):
        kw["query_positions"] = qt["query_positions"]
    kw.update(d.scale_kw("scale", "softmax_scale"))
    dev = {n: x.to(d.device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    query, key_d, value_d = (x.to(d.device, d.dtype) for x in (qt["query"], key, value))

    def call(backend):
        return mate.qsa_sparse_attention(query, key_d, value_d, **dev, return_lse=True, backend=backend)

    def naive():
        return qsa_tests.naive_attention(qt["query"], key, value, **kw)

    return call, naive


DRAWS = {
    "qsa_indexer_mqa_score": mqa_score,
    "qsa_mqa_prefill": mqa_prefill,
    "qsa_mqa_decode": mqa_decode,
    "nsa_selection_attention": nsa_selection,
    "gqa_attention": gqa,
    "merge_attention_states": merge_states,
    "qsa_sparse_attention": qsa_attention,
}


@pytest.mark.parametrize("entry", DRAWS)
@CPU
@given(data=st.data())
def test_reference_matches_naive_oracle(entry, data):
    call, naive = DRAWS[entry](Draw(data, native=False, device="cpu"))
    assert_matches(call("reference"), naive(), tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", DRAWS)
@GPU
@given(data=st.data())
def test_native_matches_reference(entry, data):
    call, _ = DRAWS[entry](Draw(data, native=True, device="cuda"))
    poison_allocator("cuda")
    try:
        got = call("tilelang")
    except ValueError as e:
        if NOT_YET.search(str(e)):
            pytest.skip(str(e))
        raise
    torch.cuda.synchronize()
    assert_matches(got, call("reference"), tol=1e-2 if entry not in ("qsa_indexer_mqa_score", "qsa_mqa_prefill", "qsa_mqa_decode") else 1e-4)


# ---------------------------------------------------------------- argument checks


def valid_calls(device):
    """Per entrypoint: a valid native-shaped call as keywords, and which arguments are metadata, buffers,
    layout-checked (native vector loads) and invalid values of its scalar options."""
    g = torch.Generator().manual_seed(0)

    def bf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def i32(*shape, hi=2):
        return torch.randint(0, hi, shape, generator=g, dtype=I32).to(device)

    scale_bad = [("x", TypeError), (-1.0, ValueError), (0.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError)]
    backend_bad = [(1, TypeError), ("cuda", ValueError)]
    return {
        "qsa_indexer_mqa_score": dict(
            fn=mate.qsa_indexer_mqa_score,
            kw=dict(q_idx=bf(2, 5, 4, 128), block_keys=bf(2, 9, 128), query_positions=i32(2, 5, hi=30), seq_lens_q=i32(2, hi=5)),
            meta=["query_positions", "seq_lens_q"], buffers=[], layout=["q_idx", "block_keys"],
            scalars=dict(scale=scale_bad, block_size=[(0, ValueError), (2.0, TypeError)], backend=backend_bad)),
        "qsa_mqa_prefill": dict(
            fn=mate.qsa_mqa_prefill,
            kw=dict(q=bf(6, 4, 128), k=bf(9, 128), row_starts=i32(6), row_ends=i32(6, hi=9)),
            meta=["row_starts", "row_ends"], buffers=[], layout=["q", "k"],
            scalars=dict(score_scale=scale_bad, backend=backend_bad)),
        "qsa_mqa_decode": dict(
            fn=mate.qsa_mqa_decode,
            kw=dict(q=bf(3, 4, 128), k_cache=bf(5, 16, 128), page_table=i32(3, 2, hi=5), context_lens=i32(3, hi=32), max_model_len=32),
            meta=["page_table", "context_lens"], buffers=[], layout=["k_cache"],
            scalars=dict(max_model_len=[(0, ValueError), ("32", TypeError), (3.5, TypeError)], scale=scale_bad, backend=backend_bad)),
        "nsa_selection_attention": dict(
            fn=mate.nsa_selection_attention,
            kw=dict(q=bf(1, 4, 2, 64), k=bf(1, 40, 1, 64), v=bf(1, 40, 1, 64), block_indices=i32(1, 4, 1, 3), block_counts=i32(1, 4, 1, hi=4),
                    block_size=32, out=bf(1, 4, 2, 64), lse=bf(1, 2, 4, dtype=torch.float32)),
            meta=["block_indices", "block_counts"], buffers=["out", "lse"], layout=["q", "k", "v", "out"],
            scalars=dict(scale=scale_bad, block_size=[(0, ValueError), (True, TypeError)], backend=backend_bad)),
        "gqa_attention": dict(
            fn=mate.gqa_attention,
            kw=dict(q=bf(1, 5, 2, 64), k=bf(1, 7, 1, 64), v=bf(1, 7, 1, 64), out=bf(1, 5, 2, 64), sliding_window=(3, 0)),
            meta=[], buffers=["out"], layout=["q", "k", "v", "out"],
            scalars=dict(scale=scale_bad, sliding_window=[((-2, 0), ValueError), ((1, 2, 3), ValueError), ("full", TypeError), ((1.0, 0), TypeError)],
                         return_lse=[(1, TypeError)], backend=backend_bad)),
        "merge_attention_states": dict(
            fn=mate.merge_attention_states,
            kw=dict(partial_out=bf(2, 3, 2, 64), partial_lse=bf(2, 3, 2, dtype=torch.float32), gate=bf(3, 2),
                    out=bf(3, 2, 64), lse=bf(3, 2, dtype=torch.float32)),
            meta=[], buffers=["out", "lse", "gate"], layout=[],
            scalars=dict(out_dtype=[("bf16", TypeError), (torch.int32, ValueError)], backend=backend_bad)),
        "qsa_sparse_attention": dict(
            fn=mate.qsa_sparse_attention,
            kw=dict(query=bf(1, 3, 2, 256), key=bf(1, 6, 1, 256), value=bf(1, 6, 1, 256), token_indices=i32(1, 3, 4, hi=6),
                    seq_lens_q=i32(1, hi=3), out=bf(1, 3, 2, 256)),
            meta=["token_indices", "seq_lens_q"], buffers=["out"], layout=[],
            scalars=dict(scale=scale_bad, num_splits=[(0, ValueError), (1.5, TypeError)], return_lse=[("yes", TypeError)],
                         k_scale=[(2.0, ValueError)], compute_dtype=[(torch.float32, ValueError), ("bf16", TypeError)], backend=backend_bad)),
    }


def mutate(data, spec, native):
    """One invalid change of a valid call: (kwargs, the argument the error must name)."""
    kw = dict(spec["kw"])
    tensors = [n for n, x in kw.items() if isinstance(x, torch.Tensor)]
    kinds = ["not a tensor", "dtype", "extra axis", "scalar"]
    if spec["meta"] or spec["buffers"]:
        kinds.append("metadata shape")
    if "out" in kw:
        kinds.append("overlapping out")
    if native and spec["layout"]:
        kinds += ["feature stride", "misaligned"]
    kind = data.draw(st.sampled_from(kinds), label="mutation")
    if kind == "scalar":
        name = data.draw(st.sampled_from(sorted(spec["scalars"])), label="option")
        kw[name], _ = data.draw(st.sampled_from(spec["scalars"][name]), label="value")
        return kw, name
    pool = {"metadata shape": spec["meta"] + spec["buffers"], "feature stride": spec["layout"], "misaligned": spec["layout"],
            "overlapping out": ["out"]}.get(kind, tensors)
    name = data.draw(st.sampled_from(pool), label="argument")
    x = kw[name]
    if kind == "not a tensor":
        kw[name] = x.tolist()
    elif kind == "dtype":
        kw[name] = x.to(torch.int64 if x.dtype == I32 else I32)
    elif kind == "extra axis":
        kw[name] = x.unsqueeze(-1).expand(*x.shape, 3)
    elif kind == "metadata shape":
        kw[name] = x[:-1]
    elif kind == "overlapping out":
        first = next(n for n in tensors if n != "out")
        kw["out"] = kw[first].flatten()[: x.numel()].view(x.shape) if kw[first].dtype == x.dtype and kw[first].numel() >= x.numel() else kw[first]
    elif kind == "feature stride":
        kw[name] = torch.cat([x, x], -1)[..., ::2]
    elif kind == "misaligned":
        kw[name] = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape).copy_(x)
    return kw, name


def check_rejected(entry, data, device, backend):
    spec = valid_calls(device)[entry]
    kw, name = mutate(data, spec, native=backend == "tilelang")
    kw.setdefault("backend", backend)
    with pytest.raises((TypeError, ValueError)) as err:
        spec["fn"](**kw)
    assert name in str(err.value), f"the error does not name {name}: {err.value}"


@pytest.mark.parametrize("entry", DRAWS)
@CPU
@given(data=st.data())
def test_invalid_arguments_raise(entry, data):
    check_rejected(entry, data, "cpu", "reference")


def test_valid_calls_are_valid():
    """The calls test_invalid_arguments_raise breaks run as they are."""
    for spec in valid_calls("cpu").values():
        spec["fn"](**spec["kw"], backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["qsa_indexer_mqa_score", "qsa_mqa_prefill", "qsa_mqa_decode", "nsa_selection_attention", "gqa_attention",
                                   "merge_attention_states", "qsa_sparse_attention"])
@GPU
@given(data=st.data())
def test_native_rejects_invalid_arguments_before_any_kernel(entry, data):
    """Natively too (layout rules included); nothing reaches the GPU: no CUDA error and no buffer written."""
    spec = valid_calls("cuda")[entry]
    for name in spec["buffers"]:
        spec["kw"][name].fill_(float("nan"))
    spec["fn"](**{n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in spec["kw"].items()})  # valid as is
    kw, name = mutate(data, spec, native=True)
    with pytest.raises((TypeError, ValueError)) as err:
        spec["fn"](**kw)
    assert name in str(err.value), f"the error does not name {name}: {err.value}"
    torch.cuda.synchronize()
    for b in spec["buffers"]:
        if isinstance(kw.get(b), torch.Tensor) and kw[b] is spec["kw"][b]:
            assert torch.isnan(kw[b]).all(), f"{b} was written"
