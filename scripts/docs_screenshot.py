"""Screenshots of the built documentation, with a check that the pages are neither blank nor unstyled
and that no code block or table runs past the right edge of the page.

Usage (``make docs`` runs it after ``mkdocs build --strict``)::

    .venv/bin/python scripts/docs_screenshot.py [SITE_DIR] [OUT_DIR] [--require-browser]

Takes, with headless Chromium, a 1280x900 screenshot of the home page (``index.html``) and of one
estimator page (``estimators/score-function.html``) of ``SITE_DIR`` (default ``site``) into
``OUT_DIR`` (default ``SITE_DIR/_screenshots``), then checks each image:

* **not blank**: the page shows text, i.e. a fair number of dark pixels on the light background;
* **styled**: the Material theme's header bar is there, i.e. most of the top 40 pixel rows have the
  theme's primary colour (indigo, ``#4051b5``); an unstyled page (missing CSS) has a white top.

Then it loads every page of the site at a 1280-pixel width (one browser run per page, in a frame)
and checks it:

* **styled and not blank**: the theme's header bar has its primary colour and the page has text;
* **tables fit**: no table of the page's content is cut off at the right edge, i.e. hidden past the
  table's own box, the theme's scroll wrapper around it or the content column (a table that only
  shows its right part by scrolling counts as cut off), and no word of a table cell is broken
  across two lines inside the word (``Reparameteri`` / ``zation``; breaks at a space, hyphen, dash,
  slash, dot, comma, ``=``, ``(``, ``)`` or ``_`` are fine);

and measures its code blocks (``pre > code``):

* **not cut off**: no code block is wider than its box (``scrollWidth > clientWidth``), i.e. no line
  runs past the right edge (the site's CSS wraps long lines; without it they would be cut off);
* **the width of a line**: a code block holds at least ``docs_lint.CODE_WIDTH`` characters per line,
  the limit ``scripts/docs_lint.py`` holds the Markdown sources to; and no line of a page written in
  ``docs/`` is wider than its block (it would wrap). Lines of the API pages (from the docstrings)
  that wrap are counted, not failed.

Chromium is looked up as ``chromium-headless-shell``, ``chromium``, ``chromium-browser`` or
``google-chrome`` (or ``$CHROMIUM``). This script installs nothing: when none is found it prints
how to get one and exits with 0, or with 1 under ``--require-browser`` (as CI runs it, after
installing the browser itself: ``.ci/run``). Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_lint import CODE_WIDTH  # noqa: E402  (the limit the Markdown sources are held to)

PAGES = {"home": "index.html", "estimator": "estimators/score-function.html"}
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PRIMARY = (0x40, 0x51, 0xB5)  # Material's indigo header
WIDTH, HEIGHT = 1280, 900


def find_browser() -> str | None:
    """The path of a headless-capable Chromium, or ``None``."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


NO_BROWSER = (
    "docs_screenshot: no headless Chromium found, screenshot and code-width checks skipped; to run "
    "them install one (Debian/Ubuntu: `sudo apt-get install chromium-headless-shell`) or set "
    "CHROMIUM=/path/to/chrome"
)


def screenshot(browser: str, page: Path, out: Path) -> None:
    """A ``WIDTH`` x ``HEIGHT`` screenshot of the local file ``page`` into ``out`` (PNG)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={out}", page.resolve().as_uri(),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if not out.exists():
        raise RuntimeError(f"{browser} made no screenshot of {page} (exit {result.returncode}):\n{result.stderr[-2000:]}")


def _close(pixel: tuple[int, ...], colour: tuple[int, int, int], tolerance: int = 40) -> bool:
    return all(abs(int(p) - c) <= tolerance for p, c in zip(pixel[:3], colour))


def check_image(path: Path) -> list[str]:
    """What is wrong with a screenshot: ``[]`` when it shows a styled page with text."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    problems = []
    pixels = image.load()
    header = [pixels[x, y] for y in range(5, 40, 5) for x in range(0, width, 8)]
    share_primary = sum(_close(p, PRIMARY) for p in header) / len(header)
    if share_primary < 0.5:
        problems.append(
            f"unstyled: only {share_primary:.0%} of the top rows have the theme's header colour "
            f"#{PRIMARY[0]:02x}{PRIMARY[1]:02x}{PRIMARY[2]:02x} (CSS missing?)"
        )
    body = [pixels[x, y] for y in range(80, height, 4) for x in range(0, width, 4)]
    dark = sum(sum(p) < 3 * 128 for p in body) / len(body)
    if dark < 0.005:
        problems.append(f"blank: {dark:.2%} of the page body is text-dark (expected at least 0.5%)")
    return problems


# Loads each page in turn into a 1280-pixel-wide frame and measures its code blocks and tables; the results go,
# as JSON, into a <pre id="result"> that --dump-dom prints.
_MEASURE_JS = r"""
const pages = %(pages)s;
const results = {};
const frame = document.getElementById("page");
function measure(doc) {
  const out = {blocks: 0, chars: null, cut: [], wide: [], tables: 0, tables_cut: [], broken: [],
               height: doc.documentElement.scrollHeight, styled: null, text: 0};
  const header = doc.querySelector(".md-header");
  out.styled = header ? doc.defaultView.getComputedStyle(header).backgroundColor : null;
  const article = doc.querySelector("article") || doc.body;
  out.text = article.textContent.trim().length;
  const right = article.getBoundingClientRect().right;
  doc.querySelectorAll("article table").forEach((table) => {
    if (!(table.clientWidth > 0)) return;  // not displayed
    out.tables++;
    // hidden to the right: the table's own scroll box, the theme's scroll wrapper around it, and
    // what lies past the content column
    let hidden = table.scrollWidth - table.clientWidth;
    const wrap = table.closest(".md-typeset__scrollwrap");
    if (wrap) hidden = Math.max(hidden, wrap.scrollWidth - wrap.clientWidth);
    hidden = Math.max(hidden, Math.ceil(table.getBoundingClientRect().right - right));
    const head = (table.querySelector("th, td") || table).textContent.trim();
    const label = [...table.querySelectorAll("th")].map((th) => th.textContent.trim()).join(" | ");
    if (hidden > 1) out.tables_cut.push({px: hidden, head: (label || head).slice(0, 70)});
    // a word of a cell broken across two lines (not at a space, hyphen, slash or dot)
    table.querySelectorAll("th, td").forEach((cell) => {
      const walker = doc.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const re = /[^\s\-\/.,=(|)_\u2013\u2014\u2026]+/g;
        let match;
        while ((match = re.exec(node.data)) !== null) {
          if (match[0].length < 2) continue;
          const range = doc.createRange();
          range.setStart(node, match.index);
          range.setEnd(node, match.index + match[0].length);
          const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
          if (tops.size > 1) out.broken.push(match[0].slice(0, 40));
        }
      }
    });
  });
  doc.querySelectorAll("pre > code").forEach((code) => {
    const style = doc.defaultView.getComputedStyle(code);
    const probe = doc.createElement("span");
    probe.style.whiteSpace = "pre";
    probe.textContent = "x".repeat(100);
    code.appendChild(probe);
    const charWidth = probe.getBoundingClientRect().width / 100;
    probe.remove();
    const inner = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    if (!(inner > 0 && charWidth > 0)) return;  // not displayed (a closed tab, say)
    out.blocks++;
    const chars = Math.floor(inner / charWidth + 0.01);
    if (out.chars === null || chars < out.chars) out.chars = chars;
    const lines = code.textContent.replace(/\n$/, "").split("\n");
    const longest = lines.reduce((a, l) => (l.length > a.length ? l : a), "");
    if (code.scrollWidth > code.clientWidth + 1) out.cut.push(longest.slice(0, 70));
    if (longest.length > chars) out.wide.push(longest.slice(0, 70));
  });
  return out;
}
let i = 0;
function next() {
  if (i < pages.length) { frame.src = pages[i]; return; }
  const pre = document.createElement("pre");
  pre.id = "result";
  pre.textContent = JSON.stringify(results);
  document.body.appendChild(pre);
}
frame.onload = () => {
  try { results[pages[i]] = measure(frame.contentDocument); }
  catch (error) { results[pages[i]] = {error: String(error)}; }
  i++;
  next();
};
next();
"""


def measure_code(browser: str, site: Path, pages: list[str]) -> dict[str, dict]:
    """For each page (a path relative to ``site``), its code blocks and tables at a ``WIDTH``-pixel window.

    Each entry: ``blocks`` (how many), ``chars`` (the fewest characters per line a block holds),
    ``cut`` and ``wide`` (the beginnings of the longest lines of the blocks wider than their box,
    and of those whose longest line is wider than the block holds); ``tables`` (how many),
    ``tables_cut`` (``{"px": hidden pixels, "head": the column headings}`` of each table cut off at
    the right), ``broken`` (the words of table cells broken across lines inside the word);
    ``height`` (the page's height in pixels), ``styled`` (the header's background colour, CSS
    ``rgb(...)``) and ``text`` (characters of text of the page's content).

    One browser run per page (about a second each): one run loading every page in turn into a frame
    stalled on this site with 33 pages, though each page alone measures at once.
    """
    measured: dict[str, dict] = {}
    for page in pages:
        measured.update(_measure_pages(browser, site, [page]))
    return measured


def _measure_pages(browser: str, site: Path, pages: list[str]) -> dict[str, dict]:
    """``measure_code`` for ``pages`` in one browser run."""
    harness = site / "_code_widths.html"
    frame = f'<iframe id="page" style="width:{WIDTH}px;height:{HEIGHT}px;border:0"></iframe>'
    script = _MEASURE_JS % {"pages": json.dumps(pages)}
    harness.write_text(f"<!doctype html><html><body>{frame}<script>{script}</script></body></html>")
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
        f"--window-size={WIDTH + 100},{HEIGHT + 100}", "--virtual-time-budget=120000", "--dump-dom",
        harness.resolve().as_uri(),
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        harness.unlink()
    found = re.search(r'<pre id="result">(.*?)</pre>', result.stdout, re.DOTALL)
    if not found:
        raise RuntimeError(f"{browser} measured no page (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return json.loads(html.unescape(found.group(1)))


def check_tables(measured: dict[str, dict]) -> list[str]:
    """What is wrong with the tables of ``measure_code``'s measurements: ``[]`` when every one fits."""
    problems = []
    for page, m in sorted(measured.items()):
        if "error" in m:
            continue  # check_code reports it
        cut = m.get("tables_cut", [])
        if cut:
            widest = max(cut, key=lambda t: t["px"])
            problems.append(f"{page}: {len(cut)} table(s) cut off at the right edge at {WIDTH} px, up to "
                            f"{widest['px']} px hidden (columns {widest['head']!r})")
        broken = m.get("broken", [])
        if broken:
            problems.append(f"{page}: {len(broken)} word(s) of table cells broken inside the word, "
                            f"the first {broken[0]!r}")
    return problems


def check_styled(measured: dict[str, dict], primary: tuple[int, int, int] = PRIMARY) -> list[str]:
    """Pages of ``measure_code``'s measurements without the theme's header colour or without text."""
    problems = []
    want = "rgb({}, {}, {})".format(*primary)
    for page, m in sorted(measured.items()):
        if "error" in m or "styled" not in m:
            continue
        if m["styled"] != want:
            problems.append(f"{page}: unstyled: the header is {m['styled'] or 'missing'}, not the theme's {want}")
        if m.get("text", 0) < 20:
            problems.append(f"{page}: blank: {m.get('text', 0)} characters of text")
    return problems


def check_code(measured: dict[str, dict], width: int = CODE_WIDTH) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of ``measure_code``'s measurements: ``problems == []`` when they pass."""
    problems, notes = [], []
    for page, m in sorted(measured.items()):
        if "error" in m:
            problems.append(f"{page}: not measured ({m['error']})")
            continue
        if m["cut"]:
            problems.append(f"{page}: {len(m['cut'])} code block(s) cut off at the right edge, "
                            f"the first at the line {m['cut'][0]!r}")
        if m["chars"] is not None and m["chars"] < width:
            problems.append(f"{page}: a code block holds {m['chars']} characters per line at {WIDTH} px, "
                            f"fewer than the {width} that docs_lint.CODE_WIDTH allows")
        if m["wide"]:
            if page.startswith("api/"):
                notes.append(f"{page}: {len(m['wide'])} code block(s) with a line that wraps (from the docstrings)")
            else:
                problems.append(f"{page}: {len(m['wide'])} code block(s) with a line wider than the block "
                                f"(it wraps), the first {m['wide'][0]!r}")
    return problems, notes


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("--")]
    require_browser = "--require-browser" in argv[1:]
    site = Path(args[0]) if args else Path("site")
    out_dir = Path(args[1]) if len(args) > 1 else site / "_screenshots"
    browser = find_browser()
    if browser is None:
        print(NO_BROWSER)
        return 1 if require_browser else 0
    failed = False
    for name, rel in PAGES.items():
        page = site / rel
        if not page.exists():
            print(f"docs_screenshot: {page} does not exist; build the site first (make docs)")
            return 1
        out = out_dir / f"{name}.png"
        screenshot(browser, page, out)
        problems = check_image(out)
        status = "ok" if not problems else "FAILED: " + "; ".join(problems)
        print(f"docs_screenshot: {rel} -> {out}: {status}")
        failed |= bool(problems)
    pages = sorted(
        p.relative_to(site).as_posix() for p in site.rglob("*.html")
        if not p.name.startswith("_") and p.name != "404.html"
    )
    measured = measure_code(browser, site, pages)
    problems, notes = check_code(measured)
    problems += check_tables(measured) + check_styled(measured)
    blocks = sum(m.get("blocks", 0) for m in measured.values())
    tables = sum(m.get("tables", 0) for m in measured.values())
    for note in notes:
        print(f"docs_screenshot: note: {note}")
    for problem in problems:
        print(f"docs_screenshot: FAILED: {problem}")
    if not problems:
        chars = min((m["chars"] for m in measured.values() if m.get("chars") is not None), default=None)
        print(f"docs_screenshot: {len(pages)} pages at {WIDTH} px, styled: {blocks} code blocks and "
              f"{tables} tables, none cut off, no word of a table broken, {chars} characters per code "
              f"line: ok")
    failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
