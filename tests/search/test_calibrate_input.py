"""`synth calibrate` checks its inputs before it fits or prints anything: a bad prior, a measured step the kernel
could not have run, a folder that is no run or a run with nothing measured is exit 2 with one line naming the file or
folder, the JSON path and the value, never a traceback nor an empty fit that exits 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.commands.calibrate import calibrate
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.runs.rundir import RunDir, schedule_key

STRATEGY = Strategy(attn_splits=1).model_dump(mode="json")
STEP = {"name": "a", "model": "llama-1b", "workers": 132, "ctx": 1024, "ms": 0.7, "strategy": STRATEGY}


def _steps_file(tmp_path: Path, *steps: dict[str, Any]) -> Path:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": list(steps)}))
    return path


def _exit_2(args: list[str], *parts: str) -> str:
    res = CliRunner().invoke(calibrate, args)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output and all(p in res.output for p in parts), res.output
    return res.output


@pytest.mark.parametrize(("change", "where", "value"), [
    ({"workers": 0}, "workers", "0"),  # was: RuntimeError "list scheduling stalled ... this is a bug"
    ({"workers": 5000}, "workers", "5000"),  # beyond the schedule format's MAX_WORKERS
    ({"workers": "132"}, "workers", '"132"'),
    ({"ctx": 10_000_000}, "ctx", "10000000"),  # was: clamped silently to the lowering's 4096 positions
    ({"ctx": 8192}, "ctx", "8192"),  # within the model's positions, but not the 4096 the step is lowered for
    ({"ctx": 0}, "ctx", "0"),
    ({"ms": -1}, "ms", "-1"),  # was: accepted
    ({"ms": 0}, "ms", "0"),
    ({"ms": "fast"}, "ms", '"fast"'),
    ({"max_seq_len": 10_000_000}, "max_seq_len", "10000000"),
    ({"batch": 99}, "batch", "99"),
    ({"trace": {"makespan_us": -3.0}}, "trace.makespan_us", "-3"),
    ({"always_fit": "yes"}, "always_fit", '"yes"'),
])
def test_a_bad_measured_step_is_exit_2_naming_file_path_and_value(tmp_path: Path, change: dict[str, Any],
                                                                   where: str, value: str) -> None:
    path = _steps_file(tmp_path, STEP, {**STEP, "name": "b", **change})
    out = _exit_2(["--check-measured", str(path)], f"{path}: $.steps[1].{where}: ", value)
    assert out.count("\n") == 1  # one line, nothing printed before it


def test_measured_steps_are_checked_before_any_is_lowered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad last step stops the command before the first (llama-8b, slow to lower) is lowered or fitted."""
    import megasynth.lowering.lower as lowering

    def no_lowering(*args: Any, **kw: Any) -> None:
        raise AssertionError("lowered before every step was checked")

    monkeypatch.setattr(lowering, "lower", no_lowering)
    path = _steps_file(tmp_path, {**STEP, "model": "llama-8b"}, {**STEP, "ms": -1})
    _exit_2(["--check-measured", str(path)], "$.steps[1].ms")
    _exit_2(["--measured", str(path)], "$.steps[1].ms")


def test_a_bad_prior_is_exit_2_naming_file_path_and_value(tmp_path: Path) -> None:
    prior = tmp_path / "prior.json"
    steps = _steps_file(tmp_path, STEP)
    for text, where in (("null", "$: "), ('{"ops": {"embed": {"eff": "fast"}}}', '$.ops.embed.eff: '),
                        ('{"ops": {"embed"', "$: invalid JSON"), ('{"eff": -1}', "$.eff: ")):
        prior.write_text(text)
        _exit_2(["--prior", str(prior), "--check-measured", str(steps)], f"{prior}: {where}")


def _run(root: Path, estimated: bool, candidates: int = 1) -> Path:
    run = RunDir(root)
    run.init({"model": "tiny", "workers": 8})
    sched = lower(get_model("tiny"), 8, Strategy())
    for k in range(candidates):
        run.save_candidate(f"c{k:04d}", sched, {"verdict": "accepted"},
                           {"ms": 0.05, "estimated": estimated, "ctx": 32, "strategy": Strategy().model_dump(
                               mode="json"), "schedule_key": schedule_key(sched), "workers": 8})
    return root


def test_fit_and_check_runs_must_be_runs_with_measured_candidates(tmp_path: Path) -> None:
    estimated = _run(tmp_path / "est", estimated=True)
    empty = _run(tmp_path / "empty", estimated=False, candidates=0)
    not_a_run = tmp_path / "bad"
    not_a_run.mkdir()
    for option in ("--fit-run", "--check-run"):
        what = "fit" if option == "--fit-run" else "check"
        _exit_2([option, str(not_a_run)], f"{not_a_run} is not a run folder (no run.json)")
        _exit_2([option, str(estimated)], f"{estimated} holds only cost-model estimates, nothing measured to {what}")
        _exit_2([option, str(empty)], f"{empty} holds no accepted candidates, nothing measured to {what}")
    assert "nothing to fit: give" not in _exit_2(["--fit-run", str(estimated)])


def test_a_measured_run_still_checks(tmp_path: Path) -> None:
    measured = _run(tmp_path / "gpu", estimated=False)
    res = CliRunner().invoke(calibrate, ["--check-run", str(measured)])
    assert res.exit_code == 0, res.output
    assert "over 1 measured steps" in res.output
