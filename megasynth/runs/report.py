"""Read a run folder of runs/ defensively and render it as self-contained HTML (a leaderboard and one report per run).

Every input is optional: a missing or unreadable file drops its section and leaves a note, never a crash. The HTML
needs no network when viewed (the CSS and JS of static/ are inlined); the SM timeline is drawn on a <canvas> so that
10 000+ instructions stay smooth. Numbers that came from the cost model rather than the GPU are labelled "estimated".

This module reads and computes (the `Run`, the trace summary, the geometry of the charts); the markup is in
templates/ (Jinja2, autoescaped), one template per page and per chart.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from jinja2.ext import Extension
from markupsafe import Markup

from megasynth.runs.rundir import screened_text
from megasynth.atomic import write_text_atomic

#: Bounds on what one report shows (the data files keep everything).
MAX_REJECTED_SHOWN = 20
MAX_SEQUENCE_EVENTS = 60
MAX_CRITICAL_ROWS = 400
MAX_FINDINGS_SHOWN = 50
#: Copy bandwidth measured on the H200 here (DESIGN.md §7); used for a floor only when no bench JSON gives one.
H200_COPY_TBPS = 4.19

PERFETTO_HINT = ("Open trace.json in Perfetto: ui.perfetto.dev → “Open trace file”, or in Chromium at "
                 "chrome://tracing → Load.")


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_json(path: Path, notes: list[str] | None = None) -> Any:
    """The parsed JSON at `path`, or None (with a note) when it is missing or unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        if notes is not None:
            notes.append(f"{path.name}: cannot read ({exc.strerror or exc})")
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if notes is not None:
            notes.append(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}); section omitted")
        return None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _first(d: Any, *keys: str) -> Any:
    """The first present, non-None value of `keys` in a dict (None for anything else)."""
    if not isinstance(d, dict):
        return None
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def _ms_of(d: Any) -> float | None:
    """Milliseconds per token from a timing/leaderboard record, whatever the writer called it."""
    v = _num(_first(d, "ms", "median_ms", "ms_per_token", "makespan_ms", "best_ms"))
    if v is None and isinstance(d, dict):
        for sub in ("timing", "estimate", "result"):
            if isinstance(d.get(sub), dict):
                v = _ms_of(d[sub])
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
        rows = _first(lb, "entries", "candidates", "leaderboard", "rows") or []
    if not isinstance(rows, list):
        return []
    out = []
    for k, r in enumerate(rows):
        if not isinstance(r, dict):
            continue
        cand = _first(r, "candidate", "id", "name")
        accepted = r.get("accepted")
        if accepted is None:
            accepted = r.get("verdict", "accepted") == "accepted"
        status = str(r.get("status") or ("accepted" if accepted else "rejected"))
        if not accepted and status == "rejected" and str(r.get("reason", "")).startswith("screened"):
            status = "screened"  # a leaderboard written before the status field
        note = _first(r, "rationale", "note") if accepted or status == "screened" else \
            _first(r, "reason", "error", "rationale", "note")
        out.append(Entry(str(cand if cand is not None else k), _ms_of(r) if accepted else None,
                         bool(r.get("estimated", False)), bool(accepted), str(_first(r, "proposer") or ""),
                         str(note or ""), status, _num(r.get("estimate_ms"))))
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

    @property
    def model(self) -> str:
        m = _first(self.info, "model")
        if isinstance(m, dict):
            m = _first(m, "name")
        return str(m) if m is not None else "?"

    @property
    def gpu(self) -> str:
        g = _first(self.info, "gpu", "device")
        if isinstance(g, dict):
            g = _first(g, "name", "device")
        return str(g) if g else "none (CPU)"

    @property
    def date(self) -> str:
        d = _first(self.info, "started", "date", "created", "started_at", "time")
        if isinstance(d, int | float):
            return _dt.datetime.fromtimestamp(d, _dt.UTC).strftime("%Y-%m-%d %H:%M")
        if isinstance(d, str):
            return d.replace("T", " ")[:16]
        try:
            return _dt.datetime.fromtimestamp(self.path.stat().st_mtime, _dt.UTC).strftime("%Y-%m-%d %H:%M")
        except OSError:
            return "?"

    def best(self) -> Entry | None:
        timed = [e for e in self.entries if e.accepted and e.ms is not None]
        measured = [e for e in timed if not e.estimated]
        timed = measured or timed  # a GPU measurement beats any estimate
        if timed:
            return min(timed, key=lambda e: e.ms or 0.0)
        timing = read_json(self.path / "best" / "timing.json")
        ms = _ms_of(timing)
        if ms is None:
            return None
        return Entry("best", ms, bool(_first(timing, "estimated")), True)

    def naive(self) -> Entry | None:
        """The naive baseline: candidate 0 of every run (leaderboard.json names it), or the one its proposer calls
        naive; when the leaderboard leaves it out (an estimate among GPU measurements), its own timing.json."""
        for e in self.entries:
            if e.candidate == self.baseline:
                return e
        for e in self.entries:
            if e.proposer == "naive" or e.candidate in ("0", "naive", "0000"):
                return e
        timing = read_json(self.path / "candidates" / self.baseline / "timing.json")
        ms = _ms_of(timing)
        if ms is not None:
            return Entry(self.baseline, ms, bool(_first(timing, "estimated")), True, "naive")
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
    if lb is None:
        run.notes.append("leaderboard.json is missing")
    cands = [d for d in (p / "candidates").glob("*") if d.is_dir()] if (p / "candidates").is_dir() else []
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
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ts is None or dur is None or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"traceEvents[{k}]: ts/dur/tid missing or not numbers")
        ident = args.get("id")
        events.append({"id": ident if isinstance(ident, int) else k, "op": str(args.get("op", ev.get("cat", "?"))),
                       "layer": args.get("layer") if isinstance(args.get("layer"), int) else None, "tid": tid,
                       "ts": ts, "dur": max(dur, 0.0), "wait": _num(args.get("wait_us")) or 0.0})
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
# Counterexamples (a validator finding's interleaving, normalised for the sequence diagram)


def counterexample_events(finding: Any) -> list[dict[str, Any]]:
    """Normalise the event list of a validator finding's `details` (numbered events: worker, instruction,
    start/end, counter values) into {"worker", "instruction", "op", "layer", "kind", "waits_on", "signals", "text"}.
    Unknown shapes give an empty list (the report then shows the finding's text lines)."""
    if not isinstance(finding, dict):
        return []
    details = finding.get("details") if isinstance(finding.get("details"), dict) else finding
    raw = _first(details, "events", "interleaving", "counterexample", "trace")
    if isinstance(raw, dict):
        raw = _first(raw, "events", "steps")
    if not isinstance(raw, list):
        return []
    out = []
    for ev in raw:
        if not isinstance(ev, dict):
            continue
        w = _first(ev, "worker", "w", "sm", "tid")
        ins = _first(ev, "instruction", "id", "ins")
        if isinstance(ins, dict):
            ev = {**ins, **{k: v for k, v in ev.items() if k != "instruction"}}
            ins = _first(ins, "id")
        kind = str(_first(ev, "kind", "event", "type", "phase", "what") or "start").lower()
        kind = "end" if kind in ("end", "finish", "e", "signal", "done") else "start"
        if not isinstance(w, int):
            continue
        sig = [s.get("counter") if isinstance(s, dict) else s for s in (ev.get("signals") or [])]
        if isinstance(ev.get("counters"), dict) and kind == "end":  # validator: counter values after an end
            sig += [int(c) for c in ev["counters"] if str(c).isdigit()]
        wt = [s.get("counter") if isinstance(s, dict) else s for s in (ev.get("waits") or [])]
        text = ev.get("text")
        if text is None:
            text = f"{kind} #{ins} {ev.get('op') or ''}" + (f" L{ev['layer']}" if ev.get("layer") is not None else "")
            waits = [w for w in ev.get("waits") or [] if isinstance(w, dict)]
            if waits:
                text += " (" + ", ".join(f"c{w.get('counter')} = {w.get('current', '?')} >= {w.get('value')}"
                                         for w in waits) + ")"
            if isinstance(ev.get("counters"), dict) and ev["counters"]:
                text += " -> " + ", ".join(f"c{c} = {v}" for c, v in ev["counters"].items())
        out.append({"n": _first(ev, "n", "step", "index"), "worker": w, "instruction": ins, "op": ev.get("op"),
                    "layer": ev.get("layer"), "kind": kind,
                    "signals": [c for c in sig if isinstance(c, int)],
                    "waits_on": [c for c in wt if isinstance(c, int)],
                    "text": text})
    return out


def focus_events(events: list[dict[str, Any]], focus: set[int], limit: int = MAX_SEQUENCE_EVENTS
                 ) -> list[dict[str, Any]]:
    """The events that explain a finding when there are too many to draw: those of the focus instructions, and the
    last end before each focus start that signalled a counter it waits on (what released it)."""
    if len(events) <= limit:
        return events
    keep: set[int] = set()
    last_end: dict[int, int] = {}
    for k, e in enumerate(events):
        if e["kind"] == "end":
            for c in e["signals"]:
                last_end[c] = k
        if e.get("instruction") in focus:
            keep.add(k)
            if e["kind"] == "start":
                keep.update(last_end[c] for c in e["waits_on"] if c in last_end)
    return [events[k] for k in sorted(keep)][:limit]


# ---------------------------------------------------------------------------------------------------------------
# Baselines and the bandwidth floor (from a bench JSON the run folder holds, when present)


def _bench_docs(run: Run) -> list[tuple[Path, Any]]:
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
            return rows, floor if floor is not None else _num(_first(doc, "floor_ms")), est
    if isinstance(doc, dict) and isinstance(doc.get("results"), list) and any(
            isinstance(r, dict) and isinstance(r.get("variants"), dict) for r in doc["results"]):
        return _bench_by_ctx(doc, ctx)
    items: Any = _first(doc, "results", "baselines", "measurements", "rows", "variants") if isinstance(doc, dict) \
        else doc
    if isinstance(items, dict):
        items = [{"name": k, **v} if isinstance(v, dict) else {"name": k, "ms": v} for k, v in items.items()]
    rows: list[tuple[str, float]] = []
    floor = None
    for it in items if isinstance(items, list) else []:
        if not isinstance(it, dict) or (ctx is not None and it.get("ctx") not in (None, ctx)):
            continue
        name = str(_first(it, "name", "label", "variant", "baseline") or "?")
        ms = _ms_of(it)
        if ms is None:
            continue
        if "floor" in name.lower():
            floor = ms
        else:
            rows.append((name, ms))
    f = _first(doc, "floor_ms") if isinstance(doc, dict) else None
    if isinstance(f, dict):
        f = _ms_of(f)
    if _num(f) is not None:
        floor = _num(f)
    est = bool(_first(doc, "estimated")) if isinstance(doc, dict) else False
    return rows, floor, est


def _variant_label(name: str) -> str:
    """The bench's own label of a variant (megasynth.measure.bench owns them), or the name itself."""
    try:
        from megasynth.measure.bench import VARIANTS
    except Exception:  # noqa: BLE001 - the labels are cosmetic; never fail a report over them
        return name
    v = VARIANTS.get(name)
    return v[0] if v else name


def _bench_by_ctx(doc: dict[str, Any], ctx: int | None) -> tuple[list[tuple[str, float]], float | None, bool]:
    """`synth bench --json` (format megasynth-bench/1): results per ctx, each with variants and a measured floor.
    A CPU dry run is labelled so (its numbers are CPU timings, not the GPU's)."""
    recs = [r for r in doc["results"] if isinstance(r, dict) and isinstance(r.get("variants"), dict)]
    pick = next((r for r in recs if r.get("ctx") == ctx), recs[0])
    suffix = " (CPU dry run)" if doc.get("dry_run") else ""
    rows = []
    for name, v in pick["variants"].items():
        ms = _ms_of(v) if isinstance(v, dict) and v.get("status", "ok") == "ok" else None
        if ms is not None:
            label = _variant_label(name)
            rows.append((label + ("" if "dry run" in label else suffix) + ("" if pick.get("ctx") == ctx or ctx is None
                                                              else f" @ctx {pick.get('ctx')}"), ms))
    floor = _ms_of(pick.get("floor")) if isinstance(pick.get("floor"), dict) else _num(pick.get("floor"))
    return rows, floor, False


def estimated_floor_ms(schedule: dict[str, Any] | None, ctx: int | None) -> float | None:
    """Bytes the schedule's instructions must move at `ctx` (from the catalogue's cost) / the H200's measured copy
    bandwidth (DESIGN.md §7). Only used when no bench JSON gives a measured floor; labelled estimated."""
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


# ---------------------------------------------------------------------------------------------------------------
# Templates (megasynth/runs/templates/*.j2) and the static CSS and JS (megasynth/runs/static/), shipped as package data

_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#bab0ac", "#86bcb6", "#d37295"]

# A line break (with the indentation around it) next to a tag or a template tag is layout, not content.
_LAYOUT_BREAK = re.compile(r"(?<=[>}])[ \t]*\n\s*|[ \t]*\n\s*(?=[<{])")
_COMMENT = re.compile(r"(\{#.*?#\})", re.S)


class _Compact(Extension):
    """Drops layout line breaks when a template is loaded: the templates are written one element per line, and the
    pages come out as compact as the strings they replaced. A break inside running text stays (it renders as a
    space)."""

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        # Each break becomes an empty template comment holding the same newlines: line numbers in errors stay right.
        # Template comments are left as they are (odd pieces of the split).
        parts = _COMMENT.split(source)
        return "".join(part if k % 2 else _LAYOUT_BREAK.sub(lambda m: "{#" + "\n" * m.group().count("\n") + "#}", part)
                       for k, part in enumerate(parts))


_ENV = Environment(loader=PackageLoader("megasynth.runs", "templates"), autoescape=True, extensions=[_Compact],
                   undefined=StrictUndefined)


def _render(template: str, **context: Any) -> Markup:
    """One template rendered (autoescaped: every value from a run folder is text, never markup)."""
    return Markup(_ENV.get_template(template).render(**context))


@functools.cache
def _static(name: str) -> str:
    """A file of megasynth/runs/static/, inlined into the pages so that they need no network."""
    return (resources.files("megasynth.runs") / "static" / name).read_text(encoding="utf-8")


def op_colors(ops: list[str]) -> dict[str, str]:
    """A stable colour per op: catalogue ops in decode order first, then the rest by name."""
    from megasynth.ir.catalogue import OP_ORDER

    ordered = [o for o in OP_ORDER if o in ops] + sorted(o for o in set(ops) if o not in OP_ORDER)
    return {o: _PALETTE[k % len(_PALETTE)] for k, o in enumerate(ordered)}


def fmt_ms(ms: float | None, estimated: bool = False) -> str:
    """Milliseconds as the pages and `synth runs` print them (µs below 0.01 ms), labelled when estimated."""
    if ms is None:
        return "—"
    s = f"{ms:.3f} ms" if ms >= 0.01 else f"{ms * 1000:.2f} µs"
    return s + (" (estimated)" if estimated else "")


def bar_chart_svg(rows: list[tuple[str, float, str, bool]], unit: str = "ms", width: int = 720) -> str:
    """Horizontal bars: (label, value, colour, estimated). Estimated bars are hatched and say so."""
    if not rows:
        return ""
    label_w, bar_h, gap = 300, 22, 8
    vmax = max(v for _, v, _, _ in rows) or 1.0
    vmin = min((v for _, v, _, _ in rows if v > 0), default=vmax)
    log = vmax / vmin > 30  # a 200x spread would squash the bars that matter into slivers
    plot = width - label_w - 160

    def length(v: float) -> float:
        if not log:
            return plot * v / vmax
        lo = math.log10(vmin) - 0.3
        return plot * (math.log10(max(v, vmin)) - lo) / (math.log10(vmax) - lo)

    bars = []
    for k, (label, v, colour, est) in enumerate(rows):
        y = gap + k * (bar_h + gap)
        w = max(1.0, length(v))
        val = (fmt_ms(v, est) if unit == "ms" else f"{v:.3f} {unit}" + (" (estimated)" if est else ""))
        bars.append({"label": label, "y": y, "text_y": f"{y + bar_h * 0.7:.1f}", "w": f"{w:.1f}", "colour": colour,
                     "estimated": est, "value": val, "value_x": f"{label_w + w + 6:.1f}"})
    return _render("bars.svg.j2", width=width, height=len(rows) * (bar_h + gap) + gap, bars=bars,
                   label_x=label_w - 8, x=label_w, bar_h=bar_h, log=log)


def sequence_svg(events: list[dict[str, Any]], highlight: set[int]) -> str:
    """A small sequence diagram of a counterexample interleaving: one lifeline per worker, events top to bottom,
    numbered; instructions of the finding (the racing or stuck ones) in red; signal -> wait arrows dashed."""
    evs = events[:MAX_SEQUENCE_EVENTS]
    workers = sorted({e["worker"] for e in evs})
    if not workers:
        return ""
    col_w, row_h, top, left = 200, 22, 34, 34
    x_of = {w: left + col_w // 2 + k * col_w for k, w in enumerate(workers)}
    last_end: dict[int, tuple[int, int]] = {}  # counter -> (row, x) of the latest end that signalled it
    arrows: set[tuple[int, int, int, int]] = set()
    boxes = []
    for k, e in enumerate(evs):
        y = top + k * row_h
        x = x_of[e["worker"]]
        red = e.get("instruction") in highlight
        label = f'{e["kind"]} #{e.get("instruction")}' + (f' {e["op"]}' if e.get("op") else "")
        if e.get("layer") is not None:
            label += f' L{e["layer"]}'
        boxes.append({"x": x, "y": y, "n": e.get("n") or k + 1, "label": label[:34], "title": e.get("text") or label,
                      "fill": "#fde0e0" if red else ("#e8f0fb" if e["kind"] == "start" else "#eef6ea"),
                      "stroke": "#d62728" if red else "#888"})
        if e["kind"] == "start":
            for c in e.get("waits_on", []):
                if c in last_end and last_end[c][1] != x:  # box edge to box edge
                    r0, x0 = last_end[c]
                    right = x0 < x
                    arrows.add((x0 + (col_w // 2 - 6 if right else 6 - col_w // 2), top + r0 * row_h + row_h // 2,
                                x - col_w // 2 + 6 if right else x + col_w // 2 - 6, y + row_h // 2))
        else:
            for c in e.get("signals", []):
                last_end[c] = (k, x)
    return _render("sequence.svg.j2", width=left + col_w * len(workers) + 10, height=top + row_h * len(evs) + 16,
                   top=top, lifelines=[(x_of[w], w) for w in workers], arrows=sorted(arrows), boxes=boxes,
                   half=col_w // 2, col_w=col_w, row_h=row_h)


def _candidate_number(candidate: str) -> int | None:
    """The trial number in a candidate id (`c0007` -> 7), None for an id without one."""
    digits = "".join(ch for ch in candidate if ch.isdigit())
    return int(digits) if digits else None


def curve_svg(entries: list[Entry], width: int = 720, height: int = 280) -> tuple[str, bool, bool, bool] | None:
    """The synthesis curve: every accepted candidate's time at its trial number, and per proposer the best time so
    far (a step line carried to the last trial). Returns (svg, any estimated, estimated and measured mixed, some
    drawn on the top edge because they lie above the axis), or None when no candidate has a time."""
    timed = sorted(((n, e) for e in entries if e.accepted and e.ms is not None
                    and (n := _candidate_number(e.candidate)) is not None), key=lambda ne: ne[0])
    if not timed:
        return None
    numbers = [n for e in entries if (n := _candidate_number(e.candidate)) is not None]
    n_max = max(max(numbers), 1)
    lo, hi = min(e.ms for _, e in timed), max(e.ms for _, e in timed)  # type: ignore[type-var]
    # A naive baseline far above the searched candidates would squash their differences into a sliver: the axis
    # then ends above the searched ones, and what lies higher is drawn on its top edge (its legend says so).
    searched = [e.ms for _, e in timed if e.proposer != "naive"]
    if searched and hi > 1.2 * max(searched):  # type: ignore[type-var]
        hi = max(searched)  # type: ignore[type-var]
    pad = (hi - lo) * 0.08 or lo * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    x0, x1, y0, y1 = 64, width - 170, 12, height - 40

    def sx(n: int) -> float:
        return round(x0 + (x1 - x0) * n / n_max, 1)

    def sy(ms: float) -> float:
        return round(y1 - (y1 - y0) * (min(ms, hi) - lo) / (hi - lo), 1)

    series: dict[str, dict[str, Any]] = {}
    for n, e in timed:
        name = e.proposer or "?"
        s = series.setdefault(name, {"name": name, "colour": _PALETTE[len(series) % len(_PALETTE)], "points": [],
                                     "best": [], "path": ""})
        ms = float(e.ms)  # type: ignore[arg-type]
        s["points"].append({"x": sx(n), "y": sy(ms), "candidate": e.candidate, "ms": ms,
                            "label": fmt_ms(ms, e.estimated)})
        best = min(ms, s["best"][-1]) if s["best"] else ms
        s["path"] += f"M{sx(n)},{sy(best)}" if not s["best"] else f"H{sx(n)}V{sy(best)}"
        s["best"].append(best)
    for s in series.values():
        s["path"] += f"H{sx(n_max)}"
        s["best_label"] = fmt_ms(s["best"][-1]) + (" ↑" if s["best"][-1] > hi else "")
    ticks = 4
    yticks = [{"y": sy(lo + (hi - lo) * k / ticks), "label": f"{lo + (hi - lo) * k / ticks:.3f}"}
              for k in range(ticks + 1)]
    xticks = [{"x": sx(n), "label": str(n)} for n in sorted({0, n_max // 2, n_max})]
    estimated = {e.estimated for _, e in timed}
    svg = _render("curve.svg.j2", width=width, height=height, x0=x0, x1=x1, y0=y0, y1=y1, yticks=yticks,
                  xticks=xticks, series=list(series.values()))
    return svg, True in estimated, len(estimated) > 1, any(e.ms > hi for _, e in timed)  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------------------------
# Pages: each section's data as plain values, the markup in the templates


def _timeline_data(trace: Trace, crit: list[dict[str, Any]]) -> dict[str, Any]:
    ops = sorted({e["op"] for e in trace.events})
    colours = op_colors(ops)
    ops = list(colours)
    k_of = {o: k for k, o in enumerate(ops)}
    ev = trace.events
    return {"lanes": trace.lanes, "laneNames": trace.lane_names, "ops": ops, "colors": [colours[o] for o in ops],
            "span": trace.makespan_us, "estimated": trace.estimated,
            "lane": [e["tid"] for e in ev], "ts": [round(e["ts"], 4) for e in ev],
            "dur": [round(e["dur"], 4) for e in ev], "id": [e["id"] for e in ev], "op": [k_of[e["op"]] for e in ev],
            "layer": [e["layer"] if e["layer"] is not None else -1 for e in ev],
            "wait": [round(e["wait"], 4) for e in ev], "crit": [e["id"] for e in crit]}


def _json_for_script(data: Any) -> str:
    """JSON that can sit inside a <script> element (no `</` to close it early)."""
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def _validation_view(val: Any, title: str) -> dict[str, Any]:
    if not isinstance(val, dict):
        return {"title": title, "verdict": None}
    verdict = str(val.get("verdict", "?"))
    stats = val.get("stats") if isinstance(val.get("stats"), dict) else {}
    secs = val.get("seconds") if isinstance(val.get("seconds"), dict) else {}
    findings = val.get("findings") if isinstance(val.get("findings"), list) else []
    return {"title": title, "verdict": verdict, "accepted": verdict == "accepted",
            "stats": [[k, v] for k, v in stats.items()],
            "phases": [[k, f"{v:.3f} s" if _num(v) is not None else v] for k, v in secs.items()],
            "findings": [(f.get("category", "?"), f.get("message", "")) for f in findings[:MAX_FINDINGS_SHOWN]
                         if isinstance(f, dict)]}


def _rejected_view(run: Run) -> dict[str, Any]:
    """The rejected candidates with their counterexamples, and apart from them the screened ones (the cost model
    left them out; nothing was found wrong with them)."""
    d = run.path / "rejected"
    docs = [(p.stem, read_json(p, run.notes)) for p in sorted(d.glob("*.json"))] if d.is_dir() else []
    screened = [(name, doc) for name, doc in docs if isinstance(doc, dict) and doc.get("reason") == "screened"]
    rest = [(name, doc) for name, doc in docs if not (isinstance(doc, dict) and doc.get("reason") == "screened")]
    items = [_one_rejected(name, doc) if isinstance(doc, dict) else {"name": name, "unreadable": True}
             for name, doc in rest[:MAX_REJECTED_SHOWN]]
    rows = [[str(doc.get("candidate") or name), str(doc.get("proposer") or ""), screened_text(_num(doc.get("estimate_ms"))),
             str(doc.get("rationale") or "")[:120]] for name, doc in screened]
    return {"shown": items, "total": len(rest), "more": max(0, len(rest) - MAX_REJECTED_SHOWN), "screened": rows}


def _findings_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("counterexample", "findings", "validation", "report"):
        v = doc.get(key)
        if isinstance(v, dict) and isinstance(v.get("findings"), list):
            v = v["findings"]
        if isinstance(v, dict) and ("category" in v or "details" in v or "events" in v):
            return [v]
        if isinstance(v, list):
            return [f for f in v if isinstance(f, dict)]
    return [doc] if "category" in doc else []


def _one_rejected(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    schedule = doc.get("schedule") if isinstance(doc.get("schedule"), dict) else None
    by_id = {i.get("id"): i for i in (schedule or {}).get("instructions", []) if isinstance(i, dict)}
    findings = []
    for f in _findings_of(doc)[:3]:
        events = counterexample_events(f)
        for e in events:
            ins = by_id.get(e["instruction"])
            if ins is not None:
                e["op"] = e["op"] or ins.get("op")
                e["layer"] = e["layer"] if e["layer"] is not None else ins.get("layer")
                e["signals"] = e["signals"] or [s.get("counter") for s in ins.get("signals") or []]
                e["waits_on"] = e["waits_on"] or [w.get("counter") for w in ins.get("waits") or []]
        hl = {i for i in f.get("instructions", []) if isinstance(i, int)} if isinstance(f.get("instructions"),
                                                                                         list) else set()
        shown = focus_events(events, hl) if events else []
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        stuck = details.get("stuck") if isinstance(details.get("stuck"), list) else []
        cycle = details.get("cycle")
        text = details.get("text")
        findings.append({
            "category": f.get("category", "?"), "message": f.get("message", ""),
            "events": len(events), "shown": len(shown), "svg": sequence_svg(shown, hl) if events else "",
            "stuck": [[s.get("worker"), f"#{s.get('instruction')}", s.get("counter"),
                       f"{s.get('current')} of {s.get('needed')}", s.get("reachable", "")]
                      for s in stuck[:30] if isinstance(s, dict)],
            "cycle": cycle if isinstance(cycle, list) and cycle else None,
            "text": "\n".join(map(str, text)) if isinstance(text, list) and text else None})
    return {"name": _first(doc, "candidate", "id") or name, "unreadable": False, "proposer": _first(doc, "proposer"),
            "rationale": _first(doc, "rationale"), "error": doc["error"] if _first(doc, "error") else None,
            "reason": _first(doc, "reason") or "error", "findings": findings}


def _agent_view(run: Run) -> dict[str, Any] | None:
    """The LLM agent's bookkeeping when it took part: agent_usage.json (calls, tokens, cost) and agent.jsonl."""
    usage = read_json(run.path / "agent_usage.json", run.notes)
    log = run.path / "agent.jsonl"
    if not isinstance(usage, dict) and not log.is_file():
        return None
    rows = []
    if isinstance(usage, dict):
        for key in ("model", "base_url", "calls", "rounds", "proposals", "accepted", "rejected", "prompt_tokens",
                    "completion_tokens", "total_tokens", "cost_usd", "briefing_tokens_max", "errors"):
            if usage.get(key) not in (None, {}, ""):
                rows.append([key, json.dumps(usage[key]) if isinstance(usage[key], dict) else usage[key]])
    kinds: dict[str, int] = {}
    if log.is_file():
        try:
            with open(log, encoding="utf-8") as fh:
                for k, line in enumerate(fh):
                    if k >= 100_000:
                        break
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        rec = {"type": "unreadable line"}
                    t = str(rec.get("type", "?")) if isinstance(rec, dict) else "?"
                    kinds[t] = kinds.get(t, 0) + 1
        except OSError as exc:
            run.notes.append(f"agent.jsonl: cannot read ({exc.strerror or exc})")
    return {"rows": rows, "kinds": sorted(kinds.items())}


def _per_op_view(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    per_op = summary.get("per_op", {})
    colours = op_colors(list(per_op))
    total = sum(d["total_us"] for d in per_op.values()) or 1.0
    tmax = max((d["total_us"] for d in per_op.values()), default=1.0) or 1.0
    rows = [{"op": op, "colour": colours[op], "count": d["count"], "total": f"{d['total_us']:.1f}",
             "share": f"{100 * d['total_us'] / total:.1f}%", "mean": f"{d['mean_us']:.2f}",
             "wait": f"{d['wait_us']:.1f}", "bar": max(1, int(240 * d["total_us"] / tmax))} for op, d in per_op.items()]
    per_sm = summary.get("per_sm", {})
    worst = sorted(per_sm, key=lambda w: -per_sm[w]["idle_us"])[:5]
    return {"rows": rows, "busy": f"{100 * summary.get('busy_fraction', 0):.1f}",
            "wait": f"{100 * summary.get('wait_fraction', 0):.1f}",
            "idle": [(trace.lane_names[w] if 0 <= w < trace.lanes else w, f"{per_sm[w]['idle_us']:.1f}")
                     for w in worst],
            "critical": [(op, f"{us:.1f}") for op, us in summary.get("critical_path_by_op_us", {}).items()]}


def _critical_view(trace: Trace, crit: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not crit:
        return None
    rows = [[str(k + 1), f"#{e['id']}", e["op"], "" if e["layer"] is None else str(e["layer"]),
             trace.lane_names[e["tid"]], f"{e['ts']:.2f}", f"{e['dur']:.2f}", f"{e['wait_us']:.2f}"]
            for k, e in enumerate(crit[:MAX_CRITICAL_ROWS])]
    return {"count": len(crit), "busy": f"{sum(e['dur'] for e in crit):.1f}", "rows": rows,
            "more": len(crit) > MAX_CRITICAL_ROWS}


def _candidates_view(run: Run) -> list[dict[str, Any]]:
    naive = run.naive()
    order = sorted(run.entries, key=lambda e: (not e.accepted, e.ms if e.ms is not None else math.inf))
    return [{"id": e.candidate, "linked": (run.path / "candidates" / e.candidate).is_dir(), "proposer": e.proposer,
             "accepted": e.accepted, "verdict": e.verdict, "screened": e.status == "screened",
             "ms": fmt_ms(e.ms, e.estimated),
             "speedup": f"{naive.ms / e.ms:.2f}×" if naive and naive.ms and e.ms else "", "note": e.note[:120]}
            for e in order[:200]]


def render_report(run: Run) -> str:
    """The HTML report of one run (self-contained)."""
    best_dir = run.path / "best"
    schedule = read_json(best_dir / "schedule.json", run.notes)
    validation = read_json(best_dir / "validation.json", run.notes)
    timing = read_json(best_dir / "timing.json", run.notes)
    trace_doc = read_json(best_dir / "trace.json", run.notes)
    trace: Trace | None = None
    if trace_doc is not None:
        try:
            trace = parse_trace(trace_doc)
        except ValueError as exc:
            run.notes.append(f"{exc}; timeline omitted")
    best, naive = run.best(), run.naive()
    est_any = bool(best and best.estimated) or bool(trace and trace.estimated) or bool(_first(timing, "estimated"))
    ctx = _first(trace.metadata, "ctx") if trace else None
    ctx = ctx if isinstance(ctx, int) else _first(timing, "ctx") or _first(run.info, "ctx")
    cmd = _first(run.info, "command", "argv")

    # summary cards
    floor_ms, floor_est, baselines, b_est, floor_note = None, False, [], False, ""
    for _p, doc in _bench_docs(run):
        if isinstance(doc, dict) and doc.get("dry_run") and not floor_note:
            floor_note = " (CPU dry run)"
        rows, fl, e = bench_rows(doc, ctx if isinstance(ctx, int) else None)
        baselines += [(f"{name}", ms) for name, ms in rows]
        if fl is not None and floor_ms is None:
            floor_ms = fl
        b_est = b_est or e
    if floor_ms is None:
        floor_ms = estimated_floor_ms(schedule, ctx if isinstance(ctx, int) else None)
        floor_est = floor_ms is not None
    sp = run.speedup()
    best_txt = fmt_ms(best.ms, best.estimated) if best else "—"
    p10, p90 = _num(_first(timing, "p10_ms")), _num(_first(timing, "p90_ms"))
    if best and p10 is not None and p90 is not None:
        best_txt += f" (p10–p90 {p10:.3f}–{p90:.3f})"
    src = _first(timing, "source")
    if src:
        best_txt += f" · {src}"
    cards = [("best schedule", best_txt),
             ("naive schedule", fmt_ms(naive.ms, naive.estimated) if naive else "—"),
             ("speed-up over naive", f"{sp:.2f}×" if sp else "—"),
             ("bandwidth floor", fmt_ms(floor_ms, floor_est) + floor_note if floor_ms else "—"),
             ("candidates", f"{run.accepted} accepted / {run.screened} screened / {run.rejected} rejected")]
    if isinstance(ctx, int):
        cards.append(("context", str(ctx)))

    # chart: baselines, naive, best, floor
    bars: list[tuple[str, float, str, bool]] = [(n, ms, "#9ca3af", b_est) for n, ms in baselines]
    if naive and naive.ms:
        bars.append(("naive schedule", naive.ms, "#f28e2b", naive.estimated))
    if best and best.ms:
        bars.append(("best schedule", best.ms, "#4e79a7", best.estimated))
    if floor_ms:
        bars.append(("bandwidth floor" + (" (4.19 TB/s)" if floor_est else floor_note), floor_ms, "#59a14f",
                     floor_est))
    curve = curve_svg(run.entries)

    timeline = per_op = critical = None
    if trace is not None and trace.events:
        summary = summarize(trace, schedule)
        crit = summary["critical_path"]
        data = _timeline_data(trace, crit)
        timeline = {"estimated": trace.estimated, "instructions": len(trace.events), "lanes": trace.lanes,
                    "makespan": f"{trace.makespan_us:.1f}", "legend": list(zip(data["ops"], data["colors"],
                                                                                 strict=True)),
                    "data_json": _json_for_script(data)}
        per_op = _per_op_view(trace, summary)
        critical = _critical_view(trace, crit)
    page = {"command": (" ".join(map(str, cmd)) if isinstance(cmd, list) else cmd) if cmd else None,
            "estimated": est_any, "cards": cards,
            "chart": {"svg": bar_chart_svg(bars), "baselines": bool(baselines), "hatched": any(b[3] for b in bars)},
            "curve": {"svg": curve[0], "estimated": curve[1], "mixed": curve[2], "clipped": curve[3]} if curve else None,
            "timeline": timeline, "per_op": per_op, "critical_path": critical,
            "validation": _validation_view(validation, "Validation of the best schedule"),
            "candidates": _candidates_view(run) if run.entries else None,
            "rejected": _rejected_view(run), "agent": _agent_view(run)}
    page["notes"] = list(run.notes)  # last: the sections above add what they could not read
    page["info_json"] = json.dumps(run.info, indent=1)[:20000] if run.info else None
    return _render("report.html.j2", title=f"megasynth run {run.name}", css=_static("report.css"),
                   script=_static("timeline.js") if timeline else "", perfetto_hint=PERFETTO_HINT, run=run,
                   page=page)


def render_index(runs: list[Run]) -> str:
    """runs/index.html: the leaderboard of runs."""
    rows = []
    for r in runs:
        b = r.best()
        sp = r.speedup()
        rows.append({"name": r.name, "model": r.model, "gpu": r.gpu, "best": fmt_ms(b.ms, b.estimated) if b else "—",
                     "speedup": f"{sp:.2f}×" if sp else "—", "accepted": r.accepted, "screened": r.screened,
                     "rejected": r.rejected, "date": r.date})
    return _render("index.html.j2", title="megasynth runs", css=_static("report.css"), script="",
                   perfetto_hint=PERFETTO_HINT, rows=rows)


def write_report(run_dir: str | Path) -> Path:
    """Write runs/<run>/report.html (atomically) and return its path."""
    run = load_run(run_dir)
    out = run.path / "report.html"
    write_text_atomic(out, render_report(run))
    return out


def write_index(runs_dir: str | Path) -> Path:
    """Write runs/index.html (atomically) and return its path."""
    out = Path(runs_dir) / "index.html"
    write_text_atomic(out, render_index(list_runs(runs_dir)))
    return out
