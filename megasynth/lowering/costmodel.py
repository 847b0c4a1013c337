"""Cost model: schedule + context length -> estimated makespan, per-op time, per-SM idle, critical path, and a trace.

Per instruction: a fixed overhead (dispatch, the wait's poll, staging the activation vector, epilogue; for attention,
plus its flops at `attn_flop_rate`: a long split is arithmetic on one SM's CUDA cores; on v10 that arithmetic
overlaps the split's K/V stream, so it bounds how fast the stream is consumed instead) and its bytes
(from the catalogue's `cost`) streamed through a fluid model of device memory: every stream gets
`min(sm_peak, total_bw / active)` bytes/µs, scaled by its op's achieved efficiency. Counters are simulated exactly
(monotone adds; a wait holds once the adds that completed reach its value); a wait satisfied by an add from another
SM costs one hop (`hop_us`).

Two kernels, one model (`ring_bytes` tells them apart):
- `ring_bytes == 0` (interpreter v9): an instruction streams its bytes after its waits hold and its overhead.
- `ring_bytes > 0` (interpreter v10, kernels/gpu/stream.py): a loader per SM streams the weight (and KV-history)
  bytes of `LOADER_OPS` ahead of the compute warps, through the SM's queue in order, at most `ring_bytes` beyond
  what the compute warps have consumed, and never waits on a counter. The compute warps start an instruction once
  its waits hold, pay its overhead, then consume its bytes from the ring (`consume_bw` bytes/µs once they are
  there); the instruction ends when both are done. A small instruction is then latency (overhead, hops), a big one
  bandwidth, and the stream overlaps the waits: what v10 measured (docs/perf-notes.md, "v10"). Rows are loaded in
  boxes of `box_rows` (a tile of 24 rows moves 32), so odd tiles cost what they move.

Parameters are per op (`eff`, `overhead_us`) plus global ones. The shipped file megasynth/data/h200_costmodel.json is
fitted by `synth calibrate` (search/calibrate.py). Every number this module produces is an estimate and is labelled
so (`estimated: true`).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from megasynth.ir.catalogue import OP_ORDER, OPS, Geometry, qkv_pair_pieces
from megasynth.ir.errors import LocatedError, ScheduleError, json_path, shown
from megasynth.ir.program import Program, resolve
from megasynth.ir.schedule import Schedule, read_json

DATA = Path(__file__).parents[1] / "data" / "h200_costmodel.json"  # megasynth/data/, package data of `synth`
MAX_EVENTS_FACTOR = 12  # bound on simulation events per instruction (start, consume, bytes, loader segments, end)
#: Ops whose bytes interpreter v10's loader streams ahead of the compute warps: weights, and attention's KV history
#: (megasynth/kernels/gpu/stream.py `_loader`); the embedding row and the split reduction are read by the compute warps.
LOADER_OPS = frozenset({"attn_norm_qkv_rope", "attn_norm_qkv_rope_sq", "attn_partial", "o_proj_residual",
                        "attn_reduce_o_proj", "mlp_norm_gate_up", "down_proj_residual", "final_norm_lm_head"})
#: Matrix-vector ops whose rows the loader moves in whole boxes, and the input width (K) of each.
_BOXED = ("attn_norm_qkv_rope", "attn_norm_qkv_rope_sq", "o_proj_residual", "attn_reduce_o_proj", "mlp_norm_gate_up",
          "down_proj_residual", "final_norm_lm_head")


#: Ops without fitted parameters of their own that move their bytes like another op.
PARAMS_LIKE = {"attn_norm_qkv_rope_sq": "attn_norm_qkv_rope"}
#: The ops with parameters of their own.
OWN_PARAMS = [op for op in OP_ORDER if op not in PARAMS_LIKE]


@dataclass
class OpParams:
    eff: float = 0.64  # achieved fraction of the bandwidth share in the byte phase
    overhead_us: float = 1.0  # fixed time per instruction outside the byte phase


@dataclass
class CostParams:
    """Cost-model parameters. Bandwidths in bytes per µs (4.19 TB/s = 4.19e6 B/µs)."""

    ops: dict[str, OpParams] = field(default_factory=lambda: {op: OpParams() for op in OWN_PARAMS})
    total_bw: float = 4.19e6
    sm_peak: float = 9.5e4  # one SM alone; a prior (about 3x its fair share of 132), not measured
    hop_us: float = 0.61
    wait_us: float = 0.05  # cost of checking one wait that is already satisfied
    ring_bytes: float = 0.0  # v10: bytes per SM the loader may stream ahead of the compute warps (0: v9, no loader)
    consume_bw: float = 0.0  # v10: bytes/µs at which the compute warps consume a ring that holds them (0: at once)
    box_rows: int = 0  # rows per TMA box (0: bytes as the catalogue counts them)
    launch_us: float = 0.0  # per step outside the kernel's instructions: counter reset, launch, the last release
    attn_flop_rate: float = 0.0  # fp32 flops per µs of one SM in attn_partial (CUDA cores; 0: flops not modelled)
    #: flops per µs of one SM in attn_partial from `attn_mma_batch` sequences per step on, where v10 runs a batch's
    #: attention on the tensor cores (`StreamConfig.attn_rows`); 0: `attn_flop_rate`'s
    attn_mma_flop_rate: float = 0.0
    attn_mma_batch: int = 8
    source: str = "prior"
    notes: str = ""

    def op(self, name: str) -> OpParams:
        """An op's parameters; QKV with the QK-norm apart streams like QKV, so it shares QKV's until fitted."""
        return self.ops.get(name) or self.ops.get(PARAMS_LIKE.get(name, "")) or OpParams()

    def attn_rate(self, batch: int) -> float:
        """Attention's flop rate at `batch` sequences per step (`attn_mma_flop_rate` where it applies)."""
        return self.attn_mma_flop_rate if batch >= self.attn_mma_batch and self.attn_mma_flop_rate > 0 \
            else self.attn_flop_rate

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ops": {k: asdict(v) for k, v in self.ops.items()}}

    @classmethod
    def from_json(cls, data: Any, file: str | None = None) -> CostParams:
        """Parameters from decoded JSON, checked against `CostParamsFile` (a defect is a `CostParamsError` naming
        `file`, the JSON path and the value); ops the document leaves out get the defaults."""
        doc = parse_cost_params(data, file)
        ops = {k: OpParams(**v.model_dump()) for k, v in doc.ops.items()}
        rest = doc.model_dump(exclude={"ops", "fit", "refits"}, exclude_unset=True)
        return cls(ops={**{op: OpParams() for op in OWN_PARAMS}, **ops}, **rest)

    def save(self, path: str | Path) -> None:
        from megasynth.atomic import write_json_atomic

        write_json_atomic(path, self.to_json())


class CostParamsError(LocatedError, ValueError):
    """A cost-params file (`--cost-params`, `--prior`) that cannot be used: unreadable, not JSON, or not the
    `CostParamsFile` schema; `str()` names the file, the JSON path and the bad value."""


# The file format of `CostParams` (megasynth/data/h200_costmodel.json, what `synth calibrate -o` writes): closed
# records with typed, range-checked numbers, so that a file of another kind (a bench result, a typo'd key) or a value
# the simulation cannot use (a rate of 0 divides, a negative one runs time backwards) is refused when it is read, not
# halfway through a search. Numbers are finite; an integer is a valid float, a string or a boolean is not.
_Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
_Positive = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]  # a divisor: bandwidths, rates
_NonNegative = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]  # times, sizes; 0 switches a feature off
_OpName = Annotated[StrictStr, Field(pattern="^(" + "|".join(OP_ORDER) + ")$")]


class OpParamsFile(BaseModel):
    """One op's parameters (`OpParams`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    #: bytes / (eff x bandwidth share): a fraction of the share, so in (0, 1] (the fits clamp it there too)
    eff: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] = OpParams.eff
    overhead_us: _NonNegative = OpParams.overhead_us


class CostParamsFile(BaseModel):
    """A cost-params file: the fields of `CostParams`, plus the records of the fit that wrote it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ops: dict[_OpName, OpParamsFile] = Field(default_factory=dict)
    total_bw: _Positive = CostParams.total_bw
    sm_peak: _Positive = CostParams.sm_peak
    hop_us: _NonNegative = CostParams.hop_us
    wait_us: _NonNegative = CostParams.wait_us
    ring_bytes: _NonNegative = CostParams.ring_bytes
    consume_bw: _NonNegative = CostParams.consume_bw  # 0: consumed at once
    box_rows: Annotated[StrictInt, Field(ge=0)] = CostParams.box_rows
    launch_us: _NonNegative = CostParams.launch_us
    attn_flop_rate: _NonNegative = CostParams.attn_flop_rate  # 0: flops not modelled
    attn_mma_flop_rate: _NonNegative = CostParams.attn_mma_flop_rate  # 0: attn_flop_rate's
    attn_mma_batch: Annotated[StrictInt, Field(ge=1)] = CostParams.attn_mma_batch
    source: StrictStr = CostParams.source
    notes: StrictStr = CostParams.notes
    #: what `synth calibrate` records about its fit (and later fits of some parameters); not read by the model
    fit: dict[str, Any] | None = None
    refits: list[dict[str, Any]] | None = None


def parse_cost_params(data: Any, file: str | None = None) -> CostParamsFile:
    """Decoded JSON checked against `CostParamsFile`; the first defect is a `CostParamsError`."""
    if not isinstance(data, dict):
        raise CostParamsError(f"cost-model parameters are a JSON object, got {shown(data)}", "$", file)
    try:
        return CostParamsFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(p for p in err["loc"] if p != "[key]" and not str(p).startswith("function-"))
        if err["type"] == "extra_forbidden":
            msg = (f"unknown key (got {shown(err.get('input'))}); a cost-params file holds only the fields of "
                   "megasynth/data/h200_costmodel.json")
        elif err["type"] == "string_pattern_mismatch":  # a key of `ops` that is no op of the catalogue
            msg = f"unknown op {shown(err.get('input'))}; known: {', '.join(OP_ORDER)}"
        else:
            msg = f"{err['msg']} (got {shown(err.get('input'))})"
        raise CostParamsError(msg, json_path(loc), file) from None


def load_params(path: str | Path | None = None) -> CostParams:
    """The committed H200 parameters (priors until calibrated), or a file written by `synth calibrate`. A file that
    cannot be used is a `CostParamsError` (a ValueError) naming it, the JSON path and the value."""
    p = Path(path) if path else DATA
    if not path and not p.exists():
        return CostParams()
    try:
        data = read_json(p)  # (plain or gzip-compressed, as a schedule is read)
    except ScheduleError as exc:  # unreadable, or invalid JSON: the same one line, as this file's error
        raise CostParamsError(exc.message, exc.path, exc.file) from None
    return CostParams.from_json(data, str(p))


def instruction_cost(geo: Geometry, op: str, layer: int | None, args: dict[str, int], ctx: int) -> tuple[int, int]:
    """(bytes, flops) of one instruction at context length `ctx`, from the catalogue (0 for declared-footprint ops)."""
    spec = OPS.get(op)
    if spec is None:
        return 0, 0
    return spec.cost(geo, layer if layer is not None else -1, args, max(1, min(ctx, geo.max_seq_len)))


def moved_bytes(geo: Geometry, op: str, args: dict[str, int], nbytes: int, box_rows: int) -> int:
    """The bytes an instruction moves when its rows are loaded in whole boxes of `box_rows` rows (QKV tiles: boxes of
    RoPE pairs, per head piece); `nbytes` (the catalogue's count) when there are no boxes or no rows."""
    if box_rows <= 0 or op not in _BOXED or "start" not in args:
        return nbytes
    rows = args["end"] - args["start"]
    if rows <= 0:
        return nbytes
    if op in ("attn_norm_qkv_rope", "attn_norm_qkv_rope_sq"):
        moved = sum(2 * box_rows * -(-(j1 - j0) // box_rows) for _, j0, j1 in
                    qkv_pair_pieces(geo.cfg, args["start"], args["end"]))
    else:
        moved = box_rows * -(-rows // box_rows)
    return nbytes * moved // rows


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
    """Event simulation over queues, counters and (v10) each SM's loader. Returns (start_us, end_us, cause,
    makespan_us); `cause[i]` is the instruction whose completion let i start (-1 for none). Raises ValueError when the
    schedule cannot finish."""
    geo = prog.geometry
    n, nw = prog.n, len(prog.queues)
    ring = params.ring_bytes > 0
    work = [0.0] * n  # bytes / eff streamed by the compute warps (in the fluid pool)
    lbytes = [0.0] * n  # bytes streamed by the loader
    leff = [1.0] * n
    consume = [0.0] * n  # time the compute warps need to consume the loaded bytes
    over = [0.0] * n
    for i in range(n):
        op = prog.op[i]
        nbytes, flops = instruction_cost(geo, op, prog.layer[i], prog.args[i], ctx) if geo else (0, 0)
        if geo is not None:
            nbytes = moved_bytes(geo, op, prog.args[i], nbytes, params.box_rows)
        p = params.op(op)
        if ring and op in LOADER_OPS:
            lbytes[i], leff[i] = float(nbytes), p.eff
            consume[i] = nbytes / params.consume_bw if params.consume_bw > 0 else 0.0
        else:
            work[i] = nbytes / p.eff
        over[i] = p.overhead_us + params.wait_us * len(prog.waits[i])
        if op == "attn_partial" and params.attn_flop_rate > 0:  # a long split is arithmetic on one SM
            rate = params.attn_rate(geo.batch if geo else 1)
            if ring:  # v10 computes each K/V block as its ring slot lands: arithmetic and stream overlap
                consume[i] = max(consume[i], flops / rate)
            else:
                over[i] += flops / rate
    # Loader bookkeeping in bytes along each queue: cum[w][k] = loader bytes of the queue before position k.
    cum = []
    for q in prog.queues:
        c = [0.0]
        for i in q:
            c.append(c[-1] + lbytes[i])
        cum.append(c)
    pos_of = [0] * n
    for q in prog.queues:
        for k, i in enumerate(q):
            pos_of[i] = k
    loaded = [0.0] * nw  # bytes loaded on each worker
    lpos = [0] * nw  # queue position the loader is on
    limit = [params.ring_bytes] * nw  # loaded may not pass it (the ring is full)
    seg_target = [0.0] * nw  # where the loader's current segment ends (-1: not streaming)
    lstreaming = [False] * nw
    loaded_at: list[float] = [math.nan] * n  # when the loader finished instruction i
    waiting_load: dict[int, float] = {}  # instruction -> earliest end, while its bytes are still on the way

    start = [math.nan] * n
    end = [math.nan] * n
    cause = [-1] * n
    counters = [0] * prog.counters
    hist_t: dict[int, list[float]] = defaultdict(list)  # per counter: completion times of adds, ascending
    hist_v: dict[int, list[int]] = defaultdict(list)  # cumulative value after each add
    hist_i: dict[int, list[int]] = defaultdict(list)  # instruction of each add
    head = [0] * nw
    free = [0.0] * nw
    last = [-1] * nw
    running = [False] * nw
    blocked: dict[int, list[tuple[int, int]]] = defaultdict(list)  # counter -> heap of (value needed, worker)
    timed: list[tuple[float, int, int]] = []  # (time, kind, index): 0 = byte phase / consume point, 1 = end
    pool: list[tuple[float, int, int]] = []  # (virtual finish, kind 0 = instruction / 1 = loader, index or worker)
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
                heapq.heappush(blocked[c], (v, w))
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

    def load_next(w: int) -> None:
        """Start the loader's next segment on worker w: up to the end of the instruction it is on, or the ring's
        limit; record the instructions whose bytes are all there."""
        q, c = prog.queues[w], cum[w]
        k = lpos[w]
        while k < len(q) and c[k + 1] <= loaded[w] + 1e-9:  # finished (or empty) instructions
            i = q[k]
            loaded_at[i] = t_now
            if i in waiting_load:
                heapq.heappush(timed, (max(waiting_load.pop(i), t_now), 1, i))
            k += 1
        lpos[w] = k
        if k >= len(q):
            return
        target = min(c[k + 1], limit[w])
        if target <= loaded[w] + 1e-9:
            return  # the ring is full: wait for the compute warps
        lstreaming[w] = True
        seg_target[w] = target
        heapq.heappush(pool, (v_now + (target - loaded[w]) / leff[q[k]], 1, w))

    def finish(i: int) -> None:
        nonlocal done
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
            waiting = blocked.get(c)
            while waiting and waiting[0][0] <= counters[c]:
                wake.append(heapq.heappop(waiting)[1])
        running[w] = False
        for u in dict.fromkeys(wake):
            if not running[u]:
                try_start(u)

    for w in range(nw):
        if ring:
            load_next(w)
        try_start(w)
    limit_steps = MAX_EVENTS_FACTOR * n + 16 * nw + 16
    steps = 0
    while timed or pool:
        steps += 1
        if steps > limit_steps:
            raise RuntimeError(f"cost model simulation exceeded {limit_steps} events; this is a bug")
        active = len(pool)
        rate = min(params.sm_peak, params.total_bw / active) if active else 0.0
        t_pool = t_now + (pool[0][0] - v_now) / rate if active else math.inf
        if timed and timed[0][0] <= t_pool:
            t, kind, i = heapq.heappop(timed)
            v_now += rate * (t - t_now)
            t_now = t
            if kind == 1:
                finish(i)
            elif ring and prog.op[i] in LOADER_OPS:  # the compute warps reach the ring: it drains as they consume
                w = prog.worker[i]
                limit[w] = max(limit[w], cum[w][pos_of[i] + 1] + params.ring_bytes)
                if not lstreaming[w]:
                    load_next(w)
                earliest = t_now + consume[i]
                if math.isnan(loaded_at[i]):
                    waiting_load[i] = earliest
                else:
                    heapq.heappush(timed, (max(earliest, loaded_at[i]), 1, i))
            else:
                heapq.heappush(pool, (v_now + work[i], 0, i))
            continue
        vf, kind, i = heapq.heappop(pool)
        t_now, v_now = t_pool, vf
        if kind == 1:  # a loader segment is through
            lstreaming[i] = False
            loaded[i] = seg_target[i]
            load_next(i)
        else:
            finish(i)
    if done < n:
        raise ValueError(f"the schedule deadlocks: {n - done} of {n} instructions never start (validate it)")
    return start, end, cause, max(end, default=0.0)


def estimate(schedule: Schedule | Program, ctx: int = 1024, params: CostParams | None = None,
             schedule_sha256: str | None = None) -> Estimate:
    """Estimate one schedule at context length `ctx` (tokens in the KV cache, as on the GPU)."""
    params = params or load_params()
    prog = schedule if isinstance(schedule, Program) else resolve(schedule)
    start, end, cause, span = simulate(prog, params, ctx)
    span_step = span + params.launch_us
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
    return Estimate(span_step / 1000, dict(per_op), [(span - b) / 1000 for b in busy], path, start, end, ctx, trace)


def make_trace(prog: Program, start: list[float], end: list[float], ctx: int, params: CostParams,
               schedule_sha256: str | None = None) -> dict[str, Any]:
    """The shared Chrome/Perfetto trace format (megasynth/trace.py owns it), labelled `estimated: true`."""
    from megasynth.trace import event
    from megasynth.trace import make_trace as _make

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
