"""`synth runs list|show|report|serve` and the HTML report, on a realistic run folder (the tiny model, lowered,
validated and given a trace in the shared format), plus defensive reading of broken run folders."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.atomic import write_json_atomic
from megasynth.cli import main
from megasynth.commands.runs import serve_in_thread
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.runs.reader import load_run, parse_trace, producers_of, summarize
from megasynth.runs.report import (
    counterexample_events,
    focus_events,
    render_index,
    render_report,
    sequence_svg,
)
from megasynth.runs.rundir import read_stored
from megasynth.validator.verify import Options, verify

# ---------------------------------------------------------------------------------------------------------------
# A realistic run folder, built the way the search writes one (runs/<run>/...), with a list-scheduled trace.


def simulate_trace(schedule: Any, us_of: dict[str, float], estimated: bool = True) -> dict[str, Any]:
    """List-schedule a lowered schedule (queues in order, waits honoured) into a trace in the shared format."""
    ins = {i.id: i for i in schedule.instructions}
    nxt = [0] * len(schedule.queues)
    free = [0.0] * len(schedule.queues)
    ends: dict[int, list[tuple[float, int]]] = {}  # counter -> (end time, add)
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": w, "args": {"name": f"SM {w}"}}
              for w in range(len(schedule.queues))]
    for _ in range(len(ins) + 1):
        best = None
        for w, q in enumerate(schedule.queues):
            if nxt[w] >= len(q):
                continue
            i = ins[q[nxt[w]]]
            ready = 0.0
            for wt in i.waits:
                total, when = 0, None
                for t, add in sorted(ends.get(wt.counter, [])):
                    total += add
                    if total >= wt.value:
                        when = t
                        break
                if when is None and wt.value > 0:
                    ready = None
                    break
                ready = max(ready, when or 0.0)
            if ready is None:
                continue
            start = max(free[w], ready)
            if best is None or start < best[0]:
                best = (start, w, i, max(0.0, ready - free[w]))
        if best is None:
            break
        start, w, i, wait = best
        dur = us_of.get(i.op, 1.0)
        free[w] = start + dur
        nxt[w] += 1
        for s in i.signals:
            ends.setdefault(s.counter, []).append((start + dur, s.add))
        events.append({"name": f"{i.op} L{i.layer}", "cat": i.op, "ph": "X", "pid": 0, "tid": w, "ts": start,
                       "dur": dur, "args": {"id": i.id, "op": i.op, "layer": i.layer, "wait_us": wait}})
    return {"traceEvents": events, "metadata": {"model": "tiny", "device": "NVIDIA H200", "ctx": 32,
                                                "estimated": estimated, "schedule_sha256": "0" * 64}}


US = {"embed": 0.5, "attn_norm_qkv_rope": 2.0, "attn_partial": 3.0, "attn_reduce": 1.0, "o_proj_residual": 1.5,
      "mlp_norm_gate_up": 2.5, "down_proj_residual": 1.5, "final_norm_lm_head": 2.0}


def make_run(root: Path, name: str = "20261130-tiny-a", workers: int = 8, estimated: bool = True) -> Path:
    """runs/<name>/ with run.json, leaderboard.json, best/*, candidates/*, rejected/* (a deadlock and a race)."""
    spec = get_model("tiny")
    run = root / name
    naive = lower(spec, workers)
    better = lower(spec, workers, Strategy(attn_splits=2), proposer="heuristic")
    write_json_atomic(run / "run.json", {"command": ["synth", "search", "--model", "tiny", "--budget", "3"],
                                         "model": "tiny", "gpu": None, "seed": 0, "started": "2026-11-30T04:00:00Z",
                                         "versions": {"python": "3.11"}})
    for cid, sch, ms in (("c0000", naive, 0.031), ("c0001", better, 0.024)):
        write_json_atomic(run / "candidates" / cid / "schedule.json", sch.to_json())
        write_json_atomic(run / "candidates" / cid / "validation.json",
                          verify(sch, "schedule.json", Options(races=False)).to_json())
        write_json_atomic(run / "candidates" / cid / "timing.json", {"ms": ms, "estimated": estimated, "ctx": 32})
    write_json_atomic(run / "best" / "schedule.json", better.to_json())
    write_json_atomic(run / "best" / "validation.json", verify(better, "schedule.json", Options(races=False)).to_json())
    write_json_atomic(run / "best" / "timing.json", {"ms": 0.024, "estimated": estimated, "ctx": 32})
    write_json_atomic(run / "best" / "trace.json", simulate_trace(better, US, estimated))
    # a rejected candidate whose wait target no signaller can reach: the validator's real deadlock finding
    doc = better.to_json()
    doc["instructions"][5]["waits"] = [{"counter": 0, "value": 99}]
    from megasynth.ir.schedule import parse_schedule

    dead = verify(parse_schedule(doc), "c0002", Options(races=False))
    assert not dead.accepted
    write_json_atomic(run / "rejected" / "c0002.json", {"candidate": "c0002", "proposer": "evolve",
                                                        "counterexample": [f.to_json() for f in dead.findings]})
    # a race with a counterexample interleaving (numbered events, as the validator prints them)
    events = [{"step": 1, "worker": 0, "instruction": 3, "op": "attn_norm_qkv_rope", "layer": 0, "kind": "start"},
              {"step": 2, "worker": 1, "instruction": 5, "op": "attn_partial", "layer": 0, "kind": "start"},
              {"step": 3, "worker": 1, "instruction": 5, "op": "attn_partial", "layer": 0, "kind": "end",
               "counters": {"2": 1}},
              {"step": 4, "worker": 0, "instruction": 3, "op": "attn_norm_qkv_rope", "layer": 0, "kind": "end",
               "counters": {"1": 1}}]
    race: Any = {"category": "race", "message": "#3 attn_norm_qkv_rope L0 writes k_cache[0:2048) while #5 reads it",
                 "instructions": [3, 5], "details": {"events": events, "text": ["1. worker 0 starts #3", "..."]}}
    racy = better.to_json()
    next(i for i in racy["instructions"] if i["op"] == "attn_partial")["waits"] = []
    found = [f.to_json() for f in verify(parse_schedule(racy), "c0003", Options(interleavings=20)).findings
             if f.category == "race" and f.details.get("events")]
    if found:  # the validator's race phases are there: use their counterexample as the search would record it
        race = found
    write_json_atomic(run / "rejected" / "c0003.json", {"candidate": "c0003", "proposer": "llm",
                                                        "rationale": "dropped the qkv->attention wait",
                                                        "counterexample": race})
    write_json_atomic(run / "leaderboard.json", {"entries": [
        {"candidate": "c0000", "proposer": "naive", "accepted": True, "ms": 0.031, "estimated": estimated},
        {"candidate": "c0001", "proposer": "heuristic", "accepted": True, "ms": 0.024, "estimated": estimated},
        {"candidate": "c0002", "proposer": "evolve", "accepted": False, "ms": None, "estimated": estimated},
        {"candidate": "c0003", "proposer": "llm", "accepted": False, "ms": None, "estimated": estimated}]})
    write_json_atomic(run / "agent_usage.json", {"model": "gpt-test", "calls": 2, "prompt_tokens": 9000,
                                                 "completion_tokens": 400, "total_tokens": 9400})
    (run / "agent.jsonl").write_text('{"type": "request"}\n{"type": "response"}\n{"type": "request"}\nnot json\n')
    write_json_atomic(run / "bench.json", {"estimated": False, "results": [
        {"name": "PyTorch eager", "median_ms": 0.09}, {"name": "PyTorch CUDA graph", "median_ms": 0.04}],
        "floor_ms": 0.006})
    return run


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    make_run(root)
    make_run(root, "20261129-tiny-old", workers=4)
    (root / "20261129-empty").mkdir()
    (root / "20261129-empty" / "run.json").write_text("{not json", encoding="utf-8")
    return root


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result


# ---------------------------------------------------------------------------------------------------------------


def test_list_shows_every_run_with_best_and_speedup(runs_dir: Path) -> None:
    r = invoke("runs", "list", "--runs-dir", str(runs_dir))
    assert r.exit_code == 0, r.output
    assert "20261130-tiny-a" in r.output and "20261129-tiny-old" in r.output and "20261129-empty" in r.output
    row = next(line for line in r.output.splitlines() if "20261130-tiny-a" in line)
    assert "0.024 ms" in row and "1.29×" in row  # 0.031 / 0.024
    assert " 2/0/2 " in row  # 2 accepted, none screened, 2 rejected
    assert "(estimated)" in r.output  # under the time, when the table is narrow


def test_list_empty_dir_says_so(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["runs", "list", "--runs-dir", str(tmp_path / "nothing")])
    assert r.exit_code == 0 and "no runs" in r.output
    r = CliRunner().invoke(main, ["runs", "report", "--runs-dir", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "does not exist" in r.output and "Traceback" not in r.output


def test_show_by_prefix_and_unknown_run(runs_dir: Path) -> None:
    r = invoke("runs", "show", "20261130", "--runs-dir", str(runs_dir))
    assert r.exit_code == 0, r.output
    assert "synth search --model tiny" in r.output and "c0001" in r.output
    assert "best schedule's trace: makespan" in r.output and "(estimated)" in r.output and "critical path" in r.output
    r = CliRunner().invoke(main, ["runs", "show", "nope", "--runs-dir", str(runs_dir)])
    assert r.exit_code == 2 and "run 'nope' not found" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["runs", "show", "2026112", "--runs-dir", str(runs_dir)])
    assert r.exit_code == 2 and "ambiguous" in r.output


def test_report_writes_every_report_and_the_index(runs_dir: Path) -> None:
    r = invoke("runs", "report", "--runs-dir", str(runs_dir))
    assert r.exit_code == 0, r.output
    index = (runs_dir / "index.html").read_text(encoding="utf-8")
    for name in ("20261130-tiny-a", "20261129-tiny-old", "20261129-empty"):
        assert (runs_dir / name / "report.html").is_file()
        assert f'href="{name}/report.html"' in index
    html = (runs_dir / "20261130-tiny-a" / "report.html").read_text(encoding="utf-8")
    # self-contained: nothing fetched from the network when viewed
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "<canvas" in html and "ui.perfetto.dev" in html and "chrome://tracing" in html
    for section in ("summary", "chart", "timeline-section", "per-op", "critical-path", "validation", "leaderboard",
                    "rejected"):
        assert f'id="{section}"' in html, section
    assert "estimated" in html and "PyTorch CUDA graph" in html and "bandwidth floor" in html
    assert "<svg class=\"seq\"" in html  # the race's interleaving as a sequence diagram
    assert "stuck worker" in html  # the deadlock's stuck workers
    assert 'id="agent"' in html and "9400" in html and "2 request" in html and "1 unreadable line" in html
    broken = (runs_dir / "20261129-empty" / "report.html").read_text(encoding="utf-8")
    assert "invalid JSON" in broken and "No best/trace.json" in broken


def test_report_of_one_run(runs_dir: Path, tmp_path: Path) -> None:
    r = invoke("runs", "report", "20261129-tiny-old", "--runs-dir", str(runs_dir))
    assert r.exit_code == 0 and "20261129-tiny-old/report.html" in r.output and "index.html" in r.output


def test_trace_parsing_lanes_and_critical_path(runs_dir: Path) -> None:
    run = runs_dir / "20261130-tiny-a"
    doc = json.loads((run / "best" / "trace.json").read_text())
    sched = json.loads((run / "best" / "schedule.json").read_text())
    t = parse_trace(doc)
    assert t.lanes == len(sched["queues"]) == 8 and t.estimated
    assert len(t.events) == len(sched["instructions"])
    path = summarize(t, sched)["critical_path"]
    # the chain starts at the embedding, ends at the LM head, and each step starts no earlier than the last ended
    assert path[0]["op"] == "embed" and path[-1]["op"] == "final_norm_lm_head"
    assert all(b["ts"] + 1e-9 >= a["ts"] + a["dur"] for a, b in zip(path, path[1:], strict=False))
    assert abs(path[-1]["ts"] + path[-1]["dur"] - t.makespan_us) < 1e-9
    # every waited-on step is held up by an instruction that signals a counter it waits on
    prods = producers_of(sched)
    for a, b in zip(path, path[1:], strict=False):
        assert a["tid"] == b["tid"] or a["id"] in prods[b["id"]]
    # without the schedule the walk still finds a chain ending at the makespan
    assert summarize(t)["critical_path"][-1]["id"] == path[-1]["id"]


def test_defensive_reading(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    (run / "best").mkdir(parents=True)
    (run / "best" / "trace.json").write_text('{"traceEvents": [{"ph": "X", "ts": "soon"}]}')
    (run / "leaderboard.json").write_text('[1, {"candidate": 0, "ms": "fast"}]')
    (run / "rejected").mkdir()
    (run / "rejected" / "x.json").write_text('{"counterexample": {"details": {"events": [{"worker": "a"}]}}}')
    r = load_run(run)
    html = render_report(r)
    assert "timeline omitted" in html and "run.json is missing" in html
    assert render_index([r]).count("<tr>") == 2


def test_counterexample_events_and_sequence_diagram() -> None:
    f = {"category": "race", "instructions": [7], "details": {"events": [
        {"worker": 0, "instruction": 7, "event": "start", "waits": [{"counter": 1, "value": 1}]},
        {"worker": 1, "instruction": 8, "event": "end", "signals": [{"counter": 1, "add": 1}]},
        {"worker": 0, "instruction": 9, "event": "start", "waits": [1]}]}}
    evs = counterexample_events(f)
    assert [e["kind"] for e in evs] == ["start", "end", "start"] and evs[1]["signals"] == [1]
    svg = sequence_svg(evs, {7})
    assert svg.count("worker ") >= 2 and "#d62728" in svg and "marker-end" in svg
    assert counterexample_events({"details": {"text": ["no events"]}}) == []
    # the validator's own shape: "event", "waits" with current values, "counters" after an end
    many = [{"n": k + 1, "worker": k % 4, "event": "start" if k % 2 == 0 else "end", "instruction": k // 2,
             "op": "x", "layer": 0} for k in range(200)]
    many[151]["counters"] = {"7": 1}  # the end of #75 releases counter 7
    many.append({"n": 201, "worker": 0, "event": "start", "instruction": 500, "op": "y", "layer": 1,
                 "waits": [{"counter": 7, "value": 1, "current": 1}]})
    evs = counterexample_events({"details": {"events": many}})
    assert evs[151]["signals"] == [7] and evs[-1]["waits_on"] == [7] and "c7 = 1 >= 1" in evs[-1]["text"]
    shown = focus_events(evs, {500, 3})
    assert [(e["instruction"], e["kind"]) for e in shown] == [(3, "start"), (3, "end"), (75, "end"), (500, "start")]
    assert "marker-end" in sequence_svg(shown, {500}) and ">152<" in sequence_svg(shown, {500})


def test_serve_answers_on_localhost(runs_dir: Path) -> None:
    server, thread = serve_in_thread(runs_dir, 0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=5) as resp:
            assert resp.status == 200 and b"megasynth runs" in resp.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/20261130-tiny-a/best/trace.json", timeout=5) as resp:
            assert json.loads(resp.read())["metadata"]["estimated"] is True
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_report_charts_a_synth_bench_json(runs_dir: Path, tmp_path: Path) -> None:
    """`synth runs report RUN --bench FILE` keeps the bench in the run and charts its variants and measured floor
    (format megasynth-bench/1: results per ctx, variants with timing.median_ms, floor.ms)."""
    bench = {"format": "megasynth-bench/1", "model": "tiny", "dry_run": False, "results": [
        {"ctx": 1024, "floor": {"bytes": {"total": 1}, "ms": 0.61},
         "variants": {"torch_eager": {"status": "ok", "timing": {"median_ms": 19.3}},
                      "torch_graph": {"status": "ok", "timing": {"median_ms": 3.24}},
                      "torch_compile": {"status": "skipped", "reason": "timeout"}}},
        {"ctx": 32, "floor": {"bytes": {"total": 1}, "ms": 0.0042},
         "variants": {"torch_graph": {"status": "ok", "timing": {"median_ms": 0.05}},
                      "megakernel": {"status": "ok", "timing": {"median_ms": 0.02}}}}]}
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(bench))
    r = invoke("runs", "report", "20261129-tiny-old", "--bench", str(f), "--runs-dir", str(runs_dir))
    assert r.exit_code == 0, r.output
    assert json.loads((runs_dir / "20261129-tiny-old" / "bench.json").read_text()) == bench
    html = (runs_dir / "20261129-tiny-old" / "report.html").read_text(encoding="utf-8")
    chart = html[html.index('id="chart"'):html.index('id="timeline-section"')]
    assert "0.050 ms" in chart and "0.020 ms" in chart and "4.20 µs" in chart  # the trace's ctx (32) is picked
    assert "19.3" not in chart and "timeout" not in chart
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = CliRunner().invoke(main, ["runs", "report", "20261129-tiny-old", "--bench", str(bad), "--runs-dir",
                                  str(runs_dir)])
    assert r.exit_code == 2 and "invalid JSON" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["runs", "report", "--bench", str(f), "--runs-dir", str(runs_dir)])
    assert r.exit_code == 2 and "needs a RUN" in r.output


# ---------------------------------------------------------------------------------------------------------------
# A real run: `synth search --model tiny --budget 3` writes runs/<run>/, and `synth runs` reads what it wrote.


def search_run(root: Path) -> Path:
    """Run the real search on the tiny model into `root`; skip while `synth search` does not exist."""
    if "search" not in main.commands:
        pytest.skip("synth search is not there yet (megasynth/commands/search.py)")
    r = CliRunner().invoke(main, ["search", "--model", "tiny", "--budget", "3", "--seed", "0", "--workers", "8",
                                  "--runs-dir", str(root)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    runs = [d for d in root.iterdir() if d.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return search_run(tmp_path_factory.mktemp("searched"))


def test_real_search_run_lists_shows_and_reports(searched: Path) -> None:
    root = searched.parent
    r = invoke("runs", "list", "--runs-dir", str(root))
    assert r.exit_code == 0 and searched.name in r.output and "tiny" in r.output, r.output
    assert "(estimated)" in r.output  # no GPU here: the cost model's numbers, labelled
    r = invoke("runs", "show", searched.name, "--runs-dir", str(root))
    assert r.exit_code == 0 and "c0000" in r.output, r.output
    r = invoke("runs", "report", "--runs-dir", str(root))
    assert r.exit_code == 0, r.output
    html = (searched / "report.html").read_text(encoding="utf-8")
    run = load_run(searched)
    assert run.naive() is not None and run.naive().candidate == "c0000" and run.best() is not None
    assert run.accepted + run.rejected >= 1
    assert not (searched / "best" / "schedule.json").exists()  # written compressed
    sched = read_stored(searched / "best" / "schedule.json")
    data = json.loads(re.search(r'<script id="tl-data" type="application/json">(.*?)</script>', html,
                                re.S).group(1).replace("<\\/", "</"))
    assert data["lanes"] == len(sched["queues"]) and len(data["id"]) == len(sched["instructions"])
    assert data["estimated"] is True and "estimated" in html
    assert 'id="validation"' in html and "Verdict: <span class=\"good\">accepted" in html
    fresh = load_run(searched)
    render_report(fresh)
    assert fresh.notes == []  # the search wrote everything the report reads


def test_serve_command_prints_its_address_and_serves(runs_dir: Path) -> None:
    """`synth runs serve --port 0` as a user runs it: it says where it listens (127.0.0.1) and serves the index."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "megasynth.cli", "runs", "serve", "--port", "0", "--runs-dir",
                             str(runs_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        m = re.search(r"http://127\.0\.0\.1:(\d+)/index\.html", line)
        assert m, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/index.html", timeout=10) as resp:
            assert b"20261130-tiny-a/report.html" in resp.read()
    finally:
        proc.terminate()
        proc.wait(10)


def test_gpu_run_is_labelled_measured_not_estimated(tmp_path: Path) -> None:
    """A run timed on the GPU: no "estimated" label anywhere, the spread and the source of the timing are shown."""
    run = make_run(tmp_path, "20261130-gpu", workers=4, estimated=False)
    write_json_atomic(run / "run.json", {"model": "tiny", "gpu": "NVIDIA H200", "command": "synth search"})
    write_json_atomic(run / "best" / "timing.json", {"ms": 0.024, "median_ms": 0.024, "p10_ms": 0.023,
                                                     "p90_ms": 0.026, "estimated": False,
                                                     "source": "GPU (NVIDIA H200)"})
    html = render_report(load_run(run))
    visible = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    assert "estimated" not in visible and "Hatched" not in visible
    assert "p10–p90 0.023–0.026" in html and "GPU (NVIDIA H200)" in html and 'class="meas"' in html


def test_merge_takes_best_from_a_folder_that_promoted_one_of_the_tied_fastest(tmp_path: Path) -> None:
    """Two machines found the same fastest time: the leaderboard lists the lower id first, but only the machine that
    got there first promoted its own to best/ (a search promotes only a strictly faster candidate). The merge takes
    best/ from that folder instead of writing none."""
    from megasynth.runs.merge import promoted_fastest
    from megasynth.runs.rundir import RunDir

    folders = []
    for name, best in (("a", "c0005"), ("b", "c0002")):
        d = tmp_path / name / "run"
        write_json_atomic(d / "best" / "timing.json", {"candidate": best, "schedule_key": f"k{best}"})
        folders.append(RunDir(d))
    wanted = {c: {"record": {"schedule_key": f"k{c}"}} for c in ("c0002", "c0003", "c0005")}
    ranked = [{"candidate": "c0003", "ms": 1.0}, {"candidate": "c0005", "ms": 1.0}, {"candidate": "c0002", "ms": 1.2}]
    cid, holder = promoted_fastest(ranked, folders, wanted)
    assert (cid, holder.path if holder else None) == ("c0005", folders[0].path)
    # a best/ whose schedule is not the study's does not count; with no folder holding a tied one, the first is named
    wanted["c0005"]["record"]["schedule_key"] = "other"
    assert promoted_fastest(ranked, folders, wanted) == ("c0003", None)
    assert promoted_fastest([], folders, wanted) == (None, None)
    # searches that ran finals hold their winners in best/, not always their fastest measurement: the merge takes
    # the winner that was fastest in its search
    write_json_atomic(folders[1].path / "best" / "timing.json",
                      {"candidate": "c0002", "schedule_key": "kc0002", "finals": {"winner": "c0002"}})
    cid, holder = promoted_fastest(ranked, folders, wanted)
    assert (cid, holder.path if holder else None) == ("c0002", folders[1].path)


def test_show_ranks_close_times_and_every_table_fits_80_columns(tmp_path: Path) -> None:
    """Fifteen candidates within a microsecond of each other: `show` prints enough digits to rank them, and the
    tables of `list` and `show` stay within 80 columns (the command line alone may run past, to be copied whole)."""
    from megasynth.runs.report import ranking_decimals

    run = tmp_path / "llama-1b-20261201-153751-s12345"
    times = [0.7980 + 0.00002 * k for k in range(15)]
    entries = [{"candidate": f"c{k:04d}", "proposer": "descent", "accepted": True, "ms": ms, "estimated": False,
                "rationale": "hill climbing on the measurements around c0014 (0.7779 ms): tiles.down_proj 32 -> 64"}
               for k, ms in enumerate(times)]
    write_json_atomic(run / "leaderboard.json", {"baseline": "c0000", "entries": entries})
    write_json_atomic(run / "run.json", {"model": "llama-1b", "gpu": "NVIDIA H200", "command": "synth search " * 12})
    r = CliRunner().invoke(main, ["runs", "show", run.name, "--runs-dir", str(tmp_path)], terminal_width=80)
    assert r.exit_code == 0, r.output
    shown = re.findall(r"c00\d\d .*? (0\.\d+) ms", r.output)
    assert len(shown) == 15 and len(set(shown)) == 15, r.output  # 0.798 for all would not rank them
    assert [float(x) for x in shown] == sorted(float(x) for x in shown)
    r2 = CliRunner().invoke(main, ["runs", "list", "--runs-dir", str(tmp_path)], terminal_width=80)
    for out in (r.output, r2.output):
        assert all(len(line) <= 80 for line in out.splitlines() if not line.startswith("command:")), out
    lines = r2.output.splitlines()
    body = lines[next(k for k, line in enumerate(lines) if line.startswith("─")) + 1:]
    assert "".join(line.split()[0] for line in body if line.strip() and "a/s/r" not in line) == run.name  # folded
    assert ranking_decimals([0.798, 0.9]) == 3 and ranking_decimals([0.7981, 0.7984]) == 4
    assert ranking_decimals([0.79841, 0.798412]) == 6 and ranking_decimals([None, 0.5, 0.5]) == 3


def test_report_writes_under_the_runs_dir_only(runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`synth runs report` writes each run's report.html and index.html under --runs-dir, nothing where it is run."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = {p: p.stat().st_mtime_ns for p in runs_dir.rglob("*") if p.is_file()}
    r = invoke("runs", "report", "--runs-dir", str(runs_dir))
    assert r.exit_code == 0, r.output
    assert list(cwd.iterdir()) == []
    written = {p for p in runs_dir.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns}
    assert written == {runs_dir / "index.html", *(d / "report.html" for d in runs_dir.iterdir() if d.is_dir())}
    r = CliRunner().invoke(main, ["runs", "report"])  # the default runs/ is not there: an error, nothing written
    assert r.exit_code == 2 and list(cwd.iterdir()) == []


def test_serve_gives_a_compressed_trace_under_its_plain_name(tmp_path: Path) -> None:
    """A run keeps best/trace.json.gz; the server also answers best/trace.json with it decompressed (for a viewer
    that does not read gzip), and the report links the file the run has."""
    from megasynth.runs.rundir import write_stored

    run = make_run(tmp_path, "20261201-gz", workers=4)
    trace = json.loads((run / "best" / "trace.json").read_text())
    write_stored(run / "best" / "trace.json", trace)
    assert not (run / "best" / "trace.json").exists()
    server, thread = serve_in_thread(tmp_path, 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/20261201-gz"
        with urllib.request.urlopen(f"{base}/best/trace.json", timeout=5) as resp:
            assert resp.headers["Content-Type"] == "application/json" and json.loads(resp.read()) == trace
        with urllib.request.urlopen(f"{base}/report.html", timeout=5) as resp:
            assert b'href="best/trace.json.gz"' in resp.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
