"""The race phases of `verify`: conflict sweep + happens-before graph pass (validator.hb), z3 proofs of what the graph
leaves (validator.smt), adversarial replay (validator.replay); findings and stats go into the `Report`.

The replay cross-checks the proofs: a pair that replay runs out of order although a proof ordered it is a bug in the
validator, reported as a finding (so the schedule is never accepted on a contradicted proof).
"""

from __future__ import annotations

import time
from typing import Any

from megasynth.ir.program import Finding, Program
from megasynth.validator.deadlock import Execution, maximal_execution
from megasynth.validator.hb import find_conflicts, happens_before
from megasynth.validator.replay import replay
from megasynth.validator.smt import DEFAULT_BUDGET_S, PairResult, event_lines, prove


def conflict_of(prog: Program, a: int, b: int) -> tuple[str, int, int, str, str]:
    """The first conflicting access pair of `a` and `b`: (buffer, start, end, kind of a, kind of b)."""
    for ka, buf, lo, hi in prog.accesses[a]:
        for kb, buf2, lo2, hi2 in prog.accesses[b]:
            if buf == buf2 and lo < hi2 and lo2 < hi and not (ka == kb and ka in ("read", "reduce")):
                return buf, max(lo, lo2), min(hi, hi2), ka, kb
    return "?", 0, 0, "?", "?"


def _what(ka: str, kb: str) -> str:
    if ka != "read" and kb == "read":
        return "stale read: the later instruction can read the region before the earlier one has written it"
    if ka == "read":
        return "backward order: the later instruction can overwrite the region before the earlier one has read it"
    if ka == "write" and kb == "write":
        return "lost write: the earlier write can land after the later one"
    return "lost update: the write and the accumulation can land in either order"


def _pair_text(prog: Program, a: int, b: int) -> tuple[str, dict[str, Any]]:
    buf, lo, hi, ka, kb = conflict_of(prog, a, b)
    msg = (f"race on {buf}[{lo}:{hi}]: {prog.label(b)} ({kb}, worker {prog.worker[b]}) can start before "
           f"{prog.label(a)} ({ka}, worker {prog.worker[a]}) ends; {_what(ka, kb)}")
    return msg, {"pair": [prog.ids[a], prog.ids[b]], "buffer": buf, "range": [lo, hi], "kinds": [ka, kb]}


def _maximal_events(prog: Program, ex: Execution, b: int) -> list[dict[str, Any]]:
    """The maximal execution run one instruction at a time, up to the start of `b`, as numbered events."""
    out: list[dict[str, Any]] = []
    counters: dict[int, int] = {}
    for i in ex.order:
        ev: dict[str, Any] = {"n": len(out) + 1, "worker": prog.worker[i], "event": "start",
                              "instruction": prog.ids[i], "op": prog.op[i], "layer": prog.layer[i]}
        if prog.waits[i]:
            ev["waits"] = [{"counter": c, "value": v, "current": counters.get(c, 0)} for c, v in prog.waits[i]]
        out.append(ev)
        if i == b:
            break
        for c, add in prog.signals[i]:
            counters[c] = counters.get(c, 0) + add
        end = {"n": len(out) + 1, "worker": prog.worker[i], "event": "end", "instruction": prog.ids[i],
               "op": prog.op[i], "layer": prog.layer[i]}
        if prog.signals[i]:
            end["counters"] = {str(c): counters[c] for c, _ in prog.signals[i]}
        out.append(end)
    return out


def _unproven(prog: Program, r: PairResult | None, left: int, total: int, budget: float,
              first: tuple[int, int] | None) -> Finding:
    """The finding for pairs z3 did not decide within `budget`: the first such pair, why, and how to raise it."""
    a, b = (r.a, r.b) if r is not None else first if first is not None else (-1, -1)
    why = r.reason if r is not None else "the budget ran out before z3 reached it"
    hint = max(r.budget_hint if r is not None else 0.0, 4 * budget)
    details: dict[str, Any] = {"budget_s": budget, "undecided_pairs": left, "suggested_budget_s": hint}
    what = ""
    if a >= 0:
        buf, lo, hi, ka, kb = conflict_of(prog, a, b)
        what = (f" whether {prog.label(a)} ends before {prog.label(b)} starts (they conflict on {buf}[{lo}:{hi}], "
                f"{ka} then {kb})")
        details.update({"pair": [prog.ids[a], prog.ids[b]], "buffer": buf, "range": [lo, hi], "kinds": [ka, kb]})
    text = (f"z3 could not decide within its budget (--budget {budget:g} s){what}: {why}; {left} of the "
            f"{total} conflicting pairs the graph pass left to z3 are undecided. Rerun with --budget {hint:g} to give "
            "z3 more time (the model size it accepts grows with the budget).")
    return Finding("unproven", text, [prog.ids[a], prog.ids[b]] if a >= 0 else [], prog.path(b) if b >= 0 else None,
                   details)


def _order_pairs(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Interleave by the later instruction, so that the first queries cover distinct victims."""
    rank: dict[int, int] = {}
    keyed = []
    for a, b in sorted(pairs, key=lambda p: (p[1], -p[0])):
        r = rank.get(b, 0)
        rank[b] = r + 1
        keyed.append((r, b, a))
    keyed.sort()
    return [(a, b) for _, b, a in keyed]


def check_races(prog: Program, report: Any, options: Any, ex: Execution | None = None) -> None:
    """Run graph pass, z3 and replay; add race/unproven findings and the stats the text formatter prints."""
    pipelined = bool(getattr(options, "pipelined", False))
    seed = int(getattr(options, "seed", 0))
    t = time.perf_counter()
    ex = ex or maximal_execution(prog)
    live = [False] * prog.n
    for i in ex.order:
        live[i] = True
    conf = find_conflicts(prog, [True] * prog.n)  # a stuck `a` still conflicts with a `b` that runs
    hbr = happens_before(prog, ex, conf, live, pipelined)
    wg, static, hb = hbr.wg, hbr.static, hbr.result
    order = [x for kind, x in static if kind == 0] if static is not None else ex.order
    report.seconds["graph"] = time.perf_counter() - t
    report.stats["conflicting_pairs"] = hb.pairs
    report.stats["proven_by_graph"] = hb.pairs - len(hb.undischarged)
    if hbr.gates:
        report.stats["gated_signals"] = len(hbr.gates)
    if hbr.rounds > 1:
        report.stats["graph_rounds"] = hbr.rounds

    t = time.perf_counter()
    never = [(a, b) for a, b in hb.undischarged if not live[a]]
    pairs = _order_pairs([(a, b) for a, b in hb.undischarged if live[a]])
    budget = float(getattr(options, "budget", DEFAULT_BUDGET_S))
    results, unchecked = prove(prog, wg, hb, live, order, pairs, pipelined, seed, budget_s=budget)
    report.seconds["z3"] = time.perf_counter() - t
    proven = {(r.a, r.b) for r in results if r.status == "unsat"}
    sat: dict[tuple[int, int], PairResult] = {(r.a, r.b): r for r in results if r.status == "sat"}
    unknown = [r for r in results if r.status == "unknown"]
    report.stats["proven_by_z3"] = len(proven)
    report.stats["counterexamples"] = len(sat)
    if unchecked:
        report.stats["unchecked_pairs"] = unchecked

    race_findings: dict[tuple[int, int], Finding] = {}
    for a, b in never[:5]:
        msg, details = _pair_text(prog, a, b)
        events = _maximal_events(prog, ex, b)
        details["events"] = events
        details["text"] = [f"{prog.label(a)} never runs (the schedule deadlocks before it), so it cannot end before "
                           f"{prog.label(b)} starts; the maximal execution up to that start:"] + \
            event_lines(prog, events, {prog.ids[a], prog.ids[b]})
        race_findings[(a, b)] = Finding("race", msg, [prog.ids[a], prog.ids[b]], prog.path(b), details)
    report.stats["counterexamples"] += min(len(never), 5)
    for (a, b), r in sat.items():
        msg, details = _pair_text(prog, a, b)
        focus = {prog.ids[a], prog.ids[b]}
        details["events"] = r.events
        details["text"] = ["counterexample interleaving (z3):"] + event_lines(prog, r.events, focus)
        if r.done:
            details["text"].insert(1, f"(first, {r.done} instructions that happen before all of these run "
                                   "to completion)")
        race_findings[(a, b)] = Finding("race", msg, [prog.ids[a], prog.ids[b]], prog.path(b), details)
    findings: list[Finding] = list(race_findings.values())
    undecided = len(unknown) + unchecked
    if undecided and findings:
        findings[0].details.setdefault("text", []).append(
            f"({undecided} more conflicting pairs were not decided after {len(sat)} counterexamples or when the z3 "
            "budget ran out; fix the races shown and rerun)")
    elif undecided:  # not proven is not accepted
        findings.append(_unproven(prog, unknown[0] if unknown else None, undecided, len(pairs), budget,
                                  pairs[len(results)] if not unknown else None))

    t = time.perf_counter()
    n_inter = int(getattr(options, "interleavings", 0))
    if n_inter > 0:
        rep = replay(prog, ex, conf, wg, live, n_inter, seed, pipelined, targets=pairs[:64], static=static)
        report.stats["interleavings"] = rep.interleavings
        report.stats["replay_witnesses"] = len(rep.witnesses)
        if rep.mode != "vectorised":
            report.stats["replay_mode"] = rep.mode
        undischarged = set(hb.undischarged)
        replay_only = 0
        for (a, b), w in sorted(rep.witnesses.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            line = (f"replay: interleaving {w.k} (seed {seed}) starts {prog.label(b)} at t={w.start_b:.3g} before "
                    f"{prog.label(a)} ends at t={w.end_a:.3g}")
            if (a, b) in race_findings:
                race_findings[(a, b)].details.setdefault("text", []).append(line)
                race_findings[(a, b)].details["replay"] = {"interleaving": w.k, "start_b": w.start_b,
                                                           "end_a": w.end_a}
            elif (a, b) not in undischarged or (a, b) in proven:
                msg, details = _pair_text(prog, a, b)
                details["text"] = [line]
                findings.append(Finding("race", "validator disagreement (a bug in the validator; please report it): "
                                        "proved ordered but replay ran it out of order: " + msg,
                                        [prog.ids[a], prog.ids[b]], prog.path(b), details))
            elif not any(f.category == "race" for f in findings):
                msg, details = _pair_text(prog, a, b)
                details["text"] = [line]
                findings.append(Finding("race", msg + " (witnessed by replay; not yet checked by z3)",
                                        [prog.ids[a], prog.ids[b]], prog.path(b), details))
            else:
                replay_only += 1
        if replay_only:
            first = next(f for f in findings if f.category == "race")
            first.details.setdefault("text", []).append(
                f"(replay also ran {replay_only} other pairs that z3 did not get to out of order)")
    else:
        report.stats["interleavings"] = 0
    report.seconds["replay"] = time.perf_counter() - t
    report.findings.extend(findings)
