"""Every module of storch imports on its own: the layers import downward only (no import cycle).

``storch/__init__.py`` imports the whole package in one order, which can hide a cycle: module A
importing B while B (through a package ``__init__``) imports A only fails when A is imported first.
This test imports each module first, in a fresh interpreter whose ``storch`` package is an empty
namespace (the package ``__init__`` is skipped; sub-package ``__init__`` files still run, as they
would for a user), so any cycle shows up as "partially initialized module".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def storch_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "storch").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            names.append(".".join(parts))
    return names


# One interpreter for all modules (torch is imported once); storch's modules are dropped from
# sys.modules before each import, so each one is imported first.
_PROBE = r"""
import importlib, sys, traceback, types
import torch
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "storch" or m.startswith("storch.")]:
        del sys.modules[loaded]
    package = types.ModuleType("storch")
    package.__path__ = [sys.argv[0]]
    sys.modules["storch"] = package
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
print("\n".join(failed))
"""


def test_every_module_imports_on_its_own() -> None:
    modules = storch_modules()
    assert "storch.util" in modules and "storch.method.vimco" in modules
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("sys.argv[0]", repr(str(ROOT / "storch"))), *modules],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failures = [line for line in result.stdout.splitlines() if line.strip()]
    assert not failures, "modules that do not import on their own (an import cycle):\n" + "\n".join(failures)


def test_the_probe_finds_a_cycle(tmp_path: Path) -> None:
    """The same probe on a two-module package with a cycle reports it."""
    package = tmp_path / "storch"
    package.mkdir()
    (package / "a.py").write_text("from storch.b import B\nA = 1\n")
    (package / "b.py").write_text("from storch.a import A\nB = 2\n")
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("sys.argv[0]", repr(str(package))), "storch.a"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "storch.a: ImportError" in result.stdout and "partially initialized" in result.stdout
