"""`synth search` and `synth strategy-schema` on input a user gets wrong, and on Ctrl-C: every check before the run
folder exists (a refused search leaves nothing), --resume taking the run's own settings, run names that stay one
folder under --runs-dir, flags that do not go together, and a quiet, resumable stop on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.cli import main

TINY = ["--model", "tiny-mha", "--cpu", "--no-progress", "--jobs", "1", "--interleavings", "5",
        "--final-interleavings", "5", "--proposer", "seeds"]


def _search(runs: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["search", "--runs-dir", str(runs), *args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/r: a finished tiny-mha search of 2 candidates on 132 workers, batch 1, ctx 32."""
    runs = tmp_path_factory.mktemp("runs")
    code, out = _search(runs, *TINY, "--budget", "2", "--run", "r")
    assert code == 0, out
    return runs


def test_llm_without_an_endpoint_leaves_no_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    code, out = _search(tmp_path / "runs", "--model", "tiny-mha", "--cpu", "--budget", "2", "--proposer", "llm")
    assert code == 2 and "--proposer llm needs OPENAI_API_KEY" in out and "Traceback" not in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ['{"total_bw": "fast"}', "{", "[1, 2]"])
def test_bad_cost_params_exit_2_before_the_run_folder(tmp_path: Path, text: str) -> None:
    params = tmp_path / "params.json"
    params.write_text(text)
    code, out = _search(tmp_path / "runs", *TINY, "--budget", "2", "--cost-params", str(params))
    assert code == 2 and str(params) in out and "Traceback" not in out, out
    assert not (tmp_path / "runs").exists()


def test_resume_alone_continues_with_the_runs_model_batch_ctx_and_workers(searched: Path) -> None:
    code, out = _search(searched, "--resume", "r", "--budget", "2", "--cpu", "--no-progress", "--jobs", "1")
    assert code == 0, out
    info = json.loads((searched / "r" / "run.json").read_text())
    assert (info["model"], info["workers"], info["batch"], info["ctx"]) == ("tiny-mha", 132, 1, 32)


@pytest.mark.parametrize(("option", "value", "theirs"), [("--workers", "8", "132"), ("--model", "tiny", "tiny-mha"),
                                                         ("--batch", "2", "1"), ("--ctx", "16", "32"),
                                                         ("--max-seq-len", "16", "32")])
def test_resume_with_a_setting_other_than_the_runs_is_an_error(searched: Path, option: str, value: str,
                                                               theirs: str) -> None:
    before = sorted(p.name for p in (searched / "r" / "candidates").iterdir())
    code, out = _search(searched, "--resume", "r", "--budget", "4", "--cpu", option, value)
    assert code == 2 and option in out and f"{option} {theirs}" in out and "Traceback" not in out, out
    assert sorted(p.name for p in (searched / "r" / "candidates").iterdir()) == before


def test_resume_with_the_runs_own_settings_given_again_is_fine(searched: Path) -> None:
    code, out = _search(searched, "--resume", "r", "--budget", "2", "--workers", "132", "--model", "tiny-mha",
                        "--ctx", "32", "--cpu", "--no-progress", "--jobs", "1")
    assert code == 0, out


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "..", "x/../../y"])
@pytest.mark.parametrize("option", ["--run", "--resume"])
def test_run_names_that_leave_the_runs_dir_are_refused(tmp_path: Path, option: str, name: str) -> None:
    runs = tmp_path / "a" / "runs"
    code, out = _search(runs, *TINY, "--budget", "2", option, name)
    assert code == 2 and option in out and repr(name) in out and "Traceback" not in out, out
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(("args", "named"), [(["--batch", "4"], "--batch"), (["--workers", "8"], "--workers"),
                                             (["--patches", "--space", "tiny"], "--patches and --space"),
                                             (["--patches", "--batch", "2"], "--batch")])
def test_strategy_schema_refuses_flags_that_do_not_go_together(args: list[str], named: str) -> None:
    res = CliRunner().invoke(main, ["strategy-schema", *args])
    assert res.exit_code == 2 and named in res.output, res.output


def test_strategy_schema_still_prints_each_of_its_three_documents() -> None:
    outputs = {}
    for args in ([], ["--patches"], ["--space", "tiny", "--batch", "2"]):
        res = CliRunner().invoke(main, ["strategy-schema", *args])
        assert res.exit_code == 0, res.output
        outputs[" ".join(args)] = res.output
    assert '"title": "megasynth strategy"' in outputs[""]
    assert outputs["--patches"].startswith("{") and outputs["--patches"] != outputs[""]
    assert outputs["--space tiny --batch 2"].startswith("tiles.")


def test_ctrl_c_stops_the_workers_quietly_and_says_how_to_resume(tmp_path: Path) -> None:
    """SIGINT to the whole process group (what Ctrl-C in a terminal sends) while the pool's workers and the
    descent's cost-model processes run: one line, exit 130, no worker traceback, and the run folder readable."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "megasynth.cli", "search", "--model", "tiny-mha", "--cpu", "--budget", "400",
           "--runs-dir", str(runs), "--run", "r", "--jobs", "2", "--interleavings", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OPENAI_API_KEY": "", "OPENAI_BASE_URL": ""})
    lines: list[str] = []
    evaluated = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "accepted" in line:  # (stderr is no terminal: a line per candidate)
                evaluated.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert evaluated.wait(60), "".join(lines)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(5)
    err = "".join(lines)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Aborted" not in err, err
    last = [ln for ln in err.splitlines() if ln.startswith("interrupted:")]
    assert len(last) == 1 and f"kept in {runs / 'r'}" in last[0], err
    assert "continue with synth search --resume r --runs-dir" in last[0] and "--cpu" in last[0], err
    json.loads((runs / "r" / "run.json").read_text())
    json.loads((runs / "r" / "leaderboard.json").read_text())
    for timing in (runs / "r" / "candidates").glob("*/timing.json"):
        json.loads(timing.read_text())
