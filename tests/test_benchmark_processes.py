"""The benchmarks' ``--processes`` mode (``benchmarks/common.py``'s ``ProcessBench``): each variant in a
process of its own, rounds alternating, the same table as in one process."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rl_rollout  # noqa: E402


def test_rl_rollout_times_each_variant_in_its_own_process(capsys):
    rl_rollout.main(["--processes", "--no-compile", "--lengths", "3", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "each variant in its own process, CPU time" in out
    row = re.search(r"^\s+3\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s*$", out, re.MULTILINE)
    assert row is not None, out
    hand, storch_ms, ratio, floor_ms, floor_ratio, above_floor = (float(v) for v in row.groups())
    assert hand > 0 and storch_ms > 0 and floor_ms > 0 and 0.2 < ratio < 20 and 0.2 < floor_ratio < 20  # timings
    assert abs(above_floor - (ratio - floor_ratio)) <= 0.011  # the two ratios' difference, as printed


def test_rl_rollout_gc_freeze_runs_in_the_processes_only(capsys):
    rl_rollout.main(["--processes", "--gc-freeze", "--no-compile", "--lengths", "3", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "gc.freeze() after warm-up" in out and re.search(r"^\s+3(\s+-?[\d.]+){6}\s*$", out, re.MULTILINE)
    with pytest.raises(SystemExit):  # in one process it would freeze the other variant's objects too
        rl_rollout.main(["--gc-freeze", "--no-compile", "--lengths", "3"])
