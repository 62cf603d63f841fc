"""``storch.extend``: the interface for estimator and sampler authors, proven by the in-tree ones.

* every estimator and sampler module (``storch/method``, ``storch/sampling``) takes the engine
  (tensor types, plates, dispatch, registries, helpers) from ``storch.extend`` only, imports no
  private name from any storch module and reads no private field of a storch tensor;
* every name of ``storch.extend.__all__`` resolves, the registries to the very functions of their
  modules;
* :func:`storch.extend.register_operation` changes how a function treats plates, and refuses bad
  registrations with a message naming the function.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

import storch
import storch.extend as extend
from storch.extend import register_operation

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = {"storch.tensor", "storch.plate", "storch._dispatch", "storch._step", "storch.util", "storch.registry"}
PRIVATE_FIELDS = {"_node", "_layout"}


def _estimator_modules() -> list[Path]:
    return sorted((ROOT / "storch" / "method").glob("*.py")) + sorted((ROOT / "storch" / "sampling").glob("*.py"))


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("storch"):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if node.module in ENGINE_MODULES:
                found.append(f"{where} imports from {node.module} (use storch.extend)")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{where} imports the private name {alias.name} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ENGINE_MODULES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_FIELDS:
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner != "self":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr} (use node_of/layout_of)")
    return found


def test_estimators_use_only_the_extension_interface() -> None:
    modules = _estimator_modules()
    assert len(modules) > 30
    found = [v for path in modules for v in _violations(path)]
    assert not found, "\n".join(found)


def test_the_checker_finds_private_access(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from storch.tensor import wrap\nfrom storch.method.method import _helper\n"
        "import storch._dispatch\ndef f(t):\n    return t._node.samples, t._layout\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _violations(bad)
    finally:
        ROOT = saved
    assert len(found) == 5, found


def test_every_public_name_resolves() -> None:
    missing = [name for name in extend.__all__ if not hasattr(extend, name)]
    assert not missing
    assert set(extend.__all__) <= set(dir(extend))
    from storch.method.cumulants import register_cumulants
    from storch.sampling.swor import register_wor_support

    assert extend.register_cumulants is register_cumulants
    assert extend.register_wor_support is register_wor_support
    with pytest.raises(AttributeError, match="no attribute 'register_nothing'"):
        extend.register_nothing  # noqa: B018


def test_node_of_names_what_it_needs() -> None:
    z = storch.method.ScoreFunction("z", n_samples=2)(torch.distributions.Bernoulli(torch.tensor(0.5)))
    node = extend.node_of(z)
    assert node.plate is z.plate and node.distribution is z.distribution and node.method is z.method
    with pytest.raises(TypeError, match="StochasticTensor"):
        extend.node_of(z * 1.0)
    storch.reset()


def _handled(name: str, fn):
    """A function that routes storch tensors through ``__torch_function__``."""

    @functools.wraps(fn)
    def wrapper(*args):
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        if torch.overrides.has_torch_function(tensors):
            return torch.overrides.handle_torch_function(wrapper, tensors, *args)
        return fn(*args)

    wrapper.__name__ = name
    return wrapper


def test_register_elementwise_pads_event_dimensions() -> None:
    times = _handled("times", lambda a, b: a * b)
    x = storch.denote_independent(torch.tensor([1.0, 2.0]), 0, "data")  # no event dimension
    y = torch.ones(2, 3)  # a plain (2, 3) event
    with pytest.raises(RuntimeError):  # aligned only: (2,) against (2, 3) does not broadcast per sample
        times(x, torch.ones(3, 3))
    register_operation(times, "elementwise")
    out = times(x, torch.ones(3))
    assert out.shape == (2, 3) and out._tensor.tolist() == [[1.0] * 3, [2.0] * 3]
    assert times(x, y).shape == (2, 2, 3)
    register_operation(times)  # back to the default
    with pytest.raises(RuntimeError):
        times(x, torch.ones(3, 3))


def test_register_join_expands_plain_members() -> None:
    join = _handled("join", lambda ts: torch.cat(list(ts), -1))
    x = storch.denote_independent(torch.zeros(2, 1), 0, "data")
    register_operation(join, "join")
    try:
        out = join((x, torch.ones(1)))
    finally:
        register_operation(join)
    assert out.shape == (2, 2) and out._tensor.tolist() == [[0.0, 1.0], [0.0, 1.0]]


def test_register_dim_args_refuses_plate_dims() -> None:
    first_of = _handled("first_of", lambda t, dim: t.select(dim, 0))
    x = storch.denote_independent(torch.arange(4.0).reshape(2, 2), 0, "data")
    # unregistered, selecting on the plate goes unnoticed: the result happens to have the plate's size
    assert first_of(x, 0)._tensor.tolist() == [0.0, 1.0]
    register_operation(first_of, dim_args=(1,))
    try:
        with pytest.raises(ValueError, match="first_of got dimension 0, which is plate 'data'"):
            first_of(x, 0)
        assert first_of(x, -1)._tensor.tolist() == [0.0, 2.0]
    finally:
        register_operation(first_of)


def test_register_operation_refuses_bad_registrations() -> None:
    with pytest.raises(ValueError, match="treat must be one of"):
        register_operation(torch.sin, "pointwise")
    with pytest.raises(ValueError, match="dim_args"):
        register_operation(torch.sin, dim_args=(-1,))
    with pytest.raises(ValueError, match="passthrough"):
        register_operation(torch.sin, "passthrough", dim_args=(1,))
    with pytest.raises(TypeError, match="callable"):
        register_operation("sin")  # type: ignore[arg-type]
