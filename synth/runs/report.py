"""Read a run folder of runs/ defensively and render it as self-contained HTML (a leaderboard and one report per run).

Every input is optional: a missing or unreadable file drops its section and leaves a note, never a crash. The HTML
needs no network when viewed (inline CSS and JS); the SM timeline is drawn on a <canvas> so that 10 000+
instructions stay smooth. Numbers that came from the cost model rather than the GPU are labelled "estimated".
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from validator.atomic import write_text_atomic

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
    """One candidate on a run's leaderboard."""

    candidate: str
    ms: float | None
    estimated: bool
    accepted: bool
    proposer: str = ""
    note: str = ""


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
        note = _first(r, "rationale", "note") if accepted else _first(r, "reason", "error", "rationale", "note")
        out.append(Entry(str(cand if cand is not None else k), _ms_of(r), bool(r.get("estimated", False)),
                         bool(accepted), str(_first(r, "proposer") or ""), str(note or "")))
    return out


@dataclass
class Run:
    """What a run folder holds, read defensively. `notes` says what was missing or unreadable."""

    name: str
    path: Path
    info: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    accepted: int = 0
    rejected: int = 0
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
    run.rejected = max(len(rejs), sum(1 for e in run.entries if not e.accepted))
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
    from kernels.trace import check_trace

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
    """Time per op, per-SM busy/wait/idle and the critical path, as `kernels.trace.summarize` (the format's owner)
    computes them; the schedule, when given, tells it which instructions each one waited on."""
    from kernels.trace import summarize as trace_summary

    return trace_summary(trace.doc, producers_of(schedule))


# ---------------------------------------------------------------------------------------------------------------
# Rendering helpers

_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#bab0ac", "#86bcb6", "#d37295"]


def op_colors(ops: list[str]) -> dict[str, str]:
    """A stable colour per op: catalogue ops in decode order first, then the rest by name."""
    from validator.catalogue import OP_ORDER

    ordered = [o for o in OP_ORDER if o in ops] + sorted(o for o in set(ops) if o not in OP_ORDER)
    return {o: _PALETTE[k % len(_PALETTE)] for k, o in enumerate(ordered)}


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt_ms(ms: float | None, estimated: bool = False) -> str:
    if ms is None:
        return "—"
    s = f"{ms:.3f} ms" if ms >= 0.01 else f"{ms * 1000:.2f} µs"
    return s + (" (estimated)" if estimated else "")


def _badge(estimated: bool) -> str:
    return '<span class="est">estimated</span>' if estimated else '<span class="meas">measured</span>'


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

    h = len(rows) * (bar_h + gap) + gap
    parts = [f'<svg class="bars" width="{width}" height="{h}" viewBox="0 0 {width} {h}" role="img">',
             '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff" fill-opacity="0.0"/>'
             '<line x1="0" y1="0" x2="0" y2="6" stroke="#fff" stroke-width="2" stroke-opacity="0.55"/></pattern>'
             '</defs>']
    for k, (label, v, colour, est) in enumerate(rows):
        y = gap + k * (bar_h + gap)
        w = max(1.0, length(v))
        parts.append(f'<text x="{label_w - 8}" y="{y + bar_h * 0.7:.1f}" text-anchor="end">{esc(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}"/>')
        if est:
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="url(#hatch)"/>')
        val = (fmt_ms(v, est) if unit == "ms" else f"{v:.3f} {unit}" + (" (estimated)" if est else ""))
        parts.append(f'<text x="{label_w + w + 6:.1f}" y="{y + bar_h * 0.7:.1f}">{esc(val)}</text>')
    parts.append("</svg>")
    if log:
        parts.append("<p class='note'>Bar lengths on a log scale (the values span more than 30×).</p>")
    return "".join(parts)


def sequence_svg(events: list[dict[str, Any]], highlight: set[int]) -> str:
    """A small sequence diagram of a counterexample interleaving: one lifeline per worker, events top to bottom,
    numbered; instructions of the finding (the racing or stuck ones) in red; signal -> wait arrows dashed."""
    evs = events[:MAX_SEQUENCE_EVENTS]
    workers = sorted({e["worker"] for e in evs})
    if not workers:
        return ""
    col_w, row_h, top, left = 200, 22, 34, 34
    x_of = {w: left + col_w // 2 + k * col_w for k, w in enumerate(workers)}
    width = left + col_w * len(workers) + 10
    height = top + row_h * len(evs) + 16
    p = [f'<svg class="seq" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
         '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
         '<path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>']
    for w in workers:
        x = x_of[w]
        p.append(f'<text x="{x}" y="18" text-anchor="middle" class="lh">worker {esc(w)}</text>')
        p.append(f'<line x1="{x}" y1="{top - 8}" x2="{x}" y2="{height - 6}" stroke="#bbb" stroke-dasharray="3,3"/>')
    n_head = len(p)
    last_end: dict[int, tuple[int, int]] = {}  # counter -> (row, x) of the latest end that signalled it
    arrows: set[tuple[int, int, int, int]] = set()
    for k, e in enumerate(evs):
        y = top + k * row_h
        x = x_of[e["worker"]]
        red = e.get("instruction") in highlight
        fill = "#fde0e0" if red else ("#e8f0fb" if e["kind"] == "start" else "#eef6ea")
        stroke = "#d62728" if red else "#888"
        label = f'{e["kind"]} #{e.get("instruction")}' + (f' {e["op"]}' if e.get("op") else "")
        if e.get("layer") is not None:
            label += f' L{e["layer"]}'
        p.append(f'<text x="6" y="{y + 14}" class="num">{esc(e.get("n") or k + 1)}</text>')
        p.append(f'<rect x="{x - col_w // 2 + 6}" y="{y + 2}" width="{col_w - 12}" height="{row_h - 4}" rx="3" '
                 f'fill="{fill}" stroke="{stroke}"/>')
        p.append(f'<text x="{x}" y="{y + 15}" text-anchor="middle" class="ev">{esc(label[:34])}'
                 f'<title>{esc(e.get("text") or label)}</title></text>')
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
    lines = [f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" stroke="#777" stroke-dasharray="4,2" '
             'marker-end="url(#arr)"/>' for x0, y0, x1, y1 in sorted(arrows)]
    p[n_head:n_head] = lines  # under the boxes
    p.append("</svg>")
    return "".join(p)


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
    """The bench's own label of a variant (synth.measure.bench owns them), or the name itself."""
    try:
        from synth.measure.bench import VARIANTS
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
        from validator.catalogue import OPS
        from validator.program import resolve
        from validator.schedule import parse_schedule

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
# Pages

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#1f2937;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .sub{color:#cbd5e1;font-size:13px;margin-top:4px}main{padding:12px 24px 40px;max-width:1500px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px;margin:14px 0}
h2{font-size:16px;margin:2px 0 10px}table{border-collapse:collapse;font-size:13px}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600}td.r,th.r{text-align:right;font-variant-numeric:tabular-nums}
.est{background:#fff4d6;color:#8a5a00;border:1px solid #f0c36d;border-radius:4px;padding:0 5px;font-size:12px}
.meas{background:#e4f6e8;color:#1e6b34;border:1px solid #9bd3a9;border-radius:4px;padding:0 5px;font-size:12px}
.note{color:#6b7280;font-size:13px}.bad{color:#b91c1c;font-weight:600}.good{color:#15803d;font-weight:600}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 14px;
min-width:150px;background:#fcfcfd}.card .v{font-size:20px;font-weight:600}.card .k{color:#6b7280;font-size:12px}
#tl-wrap{position:relative;width:100%;overflow:hidden;border:1px solid #e5e7eb;border-radius:4px}
#timeline{display:block;cursor:crosshair}
#tip{position:fixed;pointer-events:none;background:#111827;color:#fff;font-size:12px;padding:5px 8px;border-radius:4px;
display:none;white-space:pre;z-index:10}
.legend span{display:inline-block;margin-right:12px;font-size:12px}.legend i{display:inline-block;width:11px;
height:11px;margin-right:4px;vertical-align:-1px;border-radius:2px}
.opbar{display:inline-block;height:11px;border-radius:2px}svg text{font-size:12px;fill:#1d1d1f}
svg.seq text.ev{font-size:11px}svg.seq text.num{fill:#6b7280;font-size:11px}svg.seq text.lh{font-weight:600}
pre{background:#f6f8fa;padding:8px;border-radius:4px;overflow:auto;font-size:12px;max-height:360px}
a{color:#1d4ed8}code{background:#f3f4f6;padding:0 3px;border-radius:3px}
"""

_TIMELINE_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('tl-data').textContent);
const cv = document.getElementById('timeline'), wrap = document.getElementById('tl-wrap');
const tip = document.getElementById('tip'), ctx = cv.getContext('2d');
const N = D.id.length, LEFT = 58, TOP = 22;
const laneH = Math.max(4, Math.min(18, Math.floor(640 / Math.max(1, D.lanes))));
const H = TOP + D.lanes * laneH + 4;
let W = 800, t0 = 0, t1 = D.span > 0 ? D.span : 1, showCrit = true;
const laneStart = new Int32Array(D.lanes + 1);  // events are sorted by (lane, ts)
for (let i = 0, l = 0; l <= D.lanes; l++) { while (i < N && D.lane[i] < l) i++; laneStart[l] = i; }
const byOp = D.ops.map(() => []);
for (let i = 0; i < N; i++) byOp[D.op[i]].push(i);
const idx = new Map(); for (let i = 0; i < N; i++) idx.set(D.id[i], i);
const crit = D.crit.map(id => idx.get(id)).filter(i => i !== undefined);
function size(){ W = Math.max(300, wrap.clientWidth); const r = window.devicePixelRatio || 1;
  cv.width = W * r; cv.height = H * r; cv.style.width = W + 'px'; cv.style.height = H + 'px';
  ctx.setTransform(r, 0, 0, r, 0, 0); }
function sx(t){ return LEFT + (t - t0) * (W - LEFT - 8) / (t1 - t0); }
function draw(){
  ctx.clearRect(0, 0, W, H); ctx.font = '11px system-ui,sans-serif';
  ctx.fillStyle = '#f6f7f9';
  for (let l = 1; l < D.lanes; l += 2) ctx.fillRect(LEFT, TOP + l * laneH, W, laneH);
  const y0 = TOP, h = Math.max(1, laneH - 1);
  ctx.fillStyle = '#d8dbe0';  // waiting on counters before a start
  ctx.beginPath();
  for (let i = 0; i < N; i++) { const w = D.wait[i]; if (w <= 0) continue;
    const a = sx(D.ts[i] - w), b = sx(D.ts[i]); if (b < LEFT || a > W) continue;
    ctx.rect(Math.max(a, LEFT), y0 + D.lane[i] * laneH + h * 0.35, Math.max(b - Math.max(a, LEFT), 0.5), h * 0.3); }
  ctx.fill();
  for (let k = 0; k < byOp.length; k++) { const ev = byOp[k]; ctx.fillStyle = D.colors[k]; ctx.beginPath();
    for (let j = 0; j < ev.length; j++) { const i = ev[j]; const a = sx(D.ts[i]), b = sx(D.ts[i] + D.dur[i]);
      if (b < LEFT || a > W) continue; const x = Math.max(a, LEFT);
      ctx.rect(x, y0 + D.lane[i] * laneH, Math.max(b - x, 0.6), h); }
    ctx.fill(); }
  if (showCrit && crit.length) { ctx.strokeStyle = '#000'; ctx.lineWidth = 1.5; ctx.beginPath();
    for (const i of crit) { const a = sx(D.ts[i]), b = sx(D.ts[i] + D.dur[i]); if (b < LEFT || a > W) continue;
      ctx.rect(Math.max(a, LEFT), y0 + D.lane[i] * laneH, Math.max(b - Math.max(a, LEFT), 1), h); }
    ctx.stroke(); }
  ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, LEFT, H); ctx.fillRect(0, 0, W, TOP);
  ctx.fillStyle = '#374151'; const every = Math.ceil(12 / laneH);
  for (let l = 0; l < D.lanes; l += every) ctx.fillText(D.laneNames[l], 4, TOP + l * laneH + Math.min(laneH, 12) - 1);
  const span = t1 - t0, step = Math.pow(10, Math.floor(Math.log10(span / 6)));
  const st = span / step > 30 ? step * 5 : span / step > 12 ? step * 2 : step;
  ctx.strokeStyle = '#e5e7eb'; ctx.lineWidth = 1; ctx.beginPath();
  for (let t = Math.ceil(t0 / st) * st; t <= t1; t += st) { const x = sx(t); ctx.moveTo(x, TOP - 4); ctx.lineTo(x, H);
    ctx.fillText((t >= 1000 ? (t / 1000).toFixed(st >= 1000 ? 0 : 2) + ' ms' : +t.toFixed(3) + ' µs'), x + 2, 12); }
  ctx.stroke();
}
let frame = 0; function redraw(){ if (!frame) frame = requestAnimationFrame(() => { frame = 0; draw(); }); }
function hit(mx, my){
  const l = Math.floor((my - TOP) / laneH); if (l < 0 || l >= D.lanes || mx < LEFT) return -1;
  const t = t0 + (mx - LEFT) * (t1 - t0) / (W - LEFT - 8), tol = 2 * (t1 - t0) / (W - LEFT - 8);
  let lo = laneStart[l], hi = laneStart[l + 1] - 1, k = -1;
  while (lo <= hi) { const m = (lo + hi) >> 1; if (D.ts[m] <= t + tol) { k = m; lo = m + 1; } else hi = m - 1; }
  if (k >= 0 && t <= D.ts[k] + D.dur[k] + tol) return k; return -1;
}
function describe(i){
  const lay = D.layer[i] >= 0 ? ' L' + D.layer[i] : '';
  return '#' + D.id[i] + ' ' + D.ops[D.op[i]] + lay + '\n' + D.laneNames[D.lane[i]] + '  start ' +
    D.ts[i].toFixed(2) + ' µs  dur ' + D.dur[i].toFixed(2) + ' µs\nwaited ' + D.wait[i].toFixed(2) + ' µs' +
    (D.estimated ? '  (estimated)' : '');
}
cv.addEventListener('mousemove', ev => { const r = cv.getBoundingClientRect();
  if (drag) { const dt = (drag.x - ev.clientX) * (t1 - t0) / (W - LEFT - 8); t0 = drag.t0 + dt; t1 = drag.t1 + dt;
    redraw(); return; }
  const i = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (i < 0) { tip.style.display = 'none'; return; }
  tip.textContent = describe(i); tip.dataset.id = D.id[i]; tip.style.display = 'block';
  const tw = tip.offsetWidth, th = tip.offsetHeight;  // keep the tooltip inside the window
  tip.style.left = (ev.clientX + 14 + tw > window.innerWidth ? ev.clientX - tw - 10 : ev.clientX + 14) + 'px';
  tip.style.top = (ev.clientY + 12 + th > window.innerHeight ? ev.clientY - th - 8 : ev.clientY + 12) + 'px'; });
cv.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
cv.addEventListener('wheel', ev => { ev.preventDefault(); const r = cv.getBoundingClientRect();
  const f = Math.exp(ev.deltaY * 0.0015), mx = ev.clientX - r.left;
  const t = t0 + Math.max(0, mx - LEFT) * (t1 - t0) / (W - LEFT - 8);
  t0 = t - (t - t0) * f; t1 = t + (t1 - t) * f; if (t1 - t0 < 1e-3) t1 = t0 + 1e-3; redraw(); }, {passive: false});
let drag = null;
cv.addEventListener('mousedown', ev => { drag = {x: ev.clientX, t0, t1}; });
window.addEventListener('mouseup', () => { drag = null; });
cv.addEventListener('dblclick', () => { t0 = 0; t1 = D.span > 0 ? D.span : 1; redraw(); });
const cb = document.getElementById('crit-toggle');
if (cb) cb.addEventListener('change', () => { showCrit = cb.checked; redraw(); });
window.addEventListener('resize', () => { size(); draw(); });
size(); draw();
cv.dataset.lanes = D.lanes; cv.dataset.instructions = N;
window.__timeline = {
  lanes: D.lanes, instructions: N,
  positionOf(id){ const i = idx.get(id); if (i === undefined) return null; const r = cv.getBoundingClientRect();
    const a = Math.max(sx(D.ts[i]), LEFT), b = sx(D.ts[i] + D.dur[i]);
    return {x: r.left + (a + Math.max(b, a + 0.6)) / 2, y: r.top + TOP + D.lane[i] * laneH + laneH / 2}; },
  longest(){ let k = 0; for (let i = 1; i < N; i++) if (D.dur[i] > D.dur[k]) k = i; return D.id[k]; },
  benchmark(frames){ const s = performance.now(); for (let f = 0; f < frames; f++) { t1 = t1 * 0.999; draw(); }
    t0 = 0; t1 = D.span > 0 ? D.span : 1; draw(); return (performance.now() - s) / frames; },
};
})();
"""


def _page(title: str, body: str, script: str = "") -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            "<link rel=\"icon\" href=\"data:,\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>{body}"
            + (f"<script>{script}</script>" if script else "") + "</body></html>\n")


def _json_script(ident: str, data: Any) -> str:
    text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f'<script id="{ident}" type="application/json">{text}</script>'


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


def _table(head: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right or set()
    th = "".join(f'<th class="r">{h}</th>' if k in right else f"<th>{h}</th>" for k, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="r">{c}</td>' if k in right else f"<td>{c}</td>"
                                    for k, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _validation_section(val: Any, title: str) -> str:
    if not isinstance(val, dict):
        return f'<section id="validation"><h2>{esc(title)}</h2><p class="note">No validation.json: not shown.</p>' \
               "</section>"
    verdict = str(val.get("verdict", "?"))
    cls = "good" if verdict == "accepted" else "bad"
    stats = val.get("stats") if isinstance(val.get("stats"), dict) else {}
    secs = val.get("seconds") if isinstance(val.get("seconds"), dict) else {}
    rows = [[esc(k), esc(v)] for k, v in stats.items()]
    srows = [[esc(k), f"{v:.3f} s" if _num(v) is not None else esc(v)] for k, v in secs.items()]
    findings = val.get("findings") if isinstance(val.get("findings"), list) else []
    f_html = ""
    if findings:
        f_html = "<h3>Findings</h3><ul>" + "".join(
            f"<li><b>{esc(f.get('category', '?'))}</b>: {esc(f.get('message', ''))}</li>"
            for f in findings[:MAX_FINDINGS_SHOWN] if isinstance(f, dict)) + "</ul>"
    return (f'<section id="validation"><h2>{esc(title)}</h2><p>Verdict: <span class="{cls}">{esc(verdict)}</span>'
            " — every interleaving the schedule permits computes what ascending-id order computes"
            f"{'' if verdict == 'accepted' else ' — NOT proven'}.</p><div class=\"cards\"><div>"
            f"{_table(['statistic', 'value'], rows, {1})}</div><div>{_table(['phase', 'time'], srows, {1})}</div>"
            f"</div>{f_html}</section>")


def _rejected_section(run: Run) -> str:
    d = run.path / "rejected"
    files = sorted(d.glob("*.json")) if d.is_dir() else []
    if not files:
        return ('<section id="rejected"><h2>Rejected candidates</h2><p class="note">None recorded in rejected/.</p>'
                "</section>")
    parts = [f'<section id="rejected"><h2>Rejected candidates ({len(files)})</h2><p class="note">Each was proven '
             "unsafe (or could not be proven safe) by the validator; the counterexample is an interleaving the "
             "schedule permits, drawn as a sequence diagram (red: the instructions of the finding; dashed arrows: "
             "the signal a start waited for).</p>"]
    for p in files[:MAX_REJECTED_SHOWN]:
        doc = read_json(p, run.notes)
        if not isinstance(doc, dict):
            parts.append(f"<h3>{esc(p.stem)}</h3><p class='note'>unreadable</p>")
            continue
        parts.append(_one_rejected(p.stem, doc))
    if len(files) > MAX_REJECTED_SHOWN:
        parts.append(f"<p class='note'>… and {len(files) - MAX_REJECTED_SHOWN} more in rejected/.</p>")
    parts.append("</section>")
    return "".join(parts)


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


def _one_rejected(name: str, doc: dict[str, Any]) -> str:
    findings = _findings_of(doc)
    head = f"<h3>{esc(_first(doc, 'candidate', 'id') or name)}"
    prop = _first(doc, "proposer")
    if prop:
        head += f" <span class='note'>({esc(prop)})</span>"
    head += "</h3>"
    why = _first(doc, "rationale")
    out = [head] + ([f"<p class='note'>{esc(why)}</p>"] if why else [])
    if _first(doc, "error"):
        out.append(f"<p><b>{esc(_first(doc, 'reason') or 'error')}</b>: {esc(doc['error'])}</p>")
    if not findings:
        out.append("<p class='note'>No counterexample recorded.</p>")
    schedule = doc.get("schedule") if isinstance(doc.get("schedule"), dict) else None
    by_id = {i.get("id"): i for i in (schedule or {}).get("instructions", []) if isinstance(i, dict)}
    for f in findings[:3]:
        out.append(f"<p><b>{esc(f.get('category', '?'))}</b>: {esc(f.get('message', ''))}</p>")
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
        if events:
            shown = focus_events(events, hl)
            out.append(sequence_svg(shown, hl))
            if len(shown) < len(events):
                out.append(f"<p class='note'>{len(shown)} of {len(events)} events shown: those of the racing "
                           "instructions and the signals that released them (all are in the JSON).</p>")
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        stuck = details.get("stuck") if isinstance(details.get("stuck"), list) else []
        if stuck:
            rows = [[esc(s.get("worker")), f"#{esc(s.get('instruction'))}", esc(s.get("counter")),
                     f"{esc(s.get('current'))} of {esc(s.get('needed'))}", esc(s.get("reachable", ""))]
                    for s in stuck[:30] if isinstance(s, dict)]
            out.append(_table(["stuck worker", "instruction", "waits on counter", "value", "reachable"], rows, {3, 4}))
            cyc = details.get("cycle")
            if isinstance(cyc, list) and cyc:
                out.append("<p>wait-for cycle: " + " → ".join(f"#{esc(c)}" for c in cyc) + f" → #{esc(cyc[0])}</p>")
        text = details.get("text")
        if isinstance(text, list) and text:
            out.append("<details><summary>as text</summary><pre>" + esc("\n".join(map(str, text))) + "</pre></details>")
        elif not events:
            out.append("<p class='note'>No event list in this finding.</p>")
    return "".join(out)


def _agent_section(run: Run) -> str:
    """The LLM agent's bookkeeping when it took part: agent_usage.json (calls, tokens, cost) and agent.jsonl."""
    usage = read_json(run.path / "agent_usage.json", run.notes)
    log = run.path / "agent.jsonl"
    if not isinstance(usage, dict) and not log.is_file():
        return ""
    rows = []
    if isinstance(usage, dict):
        for key in ("model", "base_url", "calls", "rounds", "proposals", "accepted", "rejected", "prompt_tokens",
                    "completion_tokens", "total_tokens", "cost_usd", "briefing_tokens_max", "errors"):
            if usage.get(key) not in (None, {}, ""):
                rows.append([esc(key), esc(json.dumps(usage[key]) if isinstance(usage[key], dict) else usage[key])])
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
    lines = ", ".join(f"{n} {esc(t)}" for t, n in sorted(kinds.items()))
    return ('<section id="agent"><h2>LLM agent</h2>' + (_table(["", ""], rows) if rows else "")
            + (f'<p>Transcript <a href="agent.jsonl">agent.jsonl</a>: {lines}.</p>' if kinds else "") + "</section>")


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

    body = [f"<header><h1>Run {esc(run.name)}</h1><div class=\"sub\">model {esc(run.model)} · GPU {esc(run.gpu)} · "
            f"{esc(run.date)} UTC · <a style='color:#93c5fd' href='../index.html'>all runs</a></div></header><main>"]
    cmd = _first(run.info, "command", "argv")
    if cmd:
        body.append(f"<p>Command: <code>{esc(' '.join(map(str, cmd)) if isinstance(cmd, list) else cmd)}</code></p>")
    if est_any:
        body.append('<p><span class="est">estimated</span> Numbers marked estimated come from the cost model '
                    "(no GPU was used for them), not from a measurement.</p>")

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
             ("candidates", f"{run.accepted} accepted / {run.rejected} rejected")]
    if isinstance(ctx, int):
        cards.append(("context", str(ctx)))
    body.append('<section id="summary"><h2>Summary</h2><div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>' for k, v in cards)
        + "</div></section>")

    # chart: baselines, naive, best, floor
    bars: list[tuple[str, float, str, bool]] = [(n, ms, "#9ca3af", b_est) for n, ms in baselines]
    if naive and naive.ms:
        bars.append(("naive schedule", naive.ms, "#f28e2b", naive.estimated))
    if best and best.ms:
        bars.append(("best schedule", best.ms, "#4e79a7", best.estimated))
    if floor_ms:
        bars.append(("bandwidth floor" + (" (4.19 TB/s)" if floor_est else floor_note), floor_ms, "#59a14f",
                     floor_est))
    chart_note = "" if baselines else ("<p class='note'>No bench JSON in this run (bench.json): baselines are not "
                                       "shown; measure them on the GPU with <code>synth bench --json bench.json"
                                       "</code>, then <code>synth runs report RUN --bench bench.json</code>.</p>")
    body.append('<section id="chart"><h2>Milliseconds per token: baselines, naive, best, floor</h2>'
                + (bar_chart_svg(bars) or "<p class='note'>No timings in this run.</p>") + chart_note
                + ("<p class='note'>Hatched bars are estimates.</p>" if any(b[3] for b in bars) else "")
                + "</section>")

    # timeline
    if trace is not None and trace.events:
        summary = summarize(trace, schedule)
        crit = summary["critical_path"]
        data = _timeline_data(trace, crit)
        legend = "".join(f'<span><i style="background:{c}"></i>{esc(o)}</span>'
                         for o, c in zip(data["ops"], data["colors"], strict=True))
        body.append(
            f'<section id="timeline-section"><h2>Timeline, one lane per SM {_badge(trace.estimated)}</h2>'
            f'<p class="note">{len(trace.events)} instructions on {trace.lanes} workers, makespan '
            f'{trace.makespan_us:.1f} µs{" (estimated by the cost model)" if trace.estimated else ""}. Grey: waiting '
            "on counters. Black outline: the critical path. Wheel zooms, drag pans, double-click resets.</p>"
            f'<div class="legend">{legend} <label><input type="checkbox" id="crit-toggle" checked> critical path'
            f'</label></div><div id="tl-wrap"><canvas id="timeline"></canvas></div><div id="tip"></div>'
            f'<p class="note">{esc(PERFETTO_HINT)} (<a href="best/trace.json">best/trace.json</a>)</p>'
            + _json_script("tl-data", data) + "</section>")
        body.append(_op_section(trace, summary))
        body.append(_crit_section(trace, crit))
    else:
        body.append('<section id="timeline-section"><h2>Timeline</h2><p class="note">No best/trace.json: the '
                    "timeline, time per op and critical path are not shown.</p></section>")
    body.append(_validation_section(validation, "Validation of the best schedule"))
    body.append(_leaderboard_section(run))
    body.append(_rejected_section(run))
    body.append(_agent_section(run))
    if run.notes:
        body.append('<section id="notes"><h2>Notes</h2><ul>' + "".join(f"<li>{esc(n)}</li>" for n in run.notes)
                    + "</ul></section>")
    if run.info:
        body.append("<section><h2>run.json</h2><pre>" + esc(json.dumps(run.info, indent=1)[:20000])
                    + "</pre></section>")
    body.append("</main>")
    has_tl = trace is not None and bool(trace.events)
    return _page(f"megasynth run {run.name}", "".join(body), _TIMELINE_JS if has_tl else "")


def _op_section(trace: Trace, summary: dict[str, Any]) -> str:
    per_op = summary.get("per_op", {})
    colours = op_colors(list(per_op))
    total = sum(d["total_us"] for d in per_op.values()) or 1.0
    tmax = max((d["total_us"] for d in per_op.values()), default=1.0) or 1.0
    trs = [[f'<i class="opbar" style="background:{colours[op]};width:10px"></i> {esc(op)}', str(d["count"]),
            f"{d['total_us']:.1f}", f"{100 * d['total_us'] / total:.1f}%", f"{d['mean_us']:.2f}",
            f"{d['wait_us']:.1f}", f'<span class="opbar" style="background:{colours[op]};'
            f'width:{max(1, int(240 * d["total_us"] / tmax))}px"></span>'] for op, d in per_op.items()]
    per_sm = summary.get("per_sm", {})
    worst = sorted(per_sm, key=lambda w: -per_sm[w]["idle_us"])[:5]
    idle = ", ".join(f"{esc(trace.lane_names[w] if 0 <= w < trace.lanes else w)} {per_sm[w]['idle_us']:.1f} µs"
                     for w in worst)
    cp = summary.get("critical_path_by_op_us", {})
    return (f'<section id="per-op"><h2>Time per op {_badge(trace.estimated)}</h2>'
            + _table(["op", "instructions", "busy µs", "share", "µs each", "waited µs", ""], trs, {1, 2, 3, 4, 5})
            + f"<p>SMs busy {100 * summary.get('busy_fraction', 0):.1f}% of the makespan, waiting on counters "
            f"{100 * summary.get('wait_fraction', 0):.1f}%; the rest is idle. Most idle: {idle}.</p>"
            + ("<p>On the critical path: " + ", ".join(f"{esc(op)} {us:.1f} µs" for op, us in cp.items()) + ".</p>"
               if cp else "") + "</section>")


def _crit_section(trace: Trace, crit: list[dict[str, Any]]) -> str:
    if not crit:
        return ""
    busy = sum(e["dur"] for e in crit)
    rows = [[str(k + 1), f"#{e['id']}", esc(e["op"]), "" if e["layer"] is None else str(e["layer"]),
             esc(trace.lane_names[e["tid"]]), f"{e['ts']:.2f}", f"{e['dur']:.2f}", f"{e['wait_us']:.2f}"]
            for k, e in enumerate(crit[:MAX_CRITICAL_ROWS])]
    more = f"<p class='note'>first {MAX_CRITICAL_ROWS} of {len(crit)} steps shown</p>" if len(crit) > \
        MAX_CRITICAL_ROWS else ""
    return (f'<section id="critical-path"><h2>Critical path {_badge(trace.estimated)}</h2><p>{len(crit)} '
            f"instructions, {busy:.1f} µs of work on a makespan of {trace.makespan_us:.1f} µs (the rest is "
            "synchronisation and waiting).</p><details><summary>the chain, first to last</summary>"
            + _table(["step", "id", "op", "layer", "SM", "start µs", "dur µs", "waited µs"], rows, {0, 5, 6, 7})
            + more + "</details></section>")


def _leaderboard_section(run: Run) -> str:
    if not run.entries:
        return '<section id="leaderboard"><h2>Candidates</h2><p class="note">No leaderboard.json.</p></section>'
    naive = run.naive()
    rows = []
    order = sorted(run.entries, key=lambda e: (not e.accepted, e.ms if e.ms is not None else math.inf))
    for e in order[:200]:
        sp = f"{naive.ms / e.ms:.2f}×" if naive and naive.ms and e.ms else ""
        link = (f'<a href="candidates/{esc(e.candidate)}/schedule.json">{esc(e.candidate)}</a>'
                if (run.path / "candidates" / e.candidate).is_dir() else esc(e.candidate))
        rows.append([link, esc(e.proposer), '<span class="good">accepted</span>' if e.accepted
                     else '<span class="bad">rejected</span>', fmt_ms(e.ms, e.estimated), sp, esc(e.note[:120])])
    return ('<section id="leaderboard"><h2>Candidates</h2>'
            + _table(["candidate", "proposer", "verdict", "ms per token", "vs naive", "note"], rows, {3, 4})
            + "</section>")


def render_index(runs: list[Run]) -> str:
    """runs/index.html: the leaderboard of runs."""
    rows = []
    for r in runs:
        b = r.best()
        sp = r.speedup()
        link = f'<a href="{esc(r.name)}/report.html">{esc(r.name)}</a>'
        rows.append([link, esc(r.model), esc(r.gpu), fmt_ms(b.ms, b.estimated) if b else "—",
                     f"{sp:.2f}×" if sp else "—", str(r.accepted), str(r.rejected), esc(r.date)])
    table = _table(["run", "model", "GPU", "best ms per token", "speed-up vs naive", "accepted", "rejected",
                    "date (UTC)"], rows, {3, 4, 5, 6}) if rows else "<p class='note'>No runs yet: run " \
        "<code>synth search</code>.</p>"
    body = ("<header><h1>megasynth runs</h1><div class=\"sub\">schedules proven safe, timed on the GPU or "
            "estimated by the cost model</div></header><main><section id=\"runs\"><h2>Leaderboard</h2>"
            f"{table}<p class='note'>“estimated” = cost model, no GPU. {esc(PERFETTO_HINT)}</p></section></main>")
    return _page("megasynth runs", body)


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
