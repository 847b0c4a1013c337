"""Draw runs as self-contained HTML: a report per run (`write_report`) and the leaderboard of runs (`write_index`),
with their charts as SVG and the SM timeline on a <canvas> (10 000+ instructions stay smooth); and the numbers as the
pages and `synth runs` print them (`fmt_ms`).

The data comes from `megasynth.runs.reader` (which reads run folders defensively); the markup is in templates/ (Jinja2,
autoescaped), one template per page and per chart. The HTML needs no network when viewed (the CSS and JS of static/
are inlined). Numbers that came from the cost model rather than the GPU are labelled "estimated".
"""

from __future__ import annotations

import functools
import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from jinja2.ext import Extension
from markupsafe import Markup

from megasynth.atomic import write_text_atomic
from megasynth.runs.reader import (
    Entry,
    Run,
    Trace,
    bench_docs,
    bench_rows,
    estimated_floor_ms,
    first_of,
    list_runs,
    load_run,
    num,
    parse_trace,
    read_json,
    summarize,
)
from megasynth.runs.rundir import PACK, PackError, RunDir, screened_text, stored

#: Bounds on what one report shows (the data files keep everything).
MAX_REJECTED_SHOWN = 20
MAX_SEQUENCE_EVENTS = 60
MAX_CRITICAL_ROWS = 400
MAX_FINDINGS_SHOWN = 50

PERFETTO_HINT = ("Open the trace (trace.json.gz) in Perfetto: ui.perfetto.dev → “Open trace file” (it reads gzip), "
                 "or in Chromium at chrome://tracing → Load.")

# ---------------------------------------------------------------------------------------------------------------
# Counterexamples (a validator finding's interleaving, normalised for the sequence diagram)


def counterexample_events(finding: Any) -> list[dict[str, Any]]:
    """Normalise the event list of a validator finding's `details` (numbered events: worker, instruction,
    start/end, counter values) into {"worker", "instruction", "op", "layer", "kind", "waits_on", "signals", "text"}.
    Unknown shapes give an empty list (the report then shows the finding's text lines)."""
    if not isinstance(finding, dict):
        return []
    details = finding.get("details") if isinstance(finding.get("details"), dict) else finding
    raw = first_of(details, "events", "interleaving", "counterexample", "trace")
    if isinstance(raw, dict):
        raw = first_of(raw, "events", "steps")
    if not isinstance(raw, list):
        return []
    out = []
    for ev in raw:
        if not isinstance(ev, dict):
            continue
        w = first_of(ev, "worker", "w", "sm", "tid")
        ins = first_of(ev, "instruction", "id", "ins")
        if isinstance(ins, dict):
            ev = {**ins, **{k: v for k, v in ev.items() if k != "instruction"}}
            ins = first_of(ins, "id")
        kind = str(first_of(ev, "kind", "event", "type", "phase", "what") or "start").lower()
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
        out.append({"n": first_of(ev, "n", "step", "index"), "worker": w, "instruction": ins, "op": ev.get("op"),
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


def fmt_ms(ms: float | None, estimated: bool = False, decimals: int = 3) -> str:
    """Milliseconds as the pages and `synth runs` print them (µs below 0.01 ms), labelled when estimated. `decimals`
    of a millisecond (`ranking_decimals` picks enough to tell a list's times apart)."""
    if ms is None:
        return "—"
    s = f"{ms:.{decimals}f} ms" if ms >= 0.01 else f"{ms * 1000:.{max(2, decimals - 3)}f} µs"
    return s + (" (estimated)" if estimated else "")


def ranking_decimals(times: list[float | None], least: int = 3, most: int = 6) -> int:
    """The fewest decimals of a millisecond, from `least` to `most`, at which the different times of a list all
    print differently: a leaderboard whose rows all read 0.798 ms does not say which is fastest."""
    distinct = sorted({t for t in times if t is not None})
    for d in range(least, most):
        if len({fmt_ms(t, decimals=d) for t in distinct}) == len(distinct):
            return d
    return most


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
            "phases": [[k, f"{v:.3f} s" if num(v) is not None else v] for k, v in secs.items()],
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
    rows = [[str(doc.get("candidate") or name), str(doc.get("proposer") or ""),
             screened_text(num(doc.get("estimate_ms"))), str(doc.get("rationale") or "")[:120]]
            for name, doc in screened]
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
    return {"name": first_of(doc, "candidate", "id") or name, "unreadable": False,
            "proposer": first_of(doc, "proposer"), "rationale": first_of(doc, "rationale"),
            "error": doc["error"] if first_of(doc, "error") else None,
            "reason": first_of(doc, "reason") or "error", "findings": findings}


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


def _candidate_link(run: Run, candidate: str) -> str | None:
    """What the leaderboard links a candidate to, relative to the report: its whole schedule where the run keeps it,
    else its timing.json (the strategy and patches that rebuild it); the pack (candidates.json.gz) when it is
    packed."""
    try:
        c = RunDir(run.path).candidate(candidate)
    except PackError:
        c = None  # load_run notes an unreadable pack
    if c is not None and c.packed:
        return PACK
    d = run.path / "candidates" / candidate
    f = stored(d / "schedule.json") or ((d / "timing.json") if (d / "timing.json").is_file() else None)
    return f.relative_to(run.path).as_posix() if f is not None else None


def _candidates_view(run: Run) -> list[dict[str, Any]]:
    naive = run.naive()
    order = sorted(run.entries, key=lambda e: (not e.accepted, e.ms if e.ms is not None else math.inf))
    return [{"id": e.candidate, "link": _candidate_link(run, e.candidate), "proposer": e.proposer,
             "accepted": e.accepted, "verdict": e.verdict, "screened": e.status == "screened",
             "ms": fmt_ms(e.ms, e.estimated),
             "speedup": f"{naive.ms / e.ms:.2f}×" if naive and naive.ms and e.ms else "", "note": e.note[:120]}
            for e in order[:200]]


def finals_text(finals: dict[str, Any]) -> str:
    """The finals (finals.json, best/timing.json's "finals": the search's fastest timed again side by side) in one
    line: each finalist's median, range and time in the search, the winner first."""
    parts = []
    for e in finals.get("entries") or []:
        med, lo, hi, loop = (num(first_of(e, k)) for k in ("median_ms", "min_ms", "max_ms", "loop_ms")) \
            if isinstance(e, dict) else (None, None, None, None)
        if med is not None:
            rng = f"{lo:.4f}–{hi:.4f}" if lo is not None and hi is not None else ""
            was = f"{loop:.4f} in the search" if loop is not None else ""
            more = "; ".join(x for x in (rng, was) if x)
            parts.append(f"{e.get('candidate', '?')} {med:.4f} ms" + (f" ({more})" if more else ""))
    return f"{finals.get('rounds', '?')} rounds side by side, medians: " + ", ".join(parts)


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
    est_any = bool(best and best.estimated) or bool(trace and trace.estimated) or bool(first_of(timing, "estimated"))
    ctx = first_of(trace.metadata, "ctx") if trace else None
    ctx = ctx if isinstance(ctx, int) else first_of(timing, "ctx") or first_of(run.info, "ctx")
    cmd = first_of(run.info, "command", "argv")

    # summary cards
    floor_ms, floor_est, baselines, b_est, floor_note = None, False, [], False, ""
    for _p, doc in bench_docs(run):
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
    p10, p90 = num(first_of(timing, "p10_ms")), num(first_of(timing, "p90_ms"))
    if best and p10 is not None and p90 is not None:
        best_txt += f" (p10–p90 {p10:.3f}–{p90:.3f})"
    src = first_of(timing, "source")
    if src:
        best_txt += f" · {src}"
    cards = [("best schedule", best_txt),
             ("naive schedule", fmt_ms(naive.ms, naive.estimated) if naive else "—"),
             ("speed-up over naive", f"{sp:.2f}×" if sp else "—"),
             ("bandwidth floor", fmt_ms(floor_ms, floor_est) + floor_note if floor_ms else "—"),
             ("candidates", f"{run.accepted} accepted / {run.screened} screened / {run.rejected} rejected")]
    finals = first_of(timing, "finals")
    if best and isinstance(finals, dict) and finals.get("winner") == best.candidate:
        cards.append(("finals", finals_text(finals)))
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
                    "file": (stored(best_dir / "trace.json") or best_dir / "trace.json.gz").relative_to(run.path)
                    .as_posix(),
                    "makespan": f"{trace.makespan_us:.1f}", "legend": list(zip(data["ops"], data["colors"],
                                                                                 strict=True)),
                    "data_json": _json_for_script(data)}
        per_op = _per_op_view(trace, summary)
        critical = _critical_view(trace, crit)
    page = {"command": (" ".join(map(str, cmd)) if isinstance(cmd, list) else cmd) if cmd else None,
            "estimated": est_any, "cards": cards,
            "chart": {"svg": bar_chart_svg(bars), "baselines": bool(baselines), "hatched": any(b[3] for b in bars)},
            "curve": ({"svg": curve[0], "estimated": curve[1], "mixed": curve[2], "clipped": curve[3]} if curve
                      else None),
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
