"""The runs/<run>/ folder a search writes. Every write is atomic (megasynth/atomic.py), and the files on disk are the
source of truth, so a killed search resumes without losing accepted results.

Layout:
  run.json                                  command, versions, GPU, model, seed, options
  study.db                                  the Optuna study (SQLite) unless --storage names another
  candidates/<id>/timing.json               every accepted candidate: its timing, and what reproduces it (strategy,
                                            patches, proposer, schedule_key, the lowering's version) ...
  candidates/<id>/validation.json           ... its validator report ...
  candidates/<id>/queues.json.gz            ... its final worker queues (the part of a schedule that depends on the
                                            cost-model parameters, so that a refit model still rebuilds it) ...
  candidates/<id>/schedule.json.gz          ... and, for the `KEEP_SCHEDULES` fastest only, the whole schedule
  candidates.json.gz                        the accepted candidates of a packed run (`synth runs pack`), each with
                                            exactly what its folder held: {"format": "megasynth-candidates/1",
                                            "candidates": {"<id>": {"timing", "validation", "queues", "schedule"}}}
                                            (a key is absent where the folder had no such file). A packed run that
                                            is resumed writes new candidates into folders beside it; where an id is
                                            in both, the folder wins (packing again moves it into the pack)
  rejected/<id>.json                        candidates not accepted: rejected (the counterexample), malformed (the
                                            error), or screened by the cost model (its estimate; never validated)
  leaderboard.json                          {"entries": [...accepted, fastest first..., ...screened and rejected]}
  best/{schedule.json.gz, validation.json, timing.json, trace.json.gz}   the fastest accepted candidate (trace: GPU,
                                            or the cost model's, labelled `estimated: true`)

A whole schedule is megabytes of JSON (llama-1b ~2 MB, llama-8b ~4 MB) but rebuilds in about a second from its
strategy and patches, so a run keeps few: `RunDir.load_candidate` rebuilds the others and checks the result against
the recorded schedule_key. Large files are gzip-compressed (`.json.gz`, ~20x smaller); readers also accept the plain
`.json` of runs written before (`stored`, `read_stored`).

Readers take an accepted candidate's files through `RunDir.candidate` (folder or pack alike), never from the paths
above.

Candidate ids are `c0000`, `c0001`, ... (the slot of the study's claim, `megasynth.runs.study`); `c0000` is the naive
baseline of the run.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megasynth.atomic import read_text, write_gz_atomic, write_json_atomic
from megasynth.ir.schedule import Schedule

BASELINE = "c0000"
#: The accepted candidates of a run that keep their whole schedule (schedule.json.gz), fastest first; best/ has its own.
KEEP_SCHEDULES = 3
QUEUES_FORMAT = "megasynth-queues/1"
#: The packed form of a run's accepted candidates, at the run's root.
PACK = "candidates.json.gz"
PACK_FORMAT = "megasynth-candidates/1"
#: What a candidate folder holds (each `<name>.json`, or `.json.gz`), under the same names in a pack entry.
CANDIDATE_FILES = ("timing", "validation", "queues", "schedule")


def candidate_id(number: int) -> str:
    return f"c{number:04d}"


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name a run folder under --runs-dir (None when it can). A run is one folder directly under
    the runs folder, so that `synth runs list` sees it and nothing is written outside: no path separator, no `..`,
    no leading dot (hidden, `.` or `..`), not empty."""
    if not name:
        return "a run name cannot be empty"
    seps = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if any(s in name for s in seps):
        return "a run name is one folder under --runs-dir: no path separators"
    if ".." in name:
        return "a run name cannot contain '..'"
    if name.startswith("."):
        return "a run name cannot start with a dot"
    if "\0" in name or any(not ch.isprintable() for ch in name):
        return "a run name cannot contain control characters"
    return None


def versions() -> dict[str, str | None]:
    """Versions of what produced a run (missing packages are None; torch is not imported here)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("megasynth", "torch", "triton", "z3-solver", "optuna", "pydantic"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@functools.cache
def lowering_version() -> dict[str, str | None]:
    """What a rebuild from a strategy depends on: the package version, and a digest of the lowering's and the IR's
    sources and the cost-model parameters the lowering balances with. Equal digests rebuild the same schedule; a
    different one may, and `RunDir.load_candidate` checks."""
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    sources = [*(root / "lowering").glob("*.py"), *(root / "ir").glob("*.py"), root / "data" / "h200_costmodel.json"]
    for f in sorted(sources):
        try:
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        except OSError:
            continue
    try:
        package: str | None = metadata.version("megasynth")
    except metadata.PackageNotFoundError:
        package = None
    return {"megasynth": package, "digest": digest.hexdigest()[:16]}


def schedule_key(schedule: Schedule) -> str:
    """Digest of what executes (instructions, queues, counters; not meta): equal keys = the same candidate."""
    from megasynth.trace import schedule_sha256

    doc = schedule.to_json()
    return schedule_sha256({k: doc[k] for k in ("instructions", "queues", "counters")})


def screened_text(estimate_ms: float | None) -> str:
    """How a candidate the cost model screened out (never validated, never timed) is shown everywhere: CLI,
    leaderboard, report, the agent's briefing. It is not a rejection: nothing was found wrong with it."""
    return f"screened (estimated {estimate_ms:.4f} ms)" if estimate_ms is not None else "screened"


def status_of(record: dict[str, Any]) -> str:
    """A rejected/ record's status: `screened` (the cost model left it out), `malformed` (it did not build), `failed`
    (the worker process preparing it died), or `rejected` (the validator, or the GPU check, refused it)."""
    reason = record.get("reason")
    return {"screened": "screened", "malformed": "malformed", "worker_died": "failed"}.get(str(reason), "rejected")


# -- files: gzip-compressed when large, plain JSON accepted --------------------------------------------------------
def stored(path: str | os.PathLike[str]) -> Path | None:
    """The file a run holds for `path` (a `.json` name): `<path>.gz` as runs write it, or the plain `path` of older
    runs; None when there is neither."""
    p = Path(path)
    for f in (p.with_name(p.name + ".gz"), p):
        if f.is_file():
            return f
    return None


def read_stored_text(path: str | os.PathLike[str]) -> str:
    """The text of `path` as `stored` finds it (decompressed); FileNotFoundError when there is none, OSError or
    UnicodeDecodeError when it cannot be read (a truncated .gz is an OSError)."""
    f = stored(path)
    if f is None:
        raise FileNotFoundError(2, "No such file", str(path))
    return read_text(f)


def read_stored(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of `path` as `stored` finds it, or None when it is missing or unreadable."""
    try:
        return json.loads(read_stored_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def write_stored(path: Path, doc: Any) -> None:
    """Write JSON `doc` for `path` (a `.json` name) as `<path>.gz`, compact, and drop a plain `path` left by an older
    run so that readers cannot pick a stale one."""
    write_gz_atomic(path.with_name(path.name + ".gz"), json.dumps(doc, separators=(",", ":")) + "\n")
    path.unlink(missing_ok=True)


def _drop_stored(path: Path) -> None:
    path.with_name(path.name + ".gz").unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def encode_queues(queues: list[list[int]]) -> dict[str, Any]:
    """Queues as deltas between neighbours (lowered queues step by constants, so they compress to almost nothing)."""
    return {"format": QUEUES_FORMAT, "encoding": "delta",
            "queues": [[q[0], *(b - a for a, b in zip(q, q[1:], strict=False))] if q else [] for q in queues]}


def decode_queues(doc: Any, where: str = "queues.json.gz") -> list[list[int]]:
    """The queues of an `encode_queues` document; a `ScheduleError` naming `where` for anything else."""
    from itertools import accumulate

    from megasynth.ir.errors import ScheduleError

    if not isinstance(doc, dict) or doc.get("format") != QUEUES_FORMAT or doc.get("encoding") != "delta" \
            or not isinstance(doc.get("queues"), list):
        raise ScheduleError(f"not a {QUEUES_FORMAT} document with delta-encoded queues", "$", where)
    out = []
    for k, q in enumerate(doc["queues"]):
        if not isinstance(q, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in q):
            raise ScheduleError("a queue is a list of integers", f"$.queues[{k}]", where)
        out.append(list(accumulate(q)))
    return out


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _measured_first(timing: dict[str, Any]) -> tuple[bool, float]:
    """Rank of an accepted candidate: GPU measurements before estimates (they do not compare), then the time."""
    return bool(timing.get("estimated", True)), float(timing["ms"])


class PackError(ValueError):
    """A run's candidates cannot be read or packed: an unreadable or foreign candidates.json.gz, or a candidate file
    that cannot be read. One line, naming the file, because silently skipping it would lose accepted candidates."""

    def __init__(self, file: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = str(file)
        self.reason = reason


#: path -> ((inode, size, mtime), candidates) of packs already read: a pack is megabytes (its kept schedules) and is
#: rewritten only by renaming a new file into place, so the inode, size and time tell when it changed.
_PACKS: dict[str, tuple[tuple[int, int, int], dict[str, dict[str, Any]]]] = {}


def read_pack(path: Path) -> dict[str, dict[str, Any]]:
    """candidate id -> its documents (`CANDIDATE_FILES`, those it had) of a pack, {} when there is none. The
    documents are shared between callers: copy before changing them. A `PackError` for anything but a pack."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise PackError(path, f"cannot read ({exc.strerror or exc})") from None
    sig = (st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _PACKS.get(str(path))
    if hit is not None and hit[0] == sig:
        return hit[1]
    try:
        doc = json.loads(read_text(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise PackError(path, f"cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    except json.JSONDecodeError as exc:
        raise PackError(path, f"invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != PACK_FORMAT or not isinstance(doc.get("candidates"), dict):
        raise PackError(path, f"not a {PACK_FORMAT} document")
    for cid, entry in doc["candidates"].items():
        timing = entry.get("timing") if isinstance(entry, dict) else None
        if not isinstance(timing, dict) or not isinstance(timing.get("ms"), int | float) \
                or not set(entry) <= set(CANDIDATE_FILES):
            raise PackError(path, f"$.candidates.{cid}: not an accepted candidate (timing with ms, and only "
                            f"{', '.join(CANDIDATE_FILES)})")
    _PACKS[str(path)] = (sig, doc["candidates"])
    return doc["candidates"]


def _copy(doc: Any) -> Any:
    return json.loads(json.dumps(doc)) if isinstance(doc, dict | list) else doc


@dataclass(frozen=True)
class Candidate:
    """An accepted candidate's stored documents, from its folder or from the run's pack alike, so that no reader
    needs to know how the run keeps it."""

    cid: str
    timing: dict[str, Any]
    folder: Path | None = None  # candidates/<id>/, or None when it is packed
    pack: Path | None = None  # the run's candidates.json.gz when it is packed
    entry: dict[str, Any] | None = None  # its entry in the pack

    @property
    def packed(self) -> bool:
        return self.folder is None

    def file(self, name: str) -> Path | None:
        """The file holding document `name` (`CANDIDATE_FILES`): in its folder, or the pack; None when it has none."""
        if self.folder is None:
            return self.pack if self.entry is not None and name in self.entry else None
        return stored(self.folder / f"{name}.json")

    def where(self, name: str) -> str:
        """Where document `name` is, for messages: a file of its folder, or the pack and the entry."""
        if self.folder is None:
            return f"{self.pack} ({self.cid}/{name})"
        return str(self.file(name) or self.folder / f"{name}.json{'.gz' if name in ('queues', 'schedule') else ''}")

    def document(self, name: str) -> Any:
        """Document `name` (`CANDIDATE_FILES`), or None when the candidate has none (or, in a folder, an unreadable
        one). A packed schedule or queues document is shared: copy it before changing it."""
        if name == "timing":
            return self.timing
        if self.folder is None:
            doc = (self.entry or {}).get(name)
            return _copy(doc) if name == "validation" else doc
        return read_stored(self.folder / f"{name}.json")

    def documents(self) -> dict[str, Any]:
        """Every document it has, strictly read (what a pack holds of it): a `PackError` naming a file that is
        there but cannot be read, so that packing never drops what a folder held."""
        if self.folder is None:
            return dict(self.entry or {})
        out: dict[str, Any] = {}
        for name in CANDIDATE_FILES:
            f = stored(self.folder / f"{name}.json")
            if f is None:
                continue
            try:
                out[name] = json.loads(read_text(f))
            except (OSError, UnicodeDecodeError) as exc:
                raise PackError(f, f"cannot read ({getattr(exc, 'strerror', None) or exc})") from None
            except json.JSONDecodeError as exc:
                raise PackError(f, f"invalid JSON ({exc.msg} at line {exc.lineno})") from None
        return out


@dataclass
class Packed:
    """What `RunDir.pack` did."""

    pack: Path
    packed: list[str]  # candidates moved from folders into the pack
    total: int  # candidates in the pack now
    bytes_before: int  # the pack and the packed folders' files, before
    bytes_after: int  # the pack, after
    left: list[str]  # folders left as they were: no timing.json (a candidate still being written)


class RunDir:
    """One run folder. Methods write whole files atomically; readers never see half a file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # -- creation ---------------------------------------------------------------------------------------------
    @staticmethod
    def new_name(model: str, seed: int) -> str:
        return f"{model}-{_dt.datetime.now(_dt.UTC).strftime('%Y%m%d-%H%M%S')}-s{seed}"

    def init(self, info: dict[str, Any]) -> None:
        """Write run.json (command, versions, started) unless it exists (a resumed or shared run keeps its own)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / "run.json").exists():
            return
        doc = {"command": " ".join(sys.argv), "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
               "versions": versions(), **info}
        write_json_atomic(self.path / "run.json", doc)

    @property
    def info(self) -> dict[str, Any]:
        return _read(self.path / "run.json") or {}

    def update_info(self, **fields: Any) -> None:
        write_json_atomic(self.path / "run.json", {**self.info, **fields})

    # -- candidates -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Processes sharing the run folder decide what best/ and the kept schedules are under one lock."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".best.lock", "a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when the process dies
            yield

    def save_candidate(self, cid: str, schedule: Schedule, validation: dict[str, Any], timing: dict[str, Any]) -> None:
        """An accepted candidate: its validation, its queues, its whole schedule when it is among the
        `KEEP_SCHEDULES` fastest (pushing the slowest kept one out of its folder; a packed one keeps it, the pack
        is not rewritten for a schedule), and timing.json last, stamped with the lowering's version: a candidate
        counts once its timing is there. Always into a folder, also in a packed run (see the layout above)."""
        d = self.path / "candidates" / cid
        timing = {**timing, "lowering": lowering_version()}
        write_json_atomic(d / "validation.json", validation)
        write_gz_atomic(d / "queues.json.gz", json.dumps(encode_queues(schedule.queues), separators=(",", ":")))
        with self._locked():
            ranked = sorted({**self.accepted(), cid: timing}.items(), key=lambda kv: _measured_first(kv[1]))
            keep = {c for c, _ in ranked[:KEEP_SCHEDULES]}
            if cid in keep:
                write_stored(d / "schedule.json", schedule.to_json())
            write_json_atomic(d / "timing.json", timing)
            for other, t in ranked[KEEP_SCHEDULES:]:
                if other != cid and "strategy" in t:  # rebuildable: only then may its schedule go
                    (self.path / "candidates" / other / "schedule.json.gz").unlink(missing_ok=True)

    def save_rejected(self, cid: str, record: dict[str, Any]) -> None:
        write_json_atomic(self.path / "rejected" / f"{cid}.json", record)

    def _in_folder(self, cid: str) -> Candidate | None:
        d = self.path / "candidates" / cid
        t = _read(d / "timing.json")
        return Candidate(cid, t, folder=d) if isinstance(t, dict) and isinstance(t.get("ms"), int | float) else None

    def candidates(self) -> dict[str, Candidate]:
        """Every accepted candidate on disk, by id: those in folders (a folder that has its timing.json) and those in
        the pack, the folder winning where an id is in both. A `PackError` when the pack cannot be read."""
        pack = self.path / PACK
        out = {cid: Candidate(cid, _copy(e["timing"]), pack=pack, entry=e) for cid, e in read_pack(pack).items()}
        for d in (self.path / "candidates").glob("c*"):
            c = self._in_folder(d.name)
            if c is not None:
                out[d.name] = c
        return dict(sorted(out.items()))

    def candidate(self, cid: str) -> Candidate | None:
        """One accepted candidate's documents (its folder's, else the pack's), or None when it is not one."""
        c = self._in_folder(cid)
        if c is not None:
            return c
        entry = read_pack(self.path / PACK).get(cid)
        return Candidate(cid, _copy(entry["timing"]), pack=self.path / PACK, entry=entry) if entry else None

    def candidate_ids(self) -> list[str]:
        """The ids of every candidate folder (complete or not) and every packed candidate: a cheap count that reads
        no timing.json. A `PackError` when the pack cannot be read."""
        folders = {d.name for d in (self.path / "candidates").glob("*") if d.is_dir()}
        return sorted(folders | set(read_pack(self.path / PACK)))

    def accepted(self) -> dict[str, dict[str, Any]]:
        """candidate id -> timing.json of every accepted candidate on disk (folders and pack alike)."""
        return {cid: c.timing for cid, c in self.candidates().items()}

    def rejected(self) -> dict[str, dict[str, Any]]:
        out = {}
        for f in sorted((self.path / "rejected").glob("c*.json")):
            r = _read(f)
            if isinstance(r, dict):
                out[f.stem] = r
        return out

    def outcome(self, cid: str) -> dict[str, Any] | None:
        """A candidate's files as one document, `{"accepted", "record", "validation"}` (record: timing.json when it
        was accepted, else rejected/<id>.json), or None when it has neither. What the study keeps of a candidate."""
        c = self.candidate(cid)
        if c is not None:
            return {"accepted": True, "record": c.timing, "validation": c.document("validation")}
        record = _read(self.path / "rejected" / f"{cid}.json")
        if isinstance(record, dict):
            return {"accepted": False, "record": record, "validation": record.get("validation")}
        return None

    def save_outcome(self, cid: str, doc: dict[str, Any]) -> None:
        """Write a candidate from its `outcome` document (a candidate known from the study, not from files): an
        accepted one without its schedule or queues (`load_candidate` rebuilds it from the strategy and patches)."""
        if doc.get("accepted"):
            d = self.path / "candidates" / cid
            if doc.get("validation") is not None:
                write_json_atomic(d / "validation.json", doc["validation"])
            write_json_atomic(d / "timing.json", doc["record"])
        else:
            self.save_rejected(cid, doc["record"])

    def discard(self, cid: str) -> None:
        """Remove a candidate id's files, and best/ when it is that candidate: what a process that died holding the
        id's claim left behind, before the id is used again."""
        import shutil

        shutil.rmtree(self.path / "candidates" / cid, ignore_errors=True)
        (self.path / "rejected" / f"{cid}.json").unlink(missing_ok=True)
        if cid in read_pack(self.path / PACK):
            with self._locked():
                self._write_pack({c: e for c, e in read_pack(self.path / PACK).items() if c != cid})
        best = _read(self.path / "best" / "timing.json")
        if isinstance(best, dict) and best.get("candidate") == cid:
            shutil.rmtree(self.path / "best", ignore_errors=True)

    def candidate_schedule(self, cid: str) -> Path | None:
        """The file holding an accepted candidate's whole schedule (schedule.json.gz, or an older run's
        schedule.json), or None when the run keeps only what rebuilds it, or keeps it in the pack (not a schedule
        file: `load_candidate` reads it from there, `Candidate.file("schedule")` says whether there is one)."""
        c = self._in_folder(cid)
        if c is None and cid in read_pack(self.path / PACK):
            return None
        return stored(self.path / "candidates" / cid / "schedule.json")

    def load_candidate(self, cid: str) -> Schedule:
        """An accepted candidate's schedule: its stored schedule, or, where the run did not keep it, the schedule
        rebuilt from the strategy and patches in its timing.json, with the queues of its queues.json.gz when there
        is one (they follow the cost model the lowering balanced with). A `ScheduleError` if the rebuild is not the
        schedule that was timed (its schedule_key), naming the lowering that wrote it and this one."""
        from megasynth.ir.errors import ScheduleError
        from megasynth.ir.schedule import loads_schedule, parse_schedule

        try:
            path = self.candidate_schedule(cid)
            c = self.candidate(cid)
        except PackError as exc:
            raise ScheduleError(exc.reason, "$", exc.file) from None
        if path is not None:
            try:
                return loads_schedule(read_stored_text(path), str(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise ScheduleError(f"cannot read file: {exc}", "$", str(path)) from None
        if c is not None and c.packed and c.file("schedule") is not None:
            return parse_schedule(c.document("schedule"), c.where("schedule"))
        where = c.where("timing") if c is not None else str(self.path / "candidates" / cid / "timing.json")
        timing = c.timing if c is not None else None
        if not isinstance(timing, dict) or "strategy" not in timing:
            raise ScheduleError("no schedule and no strategy in timing.json to rebuild it from", "$", where)
        from megasynth.lowering.lower import lower
        from megasynth.lowering.models import get_model, with_batch
        from megasynth.lowering.patches import apply_patches
        from megasynth.lowering.strategy import parse_strategy

        model = self.info.get("model") or "llama-1b"
        proposer = timing.get("proposer") or "naive"
        spec = with_batch(get_model(model, self.info.get("max_seq_len")),  # None in runs that predate --max-seq-len
                          int(self.info.get("batch") or 1))
        schedule = lower(spec, int(timing.get("workers") or self.info.get("workers") or 132),
                         parse_strategy(timing["strategy"], where), proposer)
        schedule = apply_patches(schedule, timing.get("patches") or [])
        doc = schedule.to_json()
        doc["meta"] = {**doc.get("meta", {}), "proposer": proposer, "parent": timing.get("parent"),
                       "rationale": timing.get("rationale", "")}
        if c is not None and c.file("queues") is not None:
            doc["queues"] = decode_queues(c.document("queues"), c.where("queues"))
        schedule = parse_schedule(doc, where)
        if timing.get("schedule_key") and schedule_key(schedule) != timing["schedule_key"]:
            then = timing.get("lowering") or {}
            raise ScheduleError(
                "the schedule rebuilt from its strategy differs from the one timed (schedule_key): it was lowered by "
                f"megasynth {then.get('megasynth', '?')} (lowering {then.get('digest', 'unrecorded')}), this is "
                f"megasynth {lowering_version()['megasynth']} (lowering {lowering_version()['digest']})",
                "$.schedule_key", where)
        return schedule

    def copy_candidate(self, cid: str, to: RunDir) -> None:
        """Copy an accepted candidate into `to` as a folder, whether this run keeps it in a folder or packed. A
        `PackError` when it is not an accepted candidate here or its files cannot be read."""
        import shutil

        c = self.candidate(cid)
        if c is None:
            raise PackError(self.path, f"{cid} is not an accepted candidate of this run")
        d = to.path / "candidates" / cid
        if c.folder is not None:
            shutil.copytree(c.folder, d)
            return
        docs = c.documents()
        if "validation" in docs:
            write_json_atomic(d / "validation.json", docs["validation"])
        if "queues" in docs:
            write_gz_atomic(d / "queues.json.gz", json.dumps(docs["queues"], separators=(",", ":")))
        if "schedule" in docs:
            write_stored(d / "schedule.json", docs["schedule"])
        write_json_atomic(d / "timing.json", docs["timing"])  # last: the candidate counts once it is there

    # -- the packed form ------------------------------------------------------------------------------------
    def _write_pack(self, entries: dict[str, dict[str, Any]]) -> None:
        doc = {"format": PACK_FORMAT, "candidates": dict(sorted(entries.items()))}
        write_gz_atomic(self.path / PACK, json.dumps(doc, separators=(",", ":")) + "\n")

    def pack(self) -> Packed:
        """Move every complete candidate folder into candidates.json.gz (merging with the candidates already
        there, a folder replacing its id's entry): one file instead of three or four per candidate. The pack is
        written atomically and read back before any folder is removed, so an interruption loses nothing. A
        `PackError` naming the file, before anything changes, when a candidate file cannot be read or a folder
        holds a file that is not a candidate's. Meant for a run no search is writing to."""
        pack = self.path / PACK
        known = {"timing.json", "validation.json", "queues.json", "queues.json.gz", "schedule.json",
                 "schedule.json.gz"}
        with self._locked():
            entries = dict(read_pack(pack))
            before = pack.stat().st_size if pack.is_file() else 0
            moved: list[Path] = []
            left: list[str] = []
            for d in sorted((self.path / "candidates").glob("*")):
                if not d.is_dir():
                    raise PackError(d, "not a candidate folder (packing would lose it)")
                files = sorted(d.iterdir())
                stray = next((f for f in files if f.name not in known or not f.is_file()), None)
                if stray is not None:
                    raise PackError(stray, "not a candidate file (packing would lose it)")
                if not (d / "timing.json").is_file():
                    left.append(d.name)
                    continue
                docs = Candidate(d.name, {}, folder=d).documents()
                if not isinstance(docs["timing"], dict) or not isinstance(docs["timing"].get("ms"), int | float):
                    raise PackError(d / "timing.json", "not an accepted candidate's timing (no ms)")
                entries[d.name] = docs
                before += sum(f.stat().st_size for f in files)
                moved.append(d)
            if moved:
                self._write_pack(entries)
                if read_pack(pack) != entries:
                    raise PackError(pack, "does not read back as written; the candidate folders are kept")
                for d in moved:
                    for f in d.iterdir():
                        f.unlink()
                    d.rmdir()
                with contextlib.suppress(OSError):
                    (self.path / "candidates").rmdir()  # only when nothing is left in it
        after = pack.stat().st_size if pack.is_file() else 0
        return Packed(pack, [d.name for d in moved], len(entries), before, after if moved else before, left)

    # -- best and leaderboard ---------------------------------------------------------------------------------
    def best_ms(self) -> float | None:
        t = _read(self.path / "best" / "timing.json")
        return t.get("ms") if isinstance(t, dict) else None

    def has_best_schedule(self) -> bool:
        """Whether best/ holds a schedule (compressed, or an older run's plain one)."""
        return stored(self.path / "best" / "schedule.json") is not None

    def best_trace(self) -> dict[str, Any] | None:
        """best/'s trace (trace.json.gz, or an older run's trace.json), None when missing or unreadable."""
        doc = read_stored(self.path / "best" / "trace.json")
        return doc if isinstance(doc, dict) else None

    def save_best(self, cid: str, schedule: Schedule, validation: dict[str, Any], timing: dict[str, Any],
                  trace: dict[str, Any] | None, replace: bool = False) -> bool:
        """Replace best/ (schedule, validation and trace first, timing last) unless it holds a candidate at least as
        fast (`replace`: whatever it holds; the finals' winner). Processes sharing the run folder compare and write
        under a lock (`.best.lock`), so two that promote at once cannot leave the slower one in best/. Returns
        whether best/ was replaced."""
        with self._locked():
            d = self.path / "best"
            on_disk = self.best_ms()
            if not replace and on_disk is not None and on_disk <= timing["ms"] and self.has_best_schedule():
                return False
            write_stored(d / "schedule.json", schedule.to_json())
            write_json_atomic(d / "validation.json", validation)
            if trace is not None:
                write_stored(d / "trace.json", trace)
            else:
                _drop_stored(d / "trace.json")  # the previous best's trace is not this one's
            write_json_atomic(d / "timing.json", {**timing, "lowering": lowering_version(), "candidate": cid})
        return True

    def best_candidate(self) -> str | None:
        """The candidate best/ holds (its timing.json's), None when there is none."""
        t = _read(self.path / "best" / "timing.json")
        return t.get("candidate") if isinstance(t, dict) else None

    def annotate_best(self, cid: str, **fields: Any) -> bool:
        """Add `fields` to best/timing.json when best/ holds `cid`; returns whether it did."""
        with self._locked():
            t = _read(self.path / "best" / "timing.json")
            if not isinstance(t, dict) or t.get("candidate") != cid:
                return False
            write_json_atomic(self.path / "best" / "timing.json", {**t, **fields})
        return True

    def finals(self) -> dict[str, Any] | None:
        """finals.json (`search.finals`), None when the run has none or it cannot be read."""
        doc = _read(self.path / "finals.json")
        return doc if isinstance(doc, dict) and isinstance(doc.get("entries"), list) else None

    def save_finals(self, doc: dict[str, Any]) -> None:
        write_json_atomic(self.path / "finals.json", doc)

    def best_per_proposer(self) -> dict[str, tuple[str, float]]:
        """proposer -> (candidate, ms) of its fastest accepted candidate (estimates do not rank against GPU
        measurements: in a run with measurements only measured candidates count)."""
        acc = self.accepted()
        measured = any(not t.get("estimated", True) for t in acc.values())
        out: dict[str, tuple[str, float]] = {}
        for cid, t in acc.items():
            who = t.get("proposer") or "?"
            if (not measured or not t.get("estimated", True)) and (who not in out or t["ms"] < out[who][1]):
                out[who] = (cid, t["ms"])
        return out

    def write_leaderboard(self) -> dict[str, Any]:
        """Rebuild leaderboard.json from the files on disk (so concurrent or resumed searches agree)."""
        acc = self.accepted()
        base = acc.get(BASELINE, {}).get("ms")
        measured = any(not t.get("estimated", True) for t in acc.values())
        rows = []
        for cid, t in acc.items():
            if measured and t.get("estimated", True):
                continue  # estimates do not rank against GPU measurements
            rows.append({"candidate": cid, "ms": t["ms"], "estimated": bool(t.get("estimated", True)),
                         "accepted": True, "proposer": t.get("proposer", ""), "parent": t.get("parent"),
                         "rationale": t.get("rationale", ""),
                         "speedup_vs_naive": round(base / t["ms"], 4) if base and t["ms"] else None})
        rows.sort(key=lambda r: r["ms"])
        for cid, r in self.rejected().items():
            row = {"candidate": cid, "ms": None, "estimated": r.get("estimated", True), "accepted": False,
                   "status": status_of(r), "proposer": r.get("proposer", ""), "parent": r.get("parent"),
                   "rationale": r.get("rationale", ""), "reason": r.get("reason", "")}
            if row["status"] == "screened":
                row["estimate_ms"] = r.get("estimate_ms")
                row["reason"] = screened_text(r.get("estimate_ms"))
            rows.append(row)
        doc = {"model": self.info.get("model"), "baseline": BASELINE, "baseline_ms": base,
               "estimated": not measured, "entries": rows}
        finals = self.finals()
        if finals is not None:  # the fastest re-timed side by side; best/ holds the winner (`search.finals`)
            doc["finals"] = finals
        write_json_atomic(self.path / "leaderboard.json", doc)
        return doc
