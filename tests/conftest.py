"""Shared fixtures: every test starts and ends with an empty cost registry and a fixed seed.

The seed is 0 unless the module (or test) is marked ``pytest.mark.seed(n)``, e.g. a module-level
``pytestmark = pytest.mark.seed(2024)``.
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "seed(n): the torch seed each test starts from (default 0)")


@pytest.fixture(autouse=True)
def clean_storch_registry(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("seed")
    storch.reset()
    torch.manual_seed(marker.args[0] if marker is not None else 0)
    yield
    storch.reset()
