"""`synth search --ctx-ranges`: one ordinary run per context range, timed at the range's UP_TO, then the schedule set
of their best schedules (`megakernel-schedule-set/1`); bad ranges are refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.ir.schedule_set import load_schedule_set
from megasynth.runs.rundir import RunDir

FAST = ["--model", "tiny", "--workers", "6", "--budget", "2", "--interleavings", "5", "--final-interleavings", "10",
        "--cpu", "--proposer", "heuristic", "--no-progress", "--jobs", "1"]


def _search(tmp_path: Path, *args: str):
    return CliRunner().invoke(main, ["search", *FAST, "--runs-dir", str(tmp_path), *args])


def test_ctx_ranges_run_one_search_per_range_and_write_the_set(tmp_path: Path) -> None:
    res = _search(tmp_path, "--run", "r", "--ctx-ranges", "16,64")
    assert res.exit_code == 0, res.output
    set_file = tmp_path / "r.set.json"
    loaded = load_schedule_set(set_file)
    assert loaded.bounds == [16, 64] and loaded.max_seq_len == 64
    doc = json.loads(set_file.read_text(encoding="utf-8"))
    assert [r["schedule"] for r in doc["ranges"]] == ["r.ctx16/best/schedule.json.gz", "r.ctx64/best/schedule.json.gz"]
    assert doc["meta"]["model"] == "tiny" and doc["meta"]["max_seq_len"] == 64
    assert doc["meta"]["runs"] == ["r.ctx16", "r.ctx64"]
    assert doc["meta"]["command"] == RunDir(tmp_path / "r.ctx16").info["command"]  # what the runs record
    for up_to in (16, 64):
        run = RunDir(tmp_path / f"r.ctx{up_to}")
        assert run.has_best_schedule()
        assert run.info["ctx"] == up_to and run.info["max_seq_len"] == 64
        assert f"up_to {up_to}: r.ctx{up_to} best " in res.output
    assert f"schedule set: {set_file}" in res.output
    # the range runs are ordinary runs: the leaderboard lists them, and the set file is not mistaken for one
    listed = CliRunner().invoke(main, ["runs", "list", "--runs-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "r.ctx16" in listed.output and "r.ctx64" in listed.output and "set.json" not in listed.output


def test_a_range_with_no_accepted_schedule_writes_no_set(tmp_path: Path) -> None:
    res = _search(tmp_path, "--run", "r", "--ctx-ranges", "16,64", "--time-limit", "0")
    assert res.exit_code == 1, res.output
    assert "range up_to 16 (run r.ctx16) ended with no accepted schedule" in res.output
    assert not (tmp_path / "r.set.json").exists() and not (tmp_path / "r.ctx64").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--ctx-ranges", "64,16"], "16 does not follow 64"),
    (["--ctx-ranges", "16,16,64"], "16 does not follow 16"),
    (["--ctx-ranges", "0,64"], "at least 1"),
    (["--ctx-ranges", "16,x"], "'x' is not a whole number"),
    (["--ctx-ranges", "16,32"], "the last range must end at max_seq_len 64 (got 32)"),
    (["--ctx-ranges", "16,64", "--max-seq-len", "32"], "the last range must end at max_seq_len 32 (got 64)"),
    (["--ctx-ranges", "16,64", "--ctx", "16"], "--ctx-ranges and --ctx do not go together"),
    (["--ctx-ranges", "16,64", "--resume", "r"], "--ctx-ranges and --resume do not go together"),
])
def test_bad_ranges_are_refused_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    res = _search(tmp_path, *args)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output  # (click wraps long messages)
    assert not any(tmp_path.iterdir())
