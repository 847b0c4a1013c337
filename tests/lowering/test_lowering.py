"""`synth lower` end to end: the schedule it writes is complete, well-formed and accepted by `validate`."""

from __future__ import annotations

import functools
import json
import re

import pytest
from click.testing import CliRunner

import megasynth.validator.cli
from megasynth.cli import main as synth_main
from megasynth.ir.catalogue import FUSED_OPROJ, OP_ORDER
from megasynth.ir.schedule import load_schedule
from megasynth.lowering.models import MODELS
from megasynth.validator.verify import Options

COUNTS = re.compile(r"(\d+) instructions, (\d+) counters, (\d+) workers, queue length (\d+)\.\.(\d+)")


@pytest.fixture
def no_races(monkeypatch: pytest.MonkeyPatch) -> None:
    """`validate` with structure, coverage and deadlock only (the race phases are tested elsewhere and are slower)."""
    monkeypatch.setattr(megasynth.validator.cli, "Options", functools.partial(Options, races=False))


def lower_cli(tmp_path, *args: str) -> tuple[object, str]:
    out = str(tmp_path / "schedule.json")
    result = CliRunner().invoke(synth_main, ["lower", *args, "-o", out])
    return result, out


def test_lower_llama_1b_is_accepted(tmp_path, no_races: None) -> None:
    result, out = lower_cli(tmp_path, "--model", "llama-1b")
    assert result.exit_code == 0, result.output
    m = COUNTS.search(result.stderr)
    assert m, result.stderr
    n, counters, workers, qmin, qmax = map(int, m.groups())
    doc = json.loads(open(out, encoding="utf-8").read())
    assert (n, counters, workers) == (len(doc["instructions"]), doc["counters"], doc["target"]["workers"])
    assert workers == 132 and qmax - qmin <= 1  # round-robin
    assert (qmin, qmax) == (min(map(len, doc["queues"])), max(map(len, doc["queues"])))
    # ids sequential in decode order; every instruction in exactly one queue
    assert [ins["id"] for ins in doc["instructions"]] == list(range(n))
    placed = [i for q in doc["queues"] for i in q]
    assert sorted(placed) == list(range(n))
    ops = [ins["op"] for ins in doc["instructions"]]
    qk_apart = {"attn_norm_qkv_rope_sq", "qk_norm_apply"}  # QK-norm models only
    assert ops[0] == "embed" and ops[-1] == "final_norm_lm_head"
    assert set(ops) == set(OP_ORDER) - {FUSED_OPROJ, *qk_apart}
    layers = [ins.get("layer") for ins in doc["instructions"] if ins["op"] != "embed"]
    assert sorted({x for x in layers if x is not None}) == list(range(MODELS["llama-1b"].config.num_hidden_layers))
    # the file round-trips through the format models unchanged
    assert load_schedule(out).to_json() == doc

    check = CliRunner().invoke(megasynth.validator.cli.main, [out, "--interleavings", "0"])
    assert check.exit_code == 0, check.output
    assert "ACCEPTED" in check.stdout


@pytest.mark.parametrize(("model", "workers", "strategy"), [
    ("tiny", 3, {"attn_splits": 3, "k_splits": {"o_proj_residual": 2, "down_proj_residual": 2}}),
    ("tiny-gqa4", 1, {"tiles": {"attn_norm_qkv_rope": 96, "final_norm_lm_head": 100}}),
    ("tiny-mha", 200, {}),
])
def test_lower_with_strategy_is_accepted(tmp_path, no_races: None, model: str, workers: int, strategy: dict) -> None:
    sfile = tmp_path / "strategy.json"
    sfile.write_text(json.dumps(strategy))
    result, out = lower_cli(tmp_path, "--model", model, "--workers", str(workers), "--strategy", str(sfile))
    assert result.exit_code == 0, result.output
    doc = json.loads(open(out, encoding="utf-8").read())
    assert doc["target"]["workers"] == workers and len(doc["queues"]) == workers
    assert doc["meta"]["proposer"] == "manual"  # a schedule from a strategy file is not the naive baseline
    assert sorted(i for q in doc["queues"] for i in q) == list(range(len(doc["instructions"])))
    if "attn_splits" in strategy:
        splits = {ins["args"]["splits"] for ins in doc["instructions"] if ins["op"] == "attn_partial"}
        assert splits == {strategy["attn_splits"]}
    check = CliRunner().invoke(megasynth.validator.cli.main, [out])
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize(("content", "needle"), [
    (None, "cannot read strategy"),
    ("{\"attn_splits\": ", "invalid JSON"),
    ("{\"attn_splits\": 0}", "$.attn_splits"),
    ("{\"tiles\": {\"warp_speed\": 4}}", "unknown op 'warp_speed'"),
    ("{\"colour\": \"red\"}", "$.colour"),
])
def test_bad_strategy_is_one_line_exit_2(tmp_path, content: str | None, needle: str) -> None:
    sfile = tmp_path / "bad.json"
    if content is not None:
        sfile.write_text(content)
    result, out = lower_cli(tmp_path, "--model", "tiny", "--strategy", str(sfile))
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: ") and str(sfile) in err and needle in err, err
    assert not (tmp_path / "schedule.json").exists()


def test_unknown_model_exit_2(tmp_path) -> None:
    result, _ = lower_cli(tmp_path, "--model", "llama-9000")
    assert result.exit_code == 2
    assert "unknown model 'llama-9000'" in result.stderr


def test_models_lists_every_spec() -> None:
    result = CliRunner().invoke(synth_main, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name, spec in MODELS.items():
        assert name in result.stdout
        assert str(spec.config.hidden_size) in result.stdout
