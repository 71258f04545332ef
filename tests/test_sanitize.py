"""tests/sanitize.py's driver on the CPU, with a stand-in for compute-sanitizer (the real runs need a Hopper GPU)."""

import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sanitize  # noqa: E402


def fake_sanitizer(tmp_path, body: str) -> str:
    """An executable that prints what a compute-sanitizer run would print, and records its arguments."""
    path = tmp_path / "compute-sanitizer"
    path.write_text(f"#!/bin/sh\n[ \"$1\" = --help ] && exit 0\necho \"$@\" >> {tmp_path / 'calls'}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_one_process_per_case_and_its_verdict(tmp_path):
    ok_memcheck = fake_sanitizer(tmp_path, 'echo "========= ERROR SUMMARY: 0 errors"; exit 0')
    ok, verdict = sanitize.sanitize("memcheck", ok_memcheck, "nsa_selection")
    assert ok and verdict == "memcheck nsa_selection: exit 0, 0 errors, 0 racecheck warnings -> OK"
    call = (tmp_path / "calls").read_text().splitlines()[-1]
    assert "--tool memcheck" in call and call.endswith("--run --cases nsa_selection")

    racy = fake_sanitizer(tmp_path, 'echo "========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)"; exit 99')
    ok, verdict = sanitize.sanitize("racecheck", racy, "gqa_local")
    assert not ok and "3 errors" in verdict and verdict.endswith("FAILED")
    assert (tmp_path / "calls").read_text().splitlines()[-1].endswith("--cases gqa_local --no-check")

    silent = fake_sanitizer(tmp_path, "exit 0")  # a run that died before its summary is no pass
    ok, verdict = sanitize.sanitize("memcheck", silent, "mqa_decode")
    assert not ok and "no summary line" in verdict


def test_a_process_past_its_time_limit_is_killed_and_failed(tmp_path):
    stuck = fake_sanitizer(tmp_path, 'echo "started"; sleep 30; echo "========= ERROR SUMMARY: 0 errors"')
    ok, verdict = sanitize.sanitize("memcheck", stuck, "qsa_paged", timeout=1)
    assert not ok and verdict == "memcheck qsa_paged: did not finish within 1 s -> FAILED"
