"""The package's metadata and what a core install (no extras) can do: one version, the licence, the
core's dependencies, and the one-line messages of the optional parts. ``make smoke``
(scripts/wheel_smoke.sh) checks the same on a wheel installed in a fresh virtual environment."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import storch

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: the modules of the extras, and the extra that brings each
OPTIONAL = {"tqdm": "bench", "matplotlib": "bench", "sklearn": "bench", "entmax": "entmax", "scipy": None}


def _requirement_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()


def test_the_version_is_stated_once_and_is_the_installed_one():
    assert PYPROJECT["dynamic"] == ["version"] and "version" not in PYPROJECT
    assert re.fullmatch(r"\d+\.\d+\.\d+", storch.__version__)
    assert metadata.version("storch") == storch.__version__  # reinstall (make venv) after changing it


def test_the_licence_is_mit_in_the_file_and_the_metadata():
    assert PYPROJECT["license"] == "MIT" and PYPROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "The storch developers" in text
    assert metadata.metadata("storch")["License-Expression"] == "MIT"
    assert PYPROJECT["urls"]["Source"] == "https://github.com/storch-dev/storch"


def test_the_core_depends_on_torch_and_numpy_only():
    assert sorted(_requirement_name(r) for r in PYPROJECT["dependencies"]) == ["numpy", "torch"]
    extras = PYPROJECT["optional-dependencies"]
    assert [_requirement_name(r) for r in extras["entmax"]] == ["entmax"]
    for extra in ("bench", "demo", "entmax"):  # the tests exercise every optional part
        assert {_requirement_name(r) for r in extras[extra]} <= {_requirement_name(r) for r in extras["test"]}


BLOCKED_IMPORTS = """
import importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Block())
import storch
assert "numpy" in sys.modules  # the core uses numpy: it is a dependency for a reason
import storch.bench.cli, storch.demo
for info in pkgutil.walk_packages(storch.__path__, "storch."):
    __import__(info.name)
print("imported", sum(1 for _ in pkgutil.walk_packages(storch.__path__, "storch.")), "modules")
"""


def test_the_readme_lists_every_extra():
    """The README's table of extras has a row for each extra of pyproject.toml, naming what it installs."""
    readme = (ROOT / "README.md").read_text()
    for extra, requirements in PYPROJECT["optional-dependencies"].items():
        row = re.search(rf"^\| `{extra}` \| ([^|]+) \|", readme, re.MULTILINE)
        assert row is not None, f"the README's table of extras has no row for {extra!r}"
        if extra not in ("test", "docs"):  # (those two summarise their long lists)
            for req in requirements:
                assert _requirement_name(req) in row.group(1).lower(), (extra, req)


def test_every_module_imports_without_the_extras():
    code = BLOCKED_IMPORTS.format(blocked=sorted(OPTIONAL) + ["pytest"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("imported ")


def test_the_optional_imports_are_the_ones_the_extras_bring():
    """Every third-party module that storch's code imports (at any depth) is torch, numpy or a module of an extra."""
    found = set()
    for path in (ROOT / "storch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    third_party = found - set(sys.stdlib_module_names) - {"__future__", "storch"}
    assert "numpy" in third_party and "torch" in third_party
    assert third_party <= {"torch", "numpy", *OPTIONAL}, third_party - {"torch", "numpy", *OPTIONAL}
