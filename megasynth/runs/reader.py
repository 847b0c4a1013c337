"""Read a run folder of runs/ defensively: the `Run` (run.json, the leaderboard's `Entry` rows, counts), the best's
trace in the shared format (`parse_trace`, `summarize`), and the baselines and bandwidth floor of a bench JSON the run
holds (`bench_rows`).

Every input is optional: a missing or unreadable file gives None and a note in `Run.notes`, never a crash. Large files
are read gzip-compressed (`<name>.json.gz`, as runs are written) or plain (older runs), see `megasynth.runs.rundir`.
The pages that show a run are drawn by `megasynth.runs.report`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from megasynth.ir.errors import json_path, shown
from megasynth.runs.rundir import PackError, RunDir, read_stored_text, screened_text

#: Copy bandwidth measured on the H200 (a streaming copy kernel); used for a floor only when no bench JSON gives one.
H200_COPY_TBPS = 4.19

# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_json(path: Path, notes: list[str] | None = None) -> Any:
    """The parsed JSON at `path` (`<path>.gz` first, as runs write large files), or None (with a note) when it is
    missing or unreadable."""
    try:
        text = read_stored_text(path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        if notes is not None:
            notes.append(f"{path.name}: cannot read ({getattr(exc, 'strerror', None) or exc})")
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if notes is not None:
            notes.append(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}); section omitted")
        return None


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def first_of(d: Any, *keys: str) -> Any:
    """The first present, non-None value of `keys` in a dict (None for anything else)."""
    if not isinstance(d, dict):
        return None
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def ms_of(d: Any) -> float | None:
    """Milliseconds per token from a timing/leaderboard record, whatever the writer called it."""
    v = num(first_of(d, "ms", "median_ms", "ms_per_token", "makespan_ms", "best_ms"))
    if v is None and isinstance(d, dict):
        for sub in ("timing", "estimate", "result"):
            if isinstance(d.get(sub), dict):
                v = ms_of(d[sub])
                if v is not None:
                    break
    return v


@dataclass
class Entry:
    """One candidate on a run's leaderboard. `status`: accepted, screened (the cost model left it out before
    validation: `estimate_ms`), malformed or rejected."""

    candidate: str
    ms: float | None
    estimated: bool
    accepted: bool
    proposer: str = ""
    note: str = ""
    status: str = ""
    estimate_ms: float | None = None

    @property
    def verdict(self) -> str:
        """The verdict as every page and `synth runs` print it."""
        if self.status == "screened":
            return screened_text(self.estimate_ms)
        return self.status or ("accepted" if self.accepted else "rejected")


def _entries(lb: Any) -> list[Entry]:
    rows = lb
    if isinstance(lb, dict):
        rows = first_of(lb, "entries", "candidates", "leaderboard", "rows") or []
    if not isinstance(rows, list):
        return []
    out = []
    for k, r in enumerate(rows):
        if not isinstance(r, dict):
            continue
        cand = first_of(r, "candidate", "id", "name")
        accepted = r.get("accepted")
        if accepted is None:
            accepted = r.get("verdict", "accepted") == "accepted"
        status = str(r.get("status") or ("accepted" if accepted else "rejected"))
        if not accepted and status == "rejected" and str(r.get("reason", "")).startswith("screened"):
            status = "screened"  # a leaderboard written before the status field
        note = first_of(r, "rationale", "note") if accepted or status == "screened" else \
            first_of(r, "reason", "error", "rationale", "note")
        out.append(Entry(str(cand if cand is not None else k), ms_of(r) if accepted else None,
                         bool(r.get("estimated", False)), bool(accepted), str(first_of(r, "proposer") or ""),
                         str(note or ""), status, num(r.get("estimate_ms"))))
    return out


@dataclass
class Run:
    """What a run folder holds, read defensively. `notes` says what was missing or unreadable."""

    name: str
    path: Path
    info: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    accepted: int = 0
    rejected: int = 0  # refused by the validator or the GPU check, or malformed (screened ones not included)
    screened: int = 0
    notes: list[str] = field(default_factory=list)
    baseline: str = "c0000"  # the naive baseline's candidate id (leaderboard.json "baseline")
    winner: str | None = None  # the finals' winner when best/ holds it (leaderboard.json "finals", search.finals)

    @property
    def model(self) -> str:
        m = first_of(self.info, "model")
        if isinstance(m, dict):
            m = first_of(m, "name")
        return str(m) if m is not None else "?"

    @property
    def gpu(self) -> str:
        g = first_of(self.info, "gpu", "device")
        if isinstance(g, dict):
            g = first_of(g, "name", "device")
        return str(g) if g else "none (CPU)"

    @property
    def date(self) -> str:
        d = first_of(self.info, "started", "date", "created", "started_at", "time")
        if isinstance(d, int | float):
            return _dt.datetime.fromtimestamp(d, _dt.UTC).strftime("%Y-%m-%d %H:%M")
        if isinstance(d, str):
            return d.replace("T", " ")[:16]
        try:
            return _dt.datetime.fromtimestamp(self.path.stat().st_mtime, _dt.UTC).strftime("%Y-%m-%d %H:%M")
        except OSError:
            return "?"

    def best(self) -> Entry | None:
        """best/'s candidate: the finals' winner where the search ran finals, else the fastest measured entry."""
        won = [e for e in self.entries if e.candidate == self.winner and e.accepted and e.ms is not None]
        if won:
            return won[0]
        timed = [e for e in self.entries if e.accepted and e.ms is not None]
        measured = [e for e in timed if not e.estimated]
        timed = measured or timed  # a GPU measurement beats any estimate
        if timed:
            return min(timed, key=lambda e: e.ms or 0.0)
        timing = read_json(self.path / "best" / "timing.json")
        ms = ms_of(timing)
        if ms is None:
            return None
        return Entry("best", ms, bool(first_of(timing, "estimated")), True)

    def naive(self) -> Entry | None:
        """The naive baseline: candidate 0 of every run (leaderboard.json names it), or the one its proposer calls
        naive; when the leaderboard leaves it out (an estimate among GPU measurements), its own timing.json."""
        for e in self.entries:
            if e.candidate == self.baseline:
                return e
        for e in self.entries:
            if e.proposer == "naive" or e.candidate in ("0", "naive", "0000"):
                return e
        try:
            c = RunDir(self.path).candidate(self.baseline)  # in its folder or in the pack
        except PackError:
            c = None  # load_run notes an unreadable pack
        timing = c.timing if c is not None else None
        ms = ms_of(timing)
        if ms is not None:
            return Entry(self.baseline, ms, bool(first_of(timing, "estimated")), True, "naive")
        return None

    def speedup(self) -> float | None:
        b, n = self.best(), self.naive()
        if b is None or n is None or not b.ms or not n.ms:
            return None
        return n.ms / b.ms


def load_run(path: str | Path) -> Run:
    """Read one run folder (runs/<run>/); never raises for missing or malformed files."""
    p = Path(path)
    run = Run(p.name, p)
    info = read_json(p / "run.json", run.notes)
    if isinstance(info, dict):
        run.info = info
    elif not (p / "run.json").exists():
        run.notes.append("run.json is missing: command, versions and GPU are unknown")
    lb = read_json(p / "leaderboard.json", run.notes)
    run.entries = _entries(lb) if lb is not None else []
    if isinstance(lb, dict) and isinstance(lb.get("baseline"), str):
        run.baseline = lb["baseline"]
    finals = lb.get("finals") if isinstance(lb, dict) else None
    if isinstance(finals, dict) and isinstance(finals.get("winner"), str):
        best = read_json(p / "best" / "timing.json", run.notes)
        if isinstance(best, dict) and best.get("candidate") == finals["winner"]:
            run.winner = finals["winner"]
    if lb is None:
        run.notes.append("leaderboard.json is missing")
    try:
        cands = RunDir(p).candidate_ids()  # folders and the pack of a packed run
    except PackError as exc:
        run.notes.append(str(exc))
        cands = [d.name for d in (p / "candidates").glob("*") if d.is_dir()]
    rejs = list((p / "rejected").glob("*.json")) if (p / "rejected").is_dir() else []
    run.accepted = max(len(cands), sum(1 for e in run.entries if e.accepted))
    run.screened = sum(1 for e in run.entries if e.status == "screened")
    run.rejected = max(len(rejs) - run.screened, sum(1 for e in run.entries if not e.accepted) - run.screened)
    return run


def list_runs(runs_dir: str | Path) -> list[Run]:
    """Every run folder under runs_dir (a folder with a run.json, leaderboard.json or best/), newest first."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    runs = [load_run(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")
            and any((d / f).exists() for f in ("run.json", "leaderboard.json", "best"))]
    runs.sort(key=lambda r: r.date, reverse=True)
    return runs


# ---------------------------------------------------------------------------------------------------------------
# Traces (the shared format: Chrome trace events, one "X" event per executed instruction)


@dataclass
class Trace:
    doc: dict[str, Any]  # the trace as read (the shared format)
    lanes: int
    events: list[dict[str, Any]]  # {"id", "op", "layer", "tid", "ts", "dur", "wait"} sorted by (tid, ts)
    metadata: dict[str, Any]
    lane_names: list[str]

    @property
    def estimated(self) -> bool:
        return bool(self.metadata.get("estimated", False))

    @property
    def makespan_us(self) -> float:
        return max((e["ts"] + e["dur"] for e in self.events), default=0.0)


def parse_trace(doc: Any) -> Trace:
    """Trace events -> a `Trace`; raises ValueError naming the first bad event (the caller notes and skips it)."""
    from megasynth.trace import check_trace

    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    check_trace(doc, "best/trace.json")  # raises TraceError (a ValueError) naming the JSON path
    events, names = [], {}
    for k, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict):
            raise ValueError(f"traceEvents[{k}] is not an object")
        tid = ev.get("tid", 0)
        if ev.get("ph") == "M" and ev.get("name") == "thread_name" and isinstance(tid, int):
            names[tid] = str((ev.get("args") or {}).get("name", f"SM {tid}"))
        if ev.get("ph") != "X":
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        ts, dur = num(ev.get("ts")), num(ev.get("dur"))
        if ts is None or dur is None or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"traceEvents[{k}]: ts/dur/tid missing or not numbers")
        ident = args.get("id")
        events.append({"id": ident if isinstance(ident, int) else k, "op": str(args.get("op", ev.get("cat", "?"))),
                       "layer": args.get("layer") if isinstance(args.get("layer"), int) else None, "tid": tid,
                       "ts": ts, "dur": max(dur, 0.0), "wait": num(args.get("wait_us")) or 0.0})
    events.sort(key=lambda e: (e["tid"], e["ts"]))
    lanes = max([t + 1 for t in names] + [e["tid"] + 1 for e in events] + [0])
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return Trace(doc, lanes, events, meta, [names.get(w, f"SM {w}") for w in range(lanes)])


def producers_of(schedule: Any) -> dict[int, list[int]] | None:
    """Instruction id -> the ids that signal a counter it waits on (who can have held it up), from schedule JSON."""
    if not isinstance(schedule, dict) or not isinstance(schedule.get("instructions"), list):
        return None
    signallers: dict[int, list[int]] = {}
    for ins in schedule["instructions"]:
        if isinstance(ins, dict):
            for sg in ins.get("signals") or []:
                if isinstance(sg, dict) and isinstance(sg.get("counter"), int):
                    signallers.setdefault(sg["counter"], []).append(ins.get("id"))
    out: dict[int, list[int]] = {}
    for ins in schedule["instructions"]:
        if isinstance(ins, dict) and isinstance(ins.get("id"), int):
            out[ins["id"]] = [p for w in ins.get("waits") or [] if isinstance(w, dict)
                              for p in signallers.get(w.get("counter"), [])]
    return out


def summarize(trace: Trace, schedule: Any = None) -> dict[str, Any]:
    """Time per op, per-SM busy/wait/idle and the critical path, as `megasynth.trace.summarize` (the format's owner)
    computes them; the schedule, when given, tells it which instructions each one waited on."""
    from megasynth.trace import summarize as trace_summary

    return trace_summary(trace.doc, producers_of(schedule))


# ---------------------------------------------------------------------------------------------------------------
# Baselines and the bandwidth floor (from a bench JSON the run folder holds, when present)


def bench_docs(run: Run) -> list[tuple[Path, Any]]:
    """The bench JSON files a run holds (bench.json, best/bench.json, bench/*.json) with their documents."""
    paths = [run.path / "bench.json", run.path / "best" / "bench.json", *sorted((run.path / "bench").glob("*.json"))]
    docs = []
    for p in paths:
        doc = read_json(p, run.notes)
        if doc is not None:
            docs.append((p, doc))
    return docs


def bench_rows(doc: Any, ctx: int | None = None) -> tuple[list[tuple[str, float]], float | None, bool]:
    """(baseline label, median ms) rows, the floor in ms and whether the numbers are estimates, from a bench JSON.
    Tolerates a list of measurements, a dict name -> measurement, and per-context groups (the run's ctx first)."""
    if isinstance(doc, dict) and isinstance(doc.get("contexts"), list | dict):
        groups = doc["contexts"]
        groups = list(groups.values()) if isinstance(groups, dict) else groups
        pick = [g for g in groups if isinstance(g, dict) and g.get("ctx") == ctx] or groups[:1]
        if pick:
            rows, floor, est = bench_rows(pick[0], ctx)
            return rows, floor if floor is not None else num(first_of(doc, "floor_ms")), est
    if isinstance(doc, dict) and isinstance(doc.get("results"), list) and any(
            isinstance(r, dict) and isinstance(r.get("variants"), dict) for r in doc["results"]):
        return _bench_by_ctx(doc, ctx)
    items: Any = first_of(doc, "results", "baselines", "measurements", "rows", "variants") if isinstance(doc, dict) \
        else doc
    if isinstance(items, dict):
        items = [{"name": k, **v} if isinstance(v, dict) else {"name": k, "ms": v} for k, v in items.items()]
    rows: list[tuple[str, float]] = []
    floor = None
    for it in items if isinstance(items, list) else []:
        if not isinstance(it, dict) or (ctx is not None and it.get("ctx") not in (None, ctx)):
            continue
        name = str(first_of(it, "name", "label", "variant", "baseline") or "?")
        ms = ms_of(it)
        if ms is None:
            continue
        if "floor" in name.lower():
            floor = ms
        else:
            rows.append((name, ms))
    f = first_of(doc, "floor_ms") if isinstance(doc, dict) else None
    if isinstance(f, dict):
        f = ms_of(f)
    if num(f) is not None:
        floor = num(f)
    est = bool(first_of(doc, "estimated")) if isinstance(doc, dict) else False
    return rows, floor, est


#: The format `synth bench --json` writes (megasynth.measure.options.FORMAT; not imported: runs sit below measure).
BENCH_FORMAT = "megasynth-bench/1"


class _BenchRow(BaseModel):
    """One ctx of a bench: what the report charts from it (its variants) must be there."""

    model_config = ConfigDict(extra="allow", strict=True)
    ctx: StrictInt = Field(ge=1)
    batch: StrictInt | None = Field(default=None, ge=1)
    variants: dict[str, dict[str, Any]]


class _BenchDoc(BaseModel):
    """The part of a `synth bench --json` document that says what was measured, for which model and batch."""

    model_config = ConfigDict(extra="allow", strict=True)
    format: StrictStr
    model: StrictStr  # the run it is kept with must be of this model
    batch: StrictInt | None = Field(default=None, ge=1)
    results: list[_BenchRow] = Field(min_length=1)


def _same_model(a: str, b: str) -> bool:
    """Two spellings of one model: the same row name, or the same checkpoint folder (one relative, one absolute)."""
    if a == b:
        return True
    if "/" in a or "/" in b:
        try:
            return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
        except (OSError, RuntimeError):
            return False
    return False


def bench_problem(doc: Any, model: str | None, batch: int | None) -> str | None:
    """Why `doc` cannot be kept as a run's bench.json (None when it can): it must be a `synth bench --json` output
    (format, results per ctx with their variants) of the run's `model` and, where the run records one, its `batch`;
    a bench of another model would chart baselines that are not this run's. The answer names the JSON path."""
    expected = "expected a `synth bench --json` output"
    if not isinstance(doc, dict):
        return f"$: {json.dumps(doc)[:80] if not isinstance(doc, list) else 'a list'} is no JSON object; {expected}"
    if isinstance(doc.get("format"), str) and doc["format"] != BENCH_FORMAT:  # another file of ours (a schedule)
        return f"$.format: {json.dumps(doc['format'])} is not {json.dumps(BENCH_FORMAT)}; {expected}"
    try:
        bench = _BenchDoc.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "missing":
            return f"{json_path(err['loc'])}: missing; {expected}"
        return f"{json_path(err['loc'])}: {err['msg']} (got {shown(err.get('input'))}); {expected}"
    if model is not None and not _same_model(bench.model, model):
        return f"$.model: {json.dumps(bench.model)} is a bench of another model; the run is for {json.dumps(model)}"
    if batch is not None:
        rows = [(("batch",), bench.batch)] + [(("results", i, "batch"), r.batch) for i, r in enumerate(bench.results)]
        for loc, got in rows:
            if got is not None and got != batch:
                return f"{json_path(loc)}: {got} is a bench at another batch; the run is for --batch {batch}"
    return None


def _bench_by_ctx(doc: dict[str, Any], ctx: int | None) -> tuple[list[tuple[str, float]], float | None, bool]:
    """`synth bench --json` (format megasynth-bench/1, read here without importing megasynth.measure: runs sit
    below it): results per ctx, each with variants (their `label` as the bench
    wrote it, else their name) and a measured floor. A CPU dry run is labelled so (its numbers are CPU timings)."""
    recs = [r for r in doc["results"] if isinstance(r, dict) and isinstance(r.get("variants"), dict)]
    pick = next((r for r in recs if r.get("ctx") == ctx), recs[0])
    suffix = " (CPU dry run)" if doc.get("dry_run") else ""
    rows = []
    for name, v in pick["variants"].items():
        ms = ms_of(v) if isinstance(v, dict) and v.get("status", "ok") == "ok" else None
        if ms is not None:
            label = str(v.get("label") or name)
            rows.append((label + ("" if "dry run" in label else suffix) + ("" if pick.get("ctx") == ctx or ctx is None
                                                              else f" @ctx {pick.get('ctx')}"), ms))
    floor = ms_of(pick.get("floor")) if isinstance(pick.get("floor"), dict) else num(pick.get("floor"))
    return rows, floor, False


def estimated_floor_ms(schedule: dict[str, Any] | None, ctx: int | None) -> float | None:
    """Bytes the schedule's instructions must move at `ctx` (from the catalogue's cost) / the H200's measured copy
    bandwidth (`H200_COPY_TBPS`). Only used when no bench JSON gives a measured floor; labelled estimated."""
    if not isinstance(schedule, dict) or not ctx:
        return None
    try:
        from megasynth.ir.catalogue import OPS
        from megasynth.ir.program import resolve
        from megasynth.ir.schedule import parse_schedule

        prog = resolve(parse_schedule(schedule))
        if prog.geometry is None:
            return None
        total = 0
        for i in range(prog.n):
            if prog.op[i] in OPS:
                layer = prog.layer[i] if prog.layer[i] is not None else -1
                seq = min(ctx, prog.geometry.max_seq_len)
                total += OPS[prog.op[i]].cost(prog.geometry, layer, prog.args[i], seq)[0]
        return total / (H200_COPY_TBPS * 1e12) * 1e3
    except Exception:  # noqa: BLE001 - a schedule we cannot read just has no floor in the report
        return None


