"""Run the test suite at several base seeds (``STORCH_TEST_SEED``) and summarise pass/fail per seed.

The statistical tests (unbiasedness at z = 4.5, variance comparisons) must hold from any random
stream, not only from the default seeds; ``tests/conftest.py`` adds ``$STORCH_TEST_SEED`` to every
test's seed. Exits non-zero if any seed has a failing test.

Usage (``make test-seeds`` runs the default, seeds 0..9 over ``tests/``)::

    .venv/bin/python scripts/test_seeds.py                  # seeds 0..9
    .venv/bin/python scripts/test_seeds.py --seeds 2 5      # only these
    .venv/bin/python scripts/test_seeds.py -- tests/test_arm.py -k variance

The docstring examples under ``storch/`` do not depend on the offset, so by default only ``tests/``
is run (the arguments after ``--`` replace it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, pytest_args: list[str]) -> tuple[int, str, list[str], float]:
    env = dict(os.environ, STORCH_TEST_SEED=str(seed))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", *pytest_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    failed = [line.split(" - ")[0] for line in out.splitlines() if re.match(r"^(FAILED|ERROR) ", line)]
    last = [line for line in out.splitlines() if line.strip()]
    return proc.returncode, last[-1] if last else "(no output)", failed, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)), help="base seeds (default 0..9)")
    parser.add_argument("pytest_args", nargs="*", default=["tests"], help="after --: arguments for pytest")
    args = parser.parse_args()

    results = {}
    for seed in args.seeds:
        rc, summary, failed, elapsed = run_seed(seed, args.pytest_args)
        results[seed] = (rc, failed)
        status = "PASS" if rc == 0 else "FAIL"
        print(f"seed {seed}: {status} ({elapsed:.0f} s) {summary}", flush=True)
        for name in failed:
            print(f"    {name}", flush=True)

    bad = [seed for seed, (rc, _) in results.items() if rc != 0]
    print(f"\n{len(results) - len(bad)}/{len(results)} seeds passed" + (f"; failing seeds: {bad}" if bad else ""))
    by_test: dict[str, list[int]] = {}
    for seed, (_, failed) in results.items():
        for name in failed:
            by_test.setdefault(name, []).append(seed)
    for name, seeds in sorted(by_test.items()):
        print(f"  {name}: seeds {seeds}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
