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
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from synth.lowering.costmodel import CostParams, OpParams, estimate, instruction_cost
from validator.program import resolve
from validator.schedule import Schedule

MIN_EVENTS = 3  # fewer traced instructions of an op than this: keep its prior
HOP_STEPS = 14  # golden-section steps for hop_us over [0, 10] µs (precision ~0.01 µs)
#: One SM's peak bandwidth (bytes/µs) tried when measured whole steps are given (a fair share of 132 SMs is 31.7e3).
PEAK_GRID = [20e3, 30e3, 45e3, 65e3, 95e3, 140e3]


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


Target = tuple[Any, int, float]  # (resolved program, ctx, measured makespan in ms)


def _loss(targets: list[Target], params: CostParams) -> float:
    return sum(abs(math.log(estimate(g, c, params).makespan_ms / m)) for g, c, m in targets if m > 0)


def _fit_hop(targets: list[Target], params: CostParams) -> tuple[float, float]:
    """The hop latency that best matches the measured makespans (golden-section search of the summed |log error|),
    and that loss. Per-instruction fits leave out the time between instructions (polling, the visibility of
    signals); this folds it into the one parameter that models it."""
    lo, hi = 0.0, 10.0
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa, fb = _loss(targets, replace(params, hop_us=a)), _loss(targets, replace(params, hop_us=b))
    for _ in range(HOP_STEPS):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = _loss(targets, replace(params, hop_us=a))
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = _loss(targets, replace(params, hop_us=b))
    hop = round((lo + hi) / 2, 4)
    return hop, _loss(targets, replace(params, hop_us=hop))


def _per_op(traced: list[tuple[dict[str, Any], Any, int]], prior: CostParams
            ) -> tuple[dict[str, OpParams], dict[str, dict[str, Any]]]:
    """Least-squares per-op fit of every traced instruction, with bandwidth shares under `prior`'s global params."""
    xs: dict[str, list[float]] = defaultdict(list)
    ys: dict[str, list[float]] = defaultdict(list)
    for trace, prog, ctx in traced:
        evs = _events(trace)
        for e, r in zip(evs, _mean_rates(evs, prior), strict=True):
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
    return ops, per_op


def fit(pairs: list[tuple[dict[str, Any], Schedule]], prior: CostParams | None = None,
        device: str | None = None, fit_hop: bool = True, measured: list[tuple[Schedule, int, float]] | None = None,
        peaks: list[float] | None = None) -> Fit:
    """Fit per-op parameters from (trace, schedule) pairs, the hop latency to the traced makespans (plus `measured`
    (schedule, ctx, ms) whole-step timings), and, when `peaks` are given, one SM's peak bandwidth from that grid;
    report the makespan error of the fitted model on the traces."""
    prior = prior or CostParams()
    traced = [(trace, resolve(schedule), int(trace.get("metadata", {}).get("ctx") or 1024))
              for trace, schedule in pairs]
    targets: list[Target] = [(prog, ctx, measured_ms(trace)) for trace, prog, ctx in traced]
    targets += [(resolve(s), c, ms) for s, c, ms in measured or []]
    best: tuple[float, CostParams, dict[str, dict[str, Any]]] | None = None
    for peak in peaks or [prior.sm_peak]:
        base = replace(prior, sm_peak=peak)
        ops, per_op = _per_op(traced, base)
        cand = replace(base, ops=ops)
        if fit_hop:
            hop, loss = _fit_hop(targets, cand)
            cand = replace(cand, hop_us=hop)
        else:
            loss = _loss(targets, cand)
        if best is None or loss < best[0]:
            best = (loss, cand, per_op)
    assert best is not None
    _, fitted, per_op = best
    what = f"{len(pairs)} traces" + (f" + {len(measured)} measured steps" if measured else "")
    fitted = replace(fitted, source=f"fitted from {what}" + (f" ({device})" if device else ""),
                     notes="synth calibrate: per-op eff/overhead by least squares on traced instructions; hop_us "
                           "(sync cost per inter-SM wait) fitted to the measured makespans"
                           + ("; sm_peak chosen from a grid" if peaks else "; sm_peak and total_bw from the prior"))
    out = Fit(fitted, per_op)
    for (trace, prog, ctx), (_, _, meas) in zip(traced, targets, strict=False):
        est = estimate(prog, ctx, fitted).makespan_ms
        out.makespans.append({"schedule_sha256": trace.get("metadata", {}).get("schedule_sha256"),
                              "measured_ms": round(meas, 6), "estimated_ms": round(est, 6),
                              "error_pct": round((est - meas) / meas * 100, 3) if meas else 0.0})
    return out


def _measured(run_dirs: list[str]) -> list[tuple[str, Schedule, int, float]]:
    """(label, schedule, ctx, ms) of every GPU-measured candidate in runs/<run> folders (whole-step timings)."""
    from synth.runs.rundir import RunDir

    out = []
    for run in run_dirs:
        rd = RunDir(run)
        for cid, timing in rd.accepted().items():
            if not timing.get("estimated", True):
                out.append((f"{rd.path.name}/{cid}", rd.load_candidate(cid), int(timing.get("ctx") or 1024),
                            float(timing["ms"])))
    return out


def check_runs(run_dirs: list[str], params: CostParams) -> list[dict[str, Any]]:
    """Held-out check: the model's estimate of every GPU-measured candidate in the given runs/<run> folders against
    its measured time (timing.json `ms` with `estimated: false`, at the candidate's `ctx`)."""
    out = []
    for label, schedule, ctx, ms in _measured(run_dirs):
        est = estimate(schedule, ctx, params).makespan_ms
        out.append({"candidate": label, "ctx": ctx, "measured_ms": ms, "estimated_ms": round(est, 6),
                    "error_pct": round((est - ms) / ms * 100, 3)})
    return out


def measured_steps(run_dirs: list[str]) -> list[tuple[Schedule, int, float]]:
    """(schedule, ctx, ms) of every GPU-measured candidate in runs/<run> folders (whole-step timings)."""
    return [(schedule, ctx, ms) for _, schedule, ctx, ms in _measured(run_dirs)]
