"""Render a gradleak report.html in headless Chromium (Debian package ``chromium``) and check it in a real browser:
every image decoded; an audit's report: the tables present, the verdict banner and "What to do next" shown; a run's
report: the answer sentence first, before any figure or section.

    python scripts/check_report_in_browser.py DIR/report.html [--screenshot PNG] [--text-only]

Prints what the browser saw and exits 1 when an image failed to load or a part is missing, 2 without Chromium.
``--text-only``: a report with no image (a text audit) passes with 0/0 images decoded. ``--screenshot PNG``: also
writes what the browser shows (1280 px wide, the full page height) to PNG.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def browser() -> str | None:
    return next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def render(report: Path, timeout: float = 60.0) -> str:
    """The DOM after the page's load event, as the browser serialises it."""
    exe = browser()
    if exe is None:
        raise FileNotFoundError("no Chromium: apt-get install chromium")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
           "--virtual-time-budget=5000", "--dump-dom", report.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout


def check(report: Path, images_required: bool = True, dom: str | None = None) -> list[str]:
    dom = render(report) if dom is None else dom
    problems = []
    m = re.search(r'data-images="(\d+)/(\d+)"', dom)
    if not m:
        problems.append("the load script did not run (no data-images on <body>)")
    elif m.group(1) != m.group(2):
        problems.append(f"only {m.group(1)} of {m.group(2)} images decoded")
    elif m.group(2) == "0" and images_required:
        problems.append("no image in the report")
    if "gradleak report</title>" in dom:  # a run's report (gradleak run): it opens with the answer sentence
        answer = dom.find('id="answer"')
        if answer < 0:
            problems.append("no answer sentence")
        elif answer > dom.find("<img") >= 0 or answer > dom.find("<h2>") >= 0:
            problems.append("the answer sentence is not the first thing on the page")
        return problems
    if 'id="verdict"' not in dom:
        problems.append("no verdict banner")
    if 'id="attacks"' not in dom:
        problems.append("no attacks table")
    if 'id="next"' not in dom:
        problems.append('no "What to do next" section')
    return problems


def screenshot(report: Path, png: Path, timeout: float = 60.0) -> None:
    """What the browser shows: 1280 px wide, tall enough for the whole page (height from the rendered DOM's size)."""
    exe = browser()
    if exe is None:
        raise FileNotFoundError("no Chromium: apt-get install chromium")
    png.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files", "--hide-scrollbars",
           "--virtual-time-budget=5000", "--window-size=1280,2400", f"--screenshot={png.resolve()}",
           report.resolve().as_uri()]
    subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if not png.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot to {png}")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("--screenshot", type=Path, default=None)
    ap.add_argument("--text-only", action="store_true", help="a report without images passes (a text audit)")
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    if browser() is None:
        print("no Chromium found: apt-get install chromium")
        return 2
    dom = render(args.report)
    problems = check(args.report, images_required=not args.text_only, dom=dom)
    m = re.search(r'data-images="([^"]+)" data-tables="([^"]+)"', dom)
    print(f"images decoded {m.group(1) if m else '?'}, tables {m.group(2) if m else '?'}")
    if args.screenshot is not None:
        screenshot(args.report, args.screenshot)
        print(f"screenshot: {args.screenshot}")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
