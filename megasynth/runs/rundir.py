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
  rejected/<id>.json                        candidates not accepted: rejected (the counterexample), malformed (the
                                            error), or screened by the cost model (its estimate; never validated)
  leaderboard.json                          {"entries": [...accepted, fastest first..., ...screened and rejected]}
  best/{schedule.json.gz, validation.json, timing.json, trace.json.gz}   the fastest accepted candidate (trace: GPU,
                                            or the cost model's, labelled `estimated: true`)

A whole schedule is megabytes of JSON (llama-1b ~2 MB, llama-8b ~4 MB) but rebuilds in about a second from its
strategy and patches, so a run keeps few: `RunDir.load_candidate` rebuilds the others and checks the result against
the recorded schedule_key. Large files are gzip-compressed (`.json.gz`, ~20x smaller); readers also accept the plain
`.json` of runs written before (`stored`, `read_stored`).

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
from pathlib import Path
from typing import Any

from megasynth.atomic import read_text, write_gz_atomic, write_json_atomic
from megasynth.ir.schedule import Schedule

BASELINE = "c0000"
#: The accepted candidates of a run that keep their whole schedule (schedule.json.gz), fastest first; best/ has its own.
KEEP_SCHEDULES = 3
QUEUES_FORMAT = "megasynth-queues/1"


def candidate_id(number: int) -> str:
    return f"c{number:04d}"


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
        `KEEP_SCHEDULES` fastest (pushing the slowest kept one out), and timing.json last, stamped with the
        lowering's version: a candidate counts once its timing is there."""
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

    def accepted(self) -> dict[str, dict[str, Any]]:
        """candidate id -> timing.json of every accepted candidate on disk."""
        out = {}
        for d in sorted((self.path / "candidates").glob("c*")):
            t = _read(d / "timing.json")
            if isinstance(t, dict) and isinstance(t.get("ms"), int | float):
                out[d.name] = t
        return out

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
        timing = _read(self.path / "candidates" / cid / "timing.json")
        if isinstance(timing, dict) and isinstance(timing.get("ms"), int | float):
            return {"accepted": True, "record": timing,
                    "validation": _read(self.path / "candidates" / cid / "validation.json")}
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
        best = _read(self.path / "best" / "timing.json")
        if isinstance(best, dict) and best.get("candidate") == cid:
            shutil.rmtree(self.path / "best", ignore_errors=True)

    def candidate_schedule(self, cid: str) -> Path | None:
        """The file holding an accepted candidate's whole schedule (schedule.json.gz, or an older run's
        schedule.json), or None when the run keeps only what rebuilds it."""
        return stored(self.path / "candidates" / cid / "schedule.json")

    def load_candidate(self, cid: str) -> Schedule:
        """An accepted candidate's schedule: its stored schedule, or, where the run did not keep it, the schedule
        rebuilt from the strategy and patches in its timing.json, with the queues of its queues.json.gz when there
        is one (they follow the cost model the lowering balanced with). A `ScheduleError` if the rebuild is not the
        schedule that was timed (its schedule_key), naming the lowering that wrote it and this one."""
        from megasynth.ir.errors import ScheduleError
        from megasynth.ir.schedule import loads_schedule, parse_schedule

        d = self.path / "candidates" / cid
        path = self.candidate_schedule(cid)
        if path is not None:
            try:
                return loads_schedule(read_stored_text(path), str(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise ScheduleError(f"cannot read file: {exc}", "$", str(path)) from None
        where = str(d / "timing.json")
        timing = _read(d / "timing.json")
        if not isinstance(timing, dict) or "strategy" not in timing:
            raise ScheduleError("no schedule and no strategy in timing.json to rebuild it from", "$", where)
        from megasynth.lowering.lower import lower
        from megasynth.lowering.models import get_model
        from megasynth.lowering.patches import apply_patches
        from megasynth.lowering.strategy import parse_strategy

        model = self.info.get("model") or "llama-1b"
        proposer = timing.get("proposer") or "naive"
        spec = get_model(model, self.info.get("max_seq_len"))  # None in runs that predate --max-seq-len
        schedule = lower(spec, int(timing.get("workers") or self.info.get("workers") or 132),
                         parse_strategy(timing["strategy"], where), proposer)
        schedule = apply_patches(schedule, timing.get("patches") or [])
        doc = schedule.to_json()
        doc["meta"] = {**doc.get("meta", {}), "proposer": proposer, "parent": timing.get("parent"),
                       "rationale": timing.get("rationale", "")}
        if (d / "queues.json.gz").is_file():
            doc["queues"] = decode_queues(read_stored(d / "queues.json"), str(d / "queues.json.gz"))
        schedule = parse_schedule(doc, where)
        if timing.get("schedule_key") and schedule_key(schedule) != timing["schedule_key"]:
            then = timing.get("lowering") or {}
            raise ScheduleError(
                "the schedule rebuilt from its strategy differs from the one timed (schedule_key): it was lowered by "
                f"megasynth {then.get('megasynth', '?')} (lowering {then.get('digest', 'unrecorded')}), this is "
                f"megasynth {lowering_version()['megasynth']} (lowering {lowering_version()['digest']})",
                "$.schedule_key", where)
        return schedule

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
                  trace: dict[str, Any] | None) -> bool:
        """Replace best/ (schedule, validation and trace first, timing last) unless it holds a candidate at least as
        fast. Processes sharing the run folder compare and write under a lock (`.best.lock`), so two that promote
        at once cannot leave the slower one in best/. Returns whether best/ was replaced."""
        with self._locked():
            d = self.path / "best"
            on_disk = self.best_ms()
            if on_disk is not None and on_disk <= timing["ms"] and self.has_best_schedule():
                return False
            write_stored(d / "schedule.json", schedule.to_json())
            write_json_atomic(d / "validation.json", validation)
            if trace is not None:
                write_stored(d / "trace.json", trace)
            else:
                _drop_stored(d / "trace.json")  # the previous best's trace is not this one's
            write_json_atomic(d / "timing.json", {**timing, "lowering": lowering_version(), "candidate": cid})
        return True

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
        write_json_atomic(self.path / "leaderboard.json", doc)
        return doc
