"""Explicit patches on a lowered schedule (schedule -> schedule): move an instruction to another queue/position,
add/change/remove a wait or a signal. A patch list is JSON; a bad patch raises `PatchError` naming the patch index
and the field, e.g. `$.patches[2].id: instruction 99999 does not exist`.

Patches are applied in order; each sees the result of the previous ones. A patch may name a counter at or past the
schedule's `counters` to use a fresh counter: `counters` grows to cover it. Patched schedules are not trusted: they go
through the validator like every other candidate.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import MAX_COUNTERS, MAX_INT, Schedule, parse_schedule

NonNeg = Annotated[int, Field(ge=0, le=MAX_INT)]


class PatchError(ScheduleError):
    """A patch that cannot be applied; `path` is `$.patches[k].field`."""


class _Patch(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Move(_Patch):
    """Move instruction `id` to queue `worker` at `position` (default: before the first larger id, which keeps an
    ascending-id queue ascending)."""

    op: Literal["move"]
    id: NonNeg
    worker: NonNeg
    position: NonNeg | None = None


class AddWait(_Patch):
    """Make instruction `id` also wait until `counters[counter] >= value`."""

    op: Literal["add_wait"]
    id: NonNeg
    counter: NonNeg
    value: NonNeg


class SetWait(_Patch):
    """Change the value of instruction `id`'s wait on `counter`."""

    op: Literal["set_wait"]
    id: NonNeg
    counter: NonNeg
    value: NonNeg


class RemoveWait(_Patch):
    """Drop instruction `id`'s wait(s) on `counter`."""

    op: Literal["remove_wait"]
    id: NonNeg
    counter: NonNeg


class AddSignal(_Patch):
    """Make instruction `id` also add `add` to `counter` when it ends."""

    op: Literal["add_signal"]
    id: NonNeg
    counter: NonNeg
    add: Annotated[int, Field(ge=1, le=MAX_INT)] = 1


class RemoveSignal(_Patch):
    """Drop instruction `id`'s signal(s) on `counter`."""

    op: Literal["remove_signal"]
    id: NonNeg
    counter: NonNeg


Patch = Annotated[Move | AddWait | SetWait | RemoveWait | AddSignal | RemoveSignal, Field(discriminator="op")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Patch)
OPS = ("move", "add_wait", "set_wait", "remove_wait", "add_signal", "remove_signal")


def patch_schema() -> dict[str, Any]:
    """JSON Schema of one patch (for the agent's briefing)."""
    return _ADAPTER.json_schema()


def parse_patch(data: Any, index: int) -> Move | AddWait | SetWait | RemoveWait | AddSignal | RemoveSignal:
    """Validate one patch; a defect raises `PatchError` at `$.patches[index].field`."""
    if not isinstance(data, dict):
        raise PatchError(f"a patch is a JSON object, got {type(data).__name__}", f"$.patches[{index}]")
    if data.get("op") not in OPS:
        raise PatchError(f"unknown patch op {data.get('op')!r}; ops: {', '.join(OPS)}", f"$.patches[{index}].op")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [p for p in err["loc"] if p not in OPS]
        field = ".".join(str(p) for p in loc) or "op"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise PatchError(f"{msg} (got {err.get('input')!r})"[:200], f"$.patches[{index}].{field}") from None


def apply_patches(schedule: Schedule, patches: list[dict[str, Any]]) -> Schedule:
    """Apply `patches` in order and return a new schedule (the input is left unchanged)."""
    if not patches:
        return schedule
    doc = schedule.to_json()
    pos_of = {ins["id"]: k for k, ins in enumerate(doc["instructions"])}
    where: dict[int, int] = {}
    for w, q in enumerate(doc["queues"]):
        for ident in q:
            where[ident] = w
    workers = doc["target"]["workers"]
    for k, raw in enumerate(patches):
        p = parse_patch(raw, k)
        at = f"$.patches[{k}]"
        if p.id not in pos_of:
            raise PatchError(f"instruction {p.id} does not exist", f"{at}.id")
        ins = doc["instructions"][pos_of[p.id]]
        counter = getattr(p, "counter", None)
        if counter is not None:
            if counter >= MAX_COUNTERS:
                raise PatchError(f"counter {counter} is past the limit of {MAX_COUNTERS}", f"{at}.counter")
            doc["counters"] = max(doc["counters"], counter + 1)
        if isinstance(p, Move):
            if p.worker >= workers:
                raise PatchError(f"worker {p.worker} is out of range (target.workers: {workers})", f"{at}.worker")
            while len(doc["queues"]) <= p.worker:
                doc["queues"].append([])
            doc["queues"][where[p.id]].remove(p.id)
            dest = doc["queues"][p.worker]
            if p.position is not None and p.position > len(dest):
                raise PatchError(f"position {p.position} is past the end of queue {p.worker} ({len(dest)} long "
                                 "without the moved instruction)", f"{at}.position")
            if p.position is None:
                at_pos = next((k for k, other in enumerate(dest) if other > p.id), len(dest))
            else:
                at_pos = p.position
            dest.insert(at_pos, p.id)
            where[p.id] = p.worker
        elif isinstance(p, AddWait):
            ins.setdefault("waits", []).append({"counter": p.counter, "value": p.value})
        elif isinstance(p, AddSignal):
            ins.setdefault("signals", []).append({"counter": p.counter, "add": p.add})
        else:
            key = "waits" if isinstance(p, SetWait | RemoveWait) else "signals"
            hits = [r for r in ins.get(key, []) if r["counter"] == p.counter]
            if not hits:
                raise PatchError(f"instruction {p.id} has no {key[:-1]} on counter {p.counter}", f"{at}.counter")
            if isinstance(p, SetWait):
                for r in hits:
                    r["value"] = p.value
            else:
                ins[key] = [r for r in ins[key] if r["counter"] != p.counter]
    meta = doc.setdefault("meta", {})
    meta["patches"] = list(meta.get("patches", [])) + [dict(p) for p in patches]
    return parse_schedule(doc)

#: For tools that want the schema or to validate one patch (the agent's briefing).
PatchAdapter = _ADAPTER
