"""Links in the API reference from plain names: a griffe extension for the docs build.

storch's docstrings name other objects by their full dotted path in single backticks,
`` `storch.add_cost` `` or `` `storch.plate.Plate` ``, which reads cleanly in ``help()`` and in an
editor. For the site, this extension turns each such name that is a public storch object into an
optional autorefs cross-reference: mkdocstrings links it when the API reference renders the object,
and leaves it as code otherwise (a module that has no page, such as ``storch.method.groups``). A
trailing ``()`` stays in the text and is dropped from the target. Names in code blocks and doctests,
in double backticks, or of anything else are left as they are. That every such name exists is
checked without the docs build by ``tests/test_docstrings.py``.

Loaded by ``mkdocs.yml`` (the ``extensions`` option of the mkdocstrings Python handler).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

try:
    import griffe
except ImportError:  # without the docs extra, link_names still imports (tests/test_docstrings.py)
    griffe = None  # type: ignore[assignment]

# A name in single backticks: `storch.x.y` or `storch.x.y()`, not part of ``double`` backticks or of
# an existing [`...`][...] reference.
_NAME = re.compile(r"(?<![`\[])`(?P<path>storch(?:\.[A-Za-z_]\w*)*)(?P<call>\(\))?`(?![`\]])")
_FENCE = re.compile(r"^\s*(```|~~~)")


def link_names(text: str, exists: Callable[[str], bool]) -> str:
    """``text`` with every `storch.…` name in single backticks for which ``exists`` holds made an
    optional cross-reference; code blocks and doctests are left as they are."""

    def link(match: re.Match[str]) -> str:
        path = match["path"]
        if not exists(path):
            return match[0]
        return f'<autoref identifier="{path}" optional><code>{path}{match["call"] or ""}</code></autoref>'

    out, in_fence = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and not line.lstrip().startswith((">>>", "...")):
            line = _NAME.sub(link, line)
        out.append(line)
    return "\n".join(out)


if griffe is not None:

    def _exists(pkg: griffe.Module, path: str) -> bool:
        """Whether ``path`` names a public object of ``pkg`` (a member, an inherited one, an alias)."""
        parts = path.split(".")[1:]
        if any(part.startswith("_") for part in parts):
            return False
        obj: Any = pkg
        try:
            for part in parts:
                obj = obj.all_members[part]  # inherited members too
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False
        return True

    def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
        """``obj`` and every object defined in it (aliases skipped: they share their target's docstring)."""
        yield obj
        for member in obj.members.values():
            if not member.is_alias:
                yield from _objects(member)

    class CrossRefs(griffe.Extension):
        """Rewrites plain `storch.…` names in docstrings into optional autorefs cross-references."""

        def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
            if pkg.name != "storch":
                return
            for obj in _objects(pkg):
                if obj.docstring is not None:
                    obj.docstring.value = link_names(obj.docstring.value, lambda path: _exists(pkg, path))
