"""Conflicts and the happens-before graph pass: `Program` + maximal execution -> the conflicting pairs that need a
proof, and which of them the graph already proves.

Conflicting pairs. Per buffer, the element ranges are cut into segments at every access boundary; in each segment the
accesses in ascending-id order form maximal *runs* of mutually non-conflicting accesses (a run of reads, a run of
reduces, or one write; an instruction that reads and reduces a segment counts as a write there). Every access
conflicts with every access of the neighbouring run, and HB is transitive, so "every conflicting pair is ordered" is
equivalent to "every access happens after every member of the run just before it" (exact, not an approximation):
those are the pairs we prove. An instruction's needed predecessors are interned as a *need group* (a set of runs), so
the thousands of readers of one residual share one bitset.

Happens-before (sound): program order (unless `pipelined`); counter edges: for a wait `counters[c] >= v` of `b`, a
signaller `a` of `c` is needed when the adds of the other candidate signallers of `c` cannot reach `v` (a signaller
is no candidate when it is `b`, is queued after `b` on `b`'s worker, never runs in any execution, or cannot complete
while `c < v`: it waits for `c >= v` itself, or a capped maximal execution (`_capped_phases`) leaves it out); and
"one of them has ended": `b` is HB-after whatever every candidate is HB-after.
An instruction that never runs (stuck in the unique maximal execution) never starts, so it is never the later side of
a race; as the earlier side it never ends, so a running `b` that conflicts with it is a race. Ancestor bitsets
(Python ints) are computed in one pass over a topological order (the static order, where every candidate precedes
its waiters, when the waits admit one; else the maximal execution's completion order) and freed after their last
use, which keeps memory near-linear on large schedules.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from validator.deadlock import Execution
from validator.program import Program

READ, REDUCE, WRITE = 0, 1, 2
#: Work allowed for capped executions (instructions + waits visited): each costs one pass over the schedule.
F_BUDGET = 6_000_000
_KIND = {"read": READ, "reduce": REDUCE, "write": WRITE}


@dataclass
class Conflicts:
    """Need groups: sets of instructions (deduplicated by content); each live instruction lists the groups whose
    every member must happen before it. `runs` keeps, per group, the buffer it came from (for messages)."""

    groups: list[np.ndarray] = field(default_factory=list)  # group -> sorted member instruction indices
    group_buffer: list[str] = field(default_factory=list)
    sets: list[list[int]] = field(default_factory=list)  # need set -> groups (interned: readers share one)
    need: dict[int, int] = field(default_factory=dict)  # instruction index -> need set

    def members(self, b: int) -> list[int]:
        """Every instruction that must happen before `b` (ascending)."""
        s = self.need.get(b)
        return [] if s is None else sorted({int(a) for g in self.sets[s] for a in self.groups[g]})


def _unique(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (sort-based; numpy's hash-based `unique` is far slower on these sizes)."""
    a = np.sort(x)
    if len(a) == 0:
        return a
    keep = np.ones(len(a), dtype=bool)
    keep[1:] = a[1:] != a[:-1]
    return a[keep]


def find_conflicts(prog: Program, live: list[bool]) -> Conflicts:
    """Sweep each buffer's segments in ascending-id order (vectorised) and build the need groups of live
    instructions."""
    out = Conflicts()
    n = prog.n
    by_buf: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for i in range(n):
        if live[i]:
            for kind, buf, lo, hi in prog.accesses[i]:
                by_buf[buf].append((i, _KIND[kind], lo, hi))
    content: dict[bytes, int] = {}
    pairs_i: list[np.ndarray] = []
    pairs_g: list[np.ndarray] = []
    for buf, accs in by_buf.items():
        arr = np.array(accs, dtype=np.int64)
        inst_a, cls_a, lo_a, hi_a = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
        cuts = _unique(np.concatenate([lo_a, hi_a]))
        s0 = np.searchsorted(cuts, lo_a)
        cnt = np.searchsorted(cuts, hi_a) - s0
        total = int(cnt.sum())
        offs = np.repeat(np.cumsum(cnt) - cnt, cnt)
        seg = np.repeat(s0, cnt) + (np.arange(total) - offs)
        inst = np.repeat(inst_a, cnt)
        cls = np.repeat(cls_a, cnt)
        key = seg * n + inst
        if len(cuts) < 2**15:  # entries are in instruction order already: a stable radix sort by segment suffices
            order = np.argsort(seg.astype(np.int16), kind="stable")
        else:
            order = np.argsort(key)  # ties are one instruction's accesses to one segment: merged below
        key, seg, inst, cls = key[order], seg[order], inst[order], cls[order]
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        starts = np.flatnonzero(first)
        if len(starts) < len(key):  # one instruction, several accesses to one segment: mixed kinds act as a write
            lo_c = np.minimum.reduceat(cls, starts)
            hi_c = np.maximum.reduceat(cls, starts)
            cls = np.where(lo_c == hi_c, lo_c, WRITE)
            seg, inst = seg[starts], inst[starts]
        m = len(seg)
        seg_first = np.ones(m, dtype=bool)
        seg_first[1:] = seg[1:] != seg[:-1]
        new_run = seg_first | (cls == WRITE)
        new_run[1:] |= cls[1:] != cls[:-1]
        run_id = np.cumsum(new_run) - 1
        run_start = np.flatnonzero(new_run)
        first_run_of_seg = np.maximum.accumulate(np.where(seg_first, run_id, 0))
        prev = run_id - 1
        has_prev = prev >= first_run_of_seg
        pi, pr = inst[has_prev], prev[has_prev]
        run_end = np.append(run_start[1:], m)
        local = np.full(max(int(run_id[-1]) + 1, 1), -1, dtype=np.int64)
        for r in _unique(pr).tolist():
            members = inst[run_start[r]:run_end[r]]  # sorted and unique within a segment
            k = members.tobytes()
            g = content.get(k)
            if g is None:
                g = content[k] = len(out.groups)
                out.groups.append(members)
                out.group_buffer.append(buf)
            local[r] = g
        pairs_i.append(pi)
        pairs_g.append(local[pr])
    if pairs_i and sum(len(p) for p in pairs_i):
        ng = max(len(out.groups), 1)
        flat = _unique(np.concatenate(pairs_i) * ng + np.concatenate(pairs_g))
        fi, fg = flat // ng, flat % ng
        cut = np.flatnonzero(np.diff(fi)) + 1
        sets: dict[bytes, int] = {}
        for i_arr, g_arr in zip(np.split(fi, cut), np.split(fg, cut), strict=True):
            k = g_arr.tobytes()
            s = sets.get(k)
            if s is None:
                s = sets[k] = len(out.sets)
                out.sets.append(g_arr.tolist())
            out.need[int(i_arr[0])] = s
    return out


def bits_of(indices: list[int] | set[int], n: int) -> int:
    """A bitset (Python int) with the given bits set; linear in len(indices) + n/8."""
    buf = bytearray((n + 8) // 8)
    for a in indices:
        buf[a >> 3] |= 1 << (a & 7)
    return int.from_bytes(buf, "little")


def indices_of(bits: int) -> list[int]:
    """The set bits of a bitset, ascending (via its binary string: linear, unlike repeated big-int masking)."""
    if not bits:
        return []
    text = bin(bits)[:1:-1]
    out = []
    k = text.find("1")
    while k >= 0:
        out.append(k)
        k = text.find("1", k + 1)
    return out


@dataclass
class WaitGroups:
    """Per wait, the signallers that could end before the waiter starts, and which of them are needed."""

    keys: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    candidates: list[list[tuple[int, int]]] = field(default_factory=list)  # group -> [(signaller, add)]
    needed: list[list[int]] = field(default_factory=list)  # group -> needed signallers
    of: list[list[int]] = field(default_factory=list)  # instruction -> group per wait (-1 for value 0)


def wait_groups(prog: Program, live: list[bool]) -> WaitGroups:
    """Group the waits: two waits with the same counter, value and excluded signallers share their analysis."""
    sig: dict[int, list[tuple[int, int]]] = defaultdict(list)  # counter -> [(signaller, add)]
    for i in range(prog.n):
        if live[i]:
            for c, add in prog.signals[i]:
                sig[c].append((i, add))
    wait_values: dict[int, list[int]] = defaultdict(list)
    for b in range(prog.n):
        for c, v in prog.waits[b]:
            if v > 0:
                wait_values[c].append(v)
    for c in wait_values:
        wait_values[c] = sorted(set(wait_values[c]))
    phases: dict[int, tuple[dict[int, int], list[int]]] = {}
    run_cost = prog.n + sum(len(w) for w in prog.waits)
    spent = [0]
    base: dict[tuple[int, int], tuple[list[tuple[int, int]], dict[int, list[int]]]] = {}

    def base_candidates(c: int, v: int) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
        """Signallers of c that can supply the adds that first reach v, and their queue positions per worker."""
        got = base.get((c, v))
        if got is None:
            # A signaller that itself waits on c for at least v ("gated") only starts once c >= v, so it never
            # supplies the adds that reach v: leaving it out is exact (c first reaches v through the others).
            cands = [(a, add) for a, add in sig.get(c, []) if not any(c2 == c and v2 >= v for c2, v2 in prog.waits[a])]
            total = sum(add for _, add in cands)
            if any(total - add >= v for _, add in cands):
                # Some candidate may not be needed: keep only those that can end while c < v (one that cannot is
                # no source of the adds that first reach v either; exact, like the gated rule).
                if c not in phases and spent[0] + run_cost <= F_BUDGET:
                    spent[0] += run_cost
                    phases[c] = _capped_phases(prog, c, wait_values[c])
                if c in phases:  # past the budget the candidates stay a superset: sound, z3 decides the rest
                    when, values = phases[c]
                    j = bisect_left(values, v)
                    cands = [(a, add) for a, add in cands if when.get(a, len(values) + 1) <= j]
            per_worker: dict[int, list[int]] = defaultdict(list)
            for a, _ in cands:
                per_worker[prog.worker[a]].append(prog.qpos[a])
            for lst in per_worker.values():
                lst.sort()
            got = base[(c, v)] = (cands, per_worker)
        return got

    wg = WaitGroups(of=[[] for _ in range(prog.n)])
    for b in range(prog.n):
        if not live[b]:
            continue
        w, q = prog.worker[b], prog.qpos[b]
        for c, v in prog.waits[b]:
            if v <= 0:
                wg.of[b].append(-1)
                continue
            cands, per_worker = base_candidates(c, v)
            lst = per_worker.get(w, [])
            excluded = len(lst) - bisect_left(lst, q)  # candidates at or after b in b's queue never end before it
            key = (c, v, w if excluded else -1, excluded)
            g = wg.keys.get(key)
            if g is None:
                g = wg.keys[key] = len(wg.candidates)
                if excluded:
                    cands = [(a, add) for a, add in cands if not (prog.worker[a] == w and prog.qpos[a] >= q)]
                total = sum(add for _, add in cands)
                wg.candidates.append(cands)
                wg.needed.append([a for a, add in cands if total - add < v])
            wg.of[b].append(g)
    return wg


def _capped_phases(prog: Program, c: int, values: list[int]) -> tuple[dict[int, int], list[int]]:
    """For the sorted wait values v_0 < v_1 < ... on counter `c`: the phase j in which each instruction completes in
    the maximal execution where waits read `c` as at most v_j - 1 (phases raise the cap one value at a time; the
    last phase lifts it). An instruction can end while `c < v_j` iff its phase is <= j. One pass: counters and the
    cap only grow, so each instruction's waits are checked from the first one not yet known to hold."""
    counters = [0] * prog.counters
    head = [0] * len(prog.queues)
    nxt = [0] * prog.n  # index of the first wait of each instruction not yet known to hold
    blocked_on: dict[int, list[int]] = defaultdict(list)
    ready = list(range(len(prog.queues)))
    when: dict[int, int] = {}
    for j, v in enumerate([*values, None]):
        cap = v - 1 if v is not None else None
        ready.extend(blocked_on.pop(c, ()))
        while ready:
            w = ready.pop()
            queue = prog.queues[w]
            while head[w] < len(queue):
                i = queue[head[w]]
                waits = prog.waits[i]
                k = nxt[i]
                while k < len(waits):
                    cc, vv = waits[k]
                    have = counters[cc] if cc != c or cap is None else min(counters[cc], cap)
                    if have < vv:
                        break
                    k += 1
                nxt[i] = k
                if k < len(waits):
                    blocked_on[waits[k][0]].append(w)
                    break
                when[i] = j
                head[w] += 1
                for cc, add in prog.signals[i]:
                    counters[cc] += add
                    if blocked_on.get(cc):
                        ready.extend(blocked_on.pop(cc))
    return when, values


def group_ancestors(wg: WaitGroups, g: int, anc: dict[int, int], done: Callable[[int], bool]) -> int:
    """What a waiter of group `g` is HB-after: every needed signaller and its ancestors, and what every candidate is
    HB-after (some candidate has ended when the wait holds). The second part needs every candidate's ancestors
    (`done(a)`: already computed); otherwise it is left out (sound)."""
    out = 0
    for a in wg.needed[g]:
        out |= anc[a] | (1 << a)
    cands = wg.candidates[g]
    if cands and len(wg.needed[g]) < len(cands) and all(done(a) for a, _ in cands):
        common = -1
        for a, _ in cands:
            common &= anc[a] | (1 << a)
            if not common:
                break
        out |= common
    return out


def static_order(prog: Program, wg: WaitGroups, live: list[bool]) -> list[tuple[int, int]] | None:
    """A topological order of instructions (0, i) and wait groups (1, g) where each group follows all its candidate
    signallers; None when the waits form a cycle among candidates."""
    n = prog.n
    indeg = [0] * n
    gsucc: dict[int, list[int]] = defaultdict(list)
    isucc: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    gdeg: dict[int, int] = {}
    for y in range(n):
        if not live[y]:
            continue
        if prog.qpos[y] > 0:
            p = prog.queues[prog.worker[y]][prog.qpos[y] - 1]
            indeg[y] += 1
            isucc[p].append((0, y))
        for g in set(wg.of[y]):
            if g < 0:
                continue
            indeg[y] += 1
            gsucc[g].append(y)
            if g not in gdeg:
                gdeg[g] = len(wg.candidates[g])
                for a, _ in wg.candidates[g]:
                    isucc[a].append((1, g))
    ready = deque([(1, g) for g, d in gdeg.items() if d == 0] + [(0, y) for y in range(n) if live[y] and not indeg[y]])
    out: list[tuple[int, int]] = []
    while ready:
        kind, x = ready.popleft()
        out.append((kind, x))
        succ = isucc[x] if kind == 0 else [(0, y) for y in gsucc[x]]
        for k2, y in succ:
            if k2 == 0:
                indeg[y] -= 1
                if indeg[y] == 0:
                    ready.append((0, y))
            else:
                gdeg[y] -= 1
                if gdeg[y] == 0:
                    ready.append((1, y))
    return out if sum(1 for k, _ in out if k == 0) == sum(live) else None


@dataclass
class HBResult:
    """What the graph pass proved: the number of conflicting pairs, the ones it could not order, and for each wait
    of an instruction with undecided signallers, the signallers known to end before it starts."""

    pairs: int
    undischarged: list[tuple[int, int]]  # (a, b), a < b: a conflicting pair with no proven a -> b
    known_before: dict[tuple[int, int], set[int]]  # (instruction, wait number) -> signallers HB-before it


def graph_pass(prog: Program, ex: Execution, conf: Conflicts, wg: WaitGroups, pipelined: bool,
               order: list[int] | None = None) -> HBResult:
    """Ancestor bitsets over the HB graph in `order` (a topological order of it: the static order, where every
    candidate signaller precedes its waiters, else the maximal execution's); check every instruction's need group."""
    n = prog.n
    order = order if order is not None else ex.order
    pos = {i: p for p, i in enumerate(order)}
    # Last use of each bitset, so that it can be freed (memory stays near the width of the schedule).
    first_use = [len(order)] * len(wg.candidates)
    for b in order:
        for g in wg.of[b]:
            if g >= 0 and pos[b] < first_use[g]:
                first_use[g] = pos[b]
    last = [0] * n
    for i in order:
        last[i] = pos[i]
    for g, cands in enumerate(wg.candidates):
        for a, _ in cands:
            if pos.get(a, len(order)) < first_use[g]:
                last[a] = max(last[a], first_use[g])
    if not pipelined:
        for queue in prog.queues:
            for p, q in zip(queue, queue[1:], strict=False):
                if q in pos:
                    last[p] = max(last[p], pos[q])
    free_at: dict[int, list[int]] = defaultdict(list)
    for i in order:
        free_at[last[i]].append(i)
    group_last: dict[int, int] = {}
    for b in order:
        for g in wg.of[b]:
            if g >= 0:
                group_last[g] = max(group_last.get(g, 0), pos[b])
    group_free: dict[int, list[int]] = defaultdict(list)
    for g, p in group_last.items():
        group_free[p].append(g)

    anc: dict[int, int] = {}  # instruction -> ancestors bitset (bit i = instruction index i)
    ganc: dict[int, int] = {}  # wait group -> OR of (anc | bit) of its needed signallers
    need_bits: dict[int, int] = {}
    group_bits: dict[int, int] = {}
    pairs = 0
    undischarged: list[tuple[int, int]] = []
    known_before: dict[tuple[int, int], set[int]] = {}
    for p, b in enumerate(order):
        a_b = 0
        if not pipelined and prog.qpos[b] > 0:
            prev = prog.queues[prog.worker[b]][prog.qpos[b] - 1]
            a_b |= anc[prev] | (1 << prev)
        for g in wg.of[b]:
            if g < 0:
                continue
            ga = ganc.get(g)
            if ga is None:
                ga = group_ancestors(wg, g, anc, lambda a, p=p: pos.get(a, len(order)) < p)
                ganc[g] = ga
            a_b |= ga
        anc[b] = a_b
        for j, g in enumerate(wg.of[b]):
            if g >= 0 and len(wg.needed[g]) < len(wg.candidates[g]):
                known_before[(b, j)] = {a for a, _ in wg.candidates[g] if a_b >> a & 1}
        ns = conf.need.get(b)
        if ns is not None:
            nb = need_bits.get(ns)
            if nb is None:
                nb = 0
                for g in conf.sets[ns]:
                    rb = group_bits.get(g)
                    if rb is None:
                        rb = group_bits[g] = bits_of(conf.groups[g].tolist(), n)
                    nb |= rb
                need_bits[ns] = nb
            pairs += nb.bit_count()
            missing = nb & ~a_b
            if missing:
                undischarged.extend((a, b) for a in indices_of(missing))
        for i in free_at.get(p, ()):
            anc.pop(i, None)
        for g in group_free.get(p, ()):
            ganc.pop(g, None)
    return HBResult(pairs, undischarged, known_before)
