"""Shared fixtures: every test starts and ends with an empty cost registry and a fixed seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import storch

# the runnable examples (examples/*.py) are imported by the tests that check them
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture(autouse=True)
def clean_storch_registry():
    storch.reset()
    torch.manual_seed(0)
    yield
    storch.reset()
