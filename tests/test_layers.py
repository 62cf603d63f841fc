"""The layers of the package (README, "Layout") import downward only.

Each module belongs to one layer; a module-level import (outside ``if TYPE_CHECKING:``) may reach
its own layer or a lower one, never a higher one. Imports inside functions are deferred on purpose
(a registry that builds on a later module) and are not checked. Cycles within a layer are caught by
``tests/test_imports.py``, which imports every module on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module's layer is that of its longest matching prefix
LAYERS: dict[str, int] = {
    # 0. leaves: plates, registries, errors, distributions and their relaxations
    "storch.exceptions": 0,
    "storch.registry": 0,
    "storch.registries": 0,
    "storch.plate": 0,
    "storch._step": 0,
    "storch._tracing": 0,
    "storch.state": 0,
    "storch.distributions": 0,
    "storch.datasets": 0,
    # 1. the engine: the tensor type, dispatch, reductions, costs and the surrogate loss
    "storch._dispatch": 1,
    "storch._validation": 1,
    "storch.tensor": 1,
    "storch.util": 1,
    "storch.reductions": 1,
    "storch.ops": 1,
    "storch.wrappers": 1,
    "storch.inference": 1,
    "storch._chain_terms": 1,
    "storch._stacked_log_prob": 1,
    "storch.distributed": 1,
    "storch.nn": 1,
    # 2. the extension interface
    "storch.extend": 2,
    # 3. proposals and estimators
    "storch.sampling": 3,
    "storch.method": 3,
    # 4. what users run: the package, the manual's aliases, tests, benchmarks, demo
    "storch": 4,
    "storch.storch": 4,
    "storch.testing": 4,
    "storch.compiler": 4,
    "storch.compiled_step": 4,
    "storch._compile": 4,  # compile_step's parts: trace, inputs, checks, refusals, passes, replay
    "storch.bench": 4,
    "storch.demo": 4,
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(f"{module} has no layer: add it to LAYERS here and to the README's layout table")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every storch import at module level, outside ``if TYPE_CHECKING``."""
    found: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "storch":
                if node.module == "storch":  # from storch import distributed: the submodules
                    found.extend((node.lineno, f"storch.{a.name}") for a in node.names)
                else:
                    found.append((node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "storch")
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return found


def upward_imports(path: Path) -> list[str]:
    name = module_name(path)
    own = layer_of(name)
    bad = []
    for line, target in module_level_imports(ast.parse(path.read_text())):
        if layer_of(target) > own and not target.startswith(name + "."):  # a package may import its parts
            bad.append(f"{path.relative_to(ROOT)}:{line}: {name} (layer {own}) imports {target} (layer {layer_of(target)})")
    return bad


def test_every_module_has_a_layer() -> None:
    for path in (ROOT / "storch").rglob("*.py"):
        layer_of(module_name(path))


def test_imports_go_downward_only() -> None:
    bad = [b for path in sorted((ROOT / "storch").rglob("*.py")) for b in upward_imports(path)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    global ROOT
    package = tmp_path / "storch"
    package.mkdir()
    (package / "plate.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from storch.method import Method\n"
        "from storch.inference import backward\n"
    )
    saved, ROOT = ROOT, tmp_path
    try:
        bad = upward_imports(package / "plate.py")
    finally:
        ROOT = saved
    assert len(bad) == 1 and "storch.plate (layer 0) imports storch.inference (layer 1)" in bad[0]
