"""Cost model: schedule + context length -> estimated makespan, per-op time, per-SM idle, critical path, and a trace.

Per instruction: a fixed overhead (dispatch, barrier, tail) and then its bytes (from the catalogue's `cost`) streamed
through a fluid model of device memory: every SM in its byte phase gets `min(sm_peak, total_bw / active)` bytes/µs,
scaled by the op's achieved efficiency. Counters are simulated exactly (monotone adds; a wait holds once the adds that
completed reach its value); a wait satisfied by an add from another SM costs one hop (0.61 µs measured on the H200).

Parameters are per op (`eff`, `overhead_us`) plus global ones (`total_bw`, `sm_peak`, `hop_us`). The shipped file
synth/data/h200_costmodel.json holds *priors* derived from DESIGN.md §7 until `synth calibrate` fits GPU traces.
Every number this module produces is an estimate and is labelled so (`estimated: true`).
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from validator.catalogue import OP_ORDER, OPS, Geometry
from validator.program import Program, resolve
from validator.schedule import Schedule

DATA = Path(__file__).parents[1] / "data" / "h200_costmodel.json"  # synth/data/, package data of `synth`
MAX_EVENTS_FACTOR = 8  # bound on simulation events per instruction (each has at most start, bytes, end)


@dataclass
class OpParams:
    eff: float = 0.64  # achieved fraction of the bandwidth share in the byte phase
    overhead_us: float = 1.0  # fixed time per instruction outside the byte phase


@dataclass
class CostParams:
    """Cost-model parameters. Bandwidths in bytes per µs (4.19 TB/s = 4.19e6 B/µs)."""

    ops: dict[str, OpParams] = field(default_factory=lambda: {op: OpParams() for op in OP_ORDER})
    total_bw: float = 4.19e6
    sm_peak: float = 9.5e4  # one SM alone; a prior (about 3x its fair share of 132), not measured
    hop_us: float = 0.61
    wait_us: float = 0.05  # cost of checking one wait that is already satisfied
    source: str = "prior"
    notes: str = ""

    def op(self, name: str) -> OpParams:
        return self.ops.get(name) or OpParams()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ops": {k: asdict(v) for k, v in self.ops.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostParams:
        ops = {k: OpParams(**v) for k, v in data.get("ops", {}).items()}
        rest = {k: v for k, v in data.items() if k != "ops" and k in cls.__dataclass_fields__}
        return cls(ops={**{op: OpParams() for op in OP_ORDER}, **ops}, **rest)

    def save(self, path: str | Path) -> None:
        from validator.atomic import write_json_atomic

        write_json_atomic(path, self.to_json())


def load_params(path: str | Path | None = None) -> CostParams:
    """The committed H200 parameters (priors until calibrated), or a file written by `synth calibrate`."""
    p = Path(path) if path else DATA
    if not p.exists():
        return CostParams()
    return CostParams.from_json(json.loads(p.read_text(encoding="utf-8")))


def instruction_cost(geo: Geometry, op: str, layer: int | None, args: dict[str, int], ctx: int) -> tuple[int, int]:
    """(bytes, flops) of one instruction at context length `ctx`, from the catalogue (0 for declared-footprint ops)."""
    spec = OPS.get(op)
    if spec is None:
        return 0, 0
    return spec.cost(geo, layer if layer is not None else -1, args, max(1, min(ctx, geo.max_seq_len)))


def nominal_us(params: CostParams, op: str, nbytes: int, active: int) -> float:
    """Duration of an instruction when `active` SMs stream at once (used by the lowering's schedulers)."""
    p = params.op(op)
    rate = min(params.sm_peak, params.total_bw / max(1, active)) * p.eff
    return p.overhead_us + nbytes / rate


@dataclass
class Estimate:
    """The cost model's answer for one schedule. Everything here is an estimate (`estimated` is always True)."""

    makespan_ms: float
    per_op_ms: dict[str, float]  # summed instruction time per op (all SMs)
    per_sm_idle_ms: list[float]  # makespan minus busy time, per worker
    critical_path: list[int]  # instruction ids, first to last
    start_us: list[float]  # per instruction index
    end_us: list[float]
    ctx: int
    trace: dict[str, Any]
    estimated: bool = True

    def summary(self) -> dict[str, Any]:
        idle = self.per_sm_idle_ms
        return {"makespan_ms": round(self.makespan_ms, 6), "estimated": True, "ctx": self.ctx,
                "per_op_ms": {k: round(v, 6) for k, v in self.per_op_ms.items()},
                "idle_ms": {"mean": round(sum(idle) / max(1, len(idle)), 6), "max": round(max(idle, default=0), 6)},
                "critical_path_len": len(self.critical_path)}


def simulate(prog: Program, params: CostParams, ctx: int) -> tuple[list[float], list[float], list[int], float]:
    """Event simulation over queues and counters. Returns (start_us, end_us, cause, makespan_us); `cause[i]` is the
    instruction whose completion let i start (-1 for none). Raises ValueError when the schedule cannot finish."""
    geo = prog.geometry
    n = prog.n
    work = [0.0] * n
    over = [0.0] * n
    for i in range(n):
        nbytes, _ = instruction_cost(geo, prog.op[i], prog.layer[i], prog.args[i], ctx) if geo else (0, 0)
        p = params.op(prog.op[i])
        work[i] = nbytes / p.eff
        over[i] = p.overhead_us + params.wait_us * len(prog.waits[i])
    start = [math.nan] * n
    end = [math.nan] * n
    cause = [-1] * n
    counters = [0] * prog.counters
    hist_t: dict[int, list[float]] = defaultdict(list)  # per counter: completion times of adds, ascending
    hist_v: dict[int, list[int]] = defaultdict(list)  # cumulative value after each add
    hist_i: dict[int, list[int]] = defaultdict(list)  # instruction of each add
    head = [0] * len(prog.queues)
    free = [0.0] * len(prog.queues)
    last = [-1] * len(prog.queues)
    running = [False] * len(prog.queues)
    blocked: dict[int, list[int]] = defaultdict(list)
    timed: list[tuple[float, int, int]] = []  # (time, kind 0=start-bytes, index)
    pool: list[tuple[float, int]] = []  # (virtual finish, index) of instructions in their byte phase
    t_now, v_now = 0.0, 0.0
    done = 0

    def try_start(w: int) -> None:
        q = prog.queues[w]
        if head[w] >= len(q):
            return
        i = q[head[w]]
        ready, why = free[w], last[w]
        for c, v in prog.waits[i]:
            if counters[c] < v:
                blocked[c].append(w)
                return
            if v <= 0:
                continue
            k = bisect.bisect_left(hist_v[c], v)
            j = hist_i[c][k]
            t = hist_t[c][k] + (params.hop_us if prog.worker[j] != w else 0.0)
            if t > ready:
                ready, why = t, j
        head[w] += 1
        running[w] = True
        start[i], cause[i] = ready, why
        heapq.heappush(timed, (ready + over[i], 0, i))

    for w in range(len(prog.queues)):
        try_start(w)
    limit = MAX_EVENTS_FACTOR * n + 16
    steps = 0
    while timed or pool:
        steps += 1
        if steps > limit:
            raise RuntimeError(f"cost model simulation exceeded {limit} events; this is a bug")
        active = len(pool)
        rate = min(params.sm_peak, params.total_bw / active) if active else 0.0
        t_pool = t_now + (pool[0][0] - v_now) / rate if active else math.inf
        if timed and timed[0][0] <= t_pool:
            t, _, i = heapq.heappop(timed)
            v_now += rate * (t - t_now)
            t_now = t
            heapq.heappush(pool, (v_now + work[i], i))
            continue
        vf, i = heapq.heappop(pool)
        t_now, v_now = t_pool, vf
        end[i] = t_now
        done += 1
        w = prog.worker[i]
        free[w], last[w] = t_now, i
        wake = [w]
        for c, add in prog.signals[i]:
            counters[c] += add
            hist_t[c].append(t_now)
            hist_v[c].append(counters[c])
            hist_i[c].append(i)
            wake.extend(blocked.pop(c, ()))
        running[w] = False
        for u in dict.fromkeys(wake):
            if not running[u]:
                try_start(u)
    if done < n:
        raise ValueError(f"the schedule deadlocks: {n - done} of {n} instructions never start (validate it)")
    return start, end, cause, max(end, default=0.0)


def estimate(schedule: Schedule | Program, ctx: int = 1024, params: CostParams | None = None,
             schedule_sha256: str | None = None) -> Estimate:
    """Estimate one schedule at context length `ctx` (tokens in the KV cache, as on the GPU)."""
    params = params or load_params()
    prog = schedule if isinstance(schedule, Program) else resolve(schedule)
    start, end, cause, span = simulate(prog, params, ctx)
    per_op: dict[str, float] = defaultdict(float)
    busy = [0.0] * len(prog.queues)
    for i in range(prog.n):
        per_op[prog.op[i]] += (end[i] - start[i]) / 1000
        busy[prog.worker[i]] += end[i] - start[i]
    path: list[int] = []
    i = max(range(prog.n), key=lambda k: end[k]) if prog.n else -1
    while i != -1 and len(path) <= prog.n:
        path.append(prog.ids[i])
        i = cause[i]
    path.reverse()
    trace = make_trace(prog, start, end, ctx, params, schedule_sha256)
    return Estimate(span / 1000, dict(per_op), [(span - b) / 1000 for b in busy], path, start, end, ctx, trace)


def make_trace(prog: Program, start: list[float], end: list[float], ctx: int, params: CostParams,
               schedule_sha256: str | None = None) -> dict[str, Any]:
    """The shared Chrome/Perfetto trace format (kernels/trace.py owns it), labelled `estimated: true`."""
    from kernels.trace import event
    from kernels.trace import make_trace as _make

    events = []
    for w, q in enumerate(prog.queues):
        prev_end = 0.0
        for i in q:
            events.append(event(w, prog.ids[i], prog.op[i], prog.layer[i], round(start[i], 4),
                                round(end[i] - start[i], 4), round(max(0.0, start[i] - prev_end), 4)))
            prev_end = end[i]
    sched = prog.schedule
    meta = {"model": sched.model.name if sched.model else None, "device": f"cost model ({params.source})",
            "ctx": ctx, "estimated": True, "schedule_sha256": schedule_sha256}
    return _make(events, meta)
