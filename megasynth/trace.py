"""The shared trace format (Chrome/Perfetto trace-event JSON): writer, reader and summary. Imports no torch.

`{"traceEvents": [...], "metadata": {...}}`. One complete event ("ph": "X") per executed instruction:
`{"name": "<op> L<layer>", "cat": "<op>", "ph": "X", "pid": 0, "tid": <worker>, "ts": <start µs, relative to the
kernel's first start>, "dur": <µs>, "args": {"id", "op", "layer", "wait_us"}}`, plus one "thread_name" metadata
event per worker ("SM <w>"). `metadata` holds model, device, ctx, estimated (true when a cost model made it, not the
GPU) and schedule_sha256. The GPU interpreter writes it (`from_raw`), the cost model writes it (`make_trace`), the
reports and the calibration read it (`read_trace`, `summarize`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megasynth.atomic import read_text, write_json_atomic

METADATA_KEYS = ("model", "device", "ctx", "estimated", "schedule_sha256")


class TraceError(ValueError):
    """A trace file that does not follow the format; the message names the file and the JSON path."""


def schedule_sha256(schedule_json: Mapping[str, Any]) -> str:
    """Stable digest of a schedule document (sorted keys, compact separators)."""
    text = json.dumps(schedule_json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def event(worker: int, ident: int, op: str, layer: int | None, ts_us: float, dur_us: float,
          wait_us: float = 0.0) -> dict[str, Any]:
    """One complete event for one executed instruction."""
    name = op if layer is None else f"{op} L{layer}"
    return {"name": name, "cat": op, "ph": "X", "pid": 0, "tid": int(worker), "ts": float(ts_us),
            "dur": float(dur_us), "args": {"id": int(ident), "op": op, "layer": layer, "wait_us": float(wait_us)}}


def make_trace(events: Iterable[Mapping[str, Any]], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A trace document: the events, one thread_name record per worker seen, and the metadata (all keys present)."""
    evs = [dict(e) for e in events]
    workers = sorted({int(e["tid"]) for e in evs})
    names = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": w, "args": {"name": f"SM {w}"}} for w in workers]
    meta = {k: metadata.get(k) for k in METADATA_KEYS}
    meta["estimated"] = bool(metadata.get("estimated", False))
    meta.update({k: v for k, v in metadata.items() if k not in meta})
    return {"traceEvents": names + evs, "metadata": meta}


def from_raw(raw: Sequence[Sequence[int]], ids: Sequence[int], ops: Sequence[str], layers: Sequence[int | None],
             metadata: Mapping[str, Any]) -> dict[str, Any]:
    """GPU timestamps -> trace. `raw[i]` = (wait start ns, start ns, end ns, worker) of instruction index i (ids in
    ascending order); rows with end == 0 were not executed and are left out."""
    rows = [(i, int(r[0]), int(r[1]), int(r[2]), int(r[3])) for i, r in enumerate(raw) if int(r[2]) != 0]
    if not rows:
        return make_trace([], metadata)
    t0 = min(r[1] for r in rows)
    evs = [event(w, ids[i], ops[i], layers[i], (start - t0) / 1e3, (end - start) / 1e3, (start - wait) / 1e3)
           for i, wait, start, end, w in rows]
    evs.sort(key=lambda e: (e["tid"], e["ts"]))
    return make_trace(evs, metadata)


def write_trace(path: str | os.PathLike[str], trace: Mapping[str, Any]) -> None:
    """Write atomically (compact JSON: a llama-1b trace has ~14k events)."""
    write_json_atomic(path, trace, indent=None)


def read_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check a trace file (plain or gzip, as runs store it); a defect raises `TraceError` naming the file and
    the JSON path."""
    name = str(path)
    try:
        data = json.loads(read_text(path))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{name}: $: not UTF-8 text: {exc.reason}") from None
    except OSError as exc:
        raise TraceError(f"{name}: $: cannot read trace: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{name}: $: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    check_trace(data, name)
    return data


def check_trace(data: Any, name: str = "<trace>") -> None:
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{name}: $.traceEvents: a trace is an object with a traceEvents list")
    if not isinstance(data.get("metadata", {}), dict):
        raise TraceError(f"{name}: $.metadata: must be an object")
    for k, e in enumerate(data["traceEvents"]):
        where = f"{name}: $.traceEvents[{k}]"
        if not isinstance(e, dict) or e.get("ph") not in ("X", "M"):
            raise TraceError(f"{where}.ph: expected 'X' or 'M', got {e.get('ph') if isinstance(e, dict) else e!r}")
        if e["ph"] == "X":
            for key in ("ts", "dur", "tid"):
                if not isinstance(e.get(key), (int, float)) or isinstance(e.get(key), bool):
                    raise TraceError(f"{where}.{key}: must be a number, got {e.get(key)!r}")
            if e["dur"] < 0:
                raise TraceError(f"{where}.dur: must be >= 0, got {e['dur']}")
            args = e.get("args")
            if not isinstance(args, dict) or not isinstance(args.get("id"), int):
                raise TraceError(f"{where}.args.id: must be an integer instruction id")


def instructions(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The complete events, sorted by start time."""
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: (e["ts"], e["tid"]))


def critical_path(trace: Mapping[str, Any], producers: Mapping[int, Sequence[int]] | None = None,
                  wait_threshold_us: float = 0.05) -> list[dict[str, Any]]:
    """The chain of instructions that decided the end time, walked back from the last to finish.

    At each instruction: if it waited on counters (wait_us above the threshold) its blocker is the producer that
    finished last before it started — among `producers[id]` when the caller knows the dependencies, else among all
    instructions on other workers; otherwise its blocker is the previous instruction on its own worker.
    """
    evs = instructions(trace)
    if not evs:
        return []
    by_id = {e["args"]["id"]: e for e in evs}
    per_worker: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in evs:
        per_worker[e["tid"]].append(e)
    prev_on_worker: dict[int, dict[str, Any] | None] = {}
    for lane in per_worker.values():
        for k, e in enumerate(lane):
            prev_on_worker[e["args"]["id"]] = lane[k - 1] if k else None
    ends = sorted(evs, key=lambda e: e["ts"] + e["dur"])
    end_times = [e["ts"] + e["dur"] for e in ends]
    cur: dict[str, Any] | None = ends[-1]
    path: list[dict[str, Any]] = []
    seen: set[int] = set()
    while cur is not None and cur["args"]["id"] not in seen:  # bounded: each instruction at most once
        seen.add(cur["args"]["id"])
        path.append(cur)
        ident = cur["args"]["id"]
        nxt: dict[str, Any] | None = None
        if cur["args"].get("wait_us", 0.0) > wait_threshold_us:
            limit = cur["ts"] + 1e-9
            if producers is not None:
                cands = [by_id[p] for p in producers.get(ident, ()) if p in by_id
                         and by_id[p]["ts"] + by_id[p]["dur"] <= limit]
                nxt = max(cands, key=lambda e: e["ts"] + e["dur"], default=None)
            else:
                import bisect

                k = bisect.bisect_right(end_times, limit) - 1
                while k >= 0 and ends[k]["tid"] == cur["tid"]:
                    k -= 1
                nxt = ends[k] if k >= 0 else None
        if nxt is None:
            nxt = prev_on_worker.get(ident)
        cur = nxt
    path.reverse()
    return path


def layer_chain(path: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Where a layer goes on the critical path: over the middle half of the layers it visits (the first and last
    layers start and drain the pipeline), the median time per op, the median layer period (start of layer l+1's first
    instruction on the path minus layer l's) and the rest of the period (counter hops and waits between them).
    None when the path visits fewer than 3 layers. A latency-bound model shows a period well above its bytes' time."""
    by_layer: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for e in path:
        if isinstance(e.get("layer"), int):
            by_layer[e["layer"]].append(e)
    layers = sorted(by_layer)
    if len(layers) < 3:
        return None
    q = len(layers) // 4
    mid = layers[q:len(layers) - q]
    start = {lyr: min(e["ts"] for e in by_layer[lyr]) for lyr in layers}
    periods = [start[lyr + 1] - start[lyr] for lyr in mid if lyr + 1 in start]
    if not periods:
        return None
    ops = sorted({e["op"] for lyr in mid for e in by_layer[lyr]})
    per_op = {op: statistics.median(sum(e["dur"] for e in by_layer[lyr] if e["op"] == op) for lyr in mid)
              for op in ops}
    period = statistics.median(periods)
    return {"layers": [mid[0], mid[-1]], "period_us": period,
            "per_op_us": dict(sorted(per_op.items(), key=lambda kv: -kv[1])),
            "hops_us": max(0.0, period - sum(per_op.values()))}


def _tally(evs: Sequence[Mapping[str, Any]], key: str, time_name: str) -> dict[Any, dict[str, float]]:
    """Events grouped by `key` (op or SM): their count, summed duration (as `time_name`) and summed wait."""
    out: dict[Any, dict[str, float]] = {}
    for e in evs:
        d = out.setdefault(e[key], {"count": 0, time_name: 0.0, "wait_us": 0.0})
        d["count"] += 1
        d[time_name] += e["dur"]
        d["wait_us"] += e["args"].get("wait_us", 0.0)
    return out


def summarize(trace: Mapping[str, Any], producers: Mapping[int, Sequence[int]] | None = None,
              top: int = 10) -> dict[str, Any]:
    """Time per op, busy / waiting / idle time per SM, makespan and the critical path of a trace."""
    evs = instructions(trace)
    if not evs:
        return {"makespan_us": 0.0, "instructions": 0, "per_op": {}, "per_sm": {}, "critical_path": [],
                "estimated": bool(trace.get("metadata", {}).get("estimated", False))}
    t0 = min(e["ts"] for e in evs)
    t1 = max(e["ts"] + e["dur"] for e in evs)
    makespan = t1 - t0
    per_op = _tally(evs, "cat", "total_us")
    for d in per_op.values():
        d["mean_us"] = d["total_us"] / d["count"]
    per_sm = _tally(evs, "tid", "busy_us")
    for d in per_sm.values():
        d["idle_us"] = max(0.0, makespan - d["busy_us"] - d["wait_us"])
    path = critical_path(trace, producers)
    cp_ops: dict[str, float] = defaultdict(float)
    for e in path:
        cp_ops[e["cat"]] += e["dur"]
    return {
        "makespan_us": makespan,
        "instructions": len(evs),
        "workers": len(per_sm),
        "per_op": dict(sorted(per_op.items(), key=lambda kv: -kv[1]["total_us"])),
        "per_sm": dict(sorted(per_sm.items())),
        "busy_fraction": sum(d["busy_us"] for d in per_sm.values()) / (makespan * len(per_sm)) if makespan else 0.0,
        "wait_fraction": sum(d["wait_us"] for d in per_sm.values()) / (makespan * len(per_sm)) if makespan else 0.0,
        "critical_path": [{"id": e["args"]["id"], "op": e["cat"], "layer": e["args"].get("layer"), "tid": e["tid"],
                           "ts": e["ts"], "dur": e["dur"], "wait_us": e["args"].get("wait_us", 0.0)} for e in path],
        "critical_path_by_op_us": dict(sorted(cp_ops.items(), key=lambda kv: -kv[1])),
        "layer_chain": layer_chain([{"op": e["cat"], "layer": e["args"].get("layer"), "ts": e["ts"], "dur": e["dur"]}
                                    for e in path]),
        "estimated": bool(trace.get("metadata", {}).get("estimated", False)),
    }


def format_summary(summary: Mapping[str, Any], top: int = 8) -> str:
    """A short text rendering of `summarize`'s result."""
    tag = " (estimated)" if summary.get("estimated") else ""
    lines = [f"makespan {summary['makespan_us']:.1f} us{tag}, {summary['instructions']} instructions on "
             f"{summary.get('workers', 0)} SMs, busy {100 * summary.get('busy_fraction', 0):.0f}%, "
             f"waiting {100 * summary.get('wait_fraction', 0):.0f}%"]
    for op, d in list(summary["per_op"].items())[:top]:
        lines.append(f"  {op:22s} n={d['count']:6d} total {d['total_us']:10.1f} us  mean {d['mean_us']:7.2f} us  "
                     f"wait {d['wait_us']:10.1f} us")
    cp = summary.get("critical_path_by_op_us", {})
    if cp:
        lines.append("  critical path: " + ", ".join(f"{op} {us:.1f} us" for op, us in cp.items()))
    chain = summary.get("layer_chain")
    if chain:
        lines.append("  " + format_layer_chain(chain))
    return "\n".join(lines)


def format_layer_chain(chain: Mapping[str, Any]) -> str:
    """`layer_chain`'s result in one line."""
    a, b = chain["layers"]
    return (f"per layer on the critical path (median of layers {a}-{b}): period {chain['period_us']:.1f} us = "
            + ", ".join(f"{op} {us:.1f}" for op, us in chain["per_op_us"].items())
            + f", hops and waits {chain['hops_us']:.1f}")
