"""Each script in examples/ runs to the end (on the CPU: the reference, checked against the script's naive computation)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "common.py")


def test_every_example_is_listed():
    assert {"quickstart.py", "serving_step.py", "prefill_step.py", "nsa_selection.py", "gqa_sliding_window.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_and_checks_its_result(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if "relative error" in line]
    assert checks and all("(ok," in line for line in checks), proc.stdout
