"""The hostile-input probe (tests/hostile_probe.py) on the CPU: 0 crashes, 0 stray exceptions,
0 silently wrong results over every entrypoint and both backends (the native one must refuse
CPU tensors with a clear ValueError). On a GPU host run `python tests/hostile_probe.py`."""

import hostile_probe


def test_probe_finds_nothing_on_cpu():
    tally = hostile_probe.run("cpu")
    assert tally.counts["crash_or_stray"] == 0 and tally.counts["silently_wrong"] == 0, "\n".join(tally.failures)
    assert tally.counts["ok"] > 50 and tally.counts["clear_error"] > 200
