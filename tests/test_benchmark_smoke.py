"""The measurement scripts of ``benchmarks/`` that take storch apart (its phases, its pieces, its
dispatched operations) run to their last row at their smallest settings.

They call storch's internal functions (``storch.inference``'s steps, ``storch._dispatch``), so a change
inside storch can break them while every unit test passes; run here, such a change fails CI instead
of a later measurement. Each runs as a user runs it, in a process of its own from the repository root.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script and its smallest settings -> a pattern of the last row it prints
SCRIPTS = {
    ("step_phases.py", "--estimators", "REINFORCE", "ARM", "--blocks", "1"):
        r"sum\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+-?[\d.]+\s+\(storch - floor = -?[\d.]+ of hand\)",
    ("eager_breakdown.py", "--inner", "1", "--pairs", "1"): r"add_cost \+ surrogate, DisARM\s+[\d.]+\s+[\d.]+",
    ("rl_breakdown.py", "--length", "5", "--rounds", "1"): r"of which garbage collection\s+[\d.]+\s+[\d.]+",
    ("dispatch_counts.py",): r"rl-rollout, per decision \(T = \d+\)\s+\d+\s+\d+\s+\d+\s+\d+",
    ("rl_episode.py", "--quick"): r"^\s*\d+\s",
    ("auto_overhead.py", "--blocks", "1", "--steps", "2", "--warmup", "1"): r"auto / fixed: [\d.]+",
}


@pytest.mark.parametrize("command", list(SCRIPTS), ids=lambda c: c[0])
def test_benchmark_runs_to_its_last_row(command):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / command[0]), *command[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    last = run.stdout.strip().splitlines()[-1]
    assert re.search(SCRIPTS[command], last), run.stdout[-2000:]
