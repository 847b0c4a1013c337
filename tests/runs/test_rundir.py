"""The run folder's storage: what each accepted candidate keeps (timing, validation, queues; the whole schedule for the
fastest few), gzip-compressed large files, rebuilding a candidate from what it keeps, and older runs' plain files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from megasynth.atomic import write_json_atomic
from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import Schedule, parse_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.runs.reader import load_run, read_json
from megasynth.runs.report import render_report
from megasynth.runs.rundir import (
    KEEP_SCHEDULES,
    RunDir,
    decode_queues,
    encode_queues,
    lowering_version,
    read_stored,
    schedule_key,
    stored,
)

WORKERS = 8


def _timing(strategy: Strategy, schedule: Schedule, ms: float, estimated: bool = True) -> dict[str, Any]:
    """timing.json as the search writes it: the time and what rebuilds the candidate."""
    return {"ms": ms, "estimated": estimated, "proposer": "heuristic", "parent": None, "rationale": "test",
            "strategy": strategy.model_dump(mode="json"), "patches": [], "schedule_key": schedule_key(schedule),
            "workers": WORKERS, "ctx": 32}


def _run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.init({"model": "tiny", "workers": WORKERS})
    return run


STRATEGIES = [Strategy(), Strategy(attn_splits=2), Strategy(assignment="cost_balanced"),
              Strategy(assignment="zigzag"), Strategy(attn_splits=2, assignment="critical_path")]


def test_only_the_fastest_keep_their_schedule_and_every_candidate_rebuilds(tmp_path: Path) -> None:
    run = _run(tmp_path)
    spec = get_model("tiny")
    built = {}
    # saved slowest first, so that each new one pushes a kept schedule out
    for k, st in enumerate(STRATEGIES):
        cid = f"c{k:04d}"
        built[cid] = sch = lower(spec, WORKERS, st, "heuristic")
        run.save_candidate(cid, sch, {"verdict": "accepted"}, _timing(st, sch, 1.0 - 0.1 * k))
    kept = sorted(cid for cid in built if run.candidate_schedule(cid) is not None)
    assert kept == ["c0002", "c0003", "c0004"] and len(kept) == KEEP_SCHEDULES
    for cid, sch in built.items():
        d = run.path / "candidates" / cid
        assert not (d / "schedule.json").exists()  # never the plain form
        timing = json.loads((d / "timing.json").read_text())
        assert timing["lowering"] == lowering_version() and timing["strategy"] and "patches" in timing
        assert (d / "queues.json.gz").is_file()
        again = run.load_candidate(cid)
        assert schedule_key(again) == schedule_key(sch)
        if cid not in kept:  # rebuilt: its provenance comes from timing.json
            assert again.meta["proposer"] == "heuristic" and again.meta["rationale"] == "test"


def test_a_gpu_measurement_outranks_estimates_for_a_kept_schedule(tmp_path: Path) -> None:
    run = _run(tmp_path)
    spec = get_model("tiny")
    for k, st in enumerate(STRATEGIES[:4]):
        sch = lower(spec, WORKERS, st)
        run.save_candidate(f"c{k:04d}", sch, {}, _timing(st, sch, 0.1 + k, estimated=k != 3))
    # c0003 is the slowest number but the only measurement: it keeps its schedule, the slowest estimate does not
    assert run.candidate_schedule("c0003") is not None and run.candidate_schedule("c0002") is None


def test_the_recorded_queues_rebuild_a_candidate_the_lowering_now_places_differently(tmp_path: Path) -> None:
    """A cost-balanced placement follows the cost model's parameters; after a refit the lowering places the same
    strategy otherwise. The candidate's recorded queues give back the schedule that was timed; without them the
    rebuild is refused, naming the lowering that wrote it."""
    run = _run(tmp_path)
    spec = get_model("tiny")
    st = Strategy(assignment="cost_balanced")
    lowered = lower(spec, WORKERS, st, "heuristic")
    doc = lowered.to_json()
    doc["queues"] = [doc["queues"][1], doc["queues"][0], *doc["queues"][2:]]  # what other parameters placed
    timed = parse_schedule(doc)
    assert schedule_key(timed) != schedule_key(lowered)
    for k in range(KEEP_SCHEDULES + 1):  # c0000 (the slowest) loses its whole schedule
        sch = timed if k == 0 else lower(spec, WORKERS, STRATEGIES[k])
        run.save_candidate(f"c{k:04d}", sch, {}, _timing(st if k == 0 else STRATEGIES[k], sch, 1.0 - 0.1 * k))
    assert run.candidate_schedule("c0000") is None
    assert schedule_key(run.load_candidate("c0000")) == schedule_key(timed)
    (run.path / "candidates" / "c0000" / "queues.json.gz").unlink()
    with pytest.raises(ScheduleError, match="differs from the one timed.*lowering"):
        run.load_candidate("c0000")


def test_queues_encoding_round_trips_and_rejects_other_documents() -> None:
    queues = [[0, 8, 16, 17], [], [3, 1, 2]]
    doc = encode_queues(queues)
    assert doc["queues"][0] == [0, 8, 8, 1] and decode_queues(doc) == queues
    with pytest.raises(ScheduleError, match="megasynth-queues/1"):
        decode_queues({"queues": queues})
    with pytest.raises(ScheduleError, match="list of integers"):
        decode_queues({**doc, "queues": [[0, "1"]]})


def test_best_is_compressed_and_replaces_an_older_runs_plain_files(tmp_path: Path) -> None:
    run = _run(tmp_path)
    sch = lower(get_model("tiny"), WORKERS)
    best = run.path / "best"
    write_json_atomic(best / "schedule.json", sch.to_json())  # an older run: plain files
    write_json_atomic(best / "trace.json", {"traceEvents": []})
    write_json_atomic(best / "timing.json", {"ms": 2.0, "candidate": "c0009"})
    assert run.has_best_schedule() and run.best_trace() == {"traceEvents": []}
    trace = {"traceEvents": [], "metadata": {"estimated": True}}
    assert run.save_best("c0001", sch, {"verdict": "accepted"}, _timing(Strategy(), sch, 1.0), trace)
    assert sorted(f.name for f in best.iterdir()) == ["schedule.json.gz", "timing.json", "trace.json.gz",
                                                      "validation.json"]
    assert run.best_trace() == trace and read_stored(best / "schedule.json") == sch.to_json()
    assert gzip.decompress((best / "trace.json.gz").read_bytes()).startswith(b"{")
    # not replaced by a slower one; a faster one without a trace drops the old trace
    assert not run.save_best("c0002", sch, {}, _timing(Strategy(), sch, 1.5), trace)
    assert run.save_best("c0003", sch, {}, _timing(Strategy(), sch, 0.5), None)
    assert run.best_trace() is None and stored(best / "trace.json") is None
    # equal text gives equal bytes: a committed run does not change when it is written again
    first = (best / "schedule.json.gz").read_bytes()
    assert run.save_best("c0004", sch, {}, _timing(Strategy(), sch, 0.4), None)
    assert (best / "schedule.json.gz").read_bytes() == first


def test_readers_accept_old_plain_and_new_compressed_runs(tmp_path: Path) -> None:
    """An older run (plain schedule.json per candidate, plain best/) and a new one read the same everywhere."""
    spec = get_model("tiny")
    sch = lower(spec, WORKERS, Strategy(attn_splits=2))
    old = RunDir(tmp_path / "old")
    old.init({"model": "tiny", "workers": WORKERS})
    write_json_atomic(old.path / "candidates" / "c0000" / "schedule.json", sch.to_json())
    write_json_atomic(old.path / "candidates" / "c0000" / "timing.json", {"ms": 0.5, "estimated": True})
    write_json_atomic(old.path / "best" / "schedule.json", sch.to_json())
    write_json_atomic(old.path / "best" / "timing.json", {"ms": 0.5, "estimated": True, "candidate": "c0000"})
    new = _run(tmp_path)
    new.save_candidate("c0000", sch, {"verdict": "accepted"}, _timing(Strategy(attn_splits=2), sch, 0.5))
    new.save_best("c0000", sch, {"verdict": "accepted"}, _timing(Strategy(attn_splits=2), sch, 0.5), None)
    for rd in (old, new):
        rd.write_leaderboard()
        assert schedule_key(rd.load_candidate("c0000")) == schedule_key(sch)
        assert read_json(rd.path / "best" / "schedule.json")["queues"] == sch.to_json()["queues"]
        html = render_report(load_run(rd.path))
        assert 'href="candidates/c0000/schedule.json' in html  # the kept schedule, whichever form it has
    broken = tmp_path / "broken" / "best"
    broken.mkdir(parents=True)
    (broken / "schedule.json.gz").write_bytes(gzip.compress(b'{"format": ')[:-6])  # cut short
    notes: list[str] = []
    assert read_json(broken / "schedule.json", notes) is None and "cannot read" in notes[0]


def test_calibrate_reads_a_runs_compressed_trace_and_the_schedule_beside_it(tmp_path: Path) -> None:
    """`synth calibrate best/trace.json.gz`: the trace and the schedule.json.gz beside it, as a run keeps them."""
    from click.testing import CliRunner
    from test_runs_cli import make_run  # (pytest puts this folder on sys.path)

    from megasynth.commands.calibrate import calibrate
    from megasynth.lowering.costmodel import CostParams
    from megasynth.runs.rundir import write_stored

    run = make_run(tmp_path, "20261201-measured", workers=4, estimated=False)
    best = run / "best"
    for name in ("trace.json", "schedule.json"):
        write_stored(best / name, json.loads((best / name).read_text()))
    v9 = tmp_path / "v9.json"
    CostParams().save(v9)  # ring_bytes 0: the per-instruction fit, which reads traces and their schedules
    res = CliRunner().invoke(calibrate, [str(best / "trace.json.gz"), "--prior", str(v9)])
    assert res.exit_code == 0, res.output
    assert "median absolute error" in res.output
    (best / "schedule.json.gz").write_bytes(b"\x1f\x8b\x08\x00")  # a gzip header and nothing else
    res = CliRunner().invoke(calibrate, [str(best / "trace.json.gz"), "--prior", str(v9)])
    assert res.exit_code == 2 and "schedule.json.gz" in res.output and "Traceback" not in res.output
