"""Verify the verifier: on random small schedules, the validator's race and deadlock verdicts must equal those of a
brute-force enumeration of every interleaving (each instruction as a start and an end event), and every pair that z3
or the replay reports must be a real race.

Two families of schedules. `schedules`: 2-4 workers, <= 9 declared-footprint instructions over two 4-element
buffers; counters shared by several producers, partial targets (value below the total adds), reduces, in-place
read+write, queue order independent of ids, and cycles all occur. `layered`: model-like stages with counters shared
across layers and cumulative targets (the gates of validator/hb.py), re-assigned to random workers, renumbered, and
half the time mutated once. The replay runs 20 interleavings per example (its agreement is also checked on the
seeded bugs). `frozen_races`, the exact race oracle that test_validator_scale.py uses on schedules too large to
enumerate, is checked against the enumeration here. Runtime: ~20 s on 2 cores (derandomized, so CI is
reproducible).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megasynth.ir.program import Program, resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.validator.verify import Options, verify

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


def run_without(prog: Program, frozen: int = -1) -> set[int]:
    """The instructions (indices) of the maximal execution in which instruction `frozen` never ends: its worker stops
    at it. Counters only grow, so this is the largest set of instructions that can run before `frozen` ends; plain
    fixpoint code that shares nothing with the validator."""
    counters: dict[int, int] = defaultdict(int)
    head = [0] * len(prog.queues)
    ran: set[int] = set()
    progress = True
    while progress:
        progress = False
        for w, queue in enumerate(prog.queues):
            while head[w] < len(queue):
                i = queue[head[w]]
                if i == frozen or any(counters[c] < v for c, v in prog.waits[i]):
                    break
                ran.add(i)
                head[w] += 1
                progress = True
                for c, add in prog.signals[i]:
                    counters[c] += add
    return ran


def frozen_races(prog: Program) -> tuple[set[tuple[int, int]], bool]:
    """A race oracle for schedules too large to enumerate (not pipelined): `b` can start before `a` ends iff `b` runs
    in `run_without(prog, a)`. Uses only the footprints from the validator; checked against `brute_force` below.
    Returns racing id pairs (a < b) and whether the schedule deadlocks."""
    deadlock = len(run_without(prog)) < prog.n
    races: set[tuple[int, int]] = set()
    for a in range(prog.n):
        later = [b for b in range(a + 1, prog.n) if conflicting(prog.accesses[a], prog.accesses[b])]
        if later:
            ran = run_without(prog, a)
            races |= {(prog.ids[a], prog.ids[b]) for b in later if b in ran}
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


@st.composite
def layered(draw: Any) -> dict[str, Any]:
    """A small model-like schedule: `layers` repetitions of a producer stage P (writes, or reduce-adds, its part of
    x after reading all of y) and a consumer stage Q (reads all of x, writes its part of y). Each stage signals
    counters shared across layers (one per stage, or one per instruction: tile granularity) and the next stage waits
    for the cumulative values, as `synth` lowers with `counter_sharing: across_layers`. Then a random re-assignment
    of instructions to workers (queues in ascending id, sometimes shuffled), a renumbering of the counters, and half
    the time one mutation: a wait dropped, a target lowered by one, or two instructions of a queue swapped."""
    layers = draw(st.integers(2, 3))
    n_p = draw(st.integers(1, 2))
    n_q = draw(st.integers(1, 2 if layers == 2 or n_p == 1 else 1))
    tile_p, tile_q, reduce_p = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    c_q = n_p if tile_p else 1  # first counter of Q

    def part(k: int, of: int) -> list[int]:
        return [k * BUFSIZE // of, (k + 1) * BUFSIZE // of]

    def after(first: int, tile: bool, size: int, done: int) -> list[dict[str, int]]:
        """Waits for `done` completed layers of a stage of `size` instructions counting from counter `first`."""
        if tile:
            return [{"counter": first + k, "value": done} for k in range(size)]
        return [{"counter": first, "value": size * done}]

    instructions: list[dict[str, Any]] = []
    for layer in range(layers):
        for k in range(n_p):
            rec: dict[str, Any] = {"id": len(instructions), "op": "p", "layer": layer,
                                   "reduces" if reduce_p else "writes": [{"buffer": "x", "range": part(k, n_p)}],
                                   "signals": [{"counter": k if tile_p else 0, "add": 1}]}
            if layer:
                rec["reads"] = [{"buffer": "y", "range": [0, BUFSIZE]}]
                rec["waits"] = after(c_q, tile_q, n_q, layer)
            instructions.append(rec)
        for k in range(n_q):
            instructions.append({"id": len(instructions), "op": "q", "layer": layer,
                                 "reads": [{"buffer": "x", "range": [0, BUFSIZE]}],
                                 "writes": [{"buffer": "y", "range": part(k, n_q)}],
                                 "waits": after(0, tile_p, n_p, layer + 1),
                                 "signals": [{"counter": c_q + (k if tile_q else 0), "add": 1}]})
    counters = c_q + (n_q if tile_q else 1)
    spare = draw(st.integers(0, 2))
    perm = draw(st.permutations(list(range(counters + spare))))
    for rec in instructions:
        for item in rec.get("waits", []) + rec["signals"]:
            item["counter"] = perm[item["counter"]]
    workers = draw(st.integers(2, 4))
    queues: list[list[int]] = [[] for _ in range(workers)]
    for rec in instructions:
        queues[draw(st.integers(0, workers - 1))].append(rec["id"])
    if draw(st.integers(0, 4)) == 0:
        queues = [draw(st.permutations(q)) for q in queues]
    mutation = draw(st.sampled_from(["none", "none", "none", "drop", "lower", "swap"]))
    waiters = [rec for rec in instructions if rec.get("waits")]
    if mutation in ("drop", "lower") and waiters:
        rec = draw(st.sampled_from(waiters))
        k = draw(st.integers(0, len(rec["waits"]) - 1))
        if mutation == "drop":
            del rec["waits"][k]
        else:
            rec["waits"][k]["value"] -= 1
    elif mutation == "swap":
        long = [q for q in queues if len(q) >= 2]
        if long:
            q = draw(st.sampled_from(long))
            i, j = draw(st.lists(st.integers(0, len(q) - 1), min_size=2, max_size=2, unique=True))
            q[i], q[j] = q[j], q[i]
    return {"format": "megakernel-schedule/1", "target": {"workers": workers}, "buffers": {"x": BUFSIZE, "y": BUFSIZE},
            "counters": counters + spare, "instructions": instructions, "queues": queues}


def _check(doc: dict[str, Any], pipelined: bool) -> None:
    races, deadlock = brute_force(doc, pipelined)
    if not pipelined:
        assert frozen_races(resolve(parse_schedule(doc))) == (races, deadlock), doc
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


@settings(max_examples=600, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(layered())
def test_layered_shared_counters_match_brute_force(doc: dict[str, Any]) -> None:
    _check(doc, pipelined=False)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(layered())
def test_pipelined_layered_shared_counters_match_brute_force(doc: dict[str, Any]) -> None:
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


def test_z3_out_of_budget_is_unproven() -> None:
    doc = parse_schedule(_cycle_without_the_producer())
    report = verify(doc, "cycle", Options(interleavings=0, budget=1e-9))
    assert [f.category for f in report.findings] == ["unproven"]
    assert not report.accepted and report.findings[0].details["suggested_budget_s"] > 1e-9


def test_model_too_large_for_the_budget_is_unproven(monkeypatch: Any) -> None:
    """The model-size limit grows with the budget; the message says which budget would admit the model."""
    import megasynth.validator.smt as smt

    monkeypatch.setattr(smt, "TERMS_PER_SECOND", 1)
    report = verify(parse_schedule(_cycle_without_the_producer()), "cycle", Options(interleavings=0, budget=1.0))
    (f,) = report.findings
    assert f.category == "unproven" and "too large for the budget" in f.message and f.details["pair"] == [0, 3]
    assert f.details["suggested_budget_s"] >= 4.0 and f"--budget {f.details['suggested_budget_s']:g}" in f.message
    report = verify(parse_schedule(_cycle_without_the_producer()), "cycle",
                    Options(interleavings=0, budget=f.details["suggested_budget_s"]))
    assert report.accepted


def _two_layers(first_wait: int) -> dict[str, Any]:
    """Layer 0: P0 (#0) reduce-adds into x and adds 1 to c; Q0 (#1) reads x once c >= 1, writes y, adds 1 to d.
    Layer 1: P1 (#2) reads y once d >= `first_wait`, reduce-adds into x and adds 1 to c again; Q1 (#3) reads x once
    c >= 2. With `first_wait` 1, P1 is HB-after Q0, a waiter of c at 1, so P1 cannot supply that 1 and Q0's wait
    is an exact join on P0. With 0, P1 can signal first and Q0 read x before P0 has added: a race."""
    return {"format": "megakernel-schedule/1", "target": {"workers": 3}, "buffers": {"x": 4, "y": 4}, "counters": 2,
            "instructions": [
                {"id": 0, "op": "p", "reduces": [{"buffer": "x", "range": [0, 4]}],
                 "signals": [{"counter": 0, "add": 1}]},
                {"id": 1, "op": "q", "reads": [{"buffer": "x", "range": [0, 4]}],
                 "writes": [{"buffer": "y", "range": [0, 4]}], "waits": [{"counter": 0, "value": 1}],
                 "signals": [{"counter": 1, "add": 1}]},
                {"id": 2, "op": "p", "reads": [{"buffer": "y", "range": [0, 4]}],
                 "reduces": [{"buffer": "x", "range": [0, 4]}], "waits": [{"counter": 1, "value": first_wait}],
                 "signals": [{"counter": 0, "add": 1}]},
                {"id": 3, "op": "q", "reads": [{"buffer": "x", "range": [0, 4]}],
                 "writes": [{"buffer": "y", "range": [0, 4]}], "waits": [{"counter": 0, "value": 2}],
                 "signals": [{"counter": 1, "add": 1}]}],
            "queues": [[0], [2], [1, 3]]}


def test_gate_makes_a_cumulative_target_an_exact_join(monkeypatch: Any) -> None:
    """With the capped maximal executions switched off, the gates alone order the layers; without gates too, the
    graph leaves Q0's "1 of {P0, P1}" wait to z3."""
    import megasynth.validator.hb as hb

    doc = _two_layers(1)
    assert brute_force(doc) == (set(), False)
    monkeypatch.setattr(hb, "F_BUDGET", 0)
    report = verify(parse_schedule(doc), "layers", Options(interleavings=50))
    assert report.accepted and report.stats["gated_signals"] == 2  # P1 on c at 1, Q1 on d at 1
    assert report.stats["proven_by_graph"] == report.stats["conflicting_pairs"] and report.stats["proven_by_z3"] == 0
    monkeypatch.setattr(hb, "gate_guesses", lambda *a: ({}, {}))
    report = verify(parse_schedule(doc), "layers", Options(interleavings=50))
    assert report.accepted and report.stats["proven_by_z3"] >= 1 and "gated_signals" not in report.stats


def test_refuted_gate_guess_is_dropped_and_the_race_found() -> None:
    """The maximal execution runs Q0 before P1, so P1 is guessed gated at 1; the graph pass cannot confirm it (P1
    no longer waits for Q0), drops it and runs again, and z3 shows the race (and P1's stale read of y)."""
    doc = _two_layers(0)
    assert brute_force(doc)[0] == {(0, 1), (1, 2)}
    report = verify(parse_schedule(doc), "layers-0", Options(interleavings=50))
    assert report.stats["graph_rounds"] == 2 and "gated_signals" not in report.stats
    assert [(f.category, f.details["pair"]) for f in report.findings] == [("race", [0, 1]), ("race", [1, 2])]
    assert all(f.details["events"] for f in report.findings)


def test_pair_forced_backwards_is_a_race() -> None:
    """#1 is queued before #0 on one worker: #1 always runs first although #0 < #1 (backward order)."""
    doc = _first_of_two()
    doc["instructions"] = doc["instructions"][:1] + [{"id": 1, "op": "r", "reads": [{"buffer": "x", "range": [1, 2]}]}]
    doc["queues"] = [[1, 0]]
    report = verify(parse_schedule(doc), "backwards", Options(interleavings=10))
    (race,) = [f for f in report.findings if f.category == "race"]
    assert race.details["pair"] == [0, 1] and "stale read" in race.message
    assert brute_force(doc)[0] == {(0, 1)}
