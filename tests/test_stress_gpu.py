"""Back-to-back launches of every configured kernel finish (run with `pytest -m gpu`).

A pipeline can be correct and still deadlock now and then: NSA's one-stage
ring, under TileLang's automatic producer, passed every check once and hung
within 100 to 300 launches on the H200
(benchmarks/results/NVIDIA_H200-2026-11-30-nsa-hang.md). So each stage runs, in a
child process with a time limit, every specialization key of the shipped
config on its tuning workload (the `quick` preset's shape) LAUNCHES times back
to back. A hung kernel cannot be interrupted from Python; the child is killed
and the test names the key it was on.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from mate import _dispatch
from tuning.stages import TUNABLES

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
LAUNCHES = 1000
LIMIT_S = 300  # NSA's keys, the slowest: 8 x 1000 x 1.6 ms, plus start-up and workloads

CHILD = """
import sys, torch
from mate import _dispatch
from tuning.stages import TUNABLES
stage, launches = sys.argv[1], int(sys.argv[2])
tunable = TUNABLES[stage]
for key in _dispatch.load_config("sm90")[stage]:
    native = tunable.workload(_dispatch.parse_key(key), tunable.shapes["quick"][0])[0]
    print("started", key, flush=True)
    for i in range(launches):
        native()
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print("finished", key, flush=True)
"""


def _lines(text, word):
    return [line.split(" ", 1)[1] for line in (text or "").splitlines() if line.startswith(word + " ")]


@pytest.mark.parametrize("stage", sorted(TUNABLES))
def test_back_to_back_launches_finish(stage):
    keys = list(_dispatch.load_config("sm90")[stage])
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, stage, str(LAUNCHES)], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
        started = _lines(out, "started")
        pytest.fail(f"{stage}: not finished within {LIMIT_S} s; {len(_lines(out, 'finished'))} of {len(keys)} keys done, "
                    f"the last one started: {started[-1] if started else 'none'} (a hung kernel?)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc.stdout, "finished") == keys
