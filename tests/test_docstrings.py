"""The docstrings as a reader meets them: in ``help()`` and in the API reference.

* No cross-reference markup (``[`add_cost`][storch.add_cost]``) in any docstring: other objects are
  named by their plain dotted path in backticks, `` `storch.add_cost` ``, which the docs build makes
  a link (``scripts/griffe_crossrefs.py``) and a terminal shows as written. Every such name exists.
* The Google-style sections render as written. The API reference parses them with griffe, whose rule
  is: in ``Returns:``, ``Raises:``, ``Args:`` and their kin, a line at the section's indentation starts
  a new item and only a deeper one continues it. A description wrapped at the item's indentation
  therefore renders as one table row per line, each a sentence fragment. The same rule is applied
  here with the standard library alone, so it runs without the docs extra.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest


REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "storch"

# griffe's section title (``_RE_ADMONITION`` in griffe.docstrings.google): a line at column 0.
_HEADER = re.compile(r"^(?P<type>\w[\s\w-]*):(\s+(?P<title>\S.*))?\s*$")
_RETURNS = {"returns", "yields", "receives"}
_EXCEPTIONS = {"raises", "exceptions", "warns", "warnings"}
_NAMED = {
    "args", "arguments", "params", "parameters", "keyword args", "keyword arguments", "other args",
    "other arguments", "other params", "other parameters", "attributes",
}  # fmt: skip
# An item's first line: ``name (type): description`` (griffe's ``_RE_NAME_ANNOTATION_DESCRIPTION``,
# with the name required), ``ExceptionType: description``.
_NAMED_ITEM = re.compile(r"^\*{0,2}\w+\s*(\(.+\))?:(\s|$)")
_EXCEPTION_ITEM = re.compile(r"^[A-Za-z_][\w.]*\s*:(\s|$)")
_XREF = re.compile(r"\]\[[A-Za-z_][\w.]*\]|\]\[\]")


def _load_crossrefs():
    """``scripts/griffe_crossrefs.py``, the docs build's rule for which names become links."""
    path = REPO / "scripts" / "griffe_crossrefs.py"
    spec = importlib.util.spec_from_file_location("griffe_crossrefs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


crossrefs = _load_crossrefs()
_NAME = crossrefs._NAME


class Doc(NamedTuple):
    where: str  # file:line object
    text: str  # cleaned as inspect.cleandoc does


def docstrings(root: Path = ROOT) -> Iterator[Doc]:
    """Every module, class and function docstring under ``root``."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]
        for node in nodes:
            text = ast.get_docstring(node, clean=True)
            if text:
                line = getattr(node, "lineno", 1)
                name = getattr(node, "name", "<module>")
                yield Doc(f"{path.relative_to(root.parent)}:{line} {name}", text)


def prose_lines(text: str) -> Iterator[str]:
    """The lines of ``text`` outside fenced code blocks and doctests."""
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith((">>>", "... ")):
            yield line


def section_items(text: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``(kind, items, problems)`` per section griffe would parse, ``items`` being their first lines."""
    lines = text.split("\n")
    fenced, i = False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip(" ").startswith("```"):
            fenced = not fenced
        match = None if fenced else _HEADER.match(line)
        kind = match["type"].lower() if match else ""
        if not (kind in _RETURNS | _EXCEPTIONS | _NAMED and _is_section(lines, i)):
            i += 1
            continue
        items, problems, i = _block_items(lines, i + 1)
        yield kind, items, problems


def _is_section(lines: list[str], i: int) -> bool:
    """griffe's conditions: a blank line (or nothing) above the title and an indented line below."""
    above = i == 0 or not lines[i - 1].strip()
    below = i + 1 < len(lines) and lines[i + 1].startswith(" ") and lines[i + 1].strip() != ""
    return above and below


def _block_items(lines: list[str], i: int) -> tuple[list[str], list[str], int]:
    """The items of the block starting at line ``i`` (griffe's ``_read_block_items``)."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    items, problems = [lines[i].strip()], []
    i += 1
    while i < len(lines):
        line = lines[i]
        width = len(line) - len(line.lstrip())
        if not line.strip() or line.startswith(" " * (2 * indent)):
            pass  # blank line, or continuation
        elif width > indent:
            problems.append(f"continuation indented {width} spaces, not {2 * indent}: {line.strip()!r}")
        elif width == indent:
            items.append(line.strip())
        else:
            break
        i += 1
    return items, problems, i


def section_findings(text: str) -> list[str]:
    """What in ``text``'s Google-style sections would not render as written."""
    findings = []
    for kind, items, problems in section_items(text):
        findings += [f"{kind}: {p}" for p in problems]
        if kind in _RETURNS and len(items) > 1 and not all(_NAMED_ITEM.match(item) for item in items):
            findings.append(
                f"{kind}: {len(items)} items; indent the description's continuation lines under its "
                f"first line (one item per returned value): {items[1]!r}"
            )
        elif kind in _EXCEPTIONS:
            bad = [item for item in items if not _EXCEPTION_ITEM.match(item)]
            findings += [f"{kind}: not 'Exception: description': {item!r}" for item in bad]
        elif kind in _NAMED:
            bad = [item for item in items if not _NAMED_ITEM.match(item)]
            findings += [f"{kind}: not 'name (type): description': {item!r}" for item in bad]
    return findings


def resolves(path: str) -> bool:
    """Whether the dotted ``path`` names a module, or an attribute (annotated fields too) of one."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("storch"):
                raise AssertionError(f"{path}: importing it needs {e.name}, which the test extra installs") from e
            continue
        for part in parts[cut:]:
            annotated = any(part in getattr(c, "__annotations__", {}) for c in getattr(obj, "__mro__", ()))
            if not hasattr(obj, part) and not annotated:
                return False
            obj = getattr(obj, part, None)
        return True
    return False


DOCS = list(docstrings())


def test_the_walk_finds_the_docstrings():
    where = {d.where.split(" ")[1] for d in DOCS}
    assert {"backward", "add_cost", "Method", "<module>"} <= where and len(DOCS) > 500


def test_no_cross_reference_markup_in_docstrings():
    found = [f"{d.where}: {line.strip()}" for d in DOCS for line in prose_lines(d.text) if _XREF.search(line)]
    assert not found, (
        "cross-reference markup reads as noise in help(): write the plain dotted name in backticks "
        "(`storch.add_cost`), which the docs build links:\n" + "\n".join(found)
    )


def test_every_storch_name_in_backticks_exists():
    names = {(d.where, m["path"]) for d in DOCS for line in prose_lines(d.text) for m in _NAME.finditer(line)}
    assert len(names) > 300
    missing = sorted(f"{where}: `{name}`" for where, name in names if not resolves(name))
    assert not missing, "names in docstrings that are no storch object:\n" + "\n".join(missing)


def test_docstring_sections_render_as_written():
    found = [f"{d.where}: {f}" for d in DOCS for f in section_findings(d.text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "text, expected",
    [
        # A description wrapped at the item's indentation: two rows of fragments in the reference.
        ("Returns:\n    The estimate (a 0-dim tensor): the forward value\n    of the surrogate loss.", 1),
        ("Returns:\n    The estimate (a 0-dim tensor): the forward value\n        of the surrogate loss.", 0),
        ("Returns:\n    loss: the loss.\n    grads (tuple): the gradients.", 0),
        ("Raises:\n    ValueError: if ``dim`` falls on a plate; the message names\n    the plate.", 1),
        ("Raises:\n    ValueError: if ``dim`` falls on a plate; the message names\n        the plate.", 0),
        ("Args:\n    n: the number of draws, at least\n    one per datum.", 1),
        ("Args:\n    n: the number of draws, at least\n      one per datum.", 1),
        ("Args:\n    n: the number of draws.\n    *args: passed on.\n    **kwargs (dict): passed on.", 0),
        ("Returns the estimate:\n    The estimate\n    of it.", 0),  # not a section title
        ("First.\nReturns:\n    The estimate\n    of it.", 0),  # no blank line above: text for griffe
    ],
)
def test_the_section_rule(text, expected):
    assert len(section_findings(text)) == expected, section_findings(text)


def test_the_markup_and_name_rules():
    assert _XREF.search("see [`add_cost`][storch.add_cost]") and _XREF.search("see [storch.add_cost][]")
    assert not _XREF.search("x[key][0] and `storch.add_cost`")
    assert [m["path"] for m in _NAME.finditer("`storch.backward()`, ``storch.x``, `storch.Plate`")] == [
        "storch.backward",
        "storch.Plate",
    ]
    assert resolves("storch.add_cost") and resolves("storch.plate.Plate") and resolves("storch.method")
    assert not resolves("storch.add_costs") and not resolves("storch.no_module.x")


def test_the_docs_build_links_plain_names():
    text = "\n".join(
        [
            "Call `storch.backward()` after `storch.add_cost`; not `storch.nothing`, ``storch.x``,",
            "[`storch.plate`][storch.plate] or `torch.sum`.",
            ">>> `storch.add_cost`",
            "```python",
            "`storch.add_cost`",
            "```",
        ]
    )
    linked = crossrefs.link_names(text, lambda path: path != "storch.nothing").split("\n")
    assert linked[0] == (
        'Call <autoref identifier="storch.backward" optional><code>storch.backward()</code></autoref> after '
        '<autoref identifier="storch.add_cost" optional><code>storch.add_cost</code></autoref>; not '
        "`storch.nothing`, ``storch.x``,"
    )
    assert linked[1:] == text.split("\n")[1:]


def test_the_docs_build_loads_the_extension():
    mkdocs = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    assert "- scripts/griffe_crossrefs.py:CrossRefs" in mkdocs
