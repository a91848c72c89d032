"""Render a gradleak report.html in headless Chromium (Debian package ``chromium``) and check it in a real browser:
every image decoded, the tables present, the verdict banner shown (issue 12 item 3).

    python scripts/check_report_in_browser.py DIR/report.html

Prints what the browser saw and exits 1 when an image failed to load or a part is missing, 2 without Chromium.
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


def check(report: Path) -> list[str]:
    dom = render(report)
    problems = []
    m = re.search(r'data-images="(\d+)/(\d+)"', dom)
    if not m:
        problems.append("the load script did not run (no data-images on <body>)")
    elif m.group(1) != m.group(2):
        problems.append(f"only {m.group(1)} of {m.group(2)} images decoded")
    elif m.group(2) == "0":
        problems.append("no image in the report")
    if 'id="verdict"' not in dom:
        problems.append("no verdict banner")
    if 'id="attacks"' not in dom:
        problems.append("no attacks table")
    return problems


def main(argv=None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(__doc__)
        return 2
    if browser() is None:
        print("no Chromium found: apt-get install chromium")
        return 2
    problems = check(Path(args[0]))
    dom = render(Path(args[0]))
    m = re.search(r'data-images="([^"]+)" data-tables="([^"]+)"', dom)
    print(f"images decoded {m.group(1) if m else '?'}, tables {m.group(2) if m else '?'}")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
