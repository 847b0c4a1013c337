"""The project's files on disk: atomic writes (a temporary file in the same folder, renamed into place, so a crash
never leaves half a file), plain or gzip-compressed, and the one reader of text that may be gzip-compressed (runs keep
their large schedules and traces as `.json.gz`)."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any

GZIP_MAGIC = b"\x1f\x8b"


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; results are meant to be shared like any other file
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_gz_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` gzip-compressed to `path` (a `.gz` name) atomically. The header carries no time, so equal text
    gives equal bytes (a committed run does not change when it is rewritten)."""
    write_bytes_atomic(path, gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0))


def read_text(path: str | os.PathLike[str]) -> str:
    """A file's UTF-8 text, decompressed when it is gzip (told by its magic bytes, not its name). Raises OSError
    (a truncated or corrupt gzip file included) or UnicodeDecodeError."""
    data = Path(path).read_bytes()
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except EOFError as exc:
            raise OSError(f"{Path(path).name}: truncated gzip file ({exc})") from None
    return data.decode("utf-8")


def write_json_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n")


def write_json_file_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """Write JSON `data` to `path` atomically, gzip-compressed (compact, as runs keep it) when the name ends in
    `.gz`, so a file's name never lies about its bytes; `read_text` reads either."""
    if str(path).endswith(".gz"):
        write_gz_atomic(path, json.dumps(data, separators=(",", ":")) + "\n")
    else:
        write_json_atomic(path, data, indent=indent)
