"""Errors that carry where in a schedule they were found, so that every tool reports them in one line."""

from __future__ import annotations


def json_path(loc: tuple | list) -> str:
    """Render a location such as ('instructions', 3, 'waits', 0) as `$.instructions[3].waits[0]`."""
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


class ScheduleError(Exception):
    """A malformed schedule (exit code 2): unreadable, a schema violation or a structural defect."""

    def __init__(self, message: str, path: str = "$", file: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.file = file

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.path}: {self.message}"
