"""The schedule format: round trip, and every class of bad input gets a one-line error naming the
file and the JSON path, exit code 2 from `validate`, never a traceback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import MAX_INSTRUCTIONS, dump_schedule, load_schedule, parse_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.validator.cli import main
from megasynth.validator.verify import verify

Doc = dict[str, Any]


def _small() -> Doc:
    return {"format": "megakernel-schedule/1", "target": {"workers": 2}, "buffers": {"x": 8, "y": 4}, "counters": 2,
            "instructions": [
                {"id": 0, "op": "produce", "writes": [{"buffer": "x", "range": [0, 8]}],
                 "signals": [{"counter": 0, "add": 1}]},
                {"id": 5, "op": "consume", "reads": [{"buffer": "x", "range": [0, 4]}],
                 "writes": [{"buffer": "y", "range": [0, 4]}], "waits": [{"counter": 0, "value": 1}]}],
            "queues": [[0], [5]]}


def test_round_trip_keeps_extensions(tmp_path: Path) -> None:
    doc = lower(get_model("tiny"), 4).to_json()
    doc["x-note"] = {"by": "test"}
    doc["instructions"][0]["x-cost"] = 1.5
    doc["meta"]["parent"] = "abc"
    first = parse_schedule(doc)
    path = tmp_path / "s.json"
    dump_schedule(first, path)
    again = load_schedule(path)
    assert again.to_json() == first.to_json()
    assert again.to_json()["x-note"] == {"by": "test"}
    assert again.to_json()["instructions"][0]["x-cost"] == 1.5
    assert verify(again, str(path)).accepted


def _set(path: tuple, value: Any) -> Callable[[Doc], Doc]:
    def mutate(doc: Doc) -> Doc:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return doc
    return mutate


def _delete(path: tuple) -> Callable[[Doc], Doc]:
    def mutate(doc: Doc) -> Doc:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        return doc
    return mutate


# (name, mutation, expected JSON path, a word of the message)
CASES: list[tuple[str, Callable[[Doc], Doc], str, str]] = [
    ("wrong type: counters", _set(("counters",), "two"), "$.counters", "integer"),
    ("wrong type: id", _set(("instructions", 1, "id"), "5"), "$.instructions[1].id", "integer"),
    ("wrong type: bool as int", _set(("instructions", 0, "signals", 0, "add"), True),
     "$.instructions[0].signals[0].add", "integer"),
    ("wrong type: float workers", _set(("target", "workers"), 1.5), "$.target.workers", "integer"),
    ("wrong type: range", _set(("instructions", 0, "writes", 0, "range"), "0:8"),
     "$.instructions[0].writes[0].range", "tuple"),
    ("missing field: queues", _delete(("queues",)), "$.queues", "missing"),
    ("missing field: op", _delete(("instructions", 0, "op")), "$.instructions[0].op", "missing"),
    ("missing field: wait value", _delete(("instructions", 1, "waits", 0, "value")),
     "$.instructions[1].waits[0].value", "missing"),
    ("unknown key in a wait", _set(("instructions", 1, "waits", 0, "timeout"), 5),
     "$.instructions[1].waits[0].timeout", "unknown key"),
    ("unknown key in a signal", _set(("instructions", 0, "signals", 0, "scope"), "gpu"),
     "$.instructions[0].signals[0].scope", "unknown key"),
    ("unknown key in a region", _set(("instructions", 0, "writes", 0, "stride"), 2),
     "$.instructions[0].writes[0].stride", "unknown key"),
    ("negative counter", _set(("instructions", 1, "waits", 0, "counter"), -1), "$.instructions[1].waits[0].counter",
     "greater than or equal"),
    ("negative id", _set(("instructions", 0, "id"), -3), "$.instructions[0].id", "greater than or equal"),
    ("absurd wait value", _set(("instructions", 1, "waits", 0, "value"), 2**40), "$.instructions[1].waits[0].value",
     "less than or equal"),
    ("absurd worker count", _set(("target", "workers"), 10**6), "$.target.workers", "less than or equal"),
    ("zero add", _set(("instructions", 0, "signals", 0, "add"), 0), "$.instructions[0].signals[0].add",
     "greater than or equal"),
    ("range start after end", _set(("instructions", 0, "writes", 0, "range"), [6, 2]),
     "$.instructions[0].writes[0].range", "after its end"),
    ("wrong format", _set(("format",), "megakernel-schedule/2"), "$.format", "megakernel-schedule/1"),
    ("instruction in two queues", _set(("queues",), [[0, 5], [5]]), "$.queues[1][0]", "already in queue 0"),
    ("instruction in no queue", _set(("queues",), [[0], []]), "$.instructions[1].id", "in no queue"),
    ("queue names a missing id", _set(("queues",), [[0], [5, 9]]), "$.queues[1][1]", "does not exist"),
    ("more queues than workers", _set(("queues",), [[0], [5], []]), "$.queues", "3 queues for 2 workers"),
    ("unknown buffer", _set(("instructions", 1, "reads", 0, "buffer"), "X"), "$.instructions[1].reads[0].buffer",
     "unknown buffer 'X'"),
    ("range past the end", _set(("instructions", 1, "writes", 0, "range"), [2, 5]),
     "$.instructions[1].writes[0].range", "past the end"),
    ("duplicate ids", _set(("instructions", 1, "id"), 0), "$.instructions[1].id", "used twice"),
    ("wait counter out of range", _set(("instructions", 1, "waits", 0, "counter"), 2),
     "$.instructions[1].waits[0].counter", "out of range"),
    ("signal counter out of range", _set(("instructions", 0, "signals", 0, "counter"), 7),
     "$.instructions[0].signals[0].counter", "out of range"),
    ("no buffers and no model", _delete(("buffers",)), "$.buffers", "declare `buffers`"),
    ("catalogue op without model", _set(("instructions", 0, "op"), "embed"), "$.instructions[0].op", "model"),
    ("top level not an object", lambda d: [d], "$", "JSON object"),
]


@pytest.mark.parametrize(("name", "mutate", "path", "word"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_located_line(tmp_path: Path, name: str, mutate: Callable[[Doc], Doc], path: str,
                                       word: str) -> None:
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(mutate(_small())))
    with pytest.raises(ScheduleError) as info:
        verify(load_schedule(file), str(file))
    err = info.value
    assert err.path == path, (err.path, err.message)
    assert word in err.message, err.message
    line = str(err)
    assert "\n" not in line and line.startswith(f"{file}: {path}: ")
    res = CliRunner().invoke(main, [str(file)])
    assert res.exit_code == 2
    assert f"{file}: MALFORMED\n  {path}: " in res.stdout  # the text report names it once, on stdout
    assert "Traceback" not in res.output


@pytest.mark.parametrize("text", ['{"format": "megakernel-schedule/1", "target": {"work', "", "[1, 2,", "{]"])
def test_truncated_or_invalid_json(tmp_path: Path, text: str) -> None:
    file = tmp_path / "t.json"
    file.write_text(text)
    with pytest.raises(ScheduleError) as info:
        load_schedule(file)
    assert info.value.path == "$" and "invalid JSON" in info.value.message and "line 1" in info.value.message
    assert CliRunner().invoke(main, [str(file)]).exit_code == 2


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    nested = tmp_path / "deep.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    for file in (missing, binary, nested):
        with pytest.raises(ScheduleError) as info:
            load_schedule(file)
        assert str(info.value).startswith(f"{file}: $: ")
        res = CliRunner().invoke(main, [str(file)])
        assert res.exit_code == 2 and "Traceback" not in res.output


def test_a_million_instructions_is_rejected_fast(tmp_path: Path) -> None:
    """The size limit is checked before pydantic sees a single instruction."""
    n = 1_000_000
    body = ",".join(f'{{"id":{i},"op":"x"}}' for i in range(n))
    text = ('{"format":"megakernel-schedule/1","target":{"workers":1},"buffers":{},"counters":0,"queues":[],'
            f'"instructions":[{body}]}}')
    file = tmp_path / "huge.json"
    file.write_text(text)
    t = time.perf_counter()
    with pytest.raises(ScheduleError) as info:
        load_schedule(file)
    assert time.perf_counter() - t < 10
    assert info.value.path == "$.instructions" and str(MAX_INSTRUCTIONS) in info.value.message
