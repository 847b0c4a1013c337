"""Adversarial interleavings: replay N legal executions built to stress the schedule and report every conflicting pair
`a < b` that some execution runs out of order (`b` starts before `a` ends): a stale read, a lost write or a backward
order. Takes the `Program`, its maximal execution and the conflict need groups; returns `Witness`es.

Executions are timed: every instruction starts as early as its queue and waits allow (consumers and overwriters are
rushed) and lasts a random duration; producers are delayed by heavy-tailed durations (a random subset per
interleaving is slowed 10-1000x) and, for half of the interleavings, one suspect producer (a pair the graph pass could
not order) is held back for as long as the schedule lets it. Every legal execution is the ASAP execution of some
positive durations (start times are monotone in end times), so this samples the whole space; continuous random
durations break ties at random. Seeded.

Shadow memory is kept at the granularity of the conflict sweep (validator.hb): the runs of accesses to each segment,
so a check is "did `b` start before the latest end among the accesses it must follow", vectorised over interleavings
with numpy. When the waits admit a static evaluation order (every signaller a waiter could depend on is evaluated
first; true of lowerings), all N executions are computed at once, instruction by instruction; otherwise a per-execution
event simulation runs, time-bounded (after EVENT_SIM_BUDGET_S it stops; the report says how many it replayed).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megasynth.ir.program import Program
from megasynth.validator.deadlock import Execution
from megasynth.validator.hb import Conflicts, WaitGroups, sorted_unique, static_order

HELD = 1e7  # duration of a suspect producer that is held back
EVENT_SIM_BUDGET_S = 20.0  # the per-execution fallback stops starting batches after this long (reported as "capped")
CHECK_ROWS = 4096  # (instruction, need part) rows compared at once: a few MB per block


@dataclass
class Witness:
    """Pair (a, b), a < b, run out of order in interleaving `k`: `b` started at `start_b` before `a` ended at
    `end_a`."""

    a: int
    b: int
    k: int
    start_b: float
    end_a: float


@dataclass
class ReplayResult:
    interleavings: int
    witnesses: dict[tuple[int, int], Witness]  # first witness per pair
    witnessed_runs: int  # interleavings with at least one witness
    mode: str  # "vectorised" or "event" or "capped"


def _durations(rng: np.random.Generator, n: int, size: int, targets: list[tuple[int, int]], first: int) -> np.ndarray:
    """Durations (n x size): uniform in [0.5, 1.5), a random share (up to 30%) of each interleaving's instructions
    slowed 10-1000x, and in every other interleaving one suspect producer held back (in place, float32 coin flips:
    this is the replay's largest cost)."""
    d = rng.random((n, size))
    d += 0.5
    p = rng.uniform(0.0, 0.3, size).astype(np.float32)
    factor = np.exp(rng.uniform(np.log(10.0), np.log(1000.0), size))
    slow = rng.random((n, size), dtype=np.float32) < p
    np.multiply(d, factor, out=d, where=slow)
    if targets:
        for k in range(0, size):
            if (first + k) % 2 == 0:
                a, _ = targets[((first + k) // 2) % len(targets)]
                d[a, k] = HELD
    return d


def _group_time(wg: WaitGroups, g: int, v: int, end: np.ndarray, ready_at: dict[int, np.ndarray]) -> np.ndarray:
    """When the wait of group `g` holds: the time its candidates' adds reach `v` (+inf: never)."""
    if g in wg.extends and wg.extends[g][0] in ready_at:  # an exact join: the max over its candidates, in two parts
        base, more = wg.extends[g]
        return np.maximum(ready_at[base], end[more].max(axis=0)) if more else ready_at[base]
    cands = wg.candidates[g]
    idx = np.array([a for a, _ in cands])
    adds = np.array([add for _, add in cands])
    em = end[idx]
    if adds.sum() < v:
        return np.full(end.shape[1], np.inf)
    if (adds == 1).all():
        if v == len(cands):
            return em.max(axis=0)
        return np.partition(em, v - 1, axis=0)[v - 1]
    order = np.argsort(em, axis=0)
    cum = np.cumsum(adds[order], axis=0)
    first = np.argmax(cum >= v, axis=0)
    return np.take_along_axis(np.take_along_axis(em, order, axis=0), first[None, :], axis=0)[0]


def _vectorised(prog: Program, wg: WaitGroups, order: list[tuple[int, int]], dur: np.ndarray,
                pipelined: bool) -> tuple[np.ndarray, np.ndarray]:
    """All interleavings of a batch at once, instruction by instruction in the static order: start = the latest of
    the queue predecessor's end (start, pipelined) and the times its wait chunks hold. `dur` becomes the end times
    (in place: it is the batch's largest array)."""
    n, size = dur.shape
    start = np.full((n, size), np.inf)  # instructions that never run keep +inf
    end = dur
    ran = np.zeros(n, dtype=bool)
    ready_at: dict[int, np.ndarray] = {}  # wait group -> when its wait holds
    chunk_ready: dict[int, np.ndarray] = {}  # wait chunk -> when all its waits hold
    chunk_left: dict[int, int] = defaultdict(int)
    for kind, x in order:
        if kind == 0:
            for ch in wg.chunks_of[x]:
                chunk_left[ch] += 1
    for kind, x in order:
        if kind == 1:
            ready_at[x] = _group_time(wg, x, wg.value[x], end, ready_at)
            continue
        row = start[x]
        have = False
        if prog.qpos[x] > 0:
            p = prog.queues[prog.worker[x]][prog.qpos[x] - 1]
            row[:] = start[p] if pipelined else end[p]
            have = True
        for ch in wg.chunks_of[x]:
            r = chunk_ready.get(ch)
            if r is None:
                groups = wg.chunks[ch]
                r = ready_at[groups[0]] if len(groups) == 1 else np.max([ready_at[g] for g in groups], axis=0)
                chunk_ready[ch] = r
            if have:
                np.maximum(row, r, out=row)
            else:
                row[:] = r
                have = True
            chunk_left[ch] -= 1
            if not chunk_left[ch]:
                del chunk_ready[ch]
        if not have:
            row[:] = 0.0
        end[x] += row
        ran[x] = True
    end[~ran] = np.inf
    return start, end


def _event_sim(prog: Program, wg: WaitGroups, live: list[bool], dur: np.ndarray,
               pipelined: bool) -> tuple[np.ndarray, np.ndarray]:
    """One event-driven simulation per interleaving (ASAP starts, given durations); a blocked worker is only looked
    at again when a counter it waits on grows."""
    import heapq

    n, size = dur.shape
    start = np.full((n, size), np.inf)
    end = np.full((n, size), np.inf)
    nq = len(prog.queues)
    for k in range(size):
        counters: dict[int, int] = defaultdict(int)
        head = [0] * nq
        busy = [False] * nq
        blocked: dict[int, list[int]] = defaultdict(list)
        heap: list[tuple[float, int, int]] = []
        ready = list(range(nq))
        now = 0.0
        for _ in range(2 * n + 2):  # every round ends one instruction
            while ready:
                w = ready.pop()
                q = prog.queues[w]
                if busy[w] or head[w] >= len(q):
                    continue
                i = q[head[w]]
                unmet = next((c for c, v in prog.waits[i] if counters[c] < v), None)
                if unmet is not None:
                    blocked[unmet].append(w)
                    continue
                start[i, k] = now
                end[i, k] = now + dur[i, k]
                heapq.heappush(heap, (float(end[i, k]), i, w))
                head[w] += 1
                if pipelined:
                    ready.append(w)
                else:
                    busy[w] = True
            if not heap:
                break
            now, i, w = heapq.heappop(heap)
            for c, add in prog.signals[i]:
                counters[c] += add
                ready.extend(blocked.pop(c, ()))
            if not pipelined:
                busy[w] = False
                ready.append(w)
    return start, end


def replay(prog: Program, ex: Execution, conf: Conflicts, wg: WaitGroups, live: list[bool], count: int, seed: int,
           pipelined: bool = False, targets: list[tuple[int, int]] | None = None,
           static: list[tuple[int, int]] | None | bool = False) -> ReplayResult:
    """Replay `count` adversarial interleavings; return the first witness per out-of-order pair. `static`: the
    static order if the caller has it (None: there is none)."""
    n = prog.n
    targets = targets or []
    order = static_order(prog, wg, live) if static is False else static
    mode = "vectorised"
    if order is None:
        mode = "event"
    witnesses: dict[tuple[int, int], Witness] = {}
    witnessed = np.zeros(count, dtype=bool)
    checks = {b: conf.need[b] for b in range(n) if b in conf.need and live[b]}
    rows_b = np.array([b for b, parts in checks.items() for _ in parts], dtype=np.int64)  # one row per (b, part)
    rows_p = np.array([p for parts in checks.values() for p in parts], dtype=np.int64)
    part_members = [np.array(sorted({int(a) for g in gs for a in conf.groups[g]})) for gs in conf.parts]
    batch = max(16, min(count, int(2e7 // max(n, 1))))  # three float64 (n x batch) arrays: ~480 MB at most
    if order is None:
        batch = min(batch, max(1, 200_000 // max(n, 1)))  # small batches, so the time budget is kept
    rng = np.random.default_rng(seed)
    began = time.perf_counter()
    done = 0
    for first in range(0, count, batch):
        if order is None and time.perf_counter() - began > EVENT_SIM_BUDGET_S:
            mode = "capped"
            break
        size = min(batch, count - first)
        done = first + size
        dur = _durations(rng, n, size, targets, first)
        if order is not None:
            start, end = _vectorised(prog, wg, order, dur, pipelined)
        else:
            start, end = _event_sim(prog, wg, live, dur, pipelined)
        del dur
        latest = np.zeros((len(part_members), size))  # need part -> the latest end among its members
        for part in sorted_unique(rows_p).tolist():
            latest[part] = end[part_members[part]].max(axis=0)
        suspects: list[np.ndarray] = []
        for lo in range(0, len(rows_b), CHECK_ROWS):  # b starts before some member of its part ends
            rb, rp = rows_b[lo:lo + CHECK_ROWS], rows_p[lo:lo + CHECK_ROWS]
            suspects.append(rb[(start[rb] < latest[rp]).any(axis=1)])
        for b in sorted_unique(np.concatenate(suspects)).tolist() if suspects else ():
            parts = checks[b]
            members = sorted_unique(np.concatenate([part_members[part] for part in parts]))
            bad = np.flatnonzero(start[b] < end[members].max(axis=0))
            witnessed[first + bad] = True
            for k in bad[:4].tolist():
                late = members[end[members, k] > start[b, k]]
                for a in late.tolist():
                    if (a, b) not in witnesses:
                        witnesses[(a, b)] = Witness(a, b, first + k, float(start[b, k]), float(end[a, k]))
    return ReplayResult(done, witnesses, int(witnessed.sum()), mode)
