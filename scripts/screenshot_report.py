"""Render a run's HTML report to a PNG with headless Chromium: `python scripts/screenshot_report.py RUN out.png`.

RUN is a run folder (or a run name under --runs-dir). The report is (re)written first, opened from disk (it is
self-contained), the timeline is hovered so that the tooltip shows, and the page is captured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def screenshot(report: Path, out: Path, width: int = 1400, full_page: bool = True, hover: bool = True,
               executable: str = CHROMIUM, section: str | None = None) -> list[str]:
    """Open `report` (an HTML file) in headless Chromium, hover the longest instruction, save a PNG to `out` (the
    whole page, the window, or one section such as `timeline-section`). Returns the console errors the page
    produced (empty when it loaded cleanly)."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report.resolve().as_uri(), wait_until="load", timeout=30_000)
            if hover and page.evaluate("() => !!window.__timeline"):
                page.locator("#timeline-section").scroll_into_view_if_needed()
                pos = page.evaluate("() => window.__timeline.positionOf(window.__timeline.longest())")
                if pos:
                    page.mouse.move(pos["x"], pos["y"])
            out.parent.mkdir(parents=True, exist_ok=True)
            if section:
                if page.locator(f"#{section}").count() == 0:
                    raise SystemExit(f"error: the report has no section #{section}")
                page.locator(f"#{section}").screenshot(path=str(out))
            else:
                page.screenshot(path=str(out), full_page=full_page)
        finally:
            browser.close()
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run folder, or a run name under --runs-dir")
    ap.add_argument("out", help="PNG file to write")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--viewport-only", action="store_true", help="capture the window, not the whole page")
    ap.add_argument("--section", help="capture one section only: summary, chart, curve, timeline-section, per-op, "
                    "critical-path, validation, leaderboard, rejected")
    ap.add_argument("--chromium", default=CHROMIUM, help="path of the Chromium executable")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from megasynth.runs.report import write_index, write_report

    run = Path(a.run)
    if not run.is_dir():
        run = Path(a.runs_dir) / a.run
    if not run.is_dir():
        print(f"error: run {a.run!r} not found (neither a folder nor under {a.runs_dir}/)", file=sys.stderr)
        return 2
    if not Path(a.chromium).exists():
        print(f"error: Chromium not found at {a.chromium} (apt-get install chromium)", file=sys.stderr)
        return 2
    report = write_report(run)
    write_index(run.parent)
    errors = screenshot(report, Path(a.out), a.width, full_page=not a.viewport_only, executable=a.chromium,
                        section=a.section)
    for e in errors:
        print(f"console error: {e}", file=sys.stderr)
    print(f"{a.out}: screenshot of {report}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
