"""The documentation reads as user documentation, and its code fits the page.

``scripts/docs_lint.py`` (run by ``make docs`` after the build) holds the checks; these tests run
them without building anything:

* the Markdown sources of the site (``docs/**/*.md``) and the README: no issue-tracker references,
  no paths of the machine the docs were written on, no notes to their authors, no Sphinx roles;
* every line of a fenced code block of the site fits a code block at a 1280-pixel window
  (``docs_lint.CODE_WIDTH`` characters);
* the Python files of ``storch/`` have no Sphinx roles in their docstrings (the API pages are made
  from them, and MkDocs prints a role as it is);
* the built site (``site/``, when ``make docs`` has made it): the same text checks on every page,
  the API pages included.

The checks themselves are tested on made-up text, and ``scripts/docs_screenshot.py``'s code-width
check on made-up measurements (and, where a headless Chromium and a built site exist, on the home
page).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


lint = _load("docs_lint")


def _report(findings) -> str:
    return "\n".join(str(f) for f in findings)


# --------------------------------------------------------------------------------------------
# the documentation itself
# --------------------------------------------------------------------------------------------


def test_markdown_sources_read_as_user_documentation() -> None:
    findings = [f for f in lint.lint(lint.markdown_sources()) if f.rule != "code-too-wide"]
    assert not findings, "\n" + _report(findings)


def test_code_lines_fit_the_page() -> None:
    findings = [f for f in lint.lint(lint.markdown_sources()) if f.rule == "code-too-wide"]
    assert not findings, "\n" + _report(findings)


def test_docstrings_have_no_sphinx_roles() -> None:
    findings = lint.lint([], roles_in=ROOT / "storch")
    assert not findings, "\n" + _report(findings)


# The built site (API pages from the docstrings included) is linted by `make docs` itself, right after
# the build (`docs_lint.py --site site`), and its code widths are measured in a browser there: CI runs
# both on every submission, so no test here depends on a site left over from an earlier build.


# --------------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------------

PAGE = """# A page

As seen in issue 10, item 4, this was slow.
Fixed in #12.
The data are in /work/shared/data and ../shared/data.
The brief asks for three seeds; the session ran two.
Use :class:`storch.Tensor` or :meth:`~storch.Plate.on_unique`.
A [link](results.md#1-arm-paper), colour `#4051b5`, `#3` in code, issues in general.

```python
x = 1  # 3 issues here, a #1 in a comment
print("/tmp/out")
y = "a line of code that is far too long for a code block of the Material theme at 1280 px"
```
"""


def test_lint_finds_each_kind_of_finding() -> None:
    findings = lint.lint_markdown(ROOT / "docs" / "page.md", PAGE)
    found = [(f.line, f.rule) for f in findings]
    assert found == [
        (3, "issue-number"),
        (4, "issue-number"),
        (5, "machine-path"),
        (6, "internal-note"),
        (7, "sphinx-role"),
        (12, "machine-path"),
        (13, "code-too-wide"),
    ], _report(findings)
    assert findings[0].path == "docs/page.md" and str(findings[0]).startswith("docs/page.md:3: issue-number: ")
    assert [f.rule for f in lint.lint_markdown(Path("x.md"), "As in SPEC §5.\n")] == ["internal-note"]
    assert lint.lint_markdown(Path("x.md"), "_SPECIAL = 1; a specification\n") == []


def test_lint_knows_fences_and_inline_code() -> None:
    text = "````markdown\n```python\n#12 is not an issue inside a fence\n```\n````\nafter: #7\n"
    assert [(f.line, f.rule) for f in lint.lint_markdown(Path("x.md"), text, code_width=None)] == [
        (6, "issue-number")
    ]
    assert lint.lint_markdown(Path("x.md"), "see `#12` and `issue 3`? no: `#12`\n", code_width=None) == [
        lint.Finding("x.md", 1, "issue-number", "see `#12` and `issue 3`? no: `#12`")
    ]  # "issue 3" counts everywhere, "#12" in prose only


def test_lint_reads_built_pages() -> None:
    page = """<html><head><style>.x { color: #123; }</style><script>var a = "/tmp/";</script></head>
<body><p>It&#39;s in <code>site/</code>, see <a href="#1-x">#1</a>.</p>
<pre><code>#3 is a comment here</code></pre>
<p>Use :class:<code>Tensor</code>.</p>
<p>Data in /root/data.</p>
</body></html>"""
    findings = lint.lint_html(Path("page.html"), page)
    assert [(f.line, f.rule) for f in findings] == [(2, "issue-number"), (4, "sphinx-role"), (5, "machine-path")]


def test_lint_reads_docstrings() -> None:
    source = 'def f():\n    """Returns a :class:`Tensor`, see [`g`][g]."""\n    # :data:`X` in a comment\n'
    assert [(f.line, f.rule) for f in lint.lint_python_roles(Path("m.py"), source)] == [
        (2, "sphinx-role"),
        (3, "sphinx-role"),
    ]


def test_lint_command_line(tmp_path: Path, capsys) -> None:
    clean, dirty = tmp_path / "clean.md", tmp_path / "dirty.md"
    clean.write_text("# Fine\n\nNothing to see.\n")
    dirty.write_text("# Not fine\n\nSee issue 4.\n")
    assert lint.main([str(clean)]) == 0
    assert lint.main([str(clean), str(dirty)]) == 1
    out = capsys.readouterr().out
    assert "dirty.md:3: issue-number: See issue 4." in out


# --------------------------------------------------------------------------------------------
# the code-width check of scripts/docs_screenshot.py
# --------------------------------------------------------------------------------------------


def _screenshot():
    return _load("docs_screenshot")


def test_code_width_check_on_measurements() -> None:
    shot = _screenshot()
    fine = {"blocks": 3, "chars": 80, "cut": [], "wide": []}
    assert shot.check_code({"index.html": fine}) == ([], [])
    problems, notes = shot.check_code({
        "index.html": {"blocks": 2, "chars": 80, "cut": ["z = storch.method..."], "wide": []},
        "faq.html": {"blocks": 1, "chars": 72, "cut": [], "wide": []},
        "tutorials/plates.html": {"blocks": 1, "chars": 80, "cut": [], "wide": ["x = 1"]},
        "api/method.html": {"blocks": 9, "chars": 80, "cut": [], "wide": [">>> long"]},
        "broken.html": {"error": "no frame"},
    })
    assert [p.split(":")[0] for p in problems] == ["broken.html", "faq.html", "index.html", "tutorials/plates.html"]
    assert "cut off" in problems[2] and "72 characters" in problems[1] and "wraps" in problems[3]
    assert notes and notes[0].startswith("api/method.html: 1 code block")


def test_screenshot_check_without_a_browser_installs_nothing(monkeypatch, capsys, tmp_path: Path) -> None:
    shot = _screenshot()
    monkeypatch.setattr(shot, "find_browser", lambda: None)
    monkeypatch.setattr(shot.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert shot.main(["docs_screenshot.py", str(tmp_path)]) == 0
    assert shot.main(["docs_screenshot.py", str(tmp_path), "--require-browser"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [shot.NO_BROWSER, shot.NO_BROWSER] and "apt-get install chromium-headless-shell" in lines[0]
