"""Cost-params files (`synth search --cost-params`, `synth calibrate --prior`) are a closed, typed schema: a file of
another kind or a value the simulation cannot use is one `CostParamsError` naming the file, the JSON path and the
value when it is read; the shipped file and every file `synth calibrate` writes still load."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.lowering.costmodel import (
    DATA,
    CostParams,
    CostParamsError,
    CostParamsFile,
    OpParams,
    OpParamsFile,
    estimate,
    load_params,
)
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import SearchSpace, Strategy

V10 = CostParams(ops={op: OpParams(eff=1.0, overhead_us=1.0) for op in CostParams().ops}, total_bw=2e4, sm_peak=3e3,
                 hop_us=0.6, wait_us=0.0, ring_bytes=4096.0, consume_bw=8e3, box_rows=16, launch_us=3.0)

BAD = [  # (file text, JSON path, the value as the message shows it)
    ("null", "$", "null"),
    ("[1]", "$", "[1]"),
    ('{"ops": {"embed": {"eff": "fast"}}}', "$.ops.embed.eff", '"fast"'),
    ('{"ops": {"embed": {"eff": -1}}}', "$.ops.embed.eff", "-1"),
    ('{"ops": {"embed": {"eff": 0}}}', "$.ops.embed.eff", "0"),
    ('{"ops": {"embed": {"eff": 1.5}}}', "$.ops.embed.eff", "1.5"),
    ('{"ops": {"embed": {"overhead_us": -0.5}}}', "$.ops.embed.overhead_us", "-0.5"),
    ('{"ops": {"embed": {"eff": 0.5, "speed": 2}}}', "$.ops.embed.speed", "2"),
    ('{"ops": {"embd": {"eff": 0.5}}}', "$.ops.embd", '"embd"'),
    ('{"total_bw": 0}', "$.total_bw", "0"),
    ('{"sm_peak": true}', "$.sm_peak", "true"),
    ('{"hop_us": NaN}', "$.hop_us", "NaN"),
    ('{"box_rows": -16}', "$.box_rows", "-16"),
    ('{"attn_mma_batch": 0}', "$.attn_mma_batch", "0"),
    ('{"source": 3}', "$.source", "3"),
    # a `synth bench --json` result is no cost-params file: its keys are refused, not dropped
    ('{"model": "tiny", "results": [{"variant": "megakernel", "ms": 0.1}]}', "$.model", '"tiny"'),
]


@pytest.mark.parametrize(("text", "where", "value"), BAD)
def test_a_bad_cost_params_file_is_one_error_naming_file_path_and_value(tmp_path: Path, text: str, where: str,
                                                                        value: str) -> None:
    path = tmp_path / "params.json"
    path.write_text(text)
    with pytest.raises(CostParamsError) as info:
        load_params(path)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert msg.startswith(f"{path}: {where}: ") and value in msg, msg
    assert "\n" not in msg


def test_an_unreadable_or_truncated_cost_params_file_names_the_file(tmp_path: Path) -> None:
    truncated = tmp_path / "cut.json"
    truncated.write_text(DATA.read_text(encoding="utf-8")[:200])
    with pytest.raises(CostParamsError, match=r"cut\.json: \$: invalid JSON: .*line 13"):
        load_params(truncated)
    with pytest.raises(CostParamsError, match=r"missing\.json: \$: cannot read"):
        load_params(tmp_path / "missing.json")  # a file asked for by name is never silently the priors
    with pytest.raises(CostParamsError, match=r"^\$: cost-model parameters are a JSON object"):
        CostParams.from_json(None)  # type: ignore[arg-type]


def test_the_schema_mirrors_the_dataclasses() -> None:
    """Every field of CostParams / OpParams is in the schema with the same default, and nothing else but the fit's
    records."""
    fields = {f.name: f for f in dataclasses.fields(CostParams)}
    assert set(CostParamsFile.model_fields) - {"fit", "refits"} == set(fields)
    for name, f in fields.items():
        if name != "ops":
            assert CostParamsFile.model_fields[name].default == f.default, name
    assert {f.name: f.default for f in dataclasses.fields(OpParams)} == {
        k: v.default for k, v in OpParamsFile.model_fields.items()}


def test_the_shipped_and_saved_parameters_round_trip(tmp_path: Path) -> None:
    shipped = load_params()
    assert load_params(DATA) == shipped and shipped.ring_bytes > 0
    assert CostParams.from_json(shipped.to_json()) == shipped
    for params in (CostParams(), V10, shipped):
        path = tmp_path / "p.json"
        params.save(path)
        assert load_params(path) == params
    partial = tmp_path / "partial.json"  # a hand-written file may leave fields (and ops) out: the defaults fill in
    partial.write_text(json.dumps({"ops": {"embed": {"eff": 0.5}}, "hop_us": 1}))
    p = load_params(partial)
    assert p.op("embed") == OpParams(eff=0.5) and p.hop_us == 1 and p.op("attn_partial") == OpParams()


def test_files_synth_calibrate_writes_load_again(tmp_path: Path) -> None:
    """A step fit's output (with its `fit` record) and a refit of some parameters (with `refits`) load, and give the
    fitted parameters back."""
    from megasynth.commands.calibrate import calibrate

    rng = random.Random(2)
    spec = get_model("tiny")
    space = SearchSpace(spec, 8)
    steps = []
    for k in range(4):
        st = space.random(rng) if k else Strategy()
        ms = estimate(lower(spec, 8, st), 64, replace(V10, hop_us=0.9)).makespan_ms
        steps.append({"name": f"s{k}", "model": "tiny", "workers": 8, "ctx": 64, "ms": ms,
                      "strategy": st.model_dump(mode="json")})
    measured = tmp_path / "steps.json"
    measured.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": steps}))
    prior = tmp_path / "prior.json"
    V10.save(prior)
    fitted, refitted = tmp_path / "fit.json", tmp_path / "refit.json"
    common = ["--measured", str(measured), "--holdout", "0", "--jobs", "1", "--iterations", "1", "--max-fit", "4"]
    res = CliRunner().invoke(calibrate, ["--prior", str(prior), *common, "-o", str(fitted)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(calibrate, ["--prior", str(fitted), *common, "--free", "hop_us", "-o", str(refitted)])
    assert res.exit_code == 0, res.output
    doc = json.loads(refitted.read_text())
    assert "fit" in doc and len(doc["refits"]) == 1
    for path in (fitted, refitted):
        p = load_params(path)
        assert p.source.startswith("fitted to") and p.ring_bytes == V10.ring_bytes
        want = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("fit", "refits")}
        assert p.to_json() == want
