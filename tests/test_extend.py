"""``storch.extend``: the interface for estimator and sampler authors, proven by the in-tree ones.

* every estimator and sampler module (``storch/method``, ``storch/sampling``) takes the engine
  (tensor types, plates, dispatch, registries, helpers) from ``storch.extend`` only, imports no
  private name from any storch module and reads no private field of a storch tensor;
* every name of ``storch.extend.__all__`` resolves, the registries to the very functions of their
  modules;
* layering: ``storch.extend`` imports every ``register_*`` function directly from
  ``storch.registries`` (no lazy import, no module ``__getattr__``), and ``storch.registries`` imports
  no estimator, sampler or distribution module; the modules that fill a registry keep an entry a
  user registered before they were imported;
* :func:`storch.extend.register_operation` changes how a function treats plates, and refuses bad
  registrations with a message naming the function.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import storch
import storch.extend as extend
from storch import registries
from storch.extend import register_operation
from storch.registry import DuplicateRegistrationError, TypeRegistry

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = {
    "storch.tensor", "storch.plate", "storch._dispatch", "storch._step", "storch.util", "storch.registry",
    "storch._stacked_log_prob",
}
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


# --------------------------------------------------------------------------- layering of the registries
#: the modules that fill each registry of storch.registries with built-in entries, and one such type
FILLED_BY = {
    "RELAXATIONS": ("storch.distributions.relaxation", "Bernoulli"),
    "MEASURE_VALUED": ("storch.distributions.measure_valued", "Normal"),
    "CUMULANTS": ("storch.method.cumulants", "Normal"),
    "GSB_REPRESENTATIONS": ("storch.method.gsb", "Beta"),
    "GSB_RULES": ("storch.method.gsb", "Poisson"),
    "COORDINATES": ("storch.method.local_expectation_points", "Bernoulli"),
    "ONE_HOT_VIEWS": ("storch.method.straight_through", "Bernoulli"),
    "SPSA_WRAPPERS": ("storch.method.spsa", "OneHotCategorical"),
    "CRITIC_INPUTS": ("storch.method.critic", "Bernoulli"),
    "WOR_SUPPORTS": ("storch.sampling.swor", "Categorical"),
    "RELAXED_WOR_VALUES": ("storch.sampling.unordered_set", "Bernoulli"),
}
#: what storch.registries may import when the program runs (``TYPE_CHECKING`` imports aside)
REGISTRIES_MAY_IMPORT = {"__future__", "collections.abc", "dataclasses", "typing", "torch", "torch.distributions",
                         "storch.registry"}


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter at the repository root; its stdout (fails with its stderr)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``path`` that runs (those under ``if TYPE_CHECKING:`` do not)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_extend_imports_every_registry_directly() -> None:
    """No lazy import in storch.extend: every register_* comes from storch.registries at import."""
    tree = ast.parse((ROOT / "storch" / "extend.py").read_text())
    modules = {module for _, module in _runtime_imports(ROOT / "storch" / "extend.py")}
    assert "importlib" not in modules
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in {"__getattr__", "__dir__"}]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "import_module"]
    register_names = [name for name in extend.__all__ if name.startswith("register_") and name != "register_operation"]
    assert len(register_names) == 11
    for name in register_names:
        assert getattr(extend, name) is getattr(registries, name), name
    assert "register_cumulants" in vars(extend)  # bound at import, not on first access


def test_registries_module_imports_no_estimator() -> None:
    imports = _runtime_imports(ROOT / "storch" / "registries.py")
    wrong = [f"storch/registries.py:{line} imports {module}" for line, module in imports
             if module not in REGISTRIES_MAY_IMPORT]
    assert not wrong, "\n".join(wrong)
    # and when it runs: the package's __init__ (which imports everything) is not executed, as in a
    # program that imports storch.registries while storch is being imported
    loaded = _run_python(
        """
        import importlib.util, sys
        spec = importlib.util.find_spec("storch")
        sys.modules["storch"] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
        import storch.registries
        print(sorted(m for m in sys.modules if m.split(".")[0] == "storch"))
        """
    )
    assert loaded.split() == ["['storch',", "'storch.registries',", "'storch.registry']"]


def test_every_registry_holds_its_builtins_once_storch_is_imported() -> None:
    """Lookups never run before the estimators are imported: importing any storch module imports them."""
    out = _run_python(
        """
        import storch.registries as r
        print({name: sorted(t.__name__ for t in getattr(r, name)) for name in r.__all__ if name.isupper()})
        """
    )
    held = ast.literal_eval(out)
    assert set(held) == set(FILLED_BY)
    for name, (_, builtin) in FILLED_BY.items():
        assert builtin in held[name], name


def test_a_registration_before_the_estimators_are_imported_is_kept() -> None:
    """A user's entry for a type, made before the module with the built-in entry for that type is
    imported, survives that import (built-ins go in by ``register_default``); the other built-ins
    are added."""
    out = _run_python(
        f"""
        import importlib.util, sys
        import torch.distributions as D
        spec = importlib.util.find_spec("storch")
        package = sys.modules["storch"] = importlib.util.module_from_spec(spec)
        import storch.registries as r
        filled_by = {FILLED_BY!r}
        mine = {{name: object() for name in filled_by}}
        for name, (_, builtin) in filled_by.items():
            getattr(r, name).register(getattr(D, builtin))(mine[name])
        assert not [m for m in sys.modules if m.startswith(("storch.method", "storch.sampling"))]
        spec.loader.exec_module(package)  # now `import storch` runs: every estimator fills its registry
        for name, (module, builtin) in filled_by.items():
            assert module in sys.modules, module
            registry = getattr(r, name)
            assert registry.lookup(getattr(D, builtin)) is mine[name], name
            assert len(registry) > 1, name  # the other built-ins went in
        print("kept")
        """
    )
    assert out.strip() == "kept"


def test_register_default_keeps_existing_entries() -> None:
    from torch.distributions import Bernoulli, Categorical, OneHotCategorical

    sizes: TypeRegistry[object] = TypeRegistry("support size")
    sizes.register(Bernoulli)("user")
    value = object()
    assert sizes.register_default(Bernoulli, Categorical, Categorical)(value) is value
    assert sizes.lookup(Bernoulli) == "user" and sizes.lookup(Categorical) is value
    assert sizes.register_default(Bernoulli, Categorical)("again") == "again"  # nothing to add: a no-op
    assert list(sizes) == [Bernoulli, Categorical]
    with pytest.raises(DuplicateRegistrationError, match="Categorical is already registered"):
        sizes.register(Categorical)("user")  # a default entry is replaced only when said
    sizes.register(Categorical, replace=True)("user")
    with pytest.raises(TypeError, match="register_default\\(\\) needs at least one type"):
        sizes.register_default()
    with pytest.raises(TypeError, match="register_default\\(\\) takes types"):
        sizes.register_default(OneHotCategorical, "Bernoulli")  # type: ignore[arg-type]
    assert OneHotCategorical not in sizes


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
