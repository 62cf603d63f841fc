"""storch under ``torch.compile``: storch's own frames run eagerly, the rest of a step compiles.

A training step that samples, registers costs and calls `storch.backward` can be given to
``torch.compile`` as a whole. TorchDynamo would otherwise trace into storch's Python code (the
plate bookkeeping, the ``__torch_function__`` dispatch) and compile it with the plated tensors as
plain inputs, which fails inside AOTAutograd ("Multiple dispatch failed for aten.addmm.out").
``import storch`` therefore marks the code of every storch function as *skipped* by TorchDynamo's
frame evaluation, recursively (what ``torch.compiler.disable`` does, without a wrapper: nothing
changes for eager code). Under ``torch.compile``:

* plain-tensor code of the step (code that does not touch storch tensors) is compiled;
* every call into storch (``Method(...)``, ``storch.add_cost``, ``storch.backward``, ...) and every
  operation on a storch tensor is a graph break and runs eagerly, so storch's part of the step costs
  what it costs in eager mode; the estimates and gradients are those of eager mode, bit for bit,
  for the same seed (``tests/test_compile.py``);
* modules given to storch (a control-variate network, a critic) run eagerly when storch calls them;
  compile them separately (``torch.compile(module)``) if they are large.

Compiling a model's modules on their own and calling them on plated tensors also works: the
compiled module sees the plates as leading batch dimensions (see ``docs/scaling.md``).

The skip is registered through ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` (the
mechanism behind ``torch._dynamo.skip``), which needs no import of ``torch._dynamo`` (0.8 s). If
a torch version lacks it, nothing is registered and `REGISTERED` stays ``False``.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["skip_storch_frames", "compile", "REGISTERED"]

#: whether storch's frames are registered as skipped by TorchDynamo
REGISTERED = False
_DONE: set[types.CodeType] = set()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions, lambdas and comprehensions defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj: Any, seen: set[int]) -> Iterator[types.FunctionType]:
    """The Python functions defined by storch in a module attribute (classes searched inside)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (staticmethod, classmethod)):
        yield from _functions(obj.__func__, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                yield from _functions(f, seen)
    elif isinstance(obj, types.FunctionType):
        if (obj.__module__ or "").split(".")[0] == "storch":
            yield obj
    elif isinstance(obj, type) and obj.__module__.split(".")[0] == "storch":
        for value in vars(obj).values():
            yield from _functions(value, seen)


def skip_storch_frames() -> int:
    """Mark the code of every function of the storch modules imported so far as skipped by
    TorchDynamo, recursively; returns the number of code objects newly marked (0 if the torch
    version lacks the mechanism). ``import storch`` calls it; call it again after importing a storch
    module that ``import storch`` does not load (``storch.testing``, ``storch.bench``)."""
    global REGISTERED
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
        return 0
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    seen: set[int] = set()
    marked = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "storch" or name.startswith("storch.")):
            continue
        for value in list(vars(module).values()):
            for function in _functions(value, seen):
                for code in _codes(function.__code__):
                    if code not in _DONE:
                        set_code_exec_strategy(code, skip)
                        _DONE.add(code)
                        marked += 1
    REGISTERED = True
    return marked


def compile(fn: Callable, **kwargs: Any) -> Callable:  # noqa: A001 - the torch.compile of storch
    """``torch.compile(fn, **kwargs)`` after `skip_storch_frames` (for storch modules imported
    after ``import storch``).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> mu = torch.tensor(0.5, requires_grad=True)
        >>> def step():
        ...     x = storch.method.Reparameterization("x", n_samples=4)(Normal(mu, 1.0))
        ...     storch.add_cost(x * 2.0, "f")
        ...     return storch.backward()
        >>> _ = storch.compile(step)(); mu.grad                  # d/dmu E[2x] = 2
        tensor(2.)
    """
    skip_storch_frames()
    return torch.compile(fn, **kwargs)
