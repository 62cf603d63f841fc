"""Checks shared by the estimator tests, on a small model with a ``method`` attribute and a ``step(x)``
that samples with it, registers its costs and returns ``storch.backward()``.

* `check_copies`: ``copy.deepcopy``, pickle and ``torch.save``/``torch.load`` give a model whose
  method has the same type, ``repr`` and ``state_dict`` keys, and that runs a step;
* `check_compile_step`: ``storch.compile_step`` replays the eager step (loss and gradients) for
  the same seeds;
* `check_cost_without_logit_plates_is_refused`: a cost that reduced the logits' plate before
  registration is refused by name.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Callable

import pytest
import torch
from torch import nn

import storch

#: five data points of four binary inputs, for the small models of these checks
DATA = (torch.rand(5, 4, generator=torch.Generator().manual_seed(1)) < 0.5).float()


def check_copies(make_model: Callable[[], nn.Module], data: torch.Tensor) -> None:
    """Copies, pickles and saved-and-loaded copies of a model after one step each run a step."""
    model = make_model()
    model.step(data)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        assert type(other.method) is type(model.method) and repr(other.method) == repr(model.method)
        assert other.method.state_dict().keys() == model.method.state_dict().keys()
        storch.reset()
        other.step(data)


def check_compile_step(
    make_model: Callable[[], nn.Module], data: torch.Tensor, atol: float = 0.0, rtol: float = 0.0
) -> None:
    """Three steps of a compiled model match those of an eager one (loss and gradients), seed by seed."""
    eager, compiled = make_model(), make_model()
    step = storch.compile_step(compiled.step, compiled)
    for i in range(3):
        results = []
        for model, run in ((eager, eager.step), (compiled, step)):
            model.zero_grad()
            torch.manual_seed(100 + i)
            results.append([run(data).clone()] + [p.grad.clone() for p in model.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def check_cost_without_logit_plates_is_refused(node: storch.Tensor, match: str) -> None:
    """A cost of ``node`` with its ``"data"`` plate reduced: ``storch.backward()`` raises ``match``."""
    storch.add_cost(storch.reduce_plates(node.sum(-1), "data"), "f")
    with pytest.raises(ValueError, match=match):
        storch.backward()
