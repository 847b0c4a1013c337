"""The schedule format `megakernel-schedule/1` (docs/design.md §2): typed models, loading with located errors, dumping.

`load_schedule` takes a path or a JSON string and returns a `Schedule`, or raises `ScheduleError` naming the file and
the JSON path of the first defect. Structural checks that need more than one field (ids, queues, counter and buffer
references, ranges, catalogue footprints) live in `validator.structure`.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from megasynth.ir.errors import ScheduleError, json_path

FORMAT = "megakernel-schedule/1"

#: Bounds that keep a schedule packable into the GPU interpreter's int32 tables; larger is "absurd" and malformed.
MAX_INT = 2**31 - 1
MAX_INSTRUCTIONS = 200_000
MAX_WORKERS = 4096
MAX_COUNTERS = 4_000_000
#: Buffer sizes and element ranges are not in those tables (the interpreters index the KV cache in 64 bits): a long
#: context's KV cache passes 2**31 elements (llama-8b at 131072 positions: 2**32). Bounded well inside the int64
#: arrays the validator sweeps element ranges in.
MAX_ELEMENTS = 2**50
MAX_BATCH = 256

NonNeg = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]
Positive = Annotated[StrictInt, Field(ge=1, le=MAX_INT)]
Elements = Annotated[StrictInt, Field(ge=0, le=MAX_ELEMENTS)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Wait(_Closed):
    """Run only once `counters[counter] >= value` (acquire)."""

    counter: NonNeg
    value: NonNeg


class Signal(_Closed):
    """After all writes: `counters[counter] += add` (release)."""

    counter: NonNeg
    add: Positive


class Region(_Closed):
    """A half-open element range `[start, end)` of one named buffer."""

    buffer: StrictStr
    range: tuple[Elements, Elements]

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError(f"range start {value[0]} is after its end {value[1]}")
        return value

    @property
    def start(self) -> int:
        return self.range[0]

    @property
    def end(self) -> int:
        return self.range[1]


class Instruction(_Open):
    id: NonNeg
    op: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    layer: NonNeg | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    waits: list[Wait] = Field(default_factory=list)
    signals: list[Signal] = Field(default_factory=list)
    reads: list[Region] = Field(default_factory=list)
    writes: list[Region] = Field(default_factory=list)
    reduces: list[Region] = Field(default_factory=list)


class ModelRef(_Open):
    name: StrictStr
    config: dict[str, Any]
    max_seq_len: Positive
    #: Sequences decoded per step, each with its own KV cache slot and position; absent: 1.
    batch: Annotated[StrictInt, Field(ge=1, le=MAX_BATCH)] | None = None


class Target(_Open):
    workers: Annotated[StrictInt, Field(ge=1, le=MAX_WORKERS)]
    device: StrictStr | None = None


class Schedule(_Open):
    format: Literal["megakernel-schedule/1"]
    model: ModelRef | None = None
    target: Target
    buffers: dict[StrictStr, Elements] | None = None
    counters: Annotated[StrictInt, Field(ge=0, le=MAX_COUNTERS)]
    instructions: list[Instruction]
    queues: list[list[NonNeg]]
    meta: dict[str, Any] = Field(default_factory=dict)

    def by_id(self) -> dict[int, Instruction]:
        return {ins.id: ins for ins in self.instructions}

    def to_json(self) -> dict[str, Any]:
        """The schedule as a JSON-ready dict (empty optional lists left out, extension keys kept)."""
        return self.model_dump(mode="json", exclude_none=True)


def _describe(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key (this record is closed)"
    if err["type"] == "missing":
        return "missing required field"
    value = err.get("input")
    shown = json.dumps(value) if isinstance(value, (int, float, str, bool)) or value is None else type(value).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{msg} (got {shown})"


def parse_schedule(data: Any, file: str | None = None) -> Schedule:
    """Validate already-decoded JSON into a `Schedule`; the first defect raises `ScheduleError`."""
    if not isinstance(data, dict):
        raise ScheduleError(f"a schedule is a JSON object, got {type(data).__name__}", "$", file)
    ins = data.get("instructions")
    if isinstance(ins, list) and len(ins) > MAX_INSTRUCTIONS:
        raise ScheduleError(f"{len(ins)} instructions is more than the limit of {MAX_INSTRUCTIONS}",
                            "$.instructions", file)
    if data.get("format") != FORMAT and "format" in data:
        raise ScheduleError(f"format must be exactly {FORMAT!r}, got {data['format']!r}", "$.format", file)
    try:
        return Schedule.model_validate(data)
    except ValidationError as exc:
        raise located_error(exc, file) from None


def located_error(exc: ValidationError, file: str | None) -> ScheduleError:
    """A pydantic validation failure as one `ScheduleError`: the deepest located error first (it names the precise
    field), with its JSON path."""
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    return ScheduleError(_describe(err), json_path(loc), file)


def read_file_text(source: str | os.PathLike[str]) -> str:
    """A file's text (gunzipped when it is .gz, as runs keep schedules); an unreadable file is a one-line
    `ScheduleError` naming it."""
    from megasynth.atomic import read_text

    try:
        return read_text(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise ScheduleError(f"cannot read file: {exc.__class__.__name__}: {getattr(exc, 'strerror', None) or exc}",
                            "$", str(source)) from None


def read_json(source: str | os.PathLike[str]) -> Any:
    """A JSON file (plain, or gzip-compressed) decoded; an unreadable file or invalid JSON is a one-line
    `ScheduleError` naming the file."""
    return decode_json(read_file_text(source), str(source))


def decode_json(text: str, file: str | None = None) -> Any:
    """JSON text decoded; invalid JSON is a one-line `ScheduleError` with its line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", "$", file) from None
    except RecursionError:
        raise ScheduleError("invalid JSON: nested too deeply", "$", file) from None


def load_schedule(source: str | os.PathLike[str]) -> Schedule:
    """Load a schedule from a file path (plain JSON, or gzip-compressed as runs keep it); every failure is a one-line
    `ScheduleError`."""
    return parse_schedule(read_json(source), str(source))


def loads_schedule(text: str, file: str | None = None) -> Schedule:
    return parse_schedule(decode_json(text, file), file)


def dump_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write a schedule atomically (temporary file + rename), so a crash never leaves half a file; gzip-compressed
    when the name ends in `.gz`."""
    from megasynth.atomic import write_json_file_atomic

    write_json_file_atomic(path, schedule.to_json())


def schema() -> dict[str, Any]:
    """The published JSON Schema of the format (`validate --schema`)."""
    out = Schedule.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["$id"] = "https://megasynth.dev/schema/megakernel-schedule-1.json"
    out["title"] = "megakernel-schedule/1"
    return out
