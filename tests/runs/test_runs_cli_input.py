"""`synth runs` on input a user gets wrong: a `--bench` file that is no bench of the run (kept nowhere, exit 2
naming the file and the JSON path), and run names that would reach folders outside --runs-dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.atomic import write_json_atomic
from megasynth.cli import main

OLD_BENCH = {"estimated": False, "results": [{"name": "PyTorch eager", "median_ms": 0.09}], "floor_ms": 0.006}


def _bench(**over: Any) -> dict[str, Any]:
    doc = {"format": "megasynth-bench/1", "model": "tiny-mha", "batch": 1, "dry_run": True, "results": [
        {"ctx": 32, "batch": 1, "floor": {"ms": 0.004},
         "variants": {"torch_graph": {"status": "ok", "timing": {"median_ms": 0.05}}}}]}
    doc.update(over)
    return doc


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_json_atomic(root / "r" / "run.json", {"model": "tiny-mha", "batch": 1, "workers": 8, "ctx": 32})
    write_json_atomic(root / "r" / "leaderboard.json", {"entries": []})
    write_json_atomic(root / "r" / "bench.json", OLD_BENCH)
    return root


@pytest.mark.parametrize(("doc", "said"), [
    (None, "$: null is no JSON object"),
    ({"results": "x"}, "$.format: missing"),
    ({"format": "megasynth-schedule/1", "queues": [], "instructions": []}, "$.format"),
    (_bench(format="megasynth-bench/0"), '$.format: "megasynth-bench/0" is not "megasynth-bench/1"'),
    (_bench(results="x"), "$.results"),
    (_bench(results=[]), "$.results"),
    (_bench(results=[{"ctx": "32", "variants": {}}]), "$.results[0].ctx"),
    (_bench(model="llama-1b"), '$.model: "llama-1b" is a bench of another model; the run is for "tiny-mha"'),
    (_bench(batch=8), "$.batch: 8 is a bench at another batch"),
])
def test_report_keeps_only_a_bench_of_the_runs_model_and_batch(runs: Path, tmp_path: Path, doc: Any,
                                                               said: str) -> None:
    f = tmp_path / "bench-in.json"
    f.write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["runs", "report", "r", "--runs-dir", str(runs), "--bench", str(f)])
    assert res.exit_code == 2 and str(f) in res.output and said in res.output, res.output
    assert "Traceback" not in res.output
    assert json.loads((runs / "r" / "bench.json").read_text()) == OLD_BENCH  # the run keeps the bench it had
    assert not (runs / "r" / "report.html").exists()


def test_report_keeps_a_bench_of_the_runs_model(runs: Path, tmp_path: Path) -> None:
    f = tmp_path / "bench-in.json"
    f.write_text(json.dumps(_bench()))
    res = CliRunner().invoke(main, ["runs", "report", "r", "--runs-dir", str(runs), "--bench", str(f)])
    assert res.exit_code == 0, res.output
    assert json.loads((runs / "r" / "bench.json").read_text()) == _bench()


@pytest.mark.parametrize("command", ["show", "report", "pack"])
@pytest.mark.parametrize("name", ["..", "../runs", "r/..", "../r"])
def test_runs_commands_do_not_reach_outside_the_runs_dir(runs: Path, command: str, name: str) -> None:
    res = CliRunner().invoke(main, ["runs", command, name, "--runs-dir", str(runs)])
    assert res.exit_code == 2 and repr(name) in res.output and "Traceback" not in res.output, res.output
    assert not (runs.parent / "report.html").exists() and not (runs / "report.html").exists()
