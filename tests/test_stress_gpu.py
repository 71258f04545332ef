"""Back-to-back launches finish (run with `pytest -m gpu`).

A pipeline can be correct and still deadlock now and then: NSA's one-stage
ring, under TileLang's automatic producer, passed every check once and hung
within 100 to 300 launches on the H200
(benchmarks/results/NVIDIA_H200-2026-11-30-nsa-hang.md). So each stage runs, in a
child process with a time limit, every specialization key of the shipped
config on its tuning workload (the `quick` preset's shape) LAUNCHES times back
to back. GQA and the MQA logits kernel still use that automatic producer, and
their tuning spaces hold one-stage rings, where a lagging producer warp needs
the least lag to hang; those rings run too. A hung kernel cannot be
interrupted from Python; the child is killed and the test names the case it
was on.
"""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mate import _dispatch
from mate._hopper import FP8_KV
from mate.tuning.stages import TUNABLES

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
LAUNCHES = 1000
LIMIT_S = 300  # NSA's keys, the slowest: 8 x 1000 x 1.6 ms, plus start-up and workloads

# One-stage variants of shipped tiles, for the stages whose producer TileLang generates.
ONE_STAGE = {
    "gqa_fwd": [
        ("dtype=bfloat16,dim=128,window=causal", dict(block_m=128, block_n=128, threads=256, num_stages=1, mma_depth=2)),
        ("dtype=bfloat16,dim=64,window=causal", dict(block_m=192, block_n=128, threads=384, num_stages=1, mma_depth=2)),
        ("dtype=bfloat16,dim=128,window=local", dict(block_m=128, block_n=128, threads=256, num_stages=1, mma_depth=2)),
    ],
    "mqa_logits": [
        ("dtype=bfloat16,even_keys=1", dict(block_rows=64, block_keys=128, threads=128, num_stages=1, min_blocks=1)),
        ("dtype=bfloat16,even_keys=0", dict(block_rows=64, block_keys=64, threads=128, num_stages=1, min_blocks=1)),
        ("dtype=bfloat16,even_keys=1", dict(block_rows=128, block_keys=128, threads=256, num_stages=1, min_blocks=1)),
    ],
}

# Every child starts with HAMMER: hammer(name, call) runs one case LAUNCHES times back to back (the last
# command-line argument), between the `started NAME` and `finished NAME` lines that _finish reads.
HAMMER = """
import sys, torch
sys.path.insert(0, "benchmarks")  # the children run from the repository's root; common.py's serving inputs
launches = int(sys.argv[-1])
def hammer(name, call):
    print("started", name, flush=True)
    for i in range(launches):
        call()
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print("finished", name, flush=True)
"""

CHILD = HAMMER + """
import contextlib, json
from mate import _dispatch
from mate.tuning.measure import using_tiles
from mate.tuning.stages import TUNABLES
stage, cases = sys.argv[1], json.loads(sys.argv[2])
tunable = TUNABLES[stage]
for key, tiles in cases:
    with using_tiles("sm90", stage, key, tiles) if tiles else contextlib.nullcontext():
        native = tunable.workload(_dispatch.parse_key(key), tunable.shapes["quick"][0])[0]
        hammer(f"{key} {tiles or 'shipped'}", native)
"""


def _lines(text, word):
    return [line.split(" ", 1)[1] for line in (text or "").splitlines() if line.startswith(word + " ")]


def _finish(child_args, n_cases, what, cwd=ROOT, limit_s=LIMIT_S):
    """Run a child script (it prints `started NAME` / `finished NAME` per case) and require all n_cases to finish in time."""
    try:
        proc = subprocess.run([sys.executable, "-c", *child_args], cwd=cwd, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
        started = _lines(out, "started")
        pytest.fail(f"{what}: not finished within {limit_s} s; {len(_lines(out, 'finished'))} of {n_cases} cases done, "
                    f"the last one started: {started[-1] if started else 'none'} (a hung kernel?)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_lines(proc.stdout, "finished")) == n_cases


def _run(stage, cases):
    _finish([CHILD, stage, json.dumps(cases), str(LAUNCHES)], len(cases), stage)


# The NSA backward's two stages run together, through autograd, at a smaller shape below: their tuning
# workloads (the quick preset, H 128 over 8192 tokens) would take minutes of GPU for the same question.
BACKWARD = ("nsa_selection_bwd_dq", "nsa_selection_bwd_dkv")


@pytest.mark.parametrize("stage", sorted(set(TUNABLES) - set(BACKWARD)))
def test_shipped_configs_finish_back_to_back_launches(stage):
    _run(stage, [(key, None) for key in _dispatch.load_config("sm90")[stage]])


@pytest.mark.parametrize("stage", sorted(ONE_STAGE))
def test_one_stage_rings_of_generated_producers_finish(stage):
    assert all(tiles["num_stages"] == 1 and set(tiles) == set(_dispatch.STAGES[stage].params) for _, tiles in ONE_STAGE[stage])
    _run(stage, ONE_STAGE[stage])


# gqa_attention's children (issue 17).
GQA_PRELUDE = HAMMER + """
import mate
"""

# The option variants (varlen, sinks, softcap), which take the tiles of their window class's entry: all
# three options on, for each head dim, on a packed batch of odd lengths.
OPTIONS_CHILD = GQA_PRELUDE + """
lens_q, lens_k = [1000, 333, 1, 1500], [1000, 700, 2000, 1500]
for dim, window in [(128, (-1, 0)), (64, (1024, 0))]:
    q = torch.randn(sum(lens_q), 16, dim, device="cuda").bfloat16()
    k = torch.randn(sum(lens_k), 2, dim, device="cuda").bfloat16()
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              sliding_window=window, sinks=torch.randn(16, device="cuda"), softcap=30.0, out=torch.empty_like(q))
    hammer(f"gqa options d{dim} {window}", lambda: mate.gqa_attention(q, k, k, **kw))
"""


# QSA's split decode (issue 16) at the serving shapes' default split counts (rows 1: a cluster launch of 11
# splits, rows 8: of 6), then every cluster size (rows 1, c tiles in c splits: a cluster launch where the GPU
# holds two clusters of c whole-SM CTAs, as the H200 does up to 16) and the two launches (attention,
# then merge: 17 splits of 2 tiles); the result must not change over the launches.
QSA_DECODE_CHILD = HAMMER + """
import mate
from common import qsa_serving_problem
gen = torch.Generator().manual_seed(0)
cases = [(f"rows {b}", qsa_serving_problem(gen, b, 1)[0], None) for b in (1, 8)]
one = qsa_serving_problem(gen, 1, 1)[0]
cases += [(f"rows 1, {c} tiles in {c} splits", dict(one, token_indices=one["token_indices"][:, :64 * c]), c) for c in range(2, 17)]
cases += [("rows 1, two launches of 17 splits", one, 17)]
for name, p, splits in cases:
    first = mate.qsa_sparse_attention(**p, num_splits=splits)
    hammer(f"qsa split decode {name}", lambda: mate.qsa_sparse_attention(**p, num_splits=splits))
    assert torch.equal(mate.qsa_sparse_attention(**p, num_splits=splits), first), f"{name}: the result changed over the launches"
"""


def test_qsa_split_decode_finishes_back_to_back_launches():
    _finish([QSA_DECODE_CHILD, str(LAUNCHES)], 18, "qsa split decode")


# QSA sparse attention on FP8 caches (issue 38), the small-CTA program's kv_dtype variants: both kinds, decode rows
# 1 (many splits) and 64 (a few), prefill (one split), tensor scales, each ring depth of the space; the result must
# not change over the launches.
QSA_FP8_CHILD = HAMMER + """
import json, mate
from mate.tuning.measure import using_tiles
from common import qsa_serving_problem
gen = torch.Generator().manual_seed(0)
problems = [(f"rows {b} x {r}", qsa_serving_problem(gen, b, r)[0]) for b, r in ((1, 1), (64, 1), (1, 256))]
ks, vs = torch.tensor([0.02], device="cuda"), torch.tensor([0.03], device="cuda")
for stages in json.loads(sys.argv[1]):
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name, p in problems:
            p8 = dict(p, key=(p["key"] / 0.02).to(kv), value=(p["value"] / 0.03).to(kv), k_scale=ks, v_scale=vs)
            tiles = dict(block_n=16, num_stages=stages)
            with using_tiles("sm90", "qsa_attention_warp", "dtype=bfloat16,split=0", tiles):
                with using_tiles("sm90", "qsa_attention_warp", "dtype=bfloat16,split=1", tiles):  # patches the first's
                    call = lambda: mate.qsa_sparse_attention(**p8)
                    first = call()
                    hammer(f"qsa fp8 {kv} {name} stages {stages}", call)
                    assert torch.equal(call(), first), f"{kv} {name}: the result changed over the launches"
"""


def qsa_fp8_rings() -> list:
    """(key, tiles) of the FP8 child's kernels: both BF16 split keys at each ring depth, both FP8 kinds."""
    card = _dispatch.STAGES["qsa_attention_warp"]
    return [(f"dtype=bfloat16,split={split}", dict(block_n=16, num_stages=s, kv_dtype=kv))
            for split in (0, 1) for s in card.space["num_stages"] for kv in FP8_KV]


def test_qsa_fp8_finishes_back_to_back_launches():
    stages = list(_dispatch.STAGES["qsa_attention_warp"].space["num_stages"])
    _finish([QSA_FP8_CHILD, json.dumps(stages), str(LAUNCHES)], 6 * len(stages), "qsa fp8")


def test_gqa_option_variants_finish_back_to_back_launches():
    _finish([OPTIONS_CHILD, str(LAUNCHES)], 2, "gqa options")


# The MQA indexer's FP8 decode (issue 38), a compile-time variant of every mqa_decode entry: each key of the shipped
# config with both FP8 kinds, on the card's quick shape, a tensor k_scale (the scale read on the GPU); the result
# must not change over the launches.
MQA_FP8_CHILD = HAMMER + """
import json, mate
from mate import _dispatch
from mate.qsa.kernels.mqa_card import FP8_KV
shape = _dispatch.STAGES["mqa_decode"].shapes["quick"][0]
batch, keys = shape["batch"], shape["keys"]
for key in json.loads(sys.argv[1]):
    spec = _dispatch.parse_key(key)
    ps, pages = spec["page_size"], batch * keys // spec["page_size"]
    q = torch.randn(batch, 4, 128, device="cuda").to(getattr(torch, spec["dtype"]))
    table = torch.randperm(pages, device="cuda").int().view(batch, -1)
    ctx = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    ks = torch.tensor(0.05, device="cuda")
    for kv in FP8_KV:
        cache = (torch.randn(pages, ps, 1, 128, device="cuda") * 20).to(getattr(torch, kv))
        call = lambda: mate.qsa_mqa_decode(q, cache, table, ctx, keys, k_scale=ks)
        first = call()
        hammer(f"mqa fp8 decode {key} {kv}", call)
        assert torch.equal(call(), first), f"{key} {kv}: the result changed over the launches"
"""


def mqa_fp8_keys() -> list:
    return list(_dispatch.load_config("sm90")["mqa_decode"])


def test_mqa_fp8_decode_finishes_back_to_back_launches():
    keys = mqa_fp8_keys()
    _finish([MQA_FP8_CHILD, json.dumps(keys), str(LAUNCHES)], 2 * len(keys), "mqa fp8 decode")


# The NSA backward kernels (BACKWARD): forward + backward of (key, tiles) cases, LAUNCHES times back to back
# each (each backward launches the dq and the dk/dv kernel), on 2048 tokens, H 16 / G 2, T 16.
BACKWARD_CHILD = HAMMER + """
import contextlib, json, mate
from mate import _dispatch
from mate.tuning.measure import using_tiles
from test_nsa_gpu import draw_indices
for key, stage, tiles in json.loads(sys.argv[1]):
    spec = _dispatch.parse_key(key)
    dt, D, bs = getattr(torch, spec["dtype"]), spec["dim"], spec["block_size"]
    q, k, v = (torch.randn(1, 2048, n, D, device="cuda").to(dt).requires_grad_() for n in (16, 2, 2))
    idx = draw_indices(1, 2048, 2, 16, 2048, bs)
    do = torch.randn(q.shape, device="cuda").to(dt)
    with using_tiles("sm90", stage, key, tiles) if tiles else contextlib.nullcontext():
        o, _ = mate.nsa_selection_attention(q, k, v, idx, block_size=bs)
        hammer(f"{key} {stage} {tiles or 'shipped'}", lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
"""


def _run_backward(cases, what, limit_s=LIMIT_S):
    _finish([BACKWARD_CHILD, json.dumps(cases), str(LAUNCHES)], len(cases), what, cwd=ROOT / "tests", limit_s=limit_s)


def test_nsa_backward_finishes_back_to_back_launches():
    """Every key of the shipped config."""
    _run_backward([(key, None, None) for key in _dispatch.load_config("sm90")["nsa_selection_bwd_dq"]], "NSA backward")


BACKWARD_KEY = "dtype=bfloat16,dim=128,block_size=64"  # the seed's specialization


def ring_variants() -> list:
    """(stage, tiles): each distinct program (all tiles but min_blocks) of the backward's spaces that fits at the
    seed's specialization, with the largest min_blocks that fits."""
    spec = _dispatch.parse_key(BACKWARD_KEY)
    out = []
    for stage in BACKWARD:
        card = _dispatch.STAGES[stage]
        best = {}
        for values in itertools.product(*card.space.values()):
            tiles = dict(zip(card.space, values))
            if card.limits(spec, tiles) is None:
                shape = tuple(v for p, v in tiles.items() if p != "min_blocks")
                if tiles["min_blocks"] >= best.get(shape, {}).get("min_blocks", 0):
                    best[shape] = tiles
        out += [(stage, t) for t in best.values()]
    return out


def test_every_backward_ring_depth_finishes_back_to_back_launches():
    """Every ring depth (and, for dk/dv, entries a step) of the two backward kernels' search spaces at the seed's
    specialization, each at the most CTAs per SM its card allows."""
    _run_backward([(BACKWARD_KEY, stage, tiles) for stage, tiles in ring_variants()], "NSA backward ring depths", limit_s=240)


# gqa_attention's split-KV kernel (issue 17: paged caches, decode) and its merge: paged decode and a paged
# prefill of odd lengths, and a padded decode step (k as one page per sequence), LAUNCHES times each.
PAGED_CHILD = GQA_PRELUDE + """
B, H, Hkv, ctx = 32, 32, 4, 4096
for dim, ps, window, sq in [(128, 16, None, 1), (64, 64, (4096, 0), 8), (128, 32, (-1, 0), 100), (128, 0, (1000, 0), 1)]:
    lens = torch.randint(1, ctx + 1, (B,), dtype=torch.int32, device="cuda")
    q = torch.randn(B, sq, H, dim, device="cuda").bfloat16()
    if ps:
        k = torch.randn(B * ctx // ps, ps, Hkv, dim, device="cuda").bfloat16()
        kw = dict(block_table=torch.randperm(B * ctx // ps, device="cuda").int().view(B, -1), seq_lens_k=lens)
    else:
        k, kw = torch.randn(B, ctx, Hkv, dim, device="cuda").bfloat16(), {}
    kw.update(sliding_window=window, sinks=torch.randn(H, device="cuda"), out=torch.empty_like(q))
    hammer(f"gqa split-KV d{dim} page {ps} {window} rows {sq}", lambda: mate.gqa_attention(q, k, k, **kw))
"""


def test_gqa_split_kv_finishes_back_to_back_launches():
    _finish([PAGED_CHILD, str(LAUNCHES)], 4, "gqa split-KV")


# The split-KV kernel's ring depths at D 128 (its copies and the ids a tile ahead are hand-synchronized):
# the tiles benchmarks/experiments/gqa_ab.py --decode timed (64 x 2 ships), on the card's quick workload (dense causal).
DECODE_RINGS = [(128, 3), (64, 2), (32, 3), (32, 4)]


DECODE_RING_KEY = "dtype=bfloat16,dim=128,window=causal"


def decode_rings() -> list:
    return [(DECODE_RING_KEY, dict(block_m=64, block_n=n, threads=128, num_stages=s)) for n, s in DECODE_RINGS]


def test_gqa_split_kv_ring_depths_finish_back_to_back_launches():
    _run("gqa_decode", decode_rings())


# gqa_attention on FP8 K/V (issue 38), the split-KV kernel's kv_dtype variants at each ring depth of DECODE_RINGS,
# both kinds: paged decode (page 16: cp.async and 16-row TMA boxes; tensor scales) and a varlen prefill (the keys
# as one page from cu_seqlens_k, whole-tile TMA boxes); the result must not change over the launches.
GQA_FP8_CHILD = GQA_PRELUDE + """
import json
from mate.tuning.measure import using_tiles
B, H, Hkv, ctx, D = 32, 32, 4, 4096, 128
lens = torch.randint(1, ctx + 1, (B,), dtype=torch.int32, device="cuda")
table = torch.randperm(B * ctx // 16, device="cuda").int().view(B, -1)
kp, vp = (torch.randn(B * ctx // 16, 16, Hkv, D, device="cuda") for _ in range(2))
q1 = torch.randn(B, 1, H, D, device="cuda").bfloat16()
lens_q = [700, 1, 1200, 333]
cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
qv = torch.randn(sum(lens_q), H, D, device="cuda").bfloat16()
kv_, vv = (torch.randn(sum(lens_q) + 64, Hkv, D, device="cuda") for _ in range(2))
ks, vs = torch.tensor([0.02], device="cuda"), torch.tensor([0.03], device="cuda")
caches = {kv: [(x / s).to(kv) for x, s in ((kp, 0.02), (vp, 0.03), (kv_, 0.02), (vv, 0.03))]
          for kv in (torch.float8_e4m3fn, torch.float8_e5m2)}  # quantized once, not per ring depth
for block_n, stages in json.loads(sys.argv[1]):
    for kv, (kp8, vp8, kv8, vv8) in caches.items():
        tiles = dict(block_m=64, block_n=block_n, threads=128, num_stages=stages)
        calls = [("local", "paged decode", lambda: mate.gqa_attention(q1, kp8, vp8, block_table=table, seq_lens_k=lens,
                                                                      sliding_window=(2000, 0), k_scale=ks, v_scale=vs)),
                 ("causal", "varlen prefill", lambda: mate.gqa_attention(qv, kv8, vv8, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                         max_seqlen_q=1200, max_seqlen_k=1200,
                                                                         sliding_window=(-1, 0), k_scale=0.02, v_scale=0.03))]
        for window, name, call in calls:
            with using_tiles("sm90", "gqa_decode", f"dtype=bfloat16,dim=128,window={window}", tiles):
                first = call()
                hammer(f"gqa fp8 {kv} {name} block_n {block_n} stages {stages}", call)
                assert torch.equal(call(), first), f"{kv} {name}: the result changed over the launches"
"""


def gqa_fp8_rings() -> list:
    """(key, tiles) of the GQA FP8 child's kernels."""
    return [(f"dtype=bfloat16,dim=128,window={w}", dict(block_m=64, block_n=n, threads=128, num_stages=s, kv_dtype=kv))
            for w in ("local", "causal") for n, s in DECODE_RINGS for kv in FP8_KV]


def test_gqa_fp8_finishes_back_to_back_launches():
    _finish([GQA_FP8_CHILD, json.dumps(DECODE_RINGS), str(LAUNCHES)], 4 * len(DECODE_RINGS), "gqa fp8")


# QSA's split kernel (hand-synchronized: K and V each on a full / empty mbarrier pair a stage) at the ring
# depths of its space that the config does not ship (it ships 3 for the narrow key, 1 for the wide one), on
# the card's quick workload of each key.
def qsa_split_rings() -> list:
    out = []
    for key in ("dtype=bfloat16,split=1,wide=0", "dtype=bfloat16,split=1,wide=1"):
        shipped = _dispatch.tiles("qsa_attention", _dispatch.parse_key(key), "sm90")
        out += [(key, dict(shipped, num_stages=s))
                for s in _dispatch.STAGES["qsa_attention"].space["num_stages"] if s != shipped["num_stages"]]
    return out


def test_qsa_split_kernel_ring_depths_finish_back_to_back_launches():
    _run("qsa_attention", qsa_split_rings())


# QSA's small-CTA program (cp.async commit groups by hand, a ring of num_stages tiles, token lists a chunk ahead) at
# every ring depth and tile of its space that the config does not ship, both split keys.
def qsa_warp_rings() -> list:
    card = _dispatch.STAGES["qsa_attention_warp"]
    out = []
    for key in ("dtype=bfloat16,split=0", "dtype=bfloat16,split=1"):
        spec = _dispatch.parse_key(key)
        shipped = _dispatch.tiles(card.name, spec, "sm90")
        out += [(key, tiles) for tiles in (dict(zip(card.space, v)) for v in itertools.product(*card.space.values()))
                if tiles != shipped and not card.limits(spec, tiles)]
    return out


def test_qsa_warp_kernel_ring_depths_finish_back_to_back_launches():
    _run("qsa_attention_warp", qsa_warp_rings())


def variant_kernels() -> list:
    """(stage, key, tiles) of every kernel outside the config these tests launch: compiled at first use, one
    after another in a test's process, they took the stress tests past a 360 s suite limit on the H200
    (2026-12-01), so scripts/gpu-suite.sh compiles them in parallel first (`python tests/test_stress_gpu.py`)."""
    return ([(stage, key, tiles) for stage, cases in ONE_STAGE.items() for key, tiles in cases]
            + [(stage, BACKWARD_KEY, tiles) for stage, tiles in ring_variants()]
            + [("gqa_decode", key, tiles) for key, tiles in decode_rings()]
            + [("qsa_attention", key, tiles) for key, tiles in qsa_split_rings()]
            + [("qsa_attention_warp", key, tiles) for key, tiles in qsa_warp_rings()]
            + [("qsa_attention_warp", key, tiles) for key, tiles in qsa_fp8_rings()]
            + [("gqa_decode", key, tiles) for key, tiles in gqa_fp8_rings()]
            + [("mqa_decode", key, {**_dispatch.tiles("mqa_decode", _dispatch.parse_key(key), "sm90"), **v})
               for key in mqa_fp8_keys() for v in _dispatch.STAGES["mqa_decode"].variants(_dispatch.parse_key(key))])


if __name__ == "__main__":
    from overrides import compile_kernels

    jobs = [(stage, key, tiles, True) for stage, key, tiles in variant_kernels()]
    failed = [job for job, (_, error) in compile_kernels(jobs, int(sys.argv[1]) if len(sys.argv) > 1 else 16) if error]
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} stress-test kernels outside the config", *failed, sep="\n")
    sys.exit(1 if failed else 0)
