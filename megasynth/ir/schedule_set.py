"""The schedule-set format `megakernel-schedule-set/1`: one schedule per context range, the runtime picking by position.

A decode step's best schedule depends on the context: at 1k tokens attention is a sliver of the step, at 128k it moves
more bytes than the weights. A set names, in increasing order, ranges of KV positions and the schedule that serves each:
range k covers the positions `up_to[k-1] <= pos < up_to[k]` (the first from 0), that is contexts of up to `up_to[k]`
tokens. Every member decodes the same model with the same KV cache (`model.config`, `model.max_seq_len`,
`model.batch` equal), and the last range ends at `max_seq_len`, so every position the cache holds has a schedule.

Each member is an ordinary schedule, proven for every position below `max_seq_len` (the validator's guarantee for any
schedule), so it is proven for its own range in particular; swapping members between steps changes only the tables
the interpreter walks, never the buffers (the KV cache stays where it is), so no recompile is needed.

Member paths are relative to the set file. `load_schedule_set` raises `ScheduleError` naming the set file (or the
member file) and the JSON path of the first defect.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import MAX_INT, Schedule, load_schedule, located_error, parse_schedule, read_json

SET_FORMAT = "megakernel-schedule-set/1"


class RangeRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Exclusive bound of the KV positions this member serves (contexts of up to `up_to` tokens).
    up_to: Annotated[StrictInt, Field(ge=1, le=MAX_INT)]
    #: The member schedule's file, relative to the set file (.json or .json.gz).
    schedule: Annotated[StrictStr, Field(min_length=1)]


class SetFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: Literal["megakernel-schedule-set/1"]
    ranges: Annotated[list[RangeRef], Field(min_length=1, max_length=64)]
    meta: dict[str, Any] = Field(default_factory=dict)


@dataclass
class ScheduleSet:
    """Loaded and checked: `bounds[k]` is range k's `up_to`, `schedules[k]` its schedule, `files[k]` its path."""

    bounds: list[int]
    schedules: list[Schedule]
    files: list[str]
    file: str | None = None
    meta: dict[str, Any] | None = None

    @property
    def max_seq_len(self) -> int:
        return self.bounds[-1]

    def index(self, pos: int) -> int:
        """The range that serves KV position `pos` (0 <= pos < max_seq_len)."""
        if not 0 <= pos < self.bounds[-1]:
            raise ValueError(f"position {pos} is outside the set's positions [0, {self.bounds[-1]})")
        return bisect_right(self.bounds, pos)

    def pick(self, pos: int) -> Schedule:
        """The schedule that serves KV position `pos`."""
        return self.schedules[self.index(pos)]

    def ranges(self) -> list[tuple[int, int]]:
        """Each member's positions as [start, end)."""
        return list(zip([0, *self.bounds[:-1]], self.bounds, strict=True))


def is_schedule_set(data: Any) -> bool:
    """Whether decoded JSON claims to be a schedule set (by its `format`)."""
    return isinstance(data, dict) and data.get("format") == SET_FORMAT


def parse_schedule_set(data: Any, file: str | None = None) -> ScheduleSet:
    """Validate a decoded set file, load every member (paths relative to the set file's folder) and check that they
    form a set; the first defect raises `ScheduleError`."""
    if not isinstance(data, dict):
        raise ScheduleError(f"a schedule set is a JSON object, got {type(data).__name__}", "$", file)
    try:
        doc = SetFile.model_validate(data)
    except ValidationError as exc:
        raise located_error(exc, file) from None
    base = Path(file).parent if file else Path.cwd()
    bounds = [r.up_to for r in doc.ranges]
    for k in range(1, len(bounds)):
        if bounds[k] <= bounds[k - 1]:
            raise ScheduleError(f"up_to {bounds[k]} does not follow {bounds[k - 1]}: ranges go in increasing order",
                                f"$.ranges[{k}].up_to", file)
    schedules, files = [], []
    for k, ref in enumerate(doc.ranges):
        path = ref.schedule if os.path.isabs(ref.schedule) else str(base / ref.schedule)
        if not os.path.isfile(path):
            raise ScheduleError(f"member schedule {ref.schedule!r} not found (looked for {path})",
                                f"$.ranges[{k}].schedule", file)
        sched = load_schedule(path)  # its own defects name the member file
        if sched.model is None:
            raise ScheduleError("a member of a set needs `model` (its config, max_seq_len and batch are the set's)",
                                "$.model", path)
        schedules.append(sched)
        files.append(path)
    first = schedules[0].model
    assert first is not None
    for k, sched in enumerate(schedules[1:], 1):
        m = sched.model
        assert m is not None
        for key, mine, theirs in (("config", m.config, first.config), ("max_seq_len", m.max_seq_len, first.max_seq_len),
                                  ("batch", m.batch or 1, first.batch or 1)):
            if mine != theirs:
                raise ScheduleError(f"model.{key} differs from the first member's ({files[0]}): every member decodes "
                                    "the same model with the same KV cache", f"$.model.{key}", files[k])
    if bounds[-1] != first.max_seq_len:
        raise ScheduleError(f"the last range ends at {bounds[-1]}, but the members' KV cache holds max_seq_len "
                            f"{first.max_seq_len} positions: the last up_to must be {first.max_seq_len}",
                            f"$.ranges[{len(bounds) - 1}].up_to", file)
    return ScheduleSet(bounds, schedules, files, file, doc.meta)


def load_schedule_set(source: str | os.PathLike[str]) -> ScheduleSet:
    """Load a set file and its members; every failure is a one-line `ScheduleError`."""
    return parse_schedule_set(read_json(source), str(source))


def load_schedule_or_set(source: str | os.PathLike[str]) -> Schedule | ScheduleSet:
    """A schedule file or a set file (told apart by `format`), read once."""
    data = read_json(source)
    return parse_schedule_set(data, str(source)) if is_schedule_set(data) else parse_schedule(data, str(source))


def set_document(bounds: list[int], files: list[str], set_file: str | os.PathLike[str],
                 meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON of a set whose members are `files` (written relative to the set file's folder where they lie under
    it)."""
    base = Path(set_file).resolve().parent
    rel = []
    for f in files:
        p = Path(f).resolve()
        rel.append(str(p.relative_to(base)) if p.is_relative_to(base) else str(p))
    return {"format": SET_FORMAT, "ranges": [{"up_to": b, "schedule": r} for b, r in zip(bounds, rel, strict=True)],
            "meta": meta or {}}
