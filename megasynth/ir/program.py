"""Resolve a parsed `Schedule` into a `Program`: the structural checks (ids, queues, counters, buffers, ranges,
catalogue args and footprints) and the flat per-instruction tables every later pass reads.

Instructions are indexed by ascending id, so index order is the schedule's meaning (sequential ascending-id order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megasynth.ir.catalogue import MERGE_OPS, OPS, Access, ArgError, Geometry, check_instruction, footprint
from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ConfigError, ModelConfig
from megasynth.ir.schedule import Schedule


@dataclass
class Finding:
    """One reason to reject a well-formed schedule. `category` is race, deadlock, coverage, footprint or unproven."""

    category: str
    message: str
    instructions: list[int] = field(default_factory=list)  # instruction ids involved
    path: str | None = None  # JSON path, when one place is to blame
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"category": self.category, "message": self.message, "instructions": self.instructions}
        if self.path:
            out["path"] = self.path
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class Program:
    schedule: Schedule
    geometry: Geometry | None
    buffers: dict[str, int]
    counters: int
    ids: list[int]  # index -> instruction id (ascending)
    index: dict[int, int]  # instruction id -> index
    src: list[int]  # index -> position in schedule.instructions (for JSON paths)
    op: list[str]
    layer: list[int | None]
    args: list[dict[str, Any]]
    accesses: list[list[Access]]
    waits: list[list[tuple[int, int]]]  # (counter, value)
    signals: list[list[tuple[int, int]]]  # (counter, add)
    worker: list[int]
    qpos: list[int]
    queues: list[list[int]]  # per worker, instruction indices in order
    findings: list[Finding] = field(default_factory=list)  # footprint disagreements found while resolving

    @property
    def n(self) -> int:
        return len(self.ids)

    def label(self, i: int) -> str:
        """A short human name: `#12 attn_partial L3`."""
        layer = self.layer[i]
        return f"#{self.ids[i]} {self.op[i]}" + (f" L{layer}" if layer is not None else "")

    def path(self, i: int) -> str:
        return f"$.instructions[{self.src[i]}]"


def geometry_of(schedule: Schedule, file: str | None = None) -> Geometry | None:
    if schedule.model is None:
        return None
    try:
        cfg = ModelConfig.from_hf(schedule.model.config)
    except ConfigError as exc:
        raise ScheduleError(f"model config: {exc}", f"$.model.config.{exc.key}", file) from None
    except (TypeError, ValueError) as exc:
        raise ScheduleError(f"model config is not a valid config: {exc}", "$.model.config", file) from None
    splits = 1
    for ins in schedule.instructions:
        s = ins.args.get("splits") if ins.op in ("attn_partial", *MERGE_OPS) else None
        if isinstance(s, int) and not isinstance(s, bool) and s > splits:
            splits = s
    return Geometry(cfg, schedule.model.max_seq_len, min(splits, schedule.model.max_seq_len),
                    schedule.model.batch or 1)


def _regions(kind: str, regions: list) -> list[Access]:
    return [(kind, r.buffer, r.start, r.end) for r in regions]


def _norm(accesses: list[Access]) -> set[Access]:
    return {a for a in accesses if a[2] < a[3]}


def resolve(schedule: Schedule, file: str | None = None) -> Program:
    """Check the structure of a schedule and resolve it; a structural defect raises `ScheduleError`."""
    geo = geometry_of(schedule, file)
    if geo is not None:
        buffers = dict(geo.buffers())
        if schedule.buffers is not None:
            for name, size in schedule.buffers.items():
                if name in buffers and size < buffers[name]:
                    raise ScheduleError(f"buffer {name!r} has {size} elements; the model needs {buffers[name]}",
                                        f"$.buffers.{name}", file)
                buffers[name] = max(size, buffers.get(name, 0))
    elif schedule.buffers is None:
        raise ScheduleError("a schedule without `model` must declare `buffers`", "$.buffers", file)
    else:
        buffers = dict(schedule.buffers)

    order = sorted(range(len(schedule.instructions)), key=lambda k: schedule.instructions[k].id)
    ids = [schedule.instructions[k].id for k in order]
    index: dict[int, int] = {}
    for i, ident in enumerate(ids):
        if ident in index:
            dup = [k for k in order if schedule.instructions[k].id == ident]
            raise ScheduleError(f"id {ident} is used twice (also at $.instructions[{dup[0]}])",
                                f"$.instructions[{dup[1]}].id", file)
        index[ident] = i

    n = len(ids)
    prog = Program(schedule, geo, buffers, schedule.counters, ids, index, order, [""] * n, [None] * n, [{}] * n,
                   [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [-1] * n, [-1] * n, [])

    if len(schedule.queues) > schedule.target.workers:
        raise ScheduleError(f"{len(schedule.queues)} queues for {schedule.target.workers} workers", "$.queues", file)
    for w, queue in enumerate(schedule.queues):
        idxs = []
        for p, ident in enumerate(queue):
            where = f"$.queues[{w}][{p}]"
            i = index.get(ident)
            if i is None:
                raise ScheduleError(f"instruction id {ident} does not exist", where, file)
            if prog.worker[i] != -1:
                raise ScheduleError(f"instruction {ident} is already in queue {prog.worker[i]} at position "
                                    f"{prog.qpos[i]}", where, file)
            prog.worker[i], prog.qpos[i] = w, p
            idxs.append(i)
        prog.queues.append(idxs)
    for i in range(n):
        if prog.worker[i] == -1:
            raise ScheduleError(f"instruction {ids[i]} is in no queue", f"{prog.path(i)}.id", file)

    for i, k in enumerate(order):
        ins = schedule.instructions[k]
        where = f"$.instructions[{k}]"
        prog.op[i], prog.layer[i] = ins.op, ins.layer
        for j, wt in enumerate(ins.waits):
            if wt.counter >= schedule.counters:
                raise ScheduleError(f"counter {wt.counter} is out of range (counters: {schedule.counters})",
                                    f"{where}.waits[{j}].counter", file)
        for j, sg in enumerate(ins.signals):
            if sg.counter >= schedule.counters:
                raise ScheduleError(f"counter {sg.counter} is out of range (counters: {schedule.counters})",
                                    f"{where}.signals[{j}].counter", file)
        prog.waits[i] = [(wt.counter, wt.value) for wt in ins.waits]
        prog.signals[i] = [(sg.counter, sg.add) for sg in ins.signals]
        declared = _regions("read", ins.reads) + _regions("write", ins.writes) + _regions("reduce", ins.reduces)
        for kind, regions in (("reads", ins.reads), ("writes", ins.writes), ("reduces", ins.reduces)):
            for j, r in enumerate(regions):
                if r.buffer not in buffers:
                    raise ScheduleError(f"unknown buffer {r.buffer!r}", f"{where}.{kind}[{j}].buffer", file)
                if r.end > buffers[r.buffer]:
                    raise ScheduleError(f"range [{r.start}, {r.end}) is past the end of {r.buffer!r} "
                                        f"({buffers[r.buffer]} elements)", f"{where}.{kind}[{j}].range", file)
        if ins.op in OPS:
            if geo is None:
                raise ScheduleError(f"catalogue op {ins.op!r} needs the schedule's `model`", f"{where}.op", file)
            try:
                prog.args[i] = check_instruction(geo, ins.op, ins.layer, ins.args)
            except ArgError as exc:
                raise ScheduleError(str(exc), where, file) from None
            derived = [a for a in footprint(geo, ins.op, ins.layer if ins.layer is not None else -1, prog.args[i])
                       if a[2] < a[3]]
            for a in derived:
                if a[3] > buffers[a[1]]:
                    raise ScheduleError(f"{ins.op} touches {a[1]}[{a[2]}:{a[3]}], past the buffer's "
                                        f"{buffers[a[1]]} elements", where, file)
            if declared and _norm(declared) != _norm(derived):
                prog.findings.append(Finding(
                    "footprint", f"{prog.label(i)}: declared footprint disagrees with the catalogue's "
                    f"{sorted(_norm(derived))}", [ins.id], where))
            prog.accesses[i] = derived
        else:
            prog.args[i] = dict(ins.args)
            prog.accesses[i] = [a for a in declared if a[2] < a[3]]
    return prog
