"""Schedule sets (one schedule per context range): loading, picking by position, every defect named by file and JSON
path, and `validate` on a set (each member proven; a racy member rejects the set; a malformed set exits 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import dump_schedule
from megasynth.ir.schedule_set import load_schedule_or_set, load_schedule_set, set_document
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.validator.cli import main as validate_main


def _write_set(tmp: Path, bounds=(16, 64), model: str = "tiny", splits=(1, 4)) -> Path:
    spec = get_model(model)
    files = []
    for b, s in zip(bounds, splits, strict=True):
        f = tmp / "members" / f"upto{b}.json"
        f.parent.mkdir(exist_ok=True)
        dump_schedule(lower(spec, 4, Strategy(attn_splits=s)), f)
        files.append(str(f))
    path = tmp / "set.json"
    path.write_text(json.dumps(set_document(list(bounds), files, path, {"model": model})))
    return path


def test_a_set_loads_relative_members_and_picks_by_position(tmp_path: Path) -> None:
    path = _write_set(tmp_path)
    doc = json.loads(path.read_text())
    assert [r["schedule"] for r in doc["ranges"]] == ["members/upto16.json", "members/upto64.json"]
    sset = load_schedule_set(path)
    assert sset.bounds == [16, 64] and sset.max_seq_len == 64 and sset.ranges() == [(0, 16), (16, 64)]
    assert [sset.index(p) for p in (0, 15, 16, 63)] == [0, 0, 1, 1]
    assert sset.pick(20) is sset.schedules[1]
    assert {i.args.get("splits") for i in sset.pick(3).instructions if i.op == "attn_partial"} == {1}
    with pytest.raises(ValueError, match="outside the set's positions"):
        sset.index(64)
    assert load_schedule_or_set(path).bounds == [16, 64]  # type: ignore[union-attr]
    assert load_schedule_or_set(tmp_path / "members" / "upto16.json").format == "megakernel-schedule/1"  # type: ignore[union-attr]


def _edit(path: Path, fn) -> Path:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit, where, says", [
    (lambda d: d["ranges"].reverse(), "$.ranges[1].up_to", "increasing order"),
    (lambda d: d["ranges"][1].update(up_to=32), "$.ranges[1].up_to", "the last up_to must be 64"),
    (lambda d: d["ranges"][0].update(schedule="nope.json"), "$.ranges[0].schedule", "not found"),
    (lambda d: d["ranges"][0].update(up_to=0), "$.ranges[0].up_to", "greater than or equal to 1"),
    (lambda d: d["ranges"][0].update(extra=1), "$.ranges[0].extra", "unknown key"),
    (lambda d: d.update(ranges=[]), "$.ranges", "at least 1"),
])
def test_set_defects_name_the_json_path(tmp_path: Path, edit, where: str, says: str) -> None:
    path = _edit(_write_set(tmp_path), edit)
    with pytest.raises(ScheduleError) as exc:
        load_schedule_set(path)
    assert exc.value.path == where and says in exc.value.message and exc.value.file == str(path)


def test_members_must_share_the_model_and_the_kv_cache(tmp_path: Path) -> None:
    path = _write_set(tmp_path)
    other = tmp_path / "members" / "upto64.json"
    doc = json.loads(other.read_text())
    doc["model"]["max_seq_len"] = 128
    other.write_text(json.dumps(doc))
    with pytest.raises(ScheduleError) as exc:
        load_schedule_set(path)
    assert exc.value.path == "$.model.max_seq_len" and exc.value.file == str(other)
    dump_schedule(lower(get_model("tiny-gqa4"), 4), other)  # another model
    with pytest.raises(ScheduleError, match="same model") as exc:
        load_schedule_set(path)
    assert exc.value.path.startswith("$.model.")


def test_validate_proves_each_member_and_a_racy_member_rejects_the_set(tmp_path: Path) -> None:
    path = _write_set(tmp_path)
    res = CliRunner().invoke(validate_main, [str(path), "--interleavings", "20"])
    assert res.exit_code == 0, res.output
    assert "upto16.json (set " in res.output and "positions 0-15): ACCEPTED" in res.output
    assert "positions 16-63): ACCEPTED" in res.output
    member = tmp_path / "members" / "upto64.json"
    doc = json.loads(member.read_text())
    part = next(i for i in doc["instructions"] if i["op"] == "attn_partial" and i.get("waits"))
    part["waits"] = []  # attention no longer waits for this layer's QKV: a race
    member.write_text(json.dumps(doc))
    res = CliRunner().invoke(validate_main, [str(path), "--interleavings", "20", "--format", "json"])
    assert res.exit_code == 1, res.output
    verdicts = [r["verdict"] for r in json.loads(res.output)["reports"]]
    assert verdicts == ["accepted", "rejected"]
    _edit(path, lambda d: d["ranges"][1].update(up_to=40))
    res = CliRunner().invoke(validate_main, [str(path)])
    assert res.exit_code == 2 and "$.ranges[1].up_to" in res.output
