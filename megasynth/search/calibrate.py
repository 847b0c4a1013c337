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
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from megasynth.ir.program import resolve
from megasynth.ir.schedule import MAX_WORKERS, Schedule
from megasynth.lowering.costmodel import CostParams, OpParams, estimate, instruction_cost
from megasynth.lowering.models import MAX_BATCH

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


def _measured(run_dirs: list[str], skipped: list[str] | None = None) -> list[tuple[str, Schedule, int, float]]:
    """(label, schedule, ctx, ms) of every GPU-measured candidate in runs/<run> folders (whole-step timings). A
    candidate whose schedule.json was left out and cannot be rebuilt as timed (a cost-model-driven assignment made
    with other parameters) is left out too, named in `skipped`."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.runs.rundir import RunDir

    out = []
    for run in run_dirs:
        rd = RunDir(run)
        for cid, timing in rd.accepted().items():
            if timing.get("estimated", True):
                continue
            try:
                schedule = rd.load_candidate(cid)
            except ScheduleError as exc:
                if skipped is not None:
                    skipped.append(f"{rd.path.name}/{cid}: {exc}")
                continue
            out.append((f"{rd.path.name}/{cid}", schedule, int(timing.get("ctx") or 1024), float(timing["ms"])))
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


# --------------------------------------------------------------------------------------------------------------
# Whole-step fit (interpreter v10): every free parameter fitted to measured step times at once
#
# With the loader streaming ahead of the waits, a traced instruction's duration mixes its own work with the wait for
# bytes streamed during earlier instructions, so the per-instruction least squares above no longer separates
# overhead from bandwidth. What the search needs is the step time, so the fit goes there directly: the parameters
# minimise the squared log error of the estimated step against the measured one (Levenberg-Marquardt, derivatives by
# finite differences, parameters in log space, a weak pull towards the prior for those the data cannot tell).

#: Parameters of the step fit: global ones and, per op, "overhead_us:<op>" / "eff:<op>".
GLOBAL_FREE = ("hop_us", "sm_peak", "consume_bw", "launch_us", "attn_flop_rate", "attn_mma_flop_rate")
STEP_DIFF = 0.04  # finite-difference step, in log units
PRIOR_WEIGHT = 0.03  # residual per log unit away from the prior, for each free parameter
OP_MEAN_WEIGHT = 0.5  # weight of a traced op's mean duration against a whole step's time
EFF_MAX = 1.0


@dataclass
class Step:
    """One measured step: its program, context, whole-step time (ms; None for a trace alone) and, when it was
    traced, the traced kernel's makespan (µs, without the launch) and each op's mean instruction duration (µs)."""

    label: str
    prog: Any
    ctx: int
    ms: float | None
    trace_us: float | None = None
    op_mean_us: dict[str, float] = field(default_factory=dict)
    always: bool = False  # never held out nor left out of the optimisation (`always_fit` in a measured-steps file)


def step_free_params(prior: CostParams, ops: set[str]) -> list[str]:
    """The parameters a step fit frees: hop latency, one SM's peak bandwidth, the ring's consume rate (v10), the
    per-step launch cost, attention's flop rate (when the prior models it), the overhead of every op present, and the
    efficiency of the four big streams (gate/up, down, LM head, and attention's K/V history at long contexts)."""
    free = [g for g in GLOBAL_FREE if (g != "consume_bw" or prior.ring_bytes > 0)
            and (g != "attn_flop_rate" or prior.attn_flop_rate > 0)
            and (g != "attn_mma_flop_rate" or prior.attn_mma_flop_rate > 0)]
    free += [f"overhead_us:{op}" for op in sorted(ops) if op != "embed"]
    free += [f"eff:{op}" for op in ("mlp_norm_gate_up", "down_proj_residual", "final_norm_lm_head",
                                                     "attn_partial") if op in ops]
    return free


def _get(params: CostParams, name: str) -> float:
    kind, _, op = name.partition(":")
    if op:
        return float(getattr(params.op(op), kind))
    if name == "attn_mma_flop_rate":  # unset, it is attention's CUDA-core rate: a fit starts from there
        return float(params.attn_mma_flop_rate or params.attn_flop_rate)
    return float(getattr(params, name))


def free_param_names(prior: CostParams) -> list[str]:
    """Every parameter a step fit may free: the global ones and each op's overhead and efficiency."""
    return list(GLOBAL_FREE) + [f"{k}:{op}" for op in sorted(prior.ops) for k in ("overhead_us", "eff")]


def _set(params: CostParams, values: dict[str, float]) -> CostParams:
    ops = {k: OpParams(v.eff, v.overhead_us) for k, v in params.ops.items()}
    glob: dict[str, float] = {}
    for name, v in values.items():
        kind, _, op = name.partition(":")
        if op:  # an op that borrows another's parameters (PARAMS_LIKE) starts from them, not from the default
            p = ops.setdefault(op, OpParams(params.op(op).eff, params.op(op).overhead_us))
            setattr(p, kind, min(EFF_MAX, v) if kind == "eff" else v)
        else:
            glob[name] = v
    return replace(params, ops=ops, **glob)


def step_errors(steps: list[Step], params: CostParams) -> list[float | None]:
    """(estimate - measured) / measured * 100 of each step's whole-step time (None for a trace alone)."""
    from megasynth.lowering.costmodel import simulate

    out: list[float | None] = []
    for st in steps:
        if st.ms is None:
            out.append(None)
            continue
        span = simulate(st.prog, params, st.ctx)[3]
        out.append(((span + params.launch_us) / (st.ms * 1000) - 1) * 100)
    return out


def _residuals(steps: list[Step], params: CostParams) -> list[float]:
    """Log errors: each step's whole-step time, and (weighted) each traced kernel makespan and traced op mean."""
    from megasynth.lowering.costmodel import simulate

    out: list[float] = []
    for st in steps:
        start, end, _, span = simulate(st.prog, params, st.ctx)
        if st.ms is not None:
            out.append(math.log(max(span + params.launch_us, 1e-9) / (st.ms * 1000)))
        if st.trace_us:
            out.append(math.log(max(span, 1e-9) / st.trace_us))
        if st.op_mean_us:
            tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for i, op in enumerate(st.prog.op):
                tot[op][0] += end[i] - start[i]
                tot[op][1] += 1
            for op, mean in sorted(st.op_mean_us.items()):
                if op in tot and mean > 0 and op != "embed":
                    out.append(OP_MEAN_WEIGHT * math.log(max(tot[op][0] / tot[op][1], 1e-6) / mean))
    return out


_POOL_STEPS: list[Step] = []


def _pool_init(steps: list[Step]) -> None:
    global _POOL_STEPS
    _POOL_STEPS = steps


def _pool_residuals(params: dict[str, Any]) -> list[float]:
    return _residuals(_POOL_STEPS, CostParams.from_json(params))


@dataclass
class StepFit:
    """A whole-step fit: the parameters, which were free, and the error on the steps it was fitted to."""

    params: CostParams
    free: list[str]
    errors_pct: list[float]  # per fitted step with a whole-step time, (estimate - measured) / measured * 100
    iterations: int

    @property
    def median_abs_pct_error(self) -> float | None:
        return statistics.median(abs(e) for e in self.errors_pct) if self.errors_pct else None

    @property
    def max_abs_pct_error(self) -> float | None:
        return max((abs(e) for e in self.errors_pct), default=None)


def fit_steps(steps: list[Step], prior: CostParams, free: list[str] | None = None, iterations: int = 12,
              jobs: int = 1, notice: Any = None) -> StepFit:
    """Fit `free` parameters (default `step_free_params`) to measured whole steps (and the traced makespans and op
    means they carry). Levenberg-Marquardt on log errors; the prior pulls the parameters the steps do not determine.
    With `jobs > 1` the finite differences of one iteration are computed by that many processes."""
    if not steps:
        raise ValueError("no measured steps to fit")
    ops = {op for st in steps for op in st.prog.op}
    free = free or step_free_params(prior, ops)
    x0 = [math.log(max(_get(prior, f), 1e-3)) for f in free]

    def params_at(x: list[float]) -> CostParams:
        return _set(prior, {f: math.exp(v) for f, v in zip(free, x, strict=True)})

    def pull(x: list[float]) -> list[float]:
        return [PRIOR_WEIGHT * (a - b) for a, b in zip(x, x0, strict=True)]

    pool = None
    if jobs > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(jobs, _pool_init, (steps,))

    def many(xs: list[list[float]]) -> list[list[float]]:
        if pool is None:
            return [_residuals(steps, params_at(x)) + pull(x) for x in xs]
        got = pool.map(_pool_residuals, [params_at(x).to_json() for x in xs])
        return [g + pull(x) for g, x in zip(got, xs, strict=True)]

    try:
        x = list(x0)
        r = many([x])[0]
        loss = sum(v * v for v in r)
        lam = 1e-2
        done = 0
        for done in range(1, iterations + 1):
            cols = many([[v + (STEP_DIFF if j == k else 0.0) for j, v in enumerate(x)] for k in range(len(x))])
            jac = [[(a - b) / STEP_DIFF for a, b in zip(col, r, strict=True)] for col in cols]
            n = len(x)
            jtj = [[sum(a * b for a, b in zip(jac[i], jac[j], strict=True)) for j in range(n)] for i in range(n)]
            jtr = [sum(a * b for a, b in zip(jac[i], r, strict=True)) for i in range(n)]
            rel = 0.0
            for _ in range(8):
                m = [[jtj[i][j] + (lam * jtj[i][i] + 1e-9 if i == j else 0.0) for j in range(n)] for i in range(n)]
                step = [max(-1.0, min(1.0, v)) for v in _solve(m, [-v for v in jtr])]  # at most a factor e
                xn = [a + b for a, b in zip(x, step, strict=True)]
                rn = many([xn])[0]
                ln = sum(v * v for v in rn)
                if ln < loss:
                    rel = (loss - ln) / max(loss, 1e-12)
                    x, r, loss = xn, rn, ln
                    lam = max(1e-6, lam / 3)
                    break
                lam *= 4
            if notice:
                notice(f"step fit, iteration {done}: loss {loss:.5f}")
            if rel < 1e-4:
                break
    finally:
        if pool is not None:
            pool.terminate()
    fitted = params_at(x)
    errs = [e for e in step_errors(steps, fitted) if e is not None]
    return StepFit(fitted, free, errs, done)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems are ~15 x 15)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-15:
            continue
        for i in range(c + 1, n):
            f = m[i][c] / m[c][c]
            for j in range(c, n + 1):
                m[i][j] -= f * m[c][j]
    out = [0.0] * n
    for i in range(n - 1, -1, -1):
        s = m[i][n] - sum(m[i][j] * out[j] for j in range(i + 1, n))
        out[i] = s / m[i][i] if abs(m[i][i]) > 1e-15 else 0.0
    return out


MEASURED_FORMAT = "megasynth-measured-steps/1"
_Ms = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]
_Us = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]


class TraceSummary(BaseModel):
    """A measured step's trace summary: the traced kernel's makespan and each op's mean instruction time (µs); the
    fit takes their logarithms, so they must be positive numbers (0: not traced)."""

    model_config = ConfigDict(extra="allow", strict=True)
    makespan_us: _Us | None = None
    op_mean_us: dict[str, _Us] = Field(default_factory=dict)


class MeasuredStep(BaseModel):
    """One step of a measured-steps file, typed and range-checked before anything is lowered (other keys, such as
    `source` or `schedule_sha256`, are notes the fit does not read)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: StrictStr
    model: StrictStr
    workers: Annotated[StrictInt, Field(ge=1, le=MAX_WORKERS)]
    strategy: Any
    ctx: Annotated[StrictInt, Field(ge=1)]
    ms: _Ms
    max_seq_len: Annotated[StrictInt, Field(ge=1)] | None = None
    batch: Annotated[StrictInt, Field(ge=1, le=MAX_BATCH)] = 1
    trace: TraceSummary | None = None
    always_fit: StrictBool = False


@dataclass
class CheckedStep:
    """A measured step that passed `check_measured`: its fields, strategy and the model spec it is lowered for."""

    step: MeasuredStep
    strategy: Any
    spec: Any


def check_measured(path: str | Path) -> list[CheckedStep]:
    """Every step of a `megasynth-measured-steps/1` file checked up front, before any is lowered: its fields typed
    and in range (workers in [1, MAX_WORKERS], ms > 0), a known model at a max_seq_len it takes, a ctx within the
    positions that lowering covers, a valid strategy. The first defect is a ValueError naming the file, the JSON
    path and the value."""
    import json

    from megasynth.ir.errors import ScheduleError, json_path, shown
    from megasynth.lowering.models import get_model, with_batch
    from megasynth.lowering.strategy import parse_strategy

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: $: cannot read a measured-steps file: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != MEASURED_FORMAT:
        raise ValueError(f"{path}: $.format: not a {MEASURED_FORMAT} file")
    if not isinstance(doc.get("steps"), list):
        raise ValueError(f"{path}: $.steps: a list of steps is required")
    out = []
    for k, e in enumerate(doc["steps"]):
        where = f"{path}: $.steps[{k}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: a step must be an object (got {shown(e)})")
        missing = [f for f in ("name", "model", "workers", "strategy", "ctx", "ms") if f not in e]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        try:
            step = MeasuredStep.model_validate(e)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = json_path(err["loc"])[1:]
            raise ValueError(f"{where}{loc}: {err['msg']} (got {shown(err.get('input'))})") from None
        try:
            strategy = parse_strategy(step.strategy, str(path), f"$.steps[{k}].strategy")
        except ScheduleError as exc:
            raise ValueError(str(exc)) from None
        try:
            spec = with_batch(get_model(step.model, step.max_seq_len), step.batch)
        except KeyError as exc:  # an unknown model
            raise ValueError(f"{where}.model: {exc.args[0] if exc.args else exc}") from None
        except ValueError as exc:  # a max_seq_len the model cannot take (the message names the option's spelling)
            why = str(exc).replace("--max-seq-len ", "max_seq_len ", 1)
            raise ValueError(f"{where}.max_seq_len: {why} (got {step.max_seq_len})") from None
        if step.ctx > spec.max_seq_len:
            limit = spec.max_position_embeddings
            how = (f"; give the step a max_seq_len up to the model's max_position_embeddings {limit}" if limit
                   and limit > spec.max_seq_len else "")
            raise ValueError(f"{where}.ctx: context {step.ctx} is beyond the {spec.max_seq_len} positions the step's "
                             f"lowering of {spec.name} covers{how} (got {step.ctx})")
        out.append(CheckedStep(step, strategy, spec))
    return out


def load_measured(path: str | Path) -> list[tuple[str, Schedule, int, float, dict[str, Any] | None, bool]]:
    """The steps of a `megasynth-measured-steps/1` file (`steps`: name, model, workers, strategy, ctx, ms, and
    optionally max_seq_len (the lowering's; default the model's), batch (sequences per step; default 1), a trace
    summary and `always_fit` each) as (label, schedule lowered from the recorded strategy, ctx, ms, trace summary or
    None, always_fit). Every step is checked (`check_measured`) before the first is lowered; a malformed step is a
    ValueError naming the file, its JSON path and the value."""
    from megasynth.lowering.lower import lower

    out = []
    for k, c in enumerate(check_measured(path)):
        e = c.step
        try:
            sched = lower(c.spec, e.workers, c.strategy)
        except ValueError as exc:  # a strategy this model cannot take
            raise ValueError(f"{path}: $.steps[{k}]: {exc}") from exc
        trace = e.trace.model_dump(exclude_unset=True) if e.trace is not None else None
        out.append((f"{Path(path).name}:{e.name}@{e.ctx}", sched, e.ctx, e.ms, trace, e.always_fit))
    return out


def require_measured_run(run: str | Path, purpose: str = "fit") -> None:
    """A ValueError unless `run` is a run folder (it has run.json, as `RunDir.init` writes it) with at least one
    GPU-measured candidate: a cost-model estimate has nothing to fit (or, `purpose` "check", to check) against."""
    from megasynth.runs.rundir import RunDir

    rd = RunDir(run)
    if not (rd.path / "run.json").is_file():
        raise ValueError(f"{run} is not a run folder (no run.json)")
    accepted = rd.accepted()
    if not any(not t.get("estimated", True) for t in accepted.values()):
        what = "only cost-model estimates" if accepted else "no accepted candidates"
        raise ValueError(f"{run} holds {what}, nothing measured to {purpose}")


def run_steps(run_dirs: list[str], skipped: list[str] | None = None) -> list[Step]:
    """Every GPU-measured candidate of runs/<run> folders as a `Step`; the best's GPU trace (best/trace.json, when
    it is the best's and measured) adds its traced makespan and per-op means to that candidate's step."""
    import json

    from megasynth.runs.rundir import RunDir

    out = []
    for run in run_dirs:
        rd = RunDir(run)
        best, trace = None, None
        try:
            best = json.loads((rd.path / "best" / "timing.json").read_text(encoding="utf-8")).get("candidate")
            trace = rd.best_trace()
        except (OSError, ValueError):
            pass
        if trace is not None and trace.get("metadata", {}).get("estimated", True):
            trace = None
        for label, schedule, ctx, ms in _measured([run], skipped):
            st = Step(label, resolve(schedule), ctx, ms)
            if trace is not None and label.endswith(f"/{best}"):
                _add_trace(st, trace)
            out.append(st)
    return out


def _add_trace(step: Step, trace: dict[str, Any]) -> None:
    """A GPU trace's kernel makespan and per-op mean durations on the step it traced."""
    evs = _events(trace)
    step.trace_us = measured_ms(trace) * 1000
    tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in evs:
        op = e.get("args", {}).get("op") or e.get("cat")
        tot[op][0] += float(e["dur"])
        tot[op][1] += 1
    step.op_mean_us = {op: t / n for op, (t, n) in tot.items() if n}


def file_steps(paths: list[str]) -> list[Step]:
    """The steps of `megasynth-measured-steps/1` files, with the trace summaries they carry; a step marked
    `always_fit` (few steps picked for what the runs do not cover, such as long contexts) is never held out nor left
    out of the optimisation (`Step.always`)."""
    out = []
    for path in paths:
        for label, schedule, ctx, ms, trace, always in load_measured(path):
            st = Step(label, resolve(schedule), ctx, ms, always=always)
            if trace:
                st.trace_us = trace.get("makespan_us")
                st.op_mean_us = dict(trace.get("op_mean_us", {}))
            out.append(st)
    return out


def split_held_out(steps: list[Step], fraction: float, seed: int = 0) -> tuple[list[Step], list[Step]]:
    """(fit, held out): about `fraction` of the timed steps, picked by a hash of their label and the seed (the same
    split every time), never a traced one (its trace is fitted with it) nor one marked `always`."""
    import hashlib

    fit_set, held = [], []
    for st in steps:
        h = int(hashlib.sha256(f"{seed}:{st.label}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if st.ms is not None and not st.op_mean_us and not st.always and h < fraction else fit_set).append(st)
    return fit_set, held


def subsample(steps: list[Step], at_most: int) -> list[Step]:
    """At most `at_most` steps for the optimisation: every traced one and every one marked `always`, the rest spread
    evenly over the measured times (fast and slow schedules both stay represented)."""
    if len(steps) <= at_most:
        return steps
    traced = [st for st in steps if st.op_mean_us or st.ms is None or st.always]
    rest = sorted((st for st in steps if not (st.op_mean_us or st.ms is None or st.always)),
                  key=lambda st: st.ms or 0.0)
    k = max(0, at_most - len(traced))
    pick = [rest[round(i * (len(rest) - 1) / max(1, k - 1))] for i in range(k)] if k else []
    return traced + list({id(st): st for st in pick}.values())


def error_summary(steps: list[Step], params: CostParams) -> dict[str, Any]:
    """Median and max |error| (%) of the estimated whole-step times, with one row per step."""
    errs = step_errors(steps, params)
    rows = [{"step": st.label, "ctx": st.ctx, "measured_ms": st.ms,
             "estimated_ms": round(st.ms * (1 + e / 100), 6), "error_pct": round(e, 3)}
            for st, e in zip(steps, errs, strict=True) if e is not None and st.ms is not None]
    abs_errs = [abs(r["error_pct"]) for r in rows]
    return {"n": len(rows), "median_abs_pct_error": round(statistics.median(abs_errs), 3) if rows else None,
            "max_abs_pct_error": round(max(abs_errs), 3) if rows else None, "rows": rows}
