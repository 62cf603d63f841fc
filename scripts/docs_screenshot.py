"""Screenshots of the built documentation, with a check that the pages are neither blank nor unstyled.

Usage (``make docs`` runs it after ``mkdocs build --strict``)::

    .venv/bin/python scripts/docs_screenshot.py [SITE_DIR] [OUT_DIR]

Takes, with headless Chromium, a 1280x900 screenshot of the home page (``index.html``) and of one
estimator page (``estimators/score-function.html``) of ``SITE_DIR`` (default ``site``) into
``OUT_DIR`` (default ``SITE_DIR/_screenshots``), then checks each image:

* **not blank**: the page shows text, i.e. a fair number of dark pixels on the light background;
* **styled**: the Material theme's header bar is there, i.e. most of the top 40 pixel rows have the
  theme's primary colour (indigo, ``#4051b5``); an unstyled page (missing CSS) has a white top.

Chromium is looked up as ``chromium-headless-shell``, ``chromium``, ``chromium-browser`` or
``google-chrome`` (or ``$CHROMIUM``). When none is found and this runs as root on a Debian-like system
(as CI does), Debian's ``chromium-headless-shell`` package is installed with ``apt-get``; otherwise the
script stops with the command to run. Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image

PAGES = {"home": "index.html", "estimator": "estimators/score-function.html"}
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PRIMARY = (0x40, 0x51, 0xB5)  # Material's indigo header
WIDTH, HEIGHT = 1280, 900


def find_browser() -> str:
    """The path of a headless-capable Chromium, installing Debian's package when root can."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("docs_screenshot: no Chromium found; installing Debian's chromium-headless-shell", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium-headless-shell"],
            check=True,
            env=env,
        )
        found = shutil.which("chromium-headless-shell")
        if found:
            return found
    raise SystemExit(
        "docs_screenshot: headless Chromium is needed for the screenshot check. Install it "
        "(Debian/Ubuntu: `sudo apt-get install chromium-headless-shell` or `chromium`), or set "
        "CHROMIUM=/path/to/chrome."
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


def main(argv: list[str]) -> int:
    site = Path(argv[1]) if len(argv) > 1 else Path("site")
    out_dir = Path(argv[2]) if len(argv) > 2 else site / "_screenshots"
    browser = find_browser()
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
