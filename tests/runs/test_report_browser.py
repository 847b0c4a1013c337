"""The HTML reports in a real browser (headless Chromium driven by Playwright): the index and a report load with no
console errors, the timeline has one lane per worker, hovering shows an instruction, 10 000+ instructions redraw
fast; screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from screenshot_report import CHROMIUM_ARGS  # noqa: E402
from test_runs_cli import make_run, search_run  # noqa: E402

from megasynth.atomic import write_json_atomic  # noqa: E402
from megasynth.commands.runs import serve_in_thread  # noqa: E402
from megasynth.runs.rundir import read_stored  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def browser() -> Any:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("runs")
    make_run(root, "20261130-tiny-a", workers=8)
    make_run(root, "20261130-tiny-b", workers=5)
    big_run(root / "20261130-big")
    server, thread = serve_in_thread(root, 0)
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def big_run(run: Path, lanes: int = 132, n: int = 12_000) -> None:
    """A run whose trace has `n` instructions on `lanes` SMs (the size of a llama-1b step), measured (no estimate)."""
    rng = random.Random(0)
    ops = ["attn_norm_qkv_rope", "attn_partial", "o_proj_residual", "mlp_norm_gate_up", "down_proj_residual"]
    events: list[dict[str, Any]] = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": w, "args": {"name": f"SM {w}"}}
                                    for w in range(lanes)]
    t = [0.0] * lanes
    for i in range(n):
        w = i % lanes
        wait = rng.random() * 0.5 if rng.random() < 0.3 else 0.0
        dur = 0.5 + rng.random() * 2
        op = ops[(i * 5 // n + i) % len(ops)]
        events.append({"name": f"{op} L{i % 16}", "cat": op, "ph": "X", "pid": 0, "tid": w, "ts": t[w] + wait,
                       "dur": dur, "args": {"id": i, "op": op, "layer": i % 16, "wait_us": wait}})
        t[w] += wait + dur
    write_json_atomic(run / "best" / "trace.json", {"traceEvents": events, "metadata": {
        "model": "llama-1b", "device": "NVIDIA H200", "ctx": 1024, "estimated": False, "schedule_sha256": ""}})
    write_json_atomic(run / "run.json", {"model": "llama-1b", "gpu": "NVIDIA H200", "command": ["synth", "search"]})
    write_json_atomic(run / "leaderboard.json", [{"candidate": "c0000", "proposer": "naive", "accepted": True,
                                                 "ms": 1.9, "estimated": False}])


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    resp = page.goto(url, wait_until="load", timeout=30_000)
    assert resp is not None and resp.status == 200, url
    return page, errors


def test_index_loads_and_links_every_report(browser: Any, served: Any) -> None:
    root, base = served
    page, errors = open_page(browser, f"{base}/index.html")
    links = page.locator("#runs a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
    assert sorted(links) == ["20261130-big/report.html", "20261130-tiny-a/report.html", "20261130-tiny-b/report.html"]
    page.click("text=20261130-tiny-a")
    page.wait_for_load_state("load")
    assert page.url.endswith("/20261130-tiny-a/report.html")
    assert errors == []
    page.close()


@pytest.mark.parametrize(("name", "workers"), [("20261130-tiny-a", 8), ("20261130-tiny-b", 5)])
def test_report_timeline_one_lane_per_worker_and_hover(browser: Any, served: Any, name: str, workers: int) -> None:
    root, base = served
    page, errors = open_page(browser, f"{base}/{name}/report.html")
    queues = json.loads((root / name / "best" / "schedule.json").read_text())["queues"]
    assert len(queues) == workers
    assert page.evaluate("() => window.__timeline.lanes") == workers
    assert page.locator("#timeline").get_attribute("data-lanes") == str(workers)
    n = len(json.loads((root / name / "best" / "schedule.json").read_text())["instructions"])
    assert page.evaluate("() => window.__timeline.instructions") == n
    # hover the longest instruction: the tooltip names it, with op, layer and wait time
    ident = page.evaluate("() => window.__timeline.longest()")
    page.locator("#timeline-section").scroll_into_view_if_needed()
    pos = page.evaluate(f"() => window.__timeline.positionOf({ident})")
    page.mouse.move(pos["x"], pos["y"])
    tip = page.locator("#tip")
    assert tip.is_visible()
    box = tip.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 1400  # inside the window, even at the right edge
    text = tip.inner_text()
    assert text.startswith(f"#{ident} ") and "waited" in text and "estimated" in text
    trace = json.loads((root / name / "best" / "trace.json").read_text())
    ev = next(e for e in trace["traceEvents"] if e.get("ph") == "X" and e["args"]["id"] == ident)
    assert ev["args"]["op"] in text and f"L{ev['args']['layer']}" in text
    page.mouse.move(2, 2)
    assert not tip.is_visible()
    assert page.locator("svg.seq").count() >= 1  # the rejected race, drawn as a sequence diagram
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"report-{name}.png"), full_page=True)
    assert errors == []
    page.close()


def test_real_search_run_in_the_browser(browser: Any, tmp_path: Path) -> None:
    """A run written by `synth search --model tiny --budget 3`: its report and the index load cleanly, one lane per
    worker of the best schedule, hovering names an instruction."""
    run = search_run(tmp_path)
    server, thread = serve_in_thread(tmp_path, 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        page, errors = open_page(browser, f"{base}/index.html")
        assert page.locator("#runs a").count() == 1
        page.click(f"text={run.name}")
        page.wait_for_load_state("load")
        queues = read_stored(run / "best" / "schedule.json")["queues"]  # a search writes it compressed
        assert page.evaluate("() => window.__timeline.lanes") == len(queues)
        ident = page.evaluate("() => window.__timeline.longest()")
        page.locator("#timeline-section").scroll_into_view_if_needed()
        pos = page.evaluate(f"() => window.__timeline.positionOf({ident})")
        page.mouse.move(pos["x"], pos["y"])
        assert page.locator("#tip").inner_text().startswith(f"#{ident} ")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report-search-tiny.png"), full_page=True)
        assert errors == []
        page.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_ten_thousand_instructions_stay_smooth(browser: Any, served: Any) -> None:
    root, base = served
    page, errors = open_page(browser, f"{base}/20261130-big/report.html")
    assert page.evaluate("() => window.__timeline.lanes") == 132
    assert page.evaluate("() => window.__timeline.instructions") == 12_000
    ms = page.evaluate("() => window.__timeline.benchmark(20)")
    print(f"timeline redraw with 12 000 instructions on 132 lanes: {ms:.2f} ms per frame")
    assert ms < 50, f"{ms:.1f} ms per redraw"
    page.mouse.move(*_center(page))
    page.mouse.wheel(0, -400)  # zoom in, then hover still works
    pos = page.evaluate("() => window.__timeline.positionOf(window.__timeline.longest())")
    if pos and 0 < pos["x"] < 1400:
        page.mouse.move(pos["x"], pos["y"])
    assert "measured" in page.inner_text("#timeline-section")
    assert errors == []
    page.close()


def _center(page: Any) -> tuple[float, float]:
    box = page.locator("#timeline").bounding_box()
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def test_screenshot_script(tmp_path: Path) -> None:
    """The one command that makes the README screenshot writes a PNG and reports no console errors."""
    run = make_run(tmp_path, "20261130-shot", workers=6)
    out = ARTIFACTS / "screenshot_report.png"
    script = Path(__file__).resolve().parents[2] / "scripts" / "screenshot_report.py"
    proc = subprocess.run([sys.executable, str(script), str(run), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert (run / "report.html").is_file() and (tmp_path / "index.html").is_file()
    part = ARTIFACTS / "screenshot_timeline.png"
    proc = subprocess.run([sys.executable, str(script), str(run), str(part), "--section", "timeline-section"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert part.read_bytes()[:4] == b"\x89PNG" and part.stat().st_size < out.stat().st_size
    proc = subprocess.run([sys.executable, str(script), "nope", str(tmp_path / "x.png"), "--runs-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "run 'nope' not found" in proc.stderr and "Traceback" not in proc.stderr


def test_synthesis_curve_one_line_per_proposer(browser: Any, tmp_path: Path) -> None:
    """The synthesis curve: one dot per accepted candidate at its trial number, and per proposer a step line of the
    best time so far that ends at that proposer's best; rejected candidates get no dot."""
    run = make_run(tmp_path, "20261130-curve", workers=6)
    trials = [("c0000", "naive", 0.031), ("c0001", "heuristic", 0.027), ("c0002", "heuristic", 0.029),
              ("c0003", "evolve", None), ("c0004", "evolve", 0.030), ("c0005", "heuristic", 0.024),
              ("c0006", "evolve", 0.026), ("c0007", "evolve", 0.028), ("c0008", "llm", None)]
    entries = [{"candidate": c, "proposer": p, "accepted": ms is not None, "ms": ms, "estimated": True}
               for c, p, ms in trials]
    write_json_atomic(run / "leaderboard.json", {"baseline": "c0000", "entries": entries})
    server, thread = serve_in_thread(tmp_path, 0)
    try:
        page, errors = open_page(browser, f"http://127.0.0.1:{server.server_address[1]}/{run.name}/report.html")
        section = page.locator("#curve")
        section.scroll_into_view_if_needed()
        assert section.is_visible() and "estimated" in section.inner_text()
        lines = page.locator("#curve path.best")
        assert lines.evaluate_all("els => els.map(e => e.closest('g').dataset.proposer)") == \
            ["naive", "heuristic", "evolve"]  # in order of first appearance; llm has no accepted candidate
        for proposer in ("naive", "heuristic", "evolve"):
            times = [ms for _, p, ms in trials if p == proposer and ms is not None]
            running = [min(times[:k + 1]) for k in range(len(times))]
            group = page.locator(f'#curve g[data-proposer="{proposer}"]')
            assert [float(v) for v in group.locator("path.best").get_attribute("data-best").split(",")] == running
            dots = group.locator("circle.cand")
            assert [float(v) for v in dots.evaluate_all("els => els.map(e => e.dataset.ms)")] == times
            # drawn: the line has length, and it ends level with the proposer's best dot at the last trial's x
            end = group.locator("path.best").evaluate(
                "p => { const q = p.getPointAtLength(p.getTotalLength()); return [p.getTotalLength(), q.x, q.y]; }")
            best_y = dots.evaluate_all(f"els => els.filter(e => +e.dataset.ms === {min(times)})"
                                       ".map(e => +e.getAttribute('cy'))")[0]
            assert (end[0] > 0 or len(times) == 1) and abs(end[2] - best_y) < 0.01
        assert page.locator("#curve circle.cand").count() == sum(ms is not None for _, _, ms in trials)
        assert page.locator('#curve circle[data-candidate="c0003"]').count() == 0  # rejected: no time, no dot
        xs = page.locator("#curve path.best").evaluate_all(
            "els => els.map(p => p.getPointAtLength(p.getTotalLength()).x)")
        assert max(xs) - min(xs) < 0.01  # every line carried to the last trial
        ARTIFACTS.mkdir(exist_ok=True)
        section.screenshot(path=str(ARTIFACTS / "report-curve.png"))
        assert errors == []
        page.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
