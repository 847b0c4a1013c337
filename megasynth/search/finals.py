"""The search's finals: the fastest accepted candidates timed again side by side, in alternating rounds, on the GPU.

During the search each candidate is timed once, minutes apart from the others; with 1-2 % of noise and drift between
such measurements (docs/perf-notes.md), the lowest single measurement of a hundred candidates is biased low and
often not the fastest schedule. The finals time the fastest few again in a few rounds (`SearchConfig.finalists`,
`final_rounds`; each round starts with the next finalist), and the winner is the lowest median of its rounds.
`run_finals` writes finals.json and returns it; the loop promotes the winner to best/.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Protocol

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import Schedule
from megasynth.runs.rundir import RunDir


class Timer(Protocol):
    def time(self, schedule: Schedule) -> dict[str, Any]: ...


def finalists(run: RunDir, count: int) -> list[tuple[str, float]]:
    """The `count` fastest accepted candidates of `run` measured on the GPU, fastest first: (candidate, its ms in
    the search)."""
    rows = [(cid, float(t["ms"])) for cid, t in run.accepted().items()
            if not t.get("estimated", True) and isinstance(t.get("ms"), (int, float))]
    rows.sort(key=lambda r: (r[1], r[0]))
    return rows[:count]


def run_finals(run: RunDir, timer: Timer, count: int, rounds: int,
               notice: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Time `run`'s `count` fastest measured candidates side by side in `rounds` rounds with `timer` and write
    finals.json: per finalist its time in the search, each round's time, the median, min and max; the winner (the
    lowest median; ties to the faster search time) first. None (and nothing written) when fewer than two finalists
    can be timed. A finalist whose schedule cannot be rebuilt is left out with a notice."""
    schedules: dict[str, Schedule] = {}
    loop_ms: dict[str, float] = {}
    for cid, ms in finalists(run, count):
        try:
            schedules[cid] = run.load_candidate(cid)
            loop_ms[cid] = ms
        except ScheduleError as exc:
            if notice is not None:
                notice(f"finals: {cid} left out: {exc}")
    if len(schedules) < 2 or rounds < 1:
        return None
    order = list(schedules)
    times: dict[str, list[float]] = {cid: [] for cid in order}
    for r in range(rounds):
        k = r % len(order)
        for cid in order[k:] + order[:k]:
            times[cid].append(float(timer.time(schedules[cid])["ms"]))
    entries = [{"candidate": cid, "loop_ms": loop_ms[cid], "rounds_ms": times[cid],
                "median_ms": statistics.median(times[cid]), "min_ms": min(times[cid]), "max_ms": max(times[cid])}
               for cid in order]
    entries.sort(key=lambda e: (e["median_ms"], e["loop_ms"]))
    doc = {"rounds": rounds, "reps": getattr(timer, "reps", None), "winner": entries[0]["candidate"],
           "how": f"the {len(entries)} fastest candidates of the search timed again side by side, {rounds} rounds, "
                  "each starting with the next; ranked by the median of their rounds",
           "entries": entries}
    run.save_finals(doc)
    return doc

