"""Verify the verifier: on random small schedules, the validator's race and deadlock verdicts must equal those of a
brute-force enumeration of every interleaving (each instruction as a start and an end event), and every pair that z3
or the replay reports must be a real race.

Runtime: 1000 hypothesis examples (derandomized, so CI is reproducible) take ~30 s on 2 cores; the replay runs 20
interleavings per example (its agreement is also checked on the seeded bugs). Schedules: 2-4 workers, <= 9
declared-footprint instructions over two 4-element buffers; counters shared by several producers, partial targets
(value below the total adds), reduces, in-place read+write, queue order independent of ids, and cycles all occur.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from validator.schedule import parse_schedule
from validator.verify import Options, verify

BUFSIZE = 4


def conflicting(acc_a: list[tuple[str, str, int, int]], acc_b: list[tuple[str, str, int, int]]) -> bool:
    for ka, buf, lo, hi in acc_a:
        for kb, buf2, lo2, hi2 in acc_b:
            if buf == buf2 and lo < hi2 and lo2 < hi and not (ka == kb and ka in ("read", "reduce")):
                return True
    return False


def brute_force(doc: dict[str, Any], pipelined: bool = False) -> tuple[set[tuple[int, int]], bool]:
    """Every interleaving of start/end events: the set of racing id pairs (a < b, b started while a had not ended)
    and whether some execution deadlocks (a state with no enabled event before everything ended)."""
    ins = {i["id"]: i for i in doc["instructions"]}
    ids = sorted(ins)
    pos = {x: k for k, x in enumerate(ids)}
    kinds = {"reads": "read", "writes": "write", "reduces": "reduce"}
    acc = {x: [(kinds[kind], r["buffer"], *r["range"]) for kind in kinds for r in ins[x].get(kind, [])
               if r["range"][0] < r["range"][1]] for x in ids}
    conflicts = {x: [a for a in ids if a < x and conflicting(acc[a], acc[x])] for x in ids}
    queues = doc["queues"]
    prev = {}
    for q in queues:
        for k, x in enumerate(q):
            prev[x] = q[k - 1] if k else None
    full = (1 << len(ids)) - 1
    races: set[tuple[int, int]] = set()
    deadlock = False
    seen = set()
    stack = [(0, 0)]
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        started, ended = state
        counters: dict[int, int] = {}
        for x in ids:
            if ended >> pos[x] & 1:
                for s in ins[x].get("signals", []):
                    counters[s["counter"]] = counters.get(s["counter"], 0) + s["add"]
        moves = []
        for x in ids:
            bit = 1 << pos[x]
            if started & bit:
                if not ended & bit:
                    moves.append((started, ended | bit))
                continue
            p = prev[x]
            if p is not None and not ((started if pipelined else ended) >> pos[p] & 1):
                continue
            if all(counters.get(w["counter"], 0) >= w["value"] for w in ins[x].get("waits", [])):
                for a in conflicts[x]:
                    if not ended >> pos[a] & 1:
                        races.add((a, x))
                moves.append((started | bit, ended))
        if not moves and ended != full:
            deadlock = True
        stack.extend(moves)
    return races, deadlock


def _region(draw: Any) -> dict[str, Any]:
    lo = draw(st.integers(0, BUFSIZE - 1))
    hi = draw(st.integers(lo + 1, BUFSIZE))
    return {"buffer": draw(st.sampled_from(["x", "y"])), "range": [lo, hi]}


@st.composite
def schedules(draw: Any) -> dict[str, Any]:
    workers = draw(st.integers(2, 4))
    n = draw(st.integers(1, 9))
    counters = draw(st.integers(1, 4))
    ids = draw(st.permutations(list(range(n))))
    signals = [[{"counter": draw(st.integers(0, counters - 1)), "add": draw(st.integers(1, 2))}
                for _ in range(draw(st.integers(0, 2)))] for _ in range(n)]
    total = [sum(sg["add"] for sgs in signals for sg in sgs if sg["counter"] == c) for c in range(counters)]
    # Half the schedules are deadlock-free by construction (ascending queues, targets reachable by lower ids), so
    # that races decided by partial targets and shared counters (z3's work) are common, not drowned by deadlocks.
    acyclic = draw(st.booleans())
    instructions = []
    for x in range(n):
        rec: dict[str, Any] = {"id": x, "op": "decl"}
        for kind in ("reads", "writes", "reduces"):
            k = draw(st.integers(0, 2 if kind == "reads" else 1))
            if k:
                rec[kind] = [_region(draw) for _ in range(k)]
        if draw(st.booleans()):  # in-place update: read and write one region
            r = _region(draw)
            rec.setdefault("reads", []).append(r)
            rec.setdefault("writes", []).append(dict(r))
        waits = []
        for _ in range(draw(st.integers(0, 2))):
            c = draw(st.integers(0, counters - 1))
            # mostly reachable targets (full or partial), sometimes one above the total adds
            if acyclic:
                below = sum(sg["add"] for sgs in signals[:x] for sg in sgs if sg["counter"] == c)
                waits.append({"counter": c, "value": draw(st.integers(0, below))})
                continue
            above = draw(st.integers(0, 9)) == 0
            waits.append({"counter": c, "value": total[c] + 1 if above else draw(st.integers(0, total[c]))})
        rec["waits"] = waits
        rec["signals"] = signals[x]
        instructions.append(rec)
    queues: list[list[int]] = [[] for _ in range(workers)]
    if acyclic or draw(st.booleans()):
        ids = sorted(ids)
    for x in ids:  # queue order: ascending ids or a random permutation
        queues[draw(st.integers(0, workers - 1))].append(x)
    return {"format": "megakernel-schedule/1", "target": {"workers": workers}, "buffers": {"x": BUFSIZE, "y": BUFSIZE},
            "counters": counters, "instructions": instructions, "queues": queues}


def _check(doc: dict[str, Any], pipelined: bool) -> None:
    races, deadlock = brute_force(doc, pipelined)
    report = verify(parse_schedule(doc), "random", Options(interleavings=20, seed=1, pipelined=pipelined))
    cats = [f.category for f in report.findings]
    assert "unproven" not in cats, report.to_json()
    assert ("deadlock" in cats) == deadlock, (doc, races, deadlock, report.to_json())
    assert ("race" in cats) == bool(races), (doc, races, deadlock, report.to_json())
    for f in report.findings:
        if f.category == "race":
            a, b = f.details["pair"]
            assert (a, b) in races, (doc, races, f.to_json())
            assert "disagreement" not in f.message
            _check_events(doc, f.details.get("events", []), a, b)


def _check_events(doc: dict[str, Any], events: list[dict[str, Any]], a: int, b: int) -> None:
    """A counterexample is a legal run in which b starts before a ends: each instruction starts before it ends,
    workers start their instructions in queue order, and the waits shown hold."""
    if not events:
        return
    at = {(e["instruction"], e["event"]): k for k, e in enumerate(events)}
    assert at[(b, "start")] < at.get((a, "end"), len(events))
    for (i, kind), k in at.items():
        if kind == "end":
            assert at[(i, "start")] < k
    for q in doc["queues"]:
        starts = [at[(i, "start")] for i in q if (i, "start") in at]
        assert starts == sorted(starts)
    for e in events:
        for w in e.get("waits", []):
            assert w["current"] >= w["value"], e


@settings(max_examples=900, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(schedules())
def test_verdict_matches_brute_force(doc: dict[str, Any]) -> None:
    _check(doc, pipelined=False)


@settings(max_examples=250, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(schedules())
def test_pipelined_verdict_matches_brute_force(doc: dict[str, Any]) -> None:
    _check(doc, pipelined=True)


def test_classic_cycle_through_queue_and_counter_is_a_deadlock() -> None:
    """The 4-task schedule a published validator accepted: a cycle through a wait and queue order together."""
    doc = {"format": "megakernel-schedule/1", "target": {"workers": 2}, "buffers": {"x": 4}, "counters": 2,
           "instructions": [
               {"id": 0, "op": "a", "waits": [{"counter": 1, "value": 1}],
                "writes": [{"buffer": "x", "range": [0, 2]}]},
               {"id": 1, "op": "b", "signals": [{"counter": 0, "add": 1}]},
               {"id": 2, "op": "c", "waits": [{"counter": 0, "value": 1}]},
               {"id": 3, "op": "d", "signals": [{"counter": 1, "add": 1}]}],
           "queues": [[0, 1], [2, 3]]}
    _, deadlock = brute_force(doc)
    report = verify(parse_schedule(doc), "cycle", Options(interleavings=10))
    assert deadlock
    dl = [f for f in report.findings if f.category == "deadlock"]
    assert dl and "wait-for cycle" in dl[0].message


def test_shared_counter_stages_are_proven_by_the_graph() -> None:
    """Two stages count on one counter (targets 4 then 8): the second stage's own adds are gated behind c >= 4, so
    the graph pass orders everything without z3, and the brute force agrees that there is no race."""
    ins = [{"id": i, "op": "a", "writes": [{"buffer": "x", "range": [i, i + 1]}], "signals": [{"counter": 0, "add": 1}]}
           for i in range(4)]
    ins += [{"id": 4 + i, "op": "b", "reads": [{"buffer": "x", "range": [0, 4]}],
             "writes": [{"buffer": "y", "range": [i, i + 1]}], "waits": [{"counter": 0, "value": 4}],
             "signals": [{"counter": 0, "add": 1}]} for i in range(4)]
    ins.append({"id": 8, "op": "c", "reads": [{"buffer": "y", "range": [0, 4]}], "waits": [{"counter": 0, "value": 8}]})
    doc = {"format": "megakernel-schedule/1", "target": {"workers": 3}, "buffers": {"x": 4, "y": 4}, "counters": 1,
           "instructions": ins, "queues": [[0, 4, 8], [1, 2, 5], [3, 6, 7]]}
    races, deadlock = brute_force(doc)
    report = verify(parse_schedule(doc), "shared", Options(interleavings=50))
    assert not races and not deadlock and report.accepted
    assert report.stats["proven_by_z3"] == 0 and report.stats["proven_by_graph"] == report.stats["conflicting_pairs"]


def _first_of_two() -> dict[str, Any]:
    """#2 waits for one add from #0 (writes x) or #1 (queued after #0): the graph cannot order #0 -> #2, z3 can."""
    return {"format": "megakernel-schedule/1", "target": {"workers": 2}, "buffers": {"x": 4}, "counters": 1,
            "instructions": [
                {"id": 0, "op": "w", "writes": [{"buffer": "x", "range": [0, 4]}],
                 "signals": [{"counter": 0, "add": 1}]},
                {"id": 1, "op": "n", "signals": [{"counter": 0, "add": 1}]},
                {"id": 2, "op": "r", "reads": [{"buffer": "x", "range": [0, 4]}],
                 "waits": [{"counter": 0, "value": 1}]}],
            "queues": [[0, 1], [2]]}


def _two_of_three() -> dict[str, Any]:
    """#4 reads x after 2 adds of {#0 (writes x), #2, #3}; #3 needs #0 (both adds on d), #2 needs either of #0, #1.
    Whichever two signal, #0 has ended: #3 is HB-after #0, so without #0 only #2 could add (the graph's count of
    the candidates HB-after another)."""
    return {"format": "megakernel-schedule/1", "target": {"workers": 5}, "buffers": {"x": 4}, "counters": 2,
            "instructions": [
                {"id": 0, "op": "w", "writes": [{"buffer": "x", "range": [0, 4]}],
                 "signals": [{"counter": 0, "add": 1}, {"counter": 1, "add": 1}]},
                {"id": 1, "op": "u", "signals": [{"counter": 1, "add": 1}]},
                {"id": 2, "op": "x", "waits": [{"counter": 1, "value": 1}], "signals": [{"counter": 0, "add": 1}]},
                {"id": 3, "op": "y", "waits": [{"counter": 1, "value": 2}], "signals": [{"counter": 0, "add": 1}]},
                {"id": 4, "op": "r", "reads": [{"buffer": "x", "range": [0, 4]}],
                 "waits": [{"counter": 0, "value": 2}]}],
            "queues": [[0], [1], [2], [3], [4]]}


def _cycle_without_the_producer() -> dict[str, Any]:
    """#3 reads x after one add of {#0 (writes x), #1}; #1 waits for one of {#0, #2} and #2 for one of {#0, #1}.
    Without #0, #1 and #2 wait for each other, so #0 has ended whenever #3 starts: the waits form a cycle among
    candidates (no static order), and only z3 reasons around it."""
    def one_of(c: int) -> list[dict[str, int]]:
        return [{"counter": c, "value": 1}]

    return {"format": "megakernel-schedule/1", "target": {"workers": 4}, "buffers": {"x": 4}, "counters": 3,
            "instructions": [
                {"id": 0, "op": "w", "writes": [{"buffer": "x", "range": [0, 4]}],
                 "signals": [{"counter": c, "add": 1} for c in range(3)]},
                {"id": 1, "op": "p", "waits": one_of(1), "signals": [{"counter": 0, "add": 1},
                                                                      {"counter": 2, "add": 1}]},
                {"id": 2, "op": "q", "waits": one_of(2), "signals": [{"counter": 1, "add": 1}]},
                {"id": 3, "op": "r", "reads": [{"buffer": "x", "range": [0, 4]}], "waits": one_of(0)}],
            "queues": [[0], [1], [2], [3]]}


def test_graph_orders_one_of_two_through_their_common_ancestor() -> None:
    report = verify(parse_schedule(_first_of_two()), "1-of-2", Options(interleavings=50))
    assert report.accepted and report.stats["proven_by_graph"] == 1
    assert brute_force(_first_of_two()) == (set(), False)


def test_graph_counts_candidates_that_follow_another() -> None:
    report = verify(parse_schedule(_two_of_three()), "k-of-n", Options(interleavings=50))
    assert report.accepted and report.stats["proven_by_graph"] == 1 and report.stats["proven_by_z3"] == 0
    assert brute_force(_two_of_three()) == (set(), False)


def test_z3_proves_what_the_graph_cannot() -> None:
    doc = _cycle_without_the_producer()
    report = verify(parse_schedule(doc), "cycle", Options(interleavings=50))
    assert report.accepted and report.stats["proven_by_z3"] == 1 and report.stats["proven_by_graph"] == 0
    assert brute_force(doc) == (set(), False)
    doc["instructions"][2]["waits"] = []  # now #2, then #1, can signal without #0
    report = verify(parse_schedule(doc), "cycle-broken", Options(interleavings=50))
    assert [f.category for f in report.findings] == ["race"] and report.stats["counterexamples"] == 1
    assert brute_force(doc)[0] == {(0, 3)}


def test_z3_out_of_budget_is_unproven(monkeypatch: Any) -> None:
    import validator.races as races

    real = races.prove
    monkeypatch.setattr(races, "prove", lambda *a, **k: real(*a, **k, budget_s=-1.0))
    report = verify(parse_schedule(_cycle_without_the_producer()), "cycle", Options(interleavings=0))
    assert [f.category for f in report.findings] == ["unproven"]
    assert not report.accepted


def test_pair_forced_backwards_is_a_race() -> None:
    """#1 is queued before #0 on one worker: #1 always runs first although #0 < #1 (backward order)."""
    doc = _first_of_two()
    doc["instructions"] = doc["instructions"][:1] + [{"id": 1, "op": "r", "reads": [{"buffer": "x", "range": [1, 2]}]}]
    doc["queues"] = [[1, 0]]
    report = verify(parse_schedule(doc), "backwards", Options(interleavings=10))
    (race,) = [f for f in report.findings if f.category == "race"]
    assert race.details["pair"] == [0, 1] and "stale read" in race.message
    assert brute_force(doc)[0] == {(0, 1)}
