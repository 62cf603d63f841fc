"""Shared fixtures: every test starts and ends with an empty cost registry and a fixed seed.

The seed is 0 unless the module (or test) is marked ``pytest.mark.seed(n)``, e.g. a module-level
``pytestmark = pytest.mark.seed(2024)``.

The environment variable ``STORCH_TEST_SEED`` (an integer, default 0) is added to every test's
seed, marked or not, so that the whole suite can be run from other random streams::

    STORCH_TEST_SEED=3 .venv/bin/python -m pytest

``make test-seeds`` (``scripts/test_seeds.py``) runs the suite at offsets 0..9: the statistical
tests must hold at any seed, not only at the default one. A statistical test that seeds itself
(e.g. twice, for common random numbers) uses ``seeding.manual_seed(n)`` (tests/seeding.py), which
adds the offset too; plain ``torch.manual_seed`` is left for deterministic comparisons of two runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import storch

# the runnable examples (examples/*.py) are imported by the tests that check them, and the shared
# test problems (tests/problems.py) by the estimator tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from seeding import OFFSET as SEED_OFFSET  # noqa: E402  (tests/seeding.py, on the path just above)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "seed(n): the torch seed each test starts from (default 0), plus $STORCH_TEST_SEED"
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"STORCH_TEST_SEED={SEED_OFFSET}: every test's seed is offset by {SEED_OFFSET}" if SEED_OFFSET else None


@pytest.fixture(autouse=True)
def clean_storch_registry(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("seed")
    storch.reset()
    torch.manual_seed((marker.args[0] if marker is not None else 0) + SEED_OFFSET)
    yield
    storch.reset()
