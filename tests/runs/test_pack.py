"""A packed run (`synth runs pack`: every accepted candidate in one candidates.json.gz) reads exactly like the run it
was packed from, everywhere a candidate is read; a packed run resumes, and packing again takes in the new folders; a
corrupt pack or candidate file is a one-line error naming it."""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.lowering.costmodel import load_params
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.runs.reader import load_run
from megasynth.runs.report import render_report
from megasynth.runs.rundir import KEEP_SCHEDULES, PACK, PackError, RunDir, schedule_key
from megasynth.search.calibrate import error_summary, run_steps

WORKERS = 8
STRATEGIES = [Strategy(), Strategy(attn_splits=2), Strategy(assignment="cost_balanced"),
              Strategy(assignment="zigzag"), Strategy(attn_splits=2, assignment="critical_path")]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def _measured_run(root: Path) -> RunDir:
    """runs/<name>/ as a GPU search writes it: five measured candidates (three keep their whole schedule), best/ and
    the leaderboard."""
    run = RunDir(root / "run")
    run.init({"model": "tiny", "workers": WORKERS, "started": "2026-12-01T00:00:00+00:00"})
    spec = get_model("tiny")
    for k, st in enumerate(STRATEGIES):
        sch = lower(spec, WORKERS, st, "heuristic")
        timing = {"ms": 1.0 - 0.1 * k, "estimated": False, "proposer": "heuristic", "parent": None,
                  "rationale": "test", "strategy": st.model_dump(mode="json"), "patches": [],
                  "schedule_key": schedule_key(sch), "workers": WORKERS, "ctx": 32}
        run.save_candidate(f"c{k:04d}", sch, {"verdict": "accepted", "k": k}, timing)
        run.save_best(f"c{k:04d}", sch, {"verdict": "accepted"}, timing, None)
    run.write_leaderboard()
    return run


def _views(run: RunDir) -> dict[str, Any]:
    """Everything that reads a run's candidates: the RunDir API, `synth runs show`, the report (its links aside:
    they name the file holding each candidate) and calibrate's steps and their errors."""
    html = render_report(load_run(run.path))
    html = re.sub(r'href="(candidates/c\d+/[^"]*|candidates\.json\.gz)"', 'href="LINK"', html)
    show = invoke("runs", "show", run.path.name, "--runs-dir", str(run.path.parent))
    assert show.exit_code == 0, show.output
    steps = run_steps([str(run.path)])
    errors = error_summary(steps, load_params())
    return {"accepted": run.accepted(), "outcomes": {cid: run.outcome(cid) for cid in run.accepted()},
            "schedules": {cid: run.load_candidate(cid).to_json() for cid in run.accepted()},
            "show": show.output, "report": html, "steps": [(s.label, s.ctx, s.ms) for s in steps], "errors": errors,
            "counted": load_run(run.path).accepted}


def test_a_packed_run_reads_exactly_like_the_run_it_was_packed_from(tmp_path: Path) -> None:
    run = _measured_run(tmp_path / "a")
    before = _views(run)
    assert len(before["steps"]) == len(STRATEGIES) and before["counted"] == len(STRATEGIES)
    res = invoke("runs", "pack", "run", "--runs-dir", str(run.path.parent))
    assert res.exit_code == 0, res.output
    assert f"{len(STRATEGIES)} candidates packed" in res.output and "bytes before" in res.output
    assert not (run.path / "candidates").exists() and (run.path / PACK).is_file()
    assert _views(run) == before
    kept = [cid for cid, c in run.candidates().items() if c.file("schedule") is not None]
    assert len(kept) == KEEP_SCHEDULES and all(run.candidate(cid).packed for cid in kept)  # type: ignore[union-attr]
    assert run.candidate_schedule(kept[0]) is None  # no schedule file: load_candidate reads it from the pack
    assert 'href="candidates.json.gz"' in render_report(load_run(run.path))
    # packing again changes nothing; a candidate copied out of the pack (a merge) is a folder again
    res = invoke("runs", "pack", str(run.path))
    assert res.exit_code == 0 and "nothing to pack" in res.output, res.output
    other = RunDir(tmp_path / "copy")
    other.init(run.info)
    for cid in run.accepted():
        run.copy_candidate(cid, other)
        assert other.outcome(cid) == run.outcome(cid)
        assert schedule_key(other.load_candidate(cid)) == schedule_key(run.load_candidate(cid))
    assert sorted(p.name for p in (other.path / "candidates").iterdir()) == sorted(run.accepted())


def test_folders_beside_the_pack_are_read_with_it_and_packed_into_it(tmp_path: Path) -> None:
    """A packed run that is searched again writes folders beside the pack: readers see both (the folder winning for
    an id in both), packing again merges them, and a discarded id leaves the pack too."""
    run = _measured_run(tmp_path)
    run.pack()
    sch = lower(get_model("tiny"), WORKERS, Strategy(attn_splits=4))
    new = {"ms": 0.3, "estimated": False, "strategy": Strategy(attn_splits=4).model_dump(mode="json"),
           "patches": [], "schedule_key": schedule_key(sch), "workers": WORKERS, "ctx": 32}
    run.save_candidate("c0005", sch, {"verdict": "accepted"}, new)
    run.save_candidate("c0001", sch, {"verdict": "again"}, {**new, "ms": 0.25})  # also in the pack
    acc = run.accepted()
    assert list(acc) == [f"c{k:04d}" for k in range(6)] and acc["c0001"]["ms"] == 0.25
    assert run.outcome("c0001")["validation"] == {"verdict": "again"}  # type: ignore[index]
    assert not run.candidate("c0001").packed and run.candidate("c0002").packed  # type: ignore[union-attr]
    done = run.pack()
    assert done.packed == ["c0001", "c0005"] and done.total == 6 and not (run.path / "candidates").exists()
    assert run.accepted() == acc and run.outcome("c0001")["validation"] == {"verdict": "again"}  # type: ignore[index]
    assert schedule_key(run.load_candidate("c0005")) == schedule_key(sch)
    run.discard("c0005")
    assert "c0005" not in run.accepted() and "c0005" not in RunDir(run.path).candidate_ids()


def _cfg(tmp_path: Path, **kw: Any) -> Any:
    from megasynth.search.config import SearchConfig

    base: dict[str, Any] = dict(model="tiny", workers=8, budget=3, runs_dir=tmp_path, run="r", interleavings=20,
                                final_interleavings=50, ctx=64, gpu=False, progress=False, proposer="heuristic",
                                notice=lambda m: None, jobs=1)
    return SearchConfig(**{**base, **kw})


def test_a_packed_run_resumes_and_packs_again(tmp_path: Path) -> None:
    from megasynth.search.loop import run_search

    first = run_search(_cfg(tmp_path))
    run = RunDir(first.run_dir)
    before = run.accepted()
    assert run.pack().packed == sorted(before)
    second = run_search(_cfg(tmp_path, budget=5, resume=True, proposer="evolve"))
    assert second.evaluated == 2
    after = run.accepted()
    assert {cid: after[cid] for cid in before} == before
    assert len(after) + len(run.rejected()) == 5
    for cid in after:
        run.load_candidate(cid)
    folders = sorted(d.name for d in (run.path / "candidates").glob("c*")) if (run.path / "candidates").is_dir() \
        else []
    assert run.pack().packed == folders and run.accepted() == after
    res = invoke("runs", "show", "r", "--runs-dir", str(tmp_path))
    assert res.exit_code == 0 and f"accepted {len(after)}" in res.output, res.output


def test_a_corrupt_pack_or_candidate_file_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    run = _measured_run(tmp_path)
    queues = run.path / "candidates" / "c0002" / "queues.json.gz"
    queues.write_bytes(queues.read_bytes()[:-8])  # cut short
    res = invoke("runs", "pack", "run", "--runs-dir", str(tmp_path))
    assert res.exit_code == 2 and str(queues) in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (run.path / PACK).exists() and len(list((run.path / "candidates").iterdir())) == len(STRATEGIES)
    shutil.rmtree(queues.parent)
    assert invoke("runs", "pack", "run", "--runs-dir", str(tmp_path)).exit_code == 0
    res = invoke("runs", "pack", "nope", "--runs-dir", str(tmp_path))
    assert res.exit_code == 2 and "not found" in res.output and "Traceback" not in res.output

    pack = run.path / PACK
    pack.write_bytes(gzip.compress(b'{"format": "megasynth-candidates/1", "candidates": {"c0000": {}}}'))
    with pytest.raises(PackError, match=r"candidates\.json\.gz: \$\.candidates\.c0000: not an accepted"):
        run.accepted()
    pack.write_bytes(pack.read_bytes()[:20])
    for args in (["runs", "pack", "run", "--runs-dir", str(tmp_path)], ["calibrate", "--check-run", str(run.path)]):
        res = invoke(*args)
        assert res.exit_code == 2 and str(pack) in res.output and "Traceback" not in res.output, res.output
    assert any(str(pack) in note for note in load_run(run.path).notes)  # the browser notes it and goes on
    res = invoke("runs", "show", "run", "--runs-dir", str(tmp_path))
    assert res.exit_code == 0 and "candidates.json.gz" in res.output, res.output
