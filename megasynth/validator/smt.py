"""z3 proofs for the conflicting pairs the graph pass could not order: `prove(pairs)` -> per pair UNSAT (proven),
SAT (a counterexample interleaving as numbered events) or unknown (not proven).

Model (docs/design.md §3): integer start/end per instruction, `start < end`; program order `end(prev) <= start(next)`
(`--pipelined`: `start(prev) <= start(next)`); a wait `counters[c] >= v` of `y` holds iff the adds of the signallers
that ended by `start(y)` reach `v`, encoded as a pseudo-Boolean constraint over difference atoms `end(s) <= start(y)`
(so the sparse difference-logic solver applies: with it, `SimpleSolver` and SMT-LIB text, one feasibility check of
an 11.5k-instruction schedule took 2.6 s on 2 cores against 79 s for z3's defaults). Facts the graph pass proved
(needed signallers, signallers known to end before) are asserted as plain difference constraints instead of PB terms.
A violation of `a < b` is `start(b) < end(a)`.

Each query is sliced to the instructions that can matter: the pair, their queue predecessors and every signaller of
every counter a sliced instruction waits on, transitively. Only instructions that run in the unique maximal execution
take part (the others never start). This slice is exact: any solution is a legal prefix of an execution (all
signallers of the counters its members wait on are in it), and every prefix extends to a full execution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from megasynth.ir.program import Program
from megasynth.validator.hb import HBResult, WaitGroups, group_ancestors, indices_of

#: Seconds z3 may spend on the pairs the graph pass leaves (`validate --budget`); one query may use all of it.
DEFAULT_BUDGET_S = 60.0
MAX_EVENTS_SHOWN = 40
#: Wait terms (signaller x waiter) allowed in one pair's pruned model per second of budget (300k at the default):
#: a bigger model takes minutes to build and solve, so it needs a bigger budget, not a hang.
TERMS_PER_SECOND = 5_000


@dataclass
class PairResult:
    a: int
    b: int
    status: str  # "unsat" (proven), "sat" (counterexample) or "unknown"
    events: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    done: int = 0  # slice instructions that happen before all the shown ones (not in the model)
    budget_hint: float = 0.0  # for "unknown": a budget (seconds) that would let z3 try this pair in earnest


def _slice(prog: Program, wg: WaitGroups, live: list[bool], seeds: list[int]) -> list[int]:
    seen = set(seeds)
    stack = list(seeds)
    while stack:
        for x in _deps(prog, wg, live, stack.pop()):
            if x not in seen:
                seen.add(x)
                stack.append(x)
    return sorted(seen)


def _ancestors(prog: Program, wg: WaitGroups, order: list[int], members: set[int], pipelined: bool) -> dict[int, int]:
    """HB ancestor bitsets (same edges as the graph pass) for a dependency-closed set of instructions."""
    anc: dict[int, int] = {}
    ganc: dict[int, int] = {}
    for y in order:
        if y not in members:
            continue
        a_y = 0
        if not pipelined and prog.qpos[y] > 0:
            p = prog.queues[prog.worker[y]][prog.qpos[y] - 1]
            a_y |= anc[p] | (1 << p)
        for g in wg.of(y):
            if g >= 0:
                ga = ganc.get(g)
                if ga is None:
                    ga = ganc[g] = group_ancestors(wg, g, anc, anc.__contains__)
                a_y |= ga
        anc[y] = a_y
    return anc


def _deps(prog: Program, wg: WaitGroups, live: list[bool], y: int) -> list[int]:
    out = []
    if prog.qpos[y] > 0:
        out.append(prog.queues[prog.worker[y]][prog.qpos[y] - 1])
    for g in wg.of(y):
        if g >= 0:
            out.extend(a for a, _ in wg.candidates[g])
    return [x for x in out if live[x]]


def _prune(prog: Program, wg: WaitGroups, live: list[bool], anc: dict[int, int], a: int, b: int,
           uncertain: list[int], pipelined: bool) -> tuple[list[int], int]:
    """Split the pair's slice into `done` (a bitset: instructions that happen before every other slice member in
    every execution, and whose dependencies are all done too) and the rest, which the model keeps. Exact: every
    execution runs `done` first, so asserting that loses no execution, and a solution of the rest extends by running
    `done` before it."""
    done = anc[a] & anc[b]
    for _ in range(len(anc) + 2):
        rest = {a, b}
        stack = [a, b]
        while stack:
            y = stack.pop()
            for x in _deps(prog, wg, live, y):
                if x not in rest and not done >> x & 1:
                    rest.add(x)
                    stack.append(x)
        new = done
        for y in rest:
            new &= anc[y]
        removed = 0
        for x in uncertain:  # a done instruction must not depend on a kept one through an undecided wait
            if new >> x & 1 and any(not new >> s & 1 for s in _deps(prog, wg, live, x)):
                removed |= 1 << x
        if pipelined:  # queue order is no HB edge here, so a done instruction's queue predecessor must be done too
            for x in indices_of(new):
                if prog.qpos[x] > 0 and not new >> prog.queues[prog.worker[x]][prog.qpos[x] - 1] & 1:
                    removed |= 1 << x
        if removed:
            new &= ~removed
            for y in list(anc):
                if new >> y & 1 and anc[y] & removed:
                    new &= ~(1 << y)
        if new == done:
            return sorted(rest), done
        done = new
    raise RuntimeError("slice pruning did not converge")  # unreachable: `done` only shrinks


def _constraints(prog: Program, wg: WaitGroups, hb: HBResult, members: list[int], done: int, pipelined: bool) -> str:
    """The kept slice's model as SMT-LIB text (parsing text is much faster than building z3 terms one by one)."""
    inside = set(members)
    out = [f"(declare-const s{i} Int)(declare-const e{i} Int)(assert (< s{i} e{i}))" for i in members]
    joins: set[int] = set()
    for y in members:
        if prog.qpos[y] > 0:
            p = prog.queues[prog.worker[y]][prog.qpos[y] - 1]
            if p in inside:
                out.append(f"(assert (<= s{p} s{y}))" if pipelined else f"(assert (<= e{p} s{y}))")
        for j, g in enumerate(wg.of(y)):
            if g < 0:
                continue
            needed = [a for a in wg.needed[g] if a in inside]
            if needed:
                if g not in joins:
                    joins.add(g)
                    out.append(f"(declare-const j{g} Int)")
                    out.extend(f"(assert (<= e{a} j{g}))" for a in needed)
                out.append(f"(assert (<= j{g} s{y}))")
            known = hb.known_before.get((y, j))
            if known is None:
                continue  # every candidate is needed: the join above is the whole wait
            c, v = prog.waits[y][j]
            # signallers the graph pass proved to end before y starts: assert it, then count them as constants
            out.extend(f"(assert (<= e{a} s{y}))" for a, _ in wg.candidates[g] if a in known and a in inside)
            base = sum(add for a, add in wg.candidates[g] if a in known or done >> a & 1)
            rest = [(a, add) for a, add in wg.candidates[g] if a not in known and not done >> a & 1]
            if base >= v:
                continue
            weights = " ".join(str(add) for _, add in rest)
            atoms = " ".join(f"(<= e{a} s{y})" for a, _ in rest)
            out.append(f"(assert ((_ pbge {v - base} {weights}) {atoms}))" if rest else "(assert false)")
    return "\n".join(out)


def _events(prog: Program, model: Any, z3: Any, members: list[int], done: int) -> list[dict[str, Any]]:
    """The model as a numbered event list (ends before starts at equal times), with counter values after ends; the
    `done` instructions have all ended before the first event."""
    evs = []
    for i in members:
        s = model.eval(z3.Int(f"s{i}"), model_completion=True).as_long()
        e = model.eval(z3.Int(f"e{i}"), model_completion=True).as_long()
        evs.append((s, 1, prog.worker[i], prog.qpos[i], i, "start"))
        evs.append((e, 0, prog.worker[i], prog.qpos[i], i, "end"))
    evs.sort()
    watched = {c for i in members for c, _ in prog.waits[i]}
    counters: dict[int, int] = {}

    for i in indices_of(done):
        for c, add in prog.signals[i]:
            counters[c] = counters.get(c, 0) + add
    out = []
    for n, (_, _, w, _, i, kind) in enumerate(evs, 1):
        ev: dict[str, Any] = {"n": n, "worker": w, "event": kind, "instruction": prog.ids[i], "op": prog.op[i],
                              "layer": prog.layer[i]}
        if kind == "start" and prog.waits[i]:
            ev["waits"] = [{"counter": c, "value": v, "current": counters.get(c, 0)} for c, v in prog.waits[i]]
        if kind == "end":
            changed = {}
            for c, add in prog.signals[i]:
                counters[c] = counters.get(c, 0) + add
                if c in watched:
                    changed[c] = counters[c]
            if changed:
                ev["counters"] = {str(c): v for c, v in changed.items()}
        out.append(ev)
    return out


def event_lines(prog: Program, events: list[dict[str, Any]], focus: set[int]) -> list[str]:
    """Human-readable numbered events; only the focus instructions' events when there are many."""
    show = events if len(events) <= MAX_EVENTS_SHOWN else [e for e in events if e["instruction"] in focus]
    lines = []
    for e in show[:MAX_EVENTS_SHOWN]:
        label = f"#{e['instruction']} {e['op']}" + (f" L{e['layer']}" if e.get("layer") is not None else "")
        text = f"{e['n']:>5}. worker {e['worker']:<4} {e['event']:<5} {label}"
        if "waits" in e:
            text += "  (" + ", ".join(f"c{w['counter']} = {w['current']} >= {w['value']}" for w in e["waits"]) + ")"
        if "counters" in e:
            text += "  -> " + ", ".join(f"c{c} = {v}" for c, v in e["counters"].items())
        lines.append(text)
    hidden = len(events) - len(lines)
    if hidden > 0:
        lines.append(f"       ({hidden} other events of the slice not shown; all are in the JSON report)")
    return lines


def budget_for(terms: int) -> float:
    """The smallest budget (seconds) whose model-size limit admits `terms` wait terms."""
    return float(-(-terms // TERMS_PER_SECOND))


def prove(prog: Program, wg: WaitGroups, hb: HBResult, live: list[bool], ex_order: list[int],
          pairs: list[tuple[int, int]],
          pipelined: bool = False, seed: int = 0, max_sat: int = 5,
          budget_s: float = DEFAULT_BUDGET_S) -> tuple[list[PairResult], int]:
    """Decide each pair with z3 on its pruned slice, within `budget_s` seconds in all (a query may use what is left
    of it) and models of at most `budget_s * TERMS_PER_SECOND` wait terms. Stops after `max_sat` counterexamples or
    when the budget is spent; returns the results and the number of pairs left unchecked."""
    if not pairs:
        return [], 0
    import z3

    z3.set_param("smt.random_seed", seed)
    union = set(_slice(prog, wg, live, sorted({x for p in pairs for x in p})))
    pos = {i: k for k, i in enumerate(ex_order)}
    anc = _ancestors(prog, wg, ex_order, union, pipelined)
    uncertain = sorted({y for y, _ in hb.known_before if y in union}, key=pos.__getitem__)
    max_terms = int(budget_s * TERMS_PER_SECOND)
    results: list[PairResult] = []
    sats = 0
    start = time.perf_counter()
    for k, (a, b) in enumerate(pairs):
        left_ms = int((budget_s - (time.perf_counter() - start)) * 1000)
        if sats >= max_sat or left_ms <= 0:
            return results, len(pairs) - k
        members, done = _prune(prog, wg, live, anc, a, b, uncertain, pipelined)
        terms = sum(len(wg.candidates[g]) for y in members for g in wg.of(y) if g >= 0)
        if terms > max_terms:  # a model this size would take minutes to build and solve: say so, do not hang
            results.append(PairResult(a, b, "unknown", reason=f"its model is too large for the budget: "
                                      f"{len(members)} instructions, {terms} wait terms (the budget allows "
                                      f"{max_terms})", budget_hint=budget_for(terms)))
            return results, len(pairs) - k - 1
        solver = z3.SimpleSolver()
        solver.set("timeout", left_ms)
        solver.set("random_seed", seed)
        solver.set("arith.solver", 1)
        solver.add(z3.parse_smt2_string(_constraints(prog, wg, hb, members, done, pipelined)))
        solver.add(z3.Int(f"s{b}") < z3.Int(f"e{a}"))
        verdict = solver.check()
        if verdict == z3.unsat:
            results.append(PairResult(a, b, "unsat"))
        elif verdict == z3.sat:
            sats += 1
            results.append(PairResult(a, b, "sat", _events(prog, solver.model(), z3, members, done),
                                       done=done.bit_count()))
        else:
            results.append(PairResult(a, b, "unknown", reason=f"z3 answered unknown ({solver.reason_unknown()})",
                                       budget_hint=4 * budget_s))
            return results, len(pairs) - k - 1
    return results, 0
