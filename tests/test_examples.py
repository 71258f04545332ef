"""Each script in examples/ runs to the end (on the CPU: the reference, checked against the script's naive computation)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "common.py")


def test_every_example_is_listed():
    assert {"quickstart.py", "serving_step.py", "prefill_step.py", "nsa_selection.py", "gqa_sliding_window.py",
            "gqa_paged_decode.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_and_checks_its_result(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if "relative error" in line]
    assert checks and all("(ok," in line for line in checks), proc.stdout


def test_readme_tour_runs_on_the_cpu():
    """The README's block of every entrypoint, with its CPU line in place of the GPU one."""
    text = (EXAMPLES.parent / "README.md").read_text()
    block = text.split("<!-- tour -->\n```python\n", 1)[1].split("```", 1)[0]
    gpu, cpu = 'dev, kw = "cuda", {}', 'dev, kw = "cpu", {"backend": "reference"}'
    assert gpu in block and f"# {cpu}" in block
    proc = subprocess.run([sys.executable, "-c", block.replace(gpu, cpu, 1) + "\nprint(o.shape, out.shape, merged.shape)"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["torch.Size([1,", "256,", "16,", "128])", "torch.Size([2,", "1,", "24,", "256])",
                                   "torch.Size([8,", "24,", "256])"]


@pytest.mark.gpu
def test_serving_step_under_torch_compile():
    """The serving step made a CUDA graph by torch.compile(mode="reduce-overhead", fullgraph=True): mate's first native
    calls run inside the compiled step (its warm-up), then it records and replays for the next token."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serving_step.py"), "--compile"], capture_output=True, text=True,
                          timeout=600, env=env)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if "relative error" in line]
    assert 'torch.compile(mode="reduce-overhead")' in proc.stdout and len(checks) == 3 and all("(ok," in c for c in checks), proc.stdout
