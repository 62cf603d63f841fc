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


def test_table_check_on_measurements() -> None:
    """A table cut off at the right edge, or a word of a cell broken inside it, fails the page."""
    shot = _screenshot()
    fine = {"blocks": 0, "chars": None, "cut": [], "wide": [], "tables": 4, "tables_cut": [], "broken": []}
    assert shot.check_tables({"results.html": fine}) == []
    problems = shot.check_tables({
        "results.html": {**fine, "tables_cut": [{"px": 38, "head": "estimator | ms/step"},
                                                {"px": 453, "head": "model | test −log p(x)"}]},
        "estimators/index.html": {**fine, "broken": ["Reparameterization", "ScoreFunction"]},
        "broken.html": {"error": "no frame"},  # check_code reports it
    })
    assert [p.split(":")[0] for p in problems] == ["estimators/index.html", "results.html"]
    assert "2 word(s)" in problems[0] and "'Reparameterization'" in problems[0]
    assert "2 table(s) cut off" in problems[1] and "up to 453 px" in problems[1] and "test −log p(x)" in problems[1]


def test_styled_check_on_measurements() -> None:
    shot = _screenshot()
    styled = {"styled": "rgb(64, 81, 181)", "text": 5000}
    assert shot.check_styled({"index.html": styled, "old.html": {"error": "x"}}) == []
    problems = shot.check_styled({
        "a.html": {"styled": None, "text": 5000},
        "b.html": {"styled": "rgb(255, 255, 255)", "text": 0},
    })
    assert problems == [
        "a.html: unstyled: the header is missing, not the theme's rgb(64, 81, 181)",
        "b.html: unstyled: the header is rgb(255, 255, 255), not the theme's rgb(64, 81, 181)",
        "b.html: blank: 0 characters of text",
    ]


def test_measurement_script_measures_tables_and_words() -> None:
    """The browser side measures what the checks read (the script itself runs in Chromium)."""
    js = _screenshot()._MEASURE_JS
    for key in ("tables_cut", "broken", "scrollWidth", "md-typeset__scrollwrap", "getClientRects", "styled"):
        assert key in js


# --------------------------------------------------------------------------------------------
# the site's hooks (scripts/docs_hooks.py)
# --------------------------------------------------------------------------------------------

hooks = _load("docs_hooks")
FILES = frozenset({"benchmarks/sbn_step.py", "benchmarks/README.md", "docs/results/tables.py",
                   "tests/test_arm.py", "storch/method/expect.py", "storch/sampling/expect.py"})
REPO = "https://github.com/storch-dev/storch"


def test_hook_links_code_spans_that_name_repository_files() -> None:
    page = ("<p>See <code>benchmarks/sbn_step.py</code>, <code>docs/results/</code> and "
            "<code>test_arm.py</code>.</p>")
    linked = hooks.link_file_mentions(page, FILES, REPO + "/")
    assert linked == (
        f'<p>See <a href="{REPO}/blob/main/benchmarks/sbn_step.py" title="benchmarks/sbn_step.py in the '
        'repository"><code>benchmarks/sbn_step.py</code></a>, '
        f'<a href="{REPO}/tree/main/docs/results" title="docs/results in the repository">'
        '<code>docs/results/</code></a> and '
        f'<a href="{REPO}/blob/main/tests/test_arm.py" title="tests/test_arm.py in the repository">'
        "<code>test_arm.py</code></a>.</p>"
    )


def test_hook_leaves_everything_else_as_it_is() -> None:
    page = (
        "<p><code>runs/arm</code> <code>summary.json</code> <code>expect.py</code> <code>x = 1</code> "
        "<code>benchmarks/sbn_step.py --check</code> <code>/benchmarks/README.md</code></p>"
        '<pre><span></span><code>python benchmarks/sbn_step.py</code></pre>'
        '<pre><code>benchmarks/sbn_step.py</code></pre>'
        '<p><a href="x.html"><code>benchmarks/sbn_step.py</code></a></p>'
        '<h2 id="a"><code>benchmarks/README.md</code></h2>'
    )  # run outputs, an ambiguous name, code, a command, an absolute path; code blocks, links, headings
    assert hooks.link_file_mentions(page, FILES, REPO) == page


def test_hook_breaks_names_in_tables_at_their_dots() -> None:
    page = ("<p><code>storch.sampling.MCDecoder</code> 1.5 ± 0.2</p><table><tr><td><code>storch.sampling.MCDecoder(k=2)"
            "</code> <code>SampleWithoutReplacement</code></td><td>208.91 ± 0.03, x ± y</td></tr></table>")
    assert hooks.break_names_in_tables(page) == (
        "<p><code>storch.sampling.MCDecoder</code> 1.5 ± 0.2</p><table><tr><td><code>storch.<wbr>sampling.<wbr>"
        "MCDecoder(<wbr>k=<wbr>2)</code> <code>SampleWithoutReplacement</code></td>"
        "<td>208.91\u00a0±\u00a00.03, x ± y</td></tr></table>"
    )  # only in tables: a value and its error on one line


def test_hook_reads_the_repository_and_is_registered() -> None:
    files = hooks.repository_files()
    assert {"benchmarks/sbn_step.py", "docs/results.md", "scripts/docs_lint.py"} <= files
    assert not any(f.startswith(("site/", ".venv/")) for f in files)
    assert hooks.resolve("benchmarks/", files) == ("benchmarks", True)
    assert hooks.resolve("sbn_step.py", files) == ("benchmarks/sbn_step.py", False)
    config = (ROOT / "mkdocs.yml").read_text()
    assert "- scripts/docs_hooks.py" in config and f"repo_url: {REPO}\n" in config


def test_hook_on_a_page() -> None:
    html_in = "<table><tr><td><code>benchmarks/README.md</code></td></tr></table>"
    out = hooks.on_page_content(html_in, page=None, config={"repo_url": REPO}, files=None)
    assert f'href="{REPO}/blob/main/benchmarks/README.md"' in out and "benchmarks/<wbr>README.<wbr>md" in out
    assert hooks.on_page_content("<p><code>benchmarks/README.md</code></p>", None, {}, None) == (
        "<p><code>benchmarks/README.md</code></p>"
    )


def test_hook_without_git_walks_the_tree(monkeypatch, tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text("")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("")

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(hooks.subprocess, "run", no_git)
    assert hooks.repository_files.__wrapped__(tmp_path) == frozenset({"benchmarks/run.py"})


def test_lint_finds_lists_that_did_not_render() -> None:
    """A Markdown list right after a paragraph's last line renders as text: "* item" in the page."""
    page = """<html><body>
<p>Leaving each piece out measured:
* 45 µs for the backward pass;
1. first</p>
<ul><li>a list that rendered</li></ul>
<p>a - b and 3 * 4 on one line</p>
<pre><code>* a bullet in code
</code></pre>
</body></html>"""
    findings = lint.lint_html(Path("page.html"), page)
    assert [(f.line, f.rule, f.text) for f in findings] == [
        (3, "literal-list", "* 45 µs for the backward pass;"),
        (4, "literal-list", "1. first"),
    ]
