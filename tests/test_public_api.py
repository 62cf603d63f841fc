"""What a user's code and editor see: the public way to the raw values, and the methods' types."""

from __future__ import annotations

import collections.abc
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal

import storch
from storch.exceptions import IllegalStorchExposeError
from storch.method import Method, ScoreFunction
from storch.tensor import StochasticTensor


def test_plain_gives_the_raw_values_as_a_plain_view_in_the_same_graph():
    mu = torch.tensor([0.5, -1.0], requires_grad=True)
    z = storch.method.Reparameterization("z", n_samples=3)(Normal(mu, 1.0))
    raw = z.plain()
    assert type(raw) is torch.Tensor and raw.shape == (3, 2) and z.plate_names == ["z"]
    assert raw.data_ptr() == z.data_ptr()  # a view, no copy
    assert torch.equal(raw, z._tensor)  # Storchastic's name gives the same
    raw.sum().backward()  # gradients flow back through the samples to the parameters
    torch.testing.assert_close(mu.grad, torch.full((2,), 3.0))


def test_plain_on_a_cost_and_on_plate_weights():
    x = storch.method.Expect("x")(Bernoulli(probs=torch.tensor([0.2, 0.7])))
    weights = x.plates[0].weight.plain()
    assert type(weights) is torch.Tensor and weights.shape == (4,)
    assert torch.allclose(weights.sum(), torch.tensor(1.0))
    storch.add_cost(x.sum(-1), "c")
    (cost,) = storch.registered_costs()
    assert type(cost.plain()) is torch.Tensor and cost.plain().shape == (4,)
    storch.reset()


def test_the_refusals_name_the_public_way():
    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    with pytest.raises(IllegalStorchExposeError, match=r"t\.plain\(\) for the raw values"):
        z.item()
    with pytest.raises(IllegalStorchExposeError, match=r"t\.plain\(\)"):
        z.tolist()
    assert len(z.plain().tolist()) == 2


def _method_classes() -> list[type]:
    return sorted(
        (c for c in vars(storch.method).values() if inspect.isclass(c) and issubclass(c, Method)),
        key=lambda c: c.__name__,
    )


def test_a_method_call_is_typed_as_returning_the_stochastic_tensor():
    # What an editor or type checker reads for ``method(distribution)``.
    hint = typing.get_type_hints(Method)["__call__"]
    assert typing.get_origin(hint) is collections.abc.Callable
    assert typing.get_args(hint)[-1] is StochasticTensor
    # The same function as nn.Module's (hooks, torch.compile), only annotated.
    assert Method.__call__ is nn.Module.__call__
    assert typing.get_type_hints(Method.sample)["return"] is StochasticTensor


@pytest.mark.parametrize("cls", _method_classes(), ids=lambda c: c.__name__)
def test_every_method_is_typed_as_returning_the_stochastic_tensor(cls):
    assert typing.get_args(typing.get_type_hints(cls)["__call__"])[-1] is StochasticTensor
    assert typing.get_type_hints(cls.forward)["return"] is StochasticTensor


def test_the_methods_are_found():
    names = {c.__name__ for c in _method_classes()}
    assert {"Method", "ScoreFunction", "Reparameterization", "Expect", "MAPO", "GSB"} <= names
    assert len(names) > 25


# ``obj._name`` in user-facing code: the documentation's examples, examples/ and the doctests of
# public modules show the public way (``t.plain()``, ``storch.extend.layout_of(t)``, ...).
_PRIVATE = re.compile(r"[\w\])]\._[a-z]\w*")
REPO = Path(__file__).resolve().parents[1]


def _example_lines() -> list[tuple[str, str]]:
    lines = []
    for page in sorted([*REPO.joinpath("docs").rglob("*.md"), REPO / "README.md"]):
        fenced = False
        for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
            if line.startswith("```"):
                fenced = line.startswith("```python")
            elif fenced:
                lines.append((f"{page.relative_to(REPO)}:{number}", line))
    for script in sorted(REPO.joinpath("examples").rglob("*.py")):
        for number, line in enumerate(script.read_text(encoding="utf-8").split("\n"), 1):
            lines.append((f"{script.relative_to(REPO)}:{number}", line))
    for module in sorted(REPO.joinpath("storch").rglob("*.py")):
        if any(part.startswith("_") and part != "__init__.py" for part in module.relative_to(REPO).parts):
            continue  # a private module's examples may use its private names
        for number, line in enumerate(module.read_text(encoding="utf-8").split("\n"), 1):
            if line.lstrip().startswith((">>>", "... ")):
                lines.append((f"{module.relative_to(REPO)}:{number}", line.lstrip()[4:]))
    return lines


def test_examples_use_no_private_attribute():
    lines = _example_lines()
    assert len(lines) > 2000
    found = [
        f"{where}: {line.strip()}"
        for where, line in lines
        if not line.lstrip().startswith(("from ", "import ", "#")) and _PRIVATE.search(line.split("  #")[0])
    ]
    assert not found, "examples that reach for a private attribute:\n" + "\n".join(found)


def test_the_private_attribute_rule():
    assert _PRIVATE.search("print(z._tensor.tolist())") and _PRIVATE.search("x.plates[0].weight._tensor")
    assert not _PRIVATE.search("z.plain().tolist(), torch.__version__, storch.reduce_plates(t)")
