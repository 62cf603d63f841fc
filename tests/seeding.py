"""The tests' seeds, offset by ``STORCH_TEST_SEED`` (an integer, default 0).

``tests/conftest.py`` seeds every test with ``OFFSET`` plus its ``pytest.mark.seed`` (default 0). A
test that seeds itself, e.g. twice for common random numbers, calls :func:`manual_seed` instead of
``torch.manual_seed``, so that ``make test-seeds`` (``STORCH_TEST_SEED=0..9``) moves it as well.
"""

from __future__ import annotations

import os

import torch

OFFSET = int(os.environ.get("STORCH_TEST_SEED", "0") or 0)


def manual_seed(seed: int) -> torch.Generator:
    """``torch.manual_seed(seed + OFFSET)``."""
    return torch.manual_seed(seed + OFFSET)


def generator(seed: int) -> torch.Generator:
    """A new ``torch.Generator`` seeded with ``seed + OFFSET``."""
    return torch.Generator().manual_seed(seed + OFFSET)
