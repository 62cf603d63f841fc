"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

* **File mentions become links.** An inline code span that names a file or folder of the
  repository (```benchmarks/sbn_step.py```, ```docs/results/```, or a file name found once in the
  repository, such as ```test_arm.py```) links to it on the project's repository (``repo_url`` in
  ``mkdocs.yml``), so the Markdown sources keep the plain name. Code spans inside code blocks,
  links and headings are left as they are, and so is anything that is not a repository file
  (``runs/arm``, ``summary.json``: folders and files that a run writes).
* **Names in table cells break at their dots.** Code in a table cell may break after ``.``, ``=``,
  ``(``, ``,`` and ``/`` (a ``<wbr>`` there), never inside a word (``docs/stylesheets/extra.css``),
  so a long qualified name such as ``storch.sampling.MCDecoder(...)`` does not force its column
  wider than the page; a value and its error (``208.91 ± 0.03``) stay on one line.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The branch that the links name.
BRANCH = "main"

#: Folders that are not part of the repository's sources, when ``git`` cannot say.
_SKIP_DIRS = {".git", ".venv", ".venv-storchastic", "site", "build", "dist", "__pycache__", "runs"}

# Segments of a page left as they are: code blocks, links and headings.
_PROTECTED = re.compile(r"<pre\b.*?</pre>|<a\b.*?</a>|<h[1-6]\b.*?</h[1-6]>", re.DOTALL)
_CODE = re.compile(r"<code>([^<]+)</code>")
_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
_TABLE = re.compile(r"<table\b.*?</table>", re.DOTALL)
_BREAK_AFTER = re.compile(r"([.=(,/])(?=\w)")
_PLUS_MINUS = re.compile(r"(?<=\d) ± (?=\d)")


@cache
def repository_files(root: Path = ROOT) -> frozenset[str]:
    """The files of the repository at ``root`` (``git ls-files``; without git, a walk of the tree)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True, timeout=30
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        listed = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            rel = Path(folder).relative_to(root)
            listed.extend((rel / name).as_posix() for name in names)
    return frozenset(listed)


def resolve(mention: str, files: frozenset[str]) -> tuple[str, bool] | None:
    """``(path, is_folder)`` of the repository file or folder that ``mention`` names, or ``None``.

    A path (``benchmarks/sbn_step.py``, ``docs/results/``) must exist as it is written; a bare file
    name (``test_arm.py``) must be the name of exactly one file.
    """
    if not _PATH.fullmatch(mention) or mention.startswith("/"):
        return None
    name = mention.rstrip("/")
    if not name or ".." in name.split("/"):
        return None
    if name in files and not mention.endswith("/"):
        return name, False
    if any(f.startswith(name + "/") for f in files):
        return name, True
    if "/" not in name and "." in name:
        found = [f for f in files if f.rsplit("/", 1)[-1] == name]
        if len(found) == 1:
            return found[0], False
    return None


def link_file_mentions(page_html: str, files: frozenset[str], repo_url: str) -> str:
    """``page_html`` with each inline code span that names a repository file made a link to it."""
    base = repo_url.rstrip("/")

    def link(match: re.Match[str]) -> str:
        found = resolve(html.unescape(match.group(1)), files)
        if found is None:
            return match.group(0)
        path, folder = found
        url = f"{base}/{'tree' if folder else 'blob'}/{BRANCH}/{path}"
        return f'<a href="{html.escape(url)}" title="{html.escape(path)} in the repository">{match.group(0)}</a>'

    return _outside(_PROTECTED, page_html, lambda text: _CODE.sub(link, text))


def break_names_in_tables(page_html: str) -> str:
    """``page_html`` with a ``<wbr>`` after the dots (and ``=``, ``(``, ``,``, ``/``) of code in tables,
    and a value and its error (``208.91 ± 0.03``) held on one line."""

    def table(match: re.Match[str]) -> str:
        return _outside(re.compile(r"<pre\b.*?</pre>", re.DOTALL), match.group(0), _fix_cells)

    return _TABLE.sub(table, page_html)


def _fix_cells(text: str) -> str:
    return _PLUS_MINUS.sub("\u00a0±\u00a0", _break_code(text))


def _break_code(text: str) -> str:
    return _CODE.sub(lambda m: "<code>" + _BREAK_AFTER.sub(r"\1<wbr>", m.group(1)) + "</code>", text)


def _outside(protected: re.Pattern[str], text: str, change) -> str:
    """``text`` with ``change`` applied to the parts that ``protected`` does not match."""
    out, last = [], 0
    for match in protected.finditer(text):
        out.append(change(text[last : match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(change(text[last:]))
    return "".join(out)


def on_page_content(html_text: str, page, config, files) -> str:
    """MkDocs' hook: links to repository files, then breakable names in tables."""
    repo_url = config.get("repo_url")
    if repo_url:
        html_text = link_file_mentions(html_text, repository_files(), repo_url)
    return break_names_in_tables(html_text)
