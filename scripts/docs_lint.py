"""Checks that the documentation reads as user documentation, and that its code fits the page.

Usage (``make docs`` runs it after ``mkdocs build --strict``; ``tests/test_docs_site.py`` calls the
same functions)::

    .venv/bin/python scripts/docs_lint.py [--site SITE_DIR] [--roles-in PACKAGE_DIR] [FILES...]

Without ``FILES`` it reads the Markdown sources of the site (``docs/**/*.md``) and ``README.md``;
with ``--site`` also every page of the built site (``SITE_DIR/**/*.html``: the API pages are made
from the docstrings, so they are checked where they are shown); with ``--roles-in`` also the Python
files under that folder, for Sphinx roles only. It reports, one line per finding, as
``file:line: rule: text``, and exits with 1 when there is any finding.

What it looks for:

* ``issue-number``: a reference to an issue tracker (``issue 10``, ``#12`` in prose);
* ``machine-path``: a path on the machine the docs were written on (``/work/``, ``/root/``,
  ``/tmp/``, ``../shared``): data and outputs are described by the options that name them;
* ``internal-note``: words addressed to the people who wrote the docs, not to their readers
  (``the brief``, ``the session``), or references to their notes (``SPEC``);
* ``sphinx-role``: a Sphinx cross-reference role (``:class:`...```, ``:meth:``, ``:func:``,
  ``:attr:``, ``:mod:``, ``:exc:``, ``:obj:``, ``:data:``), which MkDocs prints as it is;
* ``literal-list`` (built pages): a paragraph with a line that starts like a list item (``* ``,
  ``- ``, ``1. ``), a Markdown list that did not render (it needs a blank line before it, and the
  content of an item is indented by 4 spaces);
* ``code-too-wide``: a line of a fenced code block in ``docs/`` wider than ``CODE_WIDTH``
  characters, the width of a code block of the Material theme at a 1280-pixel window
  (``scripts/docs_screenshot.py`` measures it): a wider line would wrap.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Characters of monospace text that fit on a line of a code block at a 1280-pixel-wide window
#: (Material's content column: 80 at the theme's 0.85 em code font, measured by docs_screenshot.py).
CODE_WIDTH = 80

_ROLE_NAMES = "class|meth|func|attr|mod|exc|obj|data"

#: (name, pattern, where): "all" lines, or "prose" only (outside code blocks and inline code).
RULES: list[tuple[str, re.Pattern[str], str]] = [
    ("issue-number", re.compile(r"\bissues?\s+\d+\b", re.IGNORECASE), "all"),
    ("issue-number", re.compile(r"(?:^|(?<=[\s(\[]))#\d+(?![\w-])"), "prose"),
    ("machine-path", re.compile(r"(?<![\w.])/(?:work|root|tmp)/|\.\./shared\b"), "all"),
    ("internal-note", re.compile(r"\bthe brief\b|\b(?:the|this) session\b", re.IGNORECASE), "all"),
    ("internal-note", re.compile(r"\bSPEC(?:\.md)?\b"), "all"),  # the design notes, not shipped
    ("sphinx-role", re.compile(rf"(?<![\w:]):(?:py:)?(?:{_ROLE_NAMES}):(?=[`~\w<])"), "all"),
]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text}"


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _excerpt(line: str, start: int, end: int, width: int = 100) -> str:
    left = max(0, start - (width - (end - start)) // 2)
    return line[left : left + width].strip()


def check_line(line: str, prose: bool, prose_text: str | None = None) -> list[tuple[str, str]]:
    """The ``(rule, excerpt)`` findings of one line; ``prose`` when it is not code.

    The "prose" rules read ``prose_text`` (default: ``line`` without its inline code spans).
    """
    found = []
    if prose and prose_text is None:
        prose_text = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
    for name, pattern, where in RULES:
        if where == "prose" and not prose:
            continue
        m = pattern.search(prose_text if where == "prose" else line)
        if m:
            text = prose_text if where == "prose" else line
            found.append((name, _excerpt(text, m.start(), m.end())))
    return found


def lint_markdown(path: Path, text: str | None = None, code_width: int | None = CODE_WIDTH) -> list[Finding]:
    """The findings of one Markdown page (``code_width=None``: no line-width check)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    findings = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            findings += [Finding(_rel(path), number, r, t) for r, t in check_line(line, prose=False)]
            continue
        if fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not line.strip().strip(fence[0]):
            fence = None
            continue
        in_code = fence is not None
        findings += [Finding(_rel(path), number, r, t) for r, t in check_line(line, prose=not in_code)]
        if in_code and code_width is not None and len(line.rstrip()) > code_width:
            findings.append(
                Finding(_rel(path), number, "code-too-wide", f"{len(line.rstrip())} > {code_width} characters: {line.strip()[:60]}")
            )
    return findings


_SKIP_ELEMENTS = re.compile(r"<(script|style)\b.*?</\1>", re.DOTALL | re.IGNORECASE)
_TAG = re.compile(r"<[^>]*>")
_CODE_ELEMENT = re.compile(r"<code\b.*?</code>", re.DOTALL)


def lint_html(path: Path, text: str | None = None) -> list[Finding]:
    """The findings of one built page: its text, tags removed, line by line."""
    text = path.read_text(encoding="utf-8") if text is None else text
    # blank out scripts and styles, keeping the line numbers
    text = _SKIP_ELEMENTS.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    findings = []
    in_pre = False
    for number, raw in enumerate(text.splitlines(), 1):
        # a line of a <pre> block is code, and so is <code> within a line: "#12" there is no
        # issue reference
        code = in_pre or "<pre" in raw
        opens, closes = raw.count("<pre"), raw.count("</pre>")
        in_pre = (in_pre or opens > closes) and not (closes > opens)
        line = html.unescape(_TAG.sub("", raw))
        prose = html.unescape(_TAG.sub("", _CODE_ELEMENT.sub(" ", raw)))
        if line.strip():
            findings += [
                Finding(_rel(path), number, r, t) for r, t in check_line(line, prose=not code, prose_text=prose)
            ]
    for paragraph in _PARAGRAPH.finditer(text):
        for item in _LIST_MARKER.finditer(paragraph.group(1)):
            number = text.count("\n", 0, paragraph.start(1) + item.start()) + 2
            shown = html.unescape(_TAG.sub("", item.group(0))).strip()
            findings.append(Finding(_rel(path), number, "literal-list", shown[:100]))
    return findings


# A paragraph of a built page with a line that starts like a list item: a Markdown list that did not
# render (it needs a blank line before it; content of an item is indented by 4 spaces).
_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.DOTALL)
_LIST_MARKER = re.compile(r"\n[ \t]*(?:[*+-]|\d+\.) [^\n]*")

_DOCSTRING_ROLE = re.compile(rf"(?<![\w:]):(?:py:)?(?:{_ROLE_NAMES}):`")


def lint_python_roles(path: Path, text: str | None = None) -> list[Finding]:
    """Sphinx roles (``:class:`X```, …) in a Python file's docstrings and comments."""
    text = path.read_text(encoding="utf-8") if text is None else text
    return [
        Finding(_rel(path), number, "sphinx-role", _excerpt(line, m.start(), m.end()))
        for number, line in enumerate(text.splitlines(), 1)
        for m in [_DOCSTRING_ROLE.search(line)]
        if m
    ]


def markdown_sources(root: Path = ROOT) -> list[Path]:
    """The Markdown sources of the site, and the README."""
    return sorted((root / "docs").rglob("*.md")) + [root / "README.md"]


def lint(markdown: list[Path], site: Path | None = None, roles_in: Path | None = None) -> list[Finding]:
    """Every finding of the Markdown files, the built site (if given) and the Python files (if given).

    The line-width check applies to the pages of the site (``docs/``) only.
    """
    findings = []
    docs = (ROOT / "docs").resolve()
    for path in markdown:
        on_site = docs in path.resolve().parents
        findings += lint_markdown(path, code_width=CODE_WIDTH if on_site else None)
    if site is not None:
        for path in sorted(site.rglob("*.html")):
            findings += lint_html(path)
    if roles_in is not None:
        for path in sorted(roles_in.rglob("*.py")):
            findings += lint_python_roles(path)
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: docs/**/*.md and README.md)")
    parser.add_argument("--site", type=Path, help="the built site: check its HTML pages too")
    parser.add_argument("--roles-in", type=Path, help="a package folder: check its Python files for Sphinx roles")
    args = parser.parse_args(argv)
    if args.site is not None and not args.site.is_dir():
        parser.error(f"--site {args.site}: no such folder (build the site first: make docs)")
    findings = lint(args.files or markdown_sources(), args.site, args.roles_in)
    for finding in findings:
        print(finding)
    checked = "the Markdown sources" + (f" and {args.site}/" if args.site else "")
    if findings:
        print(f"docs_lint: {len(findings)} finding(s) in {checked}", file=sys.stderr)
        return 1
    print(f"docs_lint: {checked}: no findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
