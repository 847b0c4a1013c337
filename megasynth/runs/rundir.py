"""The runs/<run>/ folder a search writes (DESIGN.md §6). Every write is atomic (megasynth/atomic.py), and the files
on disk are the source of truth, so a killed search resumes without losing accepted results.

Layout:
  run.json                                  command, versions, GPU, model, seed, options
  study.db                                  the Optuna study (SQLite) unless --storage names another
  candidates/<id>/schedule.json             every accepted candidate (a committed run may leave it out for size:
                                            `RunDir.load_candidate` rebuilds it from timing.json's strategy and
                                            patches and checks it against the recorded schedule_key) ...
  candidates/<id>/validation.json           ... its validator report ...
  candidates/<id>/timing.json               ... and its timing: {"ms", "estimated", "source", ...}
  rejected/<id>.json                        candidates not accepted: rejected (the counterexample), malformed (the
                                            error), or screened by the cost model (its estimate; never validated)
  leaderboard.json                          {"entries": [...accepted, fastest first..., ...screened and rejected]}
  best/{schedule,validation,timing,trace}.json   the fastest accepted candidate (trace: GPU, or the cost model's,
                                            labelled `estimated: true`)

Candidate ids are `c0000`, `c0001`, ... (the slot of the study's claim, `megasynth.search.claims`); `c0000` is the naive
baseline of the run.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

from megasynth.atomic import write_json_atomic, write_text_atomic
from megasynth.ir.schedule import Schedule

BASELINE = "c0000"


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


def _write_schedule(path: Path, schedule: Schedule) -> None:
    """Schedules are written compact: a llama-1b schedule is ~2.7 MB so (4.5 MB indented), and a run keeps dozens."""
    write_text_atomic(path, json.dumps(schedule.to_json(), separators=(",", ":")) + "\n")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


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
    def save_candidate(self, cid: str, schedule: Schedule, validation: dict[str, Any], timing: dict[str, Any]) -> None:
        """An accepted candidate. timing.json goes last: a candidate counts once its timing is there."""
        d = self.path / "candidates" / cid
        _write_schedule(d / "schedule.json", schedule)
        write_json_atomic(d / "validation.json", validation)
        write_json_atomic(d / "timing.json", timing)

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
        accepted one without schedule.json (`load_candidate` rebuilds it from the strategy and patches)."""
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

    def candidate_schedule(self, cid: str) -> Path:
        return self.path / "candidates" / cid / "schedule.json"

    def load_candidate(self, cid: str) -> Schedule:
        """An accepted candidate's schedule: its schedule.json, or, where that was left out, the schedule rebuilt
        from the strategy and patches in its timing.json (a `ScheduleError` if the rebuild is not the schedule that
        was timed, e.g. when a cost-balanced assignment was made with other cost-model parameters)."""
        from megasynth.ir.errors import ScheduleError
        from megasynth.ir.schedule import load_schedule

        path = self.candidate_schedule(cid)
        if path.exists():
            return load_schedule(path)
        timing = _read(path.with_name("timing.json"))
        where = str(path.with_name("timing.json"))
        if not isinstance(timing, dict) or "strategy" not in timing:
            raise ScheduleError("no schedule.json and no strategy in timing.json to rebuild it from", "$", where)
        from megasynth.lowering.lower import lower
        from megasynth.lowering.models import get_model
        from megasynth.lowering.patches import apply_patches
        from megasynth.lowering.strategy import parse_strategy

        model = self.info.get("model") or "llama-1b"
        schedule = lower(get_model(model), int(timing.get("workers") or self.info.get("workers") or 132),
                         parse_strategy(timing["strategy"], where), timing.get("proposer") or "naive")
        schedule = apply_patches(schedule, timing.get("patches") or [])
        if timing.get("schedule_key") and schedule_key(schedule) != timing["schedule_key"]:
            raise ScheduleError("the schedule rebuilt from its strategy differs from the one timed (schedule_key)",
                                "$.schedule_key", where)
        return schedule

    # -- best and leaderboard ---------------------------------------------------------------------------------
    def best_ms(self) -> float | None:
        t = _read(self.path / "best" / "timing.json")
        return t.get("ms") if isinstance(t, dict) else None

    def save_best(self, cid: str, schedule: Schedule, validation: dict[str, Any], timing: dict[str, Any],
                  trace: dict[str, Any] | None) -> bool:
        """Replace best/ (schedule, validation and trace first, timing last) unless it holds a candidate at least as
        fast. Processes sharing the run folder compare and write under a lock (`.best.lock`), so two that promote
        at once cannot leave the slower one in best/. Returns whether best/ was replaced."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".best.lock", "a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when the process dies
            d = self.path / "best"
            on_disk = self.best_ms()
            if on_disk is not None and on_disk <= timing["ms"] and (d / "schedule.json").exists():
                return False
            _write_schedule(d / "schedule.json", schedule)
            write_json_atomic(d / "validation.json", validation)
            if trace is not None:
                write_json_atomic(d / "trace.json", trace, indent=None)
            else:
                (d / "trace.json").unlink(missing_ok=True)  # the previous best's trace is not this one's
            write_json_atomic(d / "timing.json", {**timing, "candidate": cid})
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
