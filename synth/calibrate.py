"""Calibrate the cost model from GPU traces: (trace, schedule) pairs -> fitted per-op `eff` and `overhead_us`.

Each traced instruction gives one equation of the cost model: `dur = overhead_us + bytes / (eff * r)`, where `r` is
the mean bandwidth share the fluid model grants an SM over the instruction's interval (from the number of SMs busy
at each moment in the trace). That is linear in (overhead_us, 1/eff), so each op is a small least-squares fit, clamped
to physical ranges (0 < eff <= 1, overhead >= 0). The global parameters (total bandwidth, hop latency, one SM's peak)
stay at their measured/prior values. The fit is then judged where it matters: the estimated makespan of each traced
schedule against its measured makespan (median absolute % error; the goal is <= 10%).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from synth.costmodel import CostParams, OpParams, estimate, instruction_cost
from validator.program import resolve
from validator.schedule import Schedule

MIN_EVENTS = 3  # fewer traced instructions of an op than this: keep its prior
HOP_STEPS = 14  # golden-section steps for hop_us over [0, 10] µs (precision ~0.01 µs)


@dataclass
class Fit:
    params: CostParams
    per_op: dict[str, dict[str, Any]]  # op -> {"n", "eff", "overhead_us", "median_abs_pct_error"}
    makespans: list[dict[str, Any]] = field(default_factory=list)  # per trace: measured, estimated, error %

    @property
    def median_abs_pct_error(self) -> float | None:
        errs = [abs(m["error_pct"]) for m in self.makespans]
        return statistics.median(errs) if errs else None


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def measured_ms(trace: dict[str, Any]) -> float:
    evs = _events(trace)
    if not evs:
        return 0.0
    return (max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)) / 1000


def _mean_rates(evs: list[dict[str, Any]], params: CostParams) -> list[float]:
    """Mean fluid-model bandwidth share (bytes/µs) over each event's interval, from the busy-SM count."""
    points = sorted({e["ts"] for e in evs} | {e["ts"] + e["dur"] for e in evs})
    delta: dict[float, int] = defaultdict(int)
    for e in evs:
        delta[e["ts"]] += 1
        delta[e["ts"] + e["dur"]] -= 1
    cum = [0.0]  # integral of the rate up to points[k]
    active = 0
    for a, b in zip(points, points[1:], strict=False):
        active += delta[a]
        rate = min(params.sm_peak, params.total_bw / active) if active > 0 else params.sm_peak
        cum.append(cum[-1] + rate * (b - a))
    out = []
    for e in evs:
        s, t = e["ts"], e["ts"] + e["dur"]
        if t <= s:
            out.append(params.sm_peak)
            continue
        i, j = bisect.bisect_left(points, s), bisect.bisect_left(points, t)
        out.append((cum[j] - cum[i]) / (t - s))
    return out


def _fit_line(xs: list[float], ys: list[float], prior: OpParams) -> OpParams:
    """Least squares of y = a + b x with a >= 0 and b >= 1 (eff = 1/b <= 1)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= (0.01 * mx) ** 2 * n:
        # Every instruction moves about the same bytes: overhead and efficiency cannot be told apart, so scale the
        # prior's time by one factor (least squares), which keeps its split between the two.
        model = [prior.overhead_us + x / prior.eff for x in xs]
        scale = sum(m * y for m, y in zip(model, ys, strict=True)) / max(1e-12, sum(m * m for m in model))
        scale = max(scale, prior.eff)  # eff stays <= 1
        return OpParams(eff=prior.eff / scale, overhead_us=prior.overhead_us * scale)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    if a < 0:  # through the origin
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / max(1e-12, sum(x * x for x in xs))
    if b < 1:
        b = 1.0
        a = max(0.0, my - b * mx)
    return OpParams(eff=1 / b, overhead_us=a)


def _fit_hop(pairs: list[tuple[dict[str, Any], Schedule]], progs: list[Any], params: CostParams) -> float:
    """The hop latency that best matches the traced makespans (golden-section search of the mean |log error|).
    Per-instruction fits leave out the time between instructions (polling, the visibility of signals); this folds
    it into the one parameter that models it."""
    ctxs = [int(t.get("metadata", {}).get("ctx") or 1024) for t, _ in pairs]
    meas = [measured_ms(t) for t, _ in pairs]

    def loss(hop: float) -> float:
        p = replace(params, hop_us=hop)
        return sum(abs(math.log(estimate(g, c, p).makespan_ms / m)) for g, c, m in zip(progs, ctxs, meas, strict=True)
                   if m > 0)

    lo, hi = 0.0, 10.0
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(HOP_STEPS):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = loss(b)
    return round((lo + hi) / 2, 4)


def fit(pairs: list[tuple[dict[str, Any], Schedule]], prior: CostParams | None = None,
        device: str | None = None, fit_hop: bool = True) -> Fit:
    """Fit per-op parameters from (trace, schedule) pairs and report the makespan error of the fitted model."""
    prior = prior or CostParams()
    xs: dict[str, list[float]] = defaultdict(list)
    ys: dict[str, list[float]] = defaultdict(list)
    progs = []
    for trace, schedule in pairs:
        prog = resolve(schedule)
        progs.append(prog)
        ctx = int(trace.get("metadata", {}).get("ctx") or 1024)
        evs = _events(trace)
        rates = _mean_rates(evs, prior)
        for e, r in zip(evs, rates, strict=True):
            i = prog.index.get(int(e["args"]["id"]))
            if i is None:
                raise ValueError(f"trace event for instruction {e['args']['id']} is not in its schedule")
            nbytes, _ = instruction_cost(prog.geometry, prog.op[i], prog.layer[i], prog.args[i], ctx) \
                if prog.geometry else (0, 0)
            xs[prog.op[i]].append(nbytes / r)
            ys[prog.op[i]].append(float(e["dur"]) - prior.wait_us * len(prog.waits[i]))
    ops = dict(prior.ops)
    per_op: dict[str, dict[str, Any]] = {}
    for op in xs:
        if len(xs[op]) < MIN_EVENTS:
            continue
        p = _fit_line(xs[op], ys[op], prior.op(op))
        ops[op] = p
        errs = [abs((p.overhead_us + x / p.eff) - y) / max(y, 1e-9) * 100 for x, y in zip(xs[op], ys[op],
                                                                                            strict=True)]
        per_op[op] = {"n": len(xs[op]), "eff": round(p.eff, 4), "overhead_us": round(p.overhead_us, 4),
                      "median_abs_pct_error": round(statistics.median(errs), 2)}
    fitted = replace(prior, ops=ops, source=f"fitted from {len(pairs)} traces" + (f" ({device})" if device else ""),
                     notes="synth calibrate: per-op eff/overhead fitted by least squares on traced instructions; "
                           "hop_us (sync cost per inter-SM wait) fitted to the traced makespans; total_bw and sm_peak "
                           "kept from the prior")
    if fit_hop:
        fitted = replace(fitted, hop_us=_fit_hop(pairs, progs, fitted))
    out = Fit(fitted, per_op)
    for (trace, _), prog in zip(pairs, progs, strict=True):
        ctx = int(trace.get("metadata", {}).get("ctx") or 1024)
        meas = measured_ms(trace)
        est = estimate(prog, ctx, fitted).makespan_ms
        out.makespans.append({"schedule_sha256": trace.get("metadata", {}).get("schedule_sha256"),
                              "measured_ms": round(meas, 6), "estimated_ms": round(est, 6),
                              "error_pct": round((est - meas) / meas * 100, 3) if meas else 0.0})
    return out


def check_runs(run_dirs: list[str], params: CostParams) -> list[dict[str, Any]]:
    """Held-out check: the model's estimate of every GPU-measured candidate in the given runs/<run> folders against
    its measured time (timing.json `ms` with `estimated: false`, at the candidate's `ctx`)."""
    from pathlib import Path

    from validator.schedule import load_schedule

    out = []
    for run in run_dirs:
        for cand in sorted(Path(run).glob("candidates/*")):
            try:
                timing = json.loads((cand / "timing.json").read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if timing.get("estimated", True) or not isinstance(timing.get("ms"), int | float):
                continue
            ctx = int(timing.get("ctx") or 1024)
            est = estimate(load_schedule(cand / "schedule.json"), ctx, params).makespan_ms
            err = round((est - timing["ms"]) / timing["ms"] * 100, 3)
            out.append({"candidate": f"{Path(run).name}/{cand.name}", "ctx": ctx, "measured_ms": timing["ms"],
                        "estimated_ms": round(est, 6), "error_pct": err})
    return out
