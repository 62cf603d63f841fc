"""Every test and every docstring example starts with an empty storch registry (costs and nodes).

The docstring examples in ``storch/`` share one interpreter; without this, a node sampled by one
example would still be noted when the next example calls ``storch.backward()``. The tests' own
fixtures (seeds) are in ``tests/conftest.py``.
"""

import pytest

import storch


@pytest.fixture(autouse=True)
def _empty_storch_registry():
    storch.reset()
    yield
    storch.reset()
