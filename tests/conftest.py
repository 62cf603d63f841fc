"""Shared fixtures: every test starts and ends with an empty cost registry and a fixed seed."""

from __future__ import annotations

import pytest
import torch

import storch


@pytest.fixture(autouse=True)
def clean_storch_registry():
    storch.reset()
    torch.manual_seed(0)
    yield
    storch.reset()
