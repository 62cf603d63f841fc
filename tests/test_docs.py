"""Every Python code block of the documentation runs, and shows the output it claims.

The pages are ``docs/**/*.md`` and ``README.md``. On each page:

* every fenced block opened with ```` ```python ```` runs, in page order, in one namespace per page
  (a later block may use names an earlier one defined), from the repository root, after
  ``torch.manual_seed(0)`` and ``storch.reset()``, with one torch thread and torch.distributions'
  argument validation on (as in a new process);
* a fenced ```` ```text ```` block that follows a Python block directly (only blank lines between)
  is that block's printed output: what the block prints must match it, compared as doctest compares
  (``...`` matches anything, runs of whitespace are equal), except that a decimal number may differ
  by one unit in its last printed digit (``tests/docs_output.py`` states the rule);
* blocks in other languages (``bash``, ``text`` on its own) are not run.

So a page cannot drift from the library: an example that stops running, or whose printed numbers
change, fails here with the page, the line and the difference.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import storch
from docs_output import outputs_agree

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>[^\n`]*)$")


@dataclass
class Block:
    """One fenced code block: its language, first line number (1-based) and source."""

    language: str
    line: int
    source: str
    output: str | None = None  # the ```text block right after it, for Python blocks


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, each Python block with its output block, if any.

    Example:
        >>> page = "intro\\n```python\\nprint(1 + 1)\\n```\\n\\n```text\\n2\\n```\\n"
        >>> [(b.language, b.line, b.source, b.output) for b in parse_blocks(page)]
        [('python', 2, 'print(1 + 1)\\n', '2\\n')]
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    last_end = -10  # index of the closing fence of the previous block
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        language = m.group("info").strip().split(" ")[0].lower() if m.group("info").strip() else ""
        body = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"unclosed code fence opened at line {i + 1}")
        source = "\n".join(body) + "\n"
        between = lines[last_end + 1 : i]
        follows_python = (
            blocks and blocks[-1].language == "python" and blocks[-1].output is None
            and all(not s.strip() for s in between)
        )
        if language == "text" and follows_python:
            blocks[-1].output = source
        else:
            blocks.append(Block(language, i + 1, source))
        last_end = j
        i = j + 1
    return blocks


def run_page(path: Path) -> None:
    """Run the Python blocks of one page; raise ``AssertionError`` naming the first that fails."""
    blocks = [b for b in parse_blocks(path.read_text(encoding="utf-8")) if b.language == "python"]
    # the page runs as a module of its own, registered while it runs: TorchDynamo (torch 2.11) looks
    # up the module of the code it compiles by its __name__
    page = types.ModuleType(f"docs_page_{path.stem.replace('-', '_')}")
    namespace: dict = page.__dict__
    sys.modules[page.__name__] = page
    rel = path.relative_to(ROOT)
    storch.reset()
    torch.manual_seed(0)
    cwd, threads = os.getcwd(), torch.get_num_threads()
    validation = torch.distributions.Distribution._validate_args
    os.chdir(ROOT)
    torch.set_num_threads(1)  # the pages' small examples: threads only add contention on a busy machine
    # as in a new process: an earlier torch.compile in this one turned torch's validation off
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        for block in blocks:
            captured = io.StringIO()
            code = compile(block.source, f"{rel}:{block.line}", "exec")
            try:
                with contextlib.redirect_stdout(captured):
                    exec(code, namespace)  # noqa: S102  (the page's own example)
            except Exception as error:
                raise AssertionError(
                    f"{rel}, code block at line {block.line} raised {type(error).__name__}: {error}"
                ) from error
            if block.output is not None and not outputs_agree(block.output, captured.getvalue()):
                raise AssertionError(
                    f"{rel}, code block at line {block.line}: printed output differs from the page.\n"
                    f"--- page shows:\n{block.output}--- printed:\n{captured.getvalue()}"
                )
    finally:
        sys.modules.pop(page.__name__, None)
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.distributions.Distribution.set_default_validate_args(validation)
        storch.reset()


def test_every_page_is_collected() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert "README.md" in names and "docs/index.md" in names
    assert any(n.startswith("docs/tutorials/") for n in names)
    assert any(n.startswith("docs/estimators/") for n in names)


def test_pages_have_python_blocks() -> None:
    """The tutorials and estimator pages teach by example: each has code that runs here."""
    for path in PAGES:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("docs/tutorials/", "docs/estimators/")) and not rel.endswith("index.md"):
            blocks = parse_blocks(path.read_text(encoding="utf-8"))
            assert any(b.language == "python" for b in blocks), f"{rel} has no Python example"


def test_parse_attaches_output_only_directly_after_python() -> None:
    page = "```python\nx = 1\n```\ntext between\n```text\nnot output\n```\n```python\nprint(x)\n```\n```text\n1\n```\n"
    blocks = parse_blocks(page)
    assert [(b.language, b.output) for b in blocks] == [("python", None), ("text", None), ("python", "1\n")]


def test_a_wrong_output_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(2)\n```\n\n```text\n3\n```\n")
    global ROOT
    saved = ROOT
    ROOT = tmp_path
    try:
        with pytest.raises(AssertionError, match="printed output differs"):
            run_page(page)
    finally:
        ROOT = saved


@pytest.mark.parametrize(("printed", "passes"), [("1.41", True), ("1.39", True), ("1.42", False), ("1.4", True)])
def test_a_decimal_may_differ_by_its_last_digit(tmp_path: Path, printed: str, passes: bool) -> None:
    """The one tolerance of every page: a decimal number within one unit of its last shown digit."""
    page = tmp_path / "page.md"
    page.write_text(f"```python\nprint('after {printed}')\n```\n\n```text\nafter 1.40\n```\n")
    global ROOT
    saved = ROOT
    ROOT = tmp_path
    try:
        with contextlib.nullcontext() if passes else pytest.raises(AssertionError, match="printed output differs"):
            run_page(page)
    finally:
        ROOT = saved


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_runs(path: Path) -> None:
    run_page(path)


def _screenshot_checker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_screenshot", ROOT / "scripts" / "docs_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_screenshot_check_tells_blank_and_unstyled_pages(tmp_path: Path) -> None:
    """``make docs``'s screenshot check (scripts/docs_screenshot.py) on synthetic screenshots."""
    from PIL import Image, ImageDraw

    checker = _screenshot_checker()
    blank = Image.new("RGB", (1280, 900), "white")
    blank.save(tmp_path / "blank.png")
    problems = checker.check_image(tmp_path / "blank.png")
    assert any(p.startswith("unstyled") for p in problems) and any(p.startswith("blank") for p in problems)

    styled = Image.new("RGB", (1280, 900), "white")
    draw = ImageDraw.Draw(styled)
    draw.rectangle((0, 0, 1280, 48), fill=checker.PRIMARY)  # the theme's header bar
    for row in range(120, 800, 24):  # lines of "text"
        draw.rectangle((300, row, 980, row + 6), fill="black")
    styled.save(tmp_path / "styled.png")
    assert checker.check_image(tmp_path / "styled.png") == []

    header_only = Image.new("RGB", (1280, 900), "white")
    ImageDraw.Draw(header_only).rectangle((0, 0, 1280, 48), fill=checker.PRIMARY)
    header_only.save(tmp_path / "header_only.png")
    assert [p.split(":")[0] for p in checker.check_image(tmp_path / "header_only.png")] == ["blank"]
