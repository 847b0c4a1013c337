"""Errors that carry where in a schedule they were found, so that every tool reports them in one line."""

from __future__ import annotations


def json_path(loc: tuple | list) -> str:
    """Render a location such as ('instructions', 3, 'waits', 0) as `$.instructions[3].waits[0]`."""
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def shown(value: object, width: int = 60) -> str:
    """A bad value as its file spells it (JSON), cut to one short line for an error message."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= width else text[:width - 3] + "..."


class LocatedError(Exception):
    """An input file's defect with where it was found: `str()` is `FILE: $.json.path: message`, the one line a
    command prints before it exits 2."""

    def __init__(self, message: str, path: str = "$", file: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.file = file

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.path}: {self.message}"


class ScheduleError(LocatedError):
    """A malformed schedule (exit code 2): unreadable, a schema violation or a structural defect."""
