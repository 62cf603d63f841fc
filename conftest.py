"""Every test and every docstring example starts with an empty storch registry (costs and nodes).

The docstring examples in ``storch/`` share one interpreter; without this, a node sampled by one
example would still be noted when the next example calls ``storch.backward()``. The tests' own
fixtures (seeds) are in ``tests/conftest.py``.

Docstring examples that compile (``storch.compile``): TorchDynamo installs globals such as
``__builtins_dict___1`` into the namespace of the code it compiles, and deletes them when that
compiled code is freed, which is at interpreter exit (``torch._dynamo.reset()`` does not free it).
doctest clears each example's namespace when the example ends, so at exit dynamo's deletion found
nothing and printed ``Exception ignored ... KeyError: '__builtins_dict___1'`` after pytest's
summary. The examples' namespaces are therefore cleared except for the globals dynamo installed.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import Any

import pytest
from _pytest.doctest import DoctestItem

import storch


@pytest.fixture(autouse=True)
def _empty_storch_registry():
    storch.reset()
    yield
    storch.reset()


def _dynamo_globals(namespace: dict) -> set[str]:
    """The names TorchDynamo installed in ``namespace`` and will delete when its compiled code dies."""
    utils = sys.modules.get("torch._dynamo.utils")
    manager = getattr(getattr(utils, "CleanupManager", None), "instance", None)
    hooks = getattr(manager, "values", {})
    return {hook.name for group in list(hooks.values()) for hook in group if getattr(hook, "scope", None) is namespace}


def _clear_keeping_dynamo_globals(namespace: dict) -> None:
    """What doctest's ``clear_globs`` does, except for dynamo's globals."""
    keep = _dynamo_globals(namespace)
    for name in [name for name in namespace if name not in keep]:
        del namespace[name]
    builtins._ = None  # type: ignore[attr-defined]  # as doctest does: drop the last printed value


def _run_clearing_around_dynamo(run: Callable[..., Any]) -> Callable[..., Any]:
    """``DocTestRunner.run`` that clears the examples' namespace but keeps dynamo's globals."""

    def run_examples(test: Any, compileflags: Any = None, out: Any = None, clear_globs: bool = True) -> Any:
        try:
            return run(test, compileflags, out, clear_globs=False)
        finally:
            if clear_globs:
                _clear_keeping_dynamo_globals(test.globs)

    return run_examples


@pytest.fixture(autouse=True)
def _keep_dynamo_globals_of_doctests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if isinstance(request.node, DoctestItem):
        runner = request.node.runner
        monkeypatch.setattr(runner, "run", _run_clearing_around_dynamo(runner.run))
    yield
