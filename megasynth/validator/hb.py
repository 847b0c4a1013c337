"""Conflicts and the happens-before graph pass: `Program` + maximal execution -> the conflicting pairs that need a
proof, and which of them the graph already proves.

Conflicting pairs. Per buffer, the element ranges are cut into segments at every access boundary; in each segment the
accesses in ascending-id order form maximal *runs* of mutually non-conflicting accesses (a run of reads, a run of
reduces, or one write; an instruction that reads and reduces a segment counts as a write there). Every access
conflicts with every access of the neighbouring run, and HB is transitive, so "every conflicting pair is ordered" is
equivalent to "every access happens after every member of the run just before it" (exact, not an approximation):
those are the pairs we prove. An instruction's needed predecessors are interned as a *need group* (a set of runs), so
the thousands of readers of one residual share one bitset.

Happens-before (sound): program order (unless `pipelined`); counter edges: for a wait `counters[c] >= v` of `b`,
the *candidates* are the signallers of `c` that could supply the adds that first reach `v`. A signaller is no
candidate when it is `b` or queued after `b` on `b`'s worker, never runs in any execution, or cannot end while
`c < v`: it waits for `c >= v` itself, a capped maximal execution (`_capped_phases`) leaves it out, or it is *gated*:
HB-after some waiter of `c` at `v` or above (counters shared across layers: the layer-L+1 signallers follow the
layer-L waiters, so a cumulative target is an exact join). `b` is HB-after a candidate `x` when the candidates other
than `x` and not HB-after `x` cannot reach `v` (plain counting when none is HB-after another), and after whatever
every candidate is HB-after (one of them has ended).
Gates are circular (the waiter's own edges are what orders the later signallers after it), so `happens_before`
guesses them from the maximal execution, runs the pass, and keeps only guesses the pass itself confirms; its
docstring gives the argument (induction on the start time of the first violated fact) why that is sound.
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
from itertools import chain

import numpy as np

from megasynth.ir.program import Program
from megasynth.validator.deadlock import Execution

READ, REDUCE, WRITE = 0, 1, 2
#: Work allowed for capped executions (instructions + waits visited): each costs one pass over the schedule.
F_BUDGET = 6_000_000
#: Graph passes that may refute a gate guess (`happens_before`); one more pass runs without any guess.
MAX_ROUNDS = 6
#: Expected number of groups in a wait chunk (`WaitGroups.chunks`).
CHUNK = 16
#: A wait with at most this many candidates, some unneeded, is checked for candidates HB-before the others.
REFINE_MAX = 256
_KIND = {"read": READ, "reduce": REDUCE, "write": WRITE}


@dataclass
class Conflicts:
    """Need groups: sets of instructions (deduplicated by content); need *parts*: sets of groups, one per access
    class (consecutive identical accesses, so the thousands of readers of one residual share one part); each live
    instruction lists the parts whose every member must happen before it. `group_buffer` keeps, per group, the buffer
    it came from (for messages)."""

    groups: list[np.ndarray] = field(default_factory=list)  # group -> sorted member instruction indices
    group_buffer: list[str] = field(default_factory=list)
    parts: list[list[int]] = field(default_factory=list)  # part -> groups
    need: dict[int, list[int]] = field(default_factory=dict)  # instruction index -> parts

    def members(self, b: int) -> list[int]:
        """Every instruction that must happen before `b` (ascending)."""
        return sorted({int(a) for p in self.need.get(b, ()) for g in self.parts[p] for a in self.groups[g]})


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (sort-based; numpy's hash-based `unique` is far slower on these sizes)."""
    a = np.sort(x)
    if len(a) == 0:
        return a
    keep = np.ones(len(a), dtype=bool)
    keep[1:] = a[1:] != a[:-1]
    return a[keep]


def _classes(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Access classes of one buffer's accesses (rows: instruction, kind, lo, hi; in instruction order): consecutive
    reads (or reduces) of one range, each by an instruction with no other access to the buffer, always fall in one
    run of every segment, so the sweep treats them as one access. Returns the first row of each class and each
    row's class."""
    inst, cls, lo, hi = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
    single = np.ones(len(inst), dtype=bool)
    same_inst = inst[1:] == inst[:-1]
    single[1:] &= ~same_inst
    single[:-1] &= ~same_inst
    join = np.zeros(len(inst), dtype=bool)
    join[1:] = (single[1:] & single[:-1] & (cls[1:] == cls[:-1]) & (cls[1:] != WRITE) & (lo[1:] == lo[:-1])
                & (hi[1:] == hi[:-1]))
    class_of = np.cumsum(~join) - 1
    return np.flatnonzero(~join), class_of


def _group(out: Conflicts, content: dict[bytes, int], members: np.ndarray, buf: str) -> int:
    """The group of these member instructions (one per distinct member set, across buffers)."""
    k = members.tobytes()
    g = content.get(k)
    if g is None:
        g = content[k] = len(out.groups)
        out.groups.append(members)
        out.group_buffer.append(buf)
    return g


def find_conflicts(prog: Program, live: list[bool]) -> Conflicts:
    """Sweep each buffer's segments in ascending-id order (vectorised, over access classes) and build the need parts
    of live instructions."""
    out = Conflicts()
    n = prog.n
    by_buf: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for i in range(n):
        if live[i]:
            for kind, buf, lo, hi in prog.accesses[i]:
                by_buf[buf].append((i, _KIND[kind], lo, hi))
    content: dict[bytes, int] = {}
    part_ids: dict[bytes, int] = {}
    need_i: list[np.ndarray] = []  # (instruction, part) pairs: the instruction needs the part
    need_p: list[np.ndarray] = []
    for buf, accs in by_buf.items():
        arr = np.array(accs, dtype=np.int64)
        first_row, class_of = _classes(arr)
        row_start = np.append(first_row, len(arr))
        inst_a, cls_a, lo_a, hi_a = (arr[first_row, k] for k in range(4))  # one access per class
        cuts = sorted_unique(np.concatenate([lo_a, hi_a]))
        s0 = np.searchsorted(cuts, lo_a)
        cnt = np.searchsorted(cuts, hi_a) - s0
        total = int(cnt.sum())
        offs = np.repeat(np.cumsum(cnt) - cnt, cnt)
        seg = np.repeat(s0, cnt) + (np.arange(total) - offs)
        klass = np.repeat(np.arange(len(first_row)), cnt)
        cls = np.repeat(cls_a, cnt)
        key = seg * n + inst_a[klass]
        if len(cuts) < 2**15:  # entries are in instruction order already: a stable radix sort by segment suffices
            order = np.argsort(seg.astype(np.int16), kind="stable")
        else:
            order = np.argsort(key, kind="stable")  # ties are one instruction's accesses to one segment: merged below
        key, seg, klass, cls = key[order], seg[order], klass[order], cls[order]
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        starts = np.flatnonzero(first)
        if len(starts) < len(key):  # one instruction, several accesses to one segment: mixed kinds act as a write
            lo_c = np.minimum.reduceat(cls, starts)
            hi_c = np.maximum.reduceat(cls, starts)
            cls = np.where(lo_c == hi_c, lo_c, WRITE)
            seg = seg[starts]
            merged = klass[starts]  # the instruction's other classes in this segment: same pairs, added below
            extra_k, extra_r = klass[~first], np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(key))))
            extra_r = extra_r[~first]
            klass = merged
        else:
            extra_k = extra_r = np.zeros(0, np.int64)
        m = len(seg)
        seg_first = np.ones(m, dtype=bool)
        seg_first[1:] = seg[1:] != seg[:-1]
        new_run = seg_first | (cls == WRITE)
        new_run[1:] |= cls[1:] != cls[:-1]
        run_id = np.cumsum(new_run) - 1
        run_start = np.flatnonzero(new_run)
        run_end = np.append(run_start[1:], m)
        first_run_of_seg = np.maximum.accumulate(np.where(seg_first, run_id, 0))
        prev = run_id - 1
        has_prev = prev >= first_run_of_seg
        pk, pr = klass[has_prev], prev[has_prev]
        if len(extra_k):  # classes merged into another entry of their instruction share its predecessor run
            ek = extra_k[has_prev[extra_r]]
            pk, pr = np.concatenate([pk, ek]), np.concatenate([pr, prev[extra_r][has_prev[extra_r]]])
        local = np.full(max(int(run_id[-1]) + 1, 1), -1, dtype=np.int64)
        # runs of the same classes recur across segments (a batch's K-split readers of every element of their range):
        # their group is built once (a run of one class, most of them, keyed by the class)
        by_classes: dict[bytes, int] = {}
        by_class: dict[int, int] = {}
        runs = sorted_unique(pr)
        r0s, r1s, klass_l = run_start[runs].tolist(), run_end[runs].tolist(), klass.tolist()
        groups_of_runs = []
        for r0, r1 in zip(r0s, r1s, strict=True):
            if r1 - r0 == 1:
                c = klass_l[r0]
                g = by_class.get(c)
                if g is None:  # one class: its rows are distinct instructions in ascending order already
                    g = by_class[c] = _group(out, content, arr[row_start[c]:row_start[c + 1], 0], buf)
                groups_of_runs.append(g)
                continue
            run = klass[r0:r1]
            g = by_classes.get(run.tobytes())
            if g is None:
                members = sorted_unique(np.concatenate([arr[row_start[k]:row_start[k + 1], 0] for k in run.tolist()]))
                g = by_classes[run.tobytes()] = _group(out, content, members, buf)
            groups_of_runs.append(g)
        local[runs] = groups_of_runs
        if not len(pk):
            continue
        ng = max(len(out.groups), 1)
        flat = sorted_unique(pk * ng + local[pr])
        fk, fg = flat // ng, flat % ng
        cut = np.flatnonzero(np.diff(fk)) + 1
        seg_lo = np.append(0, cut)
        part_of: list[int] = []
        for lo_i, hi_i in zip(seg_lo.tolist(), np.append(cut, len(fk)).tolist(), strict=True):
            k = fg[lo_i:hi_i].tobytes()
            part = part_ids.get(k)
            if part is None:
                part = part_ids[k] = len(out.parts)
                out.parts.append(fg[lo_i:hi_i].tolist())
            part_of.append(part)
        cs = fk[seg_lo]  # each class's rows (its instructions) need its part
        cnt = row_start[cs + 1] - row_start[cs]
        rows = np.repeat(row_start[cs], cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        need_i.append(arr[rows, 0])
        need_p.append(np.repeat(np.array(part_of, dtype=np.int64), cnt))
    _set_need(out, need_i, need_p)
    return out


def _set_need(out: Conflicts, need_i: list[np.ndarray], need_p: list[np.ndarray]) -> None:
    """out.need from (instruction, part) pairs: each instruction's parts sorted and deduplicated, equal lists shared,
    the instructions in the order of their first pair."""
    if not need_i:
        return
    inst, part = np.concatenate(need_i), np.concatenate(need_p)
    first = np.unique(inst, return_index=True)[1]
    np_ = max(len(out.parts), 1)
    pairs = sorted_unique(inst * np_ + part)
    pi, pp = pairs // np_, pairs % np_
    bounds = np.flatnonzero(np.diff(pi)) + 1
    starts = np.append(0, bounds).tolist()
    ends = np.append(bounds, len(pi)).tolist()
    pp_l = pp.tolist()
    by_inst: dict[int, list[int]] = {}
    interned: dict[tuple[int, ...], list[int]] = {}
    for i, a, b in zip(pi[starts].tolist(), starts, ends, strict=True):
        key_t = tuple(pp_l[a:b])
        by_inst[i] = interned.setdefault(key_t, list(key_t))
    for i in inst[np.sort(first)].tolist():
        out.need[i] = by_inst[i]


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
class WaitTable:
    """Every wait as flat arrays, in instruction order and, per instruction, in the order of its `waits`."""

    owner: np.ndarray  # instruction index
    counter: np.ndarray
    value: np.ndarray
    start: np.ndarray  # instruction -> offset of its first wait (n + 1 entries)


def wait_table(prog: Program) -> WaitTable:
    """Flatten `prog.waits` once (millions of waits at tile granularity: the passes below work on arrays)."""
    counts = np.fromiter(map(len, prog.waits), np.int64, prog.n)
    total = int(counts.sum())
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(prog.waits)), np.int64, 2 * total).reshape(total, 2)
    start = np.zeros(prog.n + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    return WaitTable(np.repeat(np.arange(prog.n), counts), flat[:, 0].copy(), flat[:, 1].copy(), start)


#: (signaller, counter) -> G: a claim that the signaller cannot end while the counter is below G.
Gates = dict[tuple[int, int], int]


def signal_table(prog: Program) -> tuple[np.ndarray, np.ndarray]:
    """Every signal as flat arrays (signaller, counter)."""
    pairs = [(z, c) for z in range(prog.n) for c, _ in prog.signals[z]]
    arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def own_levels(prog: Program, table: WaitTable) -> Gates:
    """(signaller, counter) -> the largest value the signaller itself waits for on that counter (exact gates: it
    starts only once the counter is that high, so it never supplies the adds that reach it)."""
    sz, sc = signal_table(prog)
    span = max(prog.counters, 1)
    wk = table.owner * span + table.counter
    keep = np.isin(wk, sz * span + sc) & (table.value > 0)
    k, v = wk[keep], table.value[keep]
    srt = np.lexsort((v, k))
    k, v = k[srt], v[srt]
    last = np.ones(len(k), dtype=bool)
    last[:-1] = k[1:] != k[:-1]
    return {(kk // span, kk % span): vv for kk, vv in zip(k[last].tolist(), v[last].tolist(), strict=True)}


def gate_guesses(prog: Program, ex: Execution, table: WaitTable,
                 own: Gates) -> tuple[Gates, dict[tuple[int, int], int]]:
    """Guess, for each signal of `z` on counter `c`, the largest value G of a `c`-wait of an instruction that completes
    before `z` in the maximal execution (kept where it is above z's own waits), and name the latest such waiter as
    the witness. The guess is that such a waiter happens before `z`, so that `z` cannot end while `c < G`: true of
    lowerings with counters shared across layers, where the layer-L+1 signallers follow the layer-L waiters.
    `graph_pass` checks every guess it relied on."""
    n = prog.n
    pos = np.full(n, n, np.int64)
    order = np.array(ex.order, dtype=np.int64)
    pos[order] = np.arange(len(order))
    keep = (table.value > 0) & (pos[table.owner] < n)
    if not keep.any():
        return {}, {}
    c, v, p = table.counter[keep], table.value[keep], pos[table.owner[keep]]
    key = c * (n + 1) + p
    srt = np.argsort(key, kind="stable")
    key, c, v, p = key[srt], c[srt], v[srt], p[srt]
    span = int(v.max()) + 1
    running = np.maximum.accumulate(c * span + v) - c * span  # running max of v within each counter's segment
    holder = np.maximum.accumulate(np.where(v == running, np.arange(len(v)), -1))  # the latest wait reaching it
    sz, sc = signal_table(prog)
    alive = pos[sz] < n
    sz, sc = sz[alive], sc[alive]
    at = np.searchsorted(key, sc * (n + 1) + pos[sz]) - 1  # the last wait on c completed before z
    valid = at >= 0
    at = np.where(valid, at, 0)
    valid &= c[at] == sc
    at = at[valid]
    gates: Gates = {}
    witness: dict[tuple[int, int], int] = {}
    for z, cc, g, w in zip(sz[valid].tolist(), sc[valid].tolist(), running[at].tolist(),
                           order[p[holder[at]]].tolist(), strict=True):
        if g > own.get((z, cc), 0):
            gates[(z, cc)] = g
            witness[(z, cc)] = w
    return gates, witness


@dataclass
class WaitGroups:
    """Per wait, the signallers that could end before the waiter starts, and which of them are needed. An
    instruction's groups are also cut into *chunks* (content-defined cuts of its sorted groups), so that instructions
    whose waits differ in a few groups share the work on the rest."""

    keys: dict[tuple[int, int, int, int], int] = field(default_factory=dict)  # (c, v, worker, excluded) -> group
    value: list[int] = field(default_factory=list)  # group -> wait value
    candidates: list[list[tuple[int, int]]] = field(default_factory=list)  # group -> [(signaller, add)]
    needed: list[list[int]] = field(default_factory=list)  # group -> needed signallers
    gid: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per wait (WaitTable order): its group
    start: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # instruction -> its first wait
    chunks: list[list[int]] = field(default_factory=list)  # chunk -> its groups
    chunks_of: list[list[int]] = field(default_factory=list)  # instruction -> its chunks (shared lists)
    #: exact join -> (an exact join on the same counter whose candidates it includes, its other candidates): counters
    #: shared across layers make such chains, and the replay then takes one max per layer, not per earlier layer
    extends: dict[int, tuple[int, list[int]]] = field(default_factory=dict)

    def add_group(self, key: tuple[int, int, int, int], cands: list[tuple[int, int]]) -> int:
        """Register a group; its needed signallers are those the others cannot do without (plain counting)."""
        g = self.keys[key] = len(self.candidates)
        total = sum(add for _, add in cands)
        self.value.append(key[1])
        self.candidates.append(cands)
        self.needed.append([a for a, add in cands if total - add < key[1]])
        return g

    def of(self, b: int) -> list[int]:
        """The group of each wait of instruction `b`, in the order of its `waits` (-1: value 0, or `b` never runs)."""
        return self.gid[self.start[b]:self.start[b + 1]].tolist()

    def slack(self, g: int) -> bool:
        """Whether some candidate of group `g` is not needed (a "k of n" join)."""
        return len(self.needed[g]) < len(self.candidates[g])


def wait_groups(prog: Program, live: list[bool], table: WaitTable, own: Gates, gates: Gates) -> WaitGroups:
    """Group the waits by (counter, value) and find their candidate signallers: the live signallers of the counter
    less those that cannot end while it is below the value (`own` and `gates`, then a capped maximal execution where
    some remain unneeded) and, per waiter, those at or after it in its own queue."""
    n = prog.n
    sig: dict[int, list[tuple[int, int]]] = defaultdict(list)  # counter -> [(signaller, its adds together)]
    for i in range(n):
        if live[i] and prog.signals[i]:
            adds: dict[int, int] = defaultdict(int)
            for c, add in prog.signals[i]:
                adds[c] += add
            for c, add in adds.items():
                sig[c].append((i, add))
    live_arr = np.array(live, dtype=bool)
    use = live_arr[table.owner] & (table.value > 0)
    span = int(table.value.max()) + 1 if len(table.value) else 1
    wkey = table.counter * span + table.value
    ukeys = np.unique(wkey[use])
    values: dict[int, list[int]] = defaultdict(list)
    for k in ukeys.tolist():
        values[k // span].append(k % span)
    all_values: dict[int, list[int]] = defaultdict(list)  # including waits of instructions that never run
    for k in np.unique(wkey[table.value > 0]).tolist():
        all_values[k // span].append(k % span)

    wg = WaitGroups()
    run_cost = n + len(table.owner)
    spent = 0
    for c, vals in values.items():
        lev = [(max(own.get((a, c), 0), gates.get((a, c), 0)), a, add) for a, add in sig.get(c, [])]
        lev.sort()
        when: dict[int, int] | None = None
        k = 0
        join: tuple[int, set[int]] | None = None  # the last exact join on c: (group, its candidates)
        for v in vals:
            while k < len(lev) and lev[k][0] < v:
                k += 1
            cands = sorted((a, add) for _, a, add in lev[:k])
            total = sum(add for _, add in cands)
            if cands and total - min(add for _, add in cands) >= v:
                # Some candidate may not be needed: keep only those that can end while c < v (one that cannot is
                # no source of the adds that first reach v either; exact).
                if when is None and spent + run_cost <= F_BUDGET:
                    spent += run_cost
                    when = _capped_phases(prog, c, all_values[c])[0]
                if when is not None:  # past the budget the candidates stay a superset: sound, z3 decides the rest
                    jj = bisect_left(all_values[c], v)
                    cands = [(a, add) for a, add in cands if when.get(a, len(all_values[c]) + 1) <= jj]
            g = wg.add_group((c, v, -1, 0), cands)
            if sum(add for _, add in cands) == v:  # an exact join: it holds when its last candidate ends
                mine = {a for a, _ in cands}
                if join is not None and join[1] <= mine:
                    wg.extends[g] = (join[0], sorted(mine - join[1]))
                join = (g, mine)
    base = len(wg.candidates)

    # Per wait: its group, or a variant without the candidates queued at or after the waiter on its worker.
    gid = np.full(len(table.owner), -1, np.int64)
    gid[use] = np.searchsorted(ukeys, wkey[use])  # base groups were created in ascending key order
    nw = max(len(prog.queues), 1)
    ck, cq = [], []
    for g in range(base):
        for a, _ in wg.candidates[g]:
            ck.append(g * nw + prog.worker[a])
            cq.append(prog.qpos[a])
    if ck:
        ck_a, cq_a = np.array(ck, dtype=np.int64), np.array(cq, dtype=np.int64)
        srt = np.lexsort((cq_a, ck_a))
        ck_a, cq_a = ck_a[srt], cq_a[srt]
        last = np.ones(len(ck_a), dtype=bool)
        last[:-1] = ck_a[1:] != ck_a[:-1]
        mk, mq = ck_a[last], cq_a[last]  # (group, worker) -> the largest queue position of a candidate
        idx = np.flatnonzero(use)
        wk = gid[idx] * nw + np.array(prog.worker, dtype=np.int64)[table.owner[idx]]
        at = np.minimum(np.searchsorted(mk, wk), len(mk) - 1)
        qpos = np.array(prog.qpos, dtype=np.int64)
        hit = (mk[at] == wk) & (mq[at] >= qpos[table.owner[idx]])
        for t in idx[hit].tolist():
            b, g = int(table.owner[t]), int(gid[t])
            w, q = prog.worker[b], prog.qpos[b]
            cands = [(a, add) for a, add in wg.candidates[g] if not (prog.worker[a] == w and prog.qpos[a] >= q)]
            key = (int(table.counter[t]), int(table.value[t]), w, len(wg.candidates[g]) - len(cands))
            gid[t] = wg.keys.get(key, -2)
            if gid[t] == -2:
                gid[t] = wg.add_group(key, cands)

    wg.gid, wg.start = gid, table.start
    rows: dict[bytes, list[int]] = {}
    chunk_ids: dict[bytes, int] = {}
    wg.chunks_of = [[] for _ in range(n)]
    for b in range(n):
        lo, hi = int(table.start[b]), int(table.start[b + 1])
        if not live[b] or lo == hi:
            continue
        key = gid[lo:hi].tobytes()
        got = rows.get(key)
        if got is None:
            groups = sorted_unique(gid[lo:hi])
            groups = groups[groups >= 0]
            cuts = np.flatnonzero(((groups * 2654435761) >> 16) % CHUNK == 0) + 1
            got = rows[key] = []
            for part in np.split(groups, cuts):
                if len(part):
                    k = part.tobytes()
                    ch = chunk_ids.get(k)
                    if ch is None:
                        ch = chunk_ids[k] = len(wg.chunks)
                        wg.chunks.append(part.tolist())
                    got.append(ch)
        wg.chunks_of[b] = got
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
    """What a waiter of group `g` is HB-after: every needed signaller and its ancestors; when every candidate's
    ancestors are known (`done(a)`), also what every candidate is HB-after (some candidate has ended when the wait
    holds) and each candidate `x` that the wait cannot do without because the others that could end before `x`
    (those not HB-after it) do not add up to the value. Otherwise those parts are left out (sound)."""
    out = 0
    for a in wg.needed[g]:
        out |= anc[a] | (1 << a)
    cands = wg.candidates[g]
    if not cands or len(wg.needed[g]) == len(cands) or not all(done(a) for a, _ in cands):
        return out
    common = -1
    for a, _ in cands:
        common &= anc[a] | (1 << a)
        if not common:
            break
    out |= common
    if len(cands) <= REFINE_MAX:
        total = sum(add for _, add in cands)
        mask = bits_of([a for a, _ in cands], max(a for a, _ in cands) + 1)
        after: dict[int, int] = defaultdict(int)  # x -> adds of the candidates HB-after x
        for z, add in cands:
            for x in indices_of(anc[z] & mask):
                after[x] += add
        v = wg.value[g]
        for x, add in cands:
            if total - add - after[x] < v:
                out |= anc[x] | (1 << x)
    return out


def static_order(prog: Program, wg: WaitGroups, live: list[bool]) -> list[tuple[int, int]] | None:
    """A topological order of instructions (0, i) and wait groups (1, g) where each group follows all its candidate
    signallers and each instruction all the groups of its waits; None when the waits form a cycle among candidates."""
    n = prog.n
    indeg = [0] * n
    isucc: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # instruction -> (kind, node) successors
    chunk_users: dict[int, list[int]] = defaultdict(list)
    for y in range(n):
        if not live[y]:
            continue
        if prog.qpos[y] > 0:
            indeg[y] += 1
            isucc[prog.queues[prog.worker[y]][prog.qpos[y] - 1]].append((0, y))
        indeg[y] += len(wg.chunks_of[y])
        for ch in wg.chunks_of[y]:
            chunk_users[ch].append(y)
    chunk_deg = {ch: len(wg.chunks[ch]) for ch in chunk_users}
    gsucc: dict[int, list[int]] = defaultdict(list)  # group -> chunks
    for ch in chunk_users:
        for g in wg.chunks[ch]:
            gsucc[g].append(ch)
    gdeg = {g: len(wg.candidates[g]) for g in gsucc}
    for g in gsucc:
        for a, _ in wg.candidates[g]:
            isucc[a].append((1, g))
    ready = deque([(1, g) for g, d in gdeg.items() if d == 0] + [(0, y) for y in range(n) if live[y] and not indeg[y]])
    out: list[tuple[int, int]] = []
    while ready:
        kind, x = ready.popleft()
        out.append((kind, x))
        if kind == 0:
            for k2, y in isucc[x]:
                if k2 == 0:
                    indeg[y] -= 1
                    if indeg[y] == 0:
                        ready.append((0, y))
                else:
                    gdeg[y] -= 1
                    if gdeg[y] == 0:
                        ready.append((1, y))
            continue
        for ch in gsucc[x]:
            chunk_deg[ch] -= 1
            if chunk_deg[ch] == 0:
                for y in chunk_users[ch]:
                    indeg[y] -= 1
                    if indeg[y] == 0:
                        ready.append((0, y))
    return out if sum(1 for k, _ in out if k == 0) == sum(live) else None


@dataclass
class HBResult:
    """What the graph pass proved: the number of conflicting pairs, the ones it could not order, for each wait of an
    instruction with undecided signallers the signallers known to end before it starts, and the gate guesses that
    the pass could not confirm (with the value it could confirm instead)."""

    pairs: int
    undischarged: list[tuple[int, int]]  # (a, b), a < b: a conflicting pair with no proven a -> b
    known_before: dict[tuple[int, int], set[int]]  # (instruction, wait number) -> signallers HB-before it
    refuted: Gates = field(default_factory=dict)


class _Waiters:
    """Bitsets of the live waiters of a counter at or above a value, to check the gate guesses whose witness is not
    HB-before the signaller; built on first use (rare: lowerings confirm through the witness)."""

    def __init__(self, table: WaitTable, live: list[bool], n: int) -> None:
        self.table, self.live, self.n = table, live, n
        self.cache: dict[tuple[int, int], int] = {}
        self.sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _range(self, c: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        if self.sorted is None:
            t = self.table
            keep = (t.value > 0) & np.array(self.live, dtype=bool)[t.owner]
            cc, v, o = t.counter[keep], t.value[keep], t.owner[keep]
            srt = np.lexsort((-v, cc))
            self.sorted = cc[srt], v[srt], o[srt]  # by counter, values descending
        cc, v, o = self.sorted
        lo, hi = np.searchsorted(cc, [c, c + 1])
        return v, o, int(lo), int(hi)

    def values(self, c: int) -> list[int]:
        """The distinct values live instructions wait for on `c`, descending."""
        v, _, lo, hi = self._range(c)
        return sorted(set(v[lo:hi].tolist()), reverse=True)

    def at_least(self, c: int, value: int) -> int:
        """The live waiters of `c` at `value` or above, as a bitset."""
        got = self.cache.get((c, value))
        if got is None:
            v, o, lo, hi = self._range(c)
            k = lo + int(np.searchsorted(-v[lo:hi], -value, side="right"))
            got = self.cache[(c, value)] = bits_of(o[lo:k].tolist(), self.n)
        return got


def graph_pass(prog: Program, ex: Execution, conf: Conflicts, wg: WaitGroups, pipelined: bool,
               order: list[int] | None = None, gates: Gates | None = None, waiters: _Waiters | None = None,
               witness: dict[tuple[int, int], int] | None = None) -> HBResult:
    """Ancestor bitsets over the HB graph in `order` (a topological order of it: the static order, where every
    candidate signaller precedes its waiters, else the maximal execution's); check every instruction's need group
    and every gate guess the wait groups relied on (a gate holds when a waiter of its counter at or above its value
    is HB-before the signaller)."""
    n = prog.n
    order = order if order is not None else ex.order
    pos = {i: p for p, i in enumerate(order)}
    gates_of: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for (z, c), level in (gates or {}).items():
        gates_of[z].append((c, level))
    # Last use of each bitset, so that it can be freed (memory stays near the width of the schedule).
    chunk_first: dict[int, int] = {}
    chunk_last: dict[int, int] = {}
    for p, b in enumerate(order):
        for ch in wg.chunks_of[b]:
            chunk_first.setdefault(ch, p)
            chunk_last[ch] = p
    group_first: dict[int, int] = {}
    group_last: dict[int, int] = {}
    for ch, p in chunk_first.items():
        for g in wg.chunks[ch]:
            group_first[g] = min(group_first.get(g, p), p)
            group_last[g] = max(group_last.get(g, p), p)
    last = [0] * n
    for i in order:
        last[i] = pos[i]
    for g, p in group_first.items():
        for a, _ in wg.candidates[g]:
            if pos.get(a, len(order)) < p:
                last[a] = max(last[a], p)
    if not pipelined:
        for queue in prog.queues:
            for p, q in zip(queue, queue[1:], strict=False):
                if q in pos:
                    last[p] = max(last[p], pos[q])
    free_at: dict[int, list[tuple[int, int]]] = defaultdict(list)  # position -> (kind, node) to free after it
    for i in order:
        free_at[last[i]].append((0, i))
    for g, p in group_last.items():
        free_at[p].append((1, g))
    for ch, p in chunk_last.items():
        free_at[p].append((2, ch))
    slack_chunk = {ch for ch in chunk_first if any(wg.slack(g) for g in wg.chunks[ch])}

    anc: dict[int, int] = {}  # instruction -> ancestors bitset (bit i = instruction index i)
    ganc: dict[int, int] = {}  # wait group -> what its waiters are HB-after
    canc: dict[int, int] = {}  # wait chunk -> OR of its groups'
    part_bits: dict[int, int] = {}
    group_bits: dict[int, int] = {}
    pairs = 0
    undischarged: list[tuple[int, int]] = []
    known_before: dict[tuple[int, int], set[int]] = {}
    refuted: Gates = {}
    for p, b in enumerate(order):
        a_b = 0
        if not pipelined and prog.qpos[b] > 0:
            prev = prog.queues[prog.worker[b]][prog.qpos[b] - 1]
            a_b |= anc[prev] | (1 << prev)
        for ch in wg.chunks_of[b]:
            ca = canc.get(ch)
            if ca is None:
                ca = 0
                for g in wg.chunks[ch]:
                    ga = ganc.get(g)
                    if ga is None:
                        ga = ganc[g] = group_ancestors(wg, g, anc, lambda a, p=p: pos.get(a, len(order)) < p)
                    ca |= ga
                canc[ch] = ca
            a_b |= ca
        if any(ch in slack_chunk for ch in wg.chunks_of[b]):
            for j, g in enumerate(wg.of(b)):
                if g >= 0 and wg.slack(g):
                    known_before[(b, j)] = {a for a, _ in wg.candidates[g] if a_b >> a & 1}
        anc[b] = a_b
        for c, level in gates_of.get(b, ()):
            w = (witness or {}).get((b, c), -1)
            if w >= 0 and a_b >> w & 1:
                continue
            if waiters is None:
                raise ValueError("graph_pass needs `waiters` to check gate guesses")
            if not a_b & waiters.at_least(c, level):
                refuted[(b, c)] = next((v for v in waiters.values(c) if v < level and a_b & waiters.at_least(c, v)),
                                       0)
        parts = conf.need.get(b)
        if parts is not None:
            nb = 0
            for part in parts:
                pb = part_bits.get(part)
                if pb is None:
                    pb = 0
                    for g in conf.parts[part]:
                        rb = group_bits.get(g)
                        if rb is None:
                            rb = group_bits[g] = bits_of(conf.groups[g].tolist(), n)
                        pb |= rb
                    part_bits[part] = pb
                nb |= pb
            pairs += nb.bit_count()
            missing = nb & ~a_b
            if missing:
                undischarged.extend((a, b) for a in indices_of(missing))
        for kind, x in free_at.get(p, ()):
            (anc, ganc, canc)[kind].pop(x, None)
    return HBResult(pairs, undischarged, known_before, refuted)


@dataclass
class HappensBefore:
    """The outcome of `happens_before`: the wait groups it settled on, their static order (None: there is none),
    the graph pass's result, the gate guesses it used (all confirmed) and how many passes it took."""

    wg: WaitGroups
    static: list[tuple[int, int]] | None
    result: HBResult
    gates: Gates
    rounds: int


def happens_before(prog: Program, ex: Execution, conf: Conflicts, live: list[bool], pipelined: bool) -> HappensBefore:
    """Guess gates from the maximal execution, build the wait groups and run the graph pass; while the pass refutes a
    guess, lower it to what the pass did confirm and run again (after MAX_ROUNDS passes: none at all).

    Why this is sound although the gates are circular. Each fact the final pass derives ("`a` ends before `y`
    starts") is program order or comes from one wait of `y` (on `c` for `v`) and its candidates; the other signallers
    of `c` were left out as at/after `y` in its queue, waiting for `c >= v` themselves, missing from a capped maximal
    execution (all three exact), or gated: HB-after a waiter of `c` at `v` or above through a chain of derived facts,
    as the pass confirmed for every guess it used. Suppose an execution violates a derived fact; take the violated
    `a -> y` whose `y` starts first, t0 <= start(y) the time `c` first reached `v`, and E the signallers ended by t0
    (their adds reach `v`). A gated `z` in E would need its chain from its waiter `w` to fail (`w` starts at or after
    t0, `z` ends by t0), and the chain's last failing link starts before `z` ends, so before `y` starts: a violated
    fact earlier than `y`, impossible. Likewise a candidate in E HB-after `a` would mean `a` ended by t0, or an
    earlier violated link. So E holds candidates only, none HB-after `a`, and the counting that derived `a -> y` says
    they cannot reach `v` without `a`: contradiction (the common-ancestor facts follow alike: some candidate is in
    E). Facts are only ever used through links that start before `y`: an induction on start times."""
    table = wait_table(prog)
    own = own_levels(prog, table)
    gates, witness = gate_guesses(prog, ex, table, own)
    waiters = _Waiters(table, live, prog.n) if gates else None
    rounds = 0
    while True:
        rounds += 1
        if rounds > MAX_ROUNDS:
            gates = {}
        wg = wait_groups(prog, live, table, own, gates)
        static = static_order(prog, wg, live)  # candidates before waiters: lets the graph use what they all follow
        order = [x for kind, x in static if kind == 0] if static is not None else ex.order
        result = graph_pass(prog, ex, conf, wg, pipelined, order, gates, waiters, witness)
        if not result.refuted:
            return HappensBefore(wg, static, result, gates, rounds)
        for key, level in result.refuted.items():
            if level > own.get(key, 0):
                gates[key] = level
            else:
                del gates[key]
