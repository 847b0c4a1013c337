"""Seeded bugs: mutate real lowerings in the ways schedules go wrong and check that each is rejected with the right
category, with a z3 counterexample for races that the adversarial replay agrees with, and that the unmutated
lowerings are accepted.

The llama-1b naive lowering (13.8k instructions, ~3 s per validation) carries four classes; the others run on the
`tiny-gqa4` config (3 layers) so the suite stays fast. `python -m validator.bench` times llama-1b and llama-8b.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from megasynth.ir.schedule import parse_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.validator.verify import Options, Report, verify

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def llama1b() -> Doc:
    return lower(get_model("llama-1b"), 132).to_json()


@pytest.fixture(scope="module")
def tiny() -> Doc:
    return lower(get_model("tiny-gqa4"), 8).to_json()


def _copy(doc: Doc) -> Doc:
    return json.loads(json.dumps(doc))


def _select(doc: Doc, op: str, layer: int | None) -> list[dict[str, Any]]:
    return [i for i in doc["instructions"] if i["op"] == op and i.get("layer") == layer]


def _worker_of(doc: Doc, ident: int) -> int:
    return next(w for w, q in enumerate(doc["queues"]) if ident in q)


def _check(doc: Doc, expected: set[str], name: str) -> Report:
    report = verify(parse_schedule(doc), name, Options(interleavings=100, seed=3))
    cats = {f.category for f in report.findings}
    assert cats == expected, (name, [f.message for f in report.findings][:3])
    for f in report.findings:
        assert "disagreement" not in f.message, f.message
    if "race" in expected:
        assert report.stats["counterexamples"] >= 1
        race = next(f for f in report.findings if f.category == "race")
        assert race.details["events"], "a race comes with its interleaving"
        assert any(line.lstrip()[:1].isdigit() for line in race.details["text"]), race.details["text"]
        # the replay finds the same kind of witness, and only pairs the proofs could not order
        assert report.stats["replay_witnesses"] >= 1
    return report


# --- llama-1b -----------------------------------------------------------------------------------------------------


def test_unmutated_llama1b_is_accepted(llama1b: Doc) -> None:
    report = verify(parse_schedule(llama1b), "llama-1b", Options(interleavings=100))
    assert report.accepted, [f.message for f in report.findings][:3]
    assert report.stats["conflicting_pairs"] > 1_000_000
    assert report.stats["proven_by_graph"] == report.stats["conflicting_pairs"]
    assert report.stats["replay_witnesses"] == 0


def test_dropped_wait(llama1b: Doc) -> None:
    doc = _copy(llama1b)
    _select(doc, "attn_partial", 0)[3]["waits"] = []
    report = _check(doc, {"race"}, "dropped-wait")
    assert any(f.details.get("buffer") in ("q", "k_cache", "v_cache") for f in report.findings)


def test_off_by_one_target(llama1b: Doc) -> None:
    doc = _copy(llama1b)
    for ins in _select(doc, "o_proj_residual", 9):
        ins["waits"][0]["value"] -= 1
    report = _check(doc, {"race"}, "off-by-one")
    race = report.findings[0]
    assert race.details["buffer"] == "attn" and race.details["kinds"] == ["write", "read"]
    assert any("happen before all of these" in line for line in race.details["text"])


def test_consumer_moved_ahead_of_its_producer(llama1b: Doc) -> None:
    """A cycle through queue order and a counter together (the classic miss)."""
    doc = _copy(llama1b)
    producer = _select(doc, "mlp_norm_gate_up", 2)[0]["id"]
    consumer = _select(doc, "down_proj_residual", 2)[0]["id"]
    w = _worker_of(doc, producer)
    queue = [i for i in doc["queues"][_worker_of(doc, consumer)] if i != consumer]
    doc["queues"][_worker_of(doc, consumer)] = queue
    q = doc["queues"][w]
    q.insert(q.index(producer), consumer)
    report = _check(doc, {"deadlock"}, "moved-ahead")
    assert "wait-for cycle" in report.findings[0].message


# --- tiny-gqa4 ----------------------------------------------------------------------------------------------------


def test_unmutated_tiny_is_accepted(tiny: Doc) -> None:
    assert verify(parse_schedule(tiny), "tiny", Options(interleavings=200)).accepted


def _chunked_mlp(doc: Doc, chunks: int) -> Doc:
    """down_proj chunk k waits only on the gate_up rows it reads: right for `act`, wrong for the in-place `x`
    (gate_up of other chunks still reads x while down_proj reduce-adds into it)."""
    base = doc["counters"]
    gate = _select(doc, "mlp_norm_gate_up", 0)
    inter = max(i["args"]["end"] for i in gate)
    size = inter // chunks
    for ins in gate:
        ins["signals"] = [{"counter": base + ins["args"]["start"] // size, "add": 1}]
    for ins in _select(doc, "down_proj_residual", 0):
        k = ins["args"]["k_start"] // size
        ins["waits"] = [{"counter": base + k, "value": sum(1 for g in gate if g["args"]["start"] // size == k)}]
    # keep the next consumers of the gate_up counter (none besides down_proj in the naive lowering) consistent
    doc["counters"] = base + chunks
    return doc


def test_chunked_mlp_dependency_over_in_place_residual() -> None:
    doc = lower(get_model("tiny-gqa4"), 8, Strategy(k_splits={"o_proj_residual": 1, "down_proj_residual": 4}))
    doc = _chunked_mlp(doc.to_json(), 4)
    report = _check(doc, {"race"}, "chunked-mlp")
    assert any(f.details.get("buffer") == "x" for f in report.findings if f.category == "race")


def test_k_split_reducers_read_early() -> None:
    doc = lower(get_model("tiny-gqa4"), 8, Strategy(k_splits={"o_proj_residual": 2, "down_proj_residual": 1}))
    doc = doc.to_json()
    oproj = _select(doc, "o_proj_residual", 1)
    for ins in _select(doc, "mlp_norm_gate_up", 1):
        ins["waits"][0]["value"] = len(oproj) // 2  # counts one K-half of the partial sums only
    report = _check(doc, {"race"}, "k-split-early")
    race = next(f for f in report.findings if f.category == "race")
    assert race.details["buffer"] == "x" and "reduce" in race.details["kinds"]


def test_counters_swapped_between_ops(tiny: Doc) -> None:
    """An o_proj waits on attn_partial's counter and an attn_reduce on attn_reduce's own: the o_proj reads `attn`
    early (race) and the reduce waits for itself (deadlock); a race in an execution that later deadlocks is both."""
    doc = _copy(tiny)
    red = _select(doc, "attn_reduce", 1)[0]
    oproj = next(i for i in _select(doc, "o_proj_residual", 1)
                 if _worker_of(doc, i["id"]) != _worker_of(doc, red["id"]))
    red["waits"], oproj["waits"] = copy.deepcopy(oproj["waits"]), copy.deepcopy(red["waits"])
    _check(doc, {"race", "deadlock"}, "swapped")


def test_cyclic_waits_across_workers(tiny: Doc) -> None:
    doc = _copy(tiny)
    a = _select(doc, "attn_norm_qkv_rope", 0)[0]
    b = _select(doc, "mlp_norm_gate_up", 0)[0]
    assert _worker_of(doc, a["id"]) != _worker_of(doc, b["id"])
    c = doc["counters"]
    doc["counters"] = c + 1
    a["waits"] = a.get("waits", []) + [{"counter": c, "value": 1}]
    b["signals"] = b.get("signals", []) + [{"counter": c, "add": 1}]
    report = _check(doc, {"deadlock"}, "cyclic")
    assert "wait-for cycle" in report.findings[0].message


def test_coverage_gap_and_duplicate_tile(tiny: Doc) -> None:
    """A dropped o_proj tile leaves rows unproduced; a gate/up tile widened over its neighbour produces them twice."""
    doc = _copy(tiny)
    victim = _select(doc, "o_proj_residual", 1)[2]
    doc["instructions"].remove(victim)
    doc["queues"] = [[i for i in q if i != victim["id"]] for q in doc["queues"]]
    report = verify(parse_schedule(doc), "gap", Options(races=False))
    gap = [f.message for f in report.findings if f.category == "coverage"]
    assert gap == [f"o_proj_residual layer 1: rows [{victim['args']['start']}, {victim['args']['end']}) x [0, 256) "
                   "are produced by no instruction"]
    doc = _copy(tiny)
    first, second = _select(doc, "mlp_norm_gate_up", 0)[:2]
    first["args"]["end"] = second["args"]["end"]
    report = verify(parse_schedule(doc), "twice", Options(races=False))
    (dup,) = [f for f in report.findings if f.category == "coverage"]
    assert "produced twice" in dup.message and set(dup.instructions) == {first["id"], second["id"]}


def test_target_above_total_adds(tiny: Doc) -> None:
    doc = _copy(tiny)
    for ins in _select(doc, "attn_reduce", 2):
        ins["waits"][0]["value"] += 1
    report = _check(doc, {"deadlock"}, "unreachable")
    assert "unreachable" in report.findings[0].message




@pytest.mark.parametrize("knobs", [{"counter_sharing": "across_layers", "default_granularity": "chunk"},
                                   {"counter_sharing": "across_layers", "default_granularity": "all"},
                                   {"default_granularity": "tile", "assignment": "zigzag"}])
def test_other_lowerings_are_proven_by_the_graph(knobs: dict[str, str]) -> None:
    """Counters shared across layers are "k of n" joins on their face; the graph pass still orders them (a signaller
    of a later layer cannot complete while the counter is below an earlier layer's target)."""
    doc = lower(get_model("tiny-gqa4"), 8, Strategy(**knobs))
    report = verify(doc, "tiny", Options(interleavings=100))
    assert report.accepted, [f.message for f in report.findings][:2]
    assert report.stats["proven_by_graph"] == report.stats["conflicting_pairs"]


def test_across_layer_sharing_with_an_off_by_one_is_still_caught() -> None:
    doc = lower(get_model("tiny-gqa4"), 8, Strategy(counter_sharing="across_layers")).to_json()
    for ins in _select(doc, "o_proj_residual", 1):
        ins["waits"][0]["value"] -= 1
    _check(doc, {"race"}, "shared-off-by-one")
