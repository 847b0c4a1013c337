"""Lowering: model spec + strategy -> schedule. Instructions in ascending-id decode order, counters, queues.

Passes, each a plain function: `plan_stages` (tiles per op and layer) -> `direct_dependencies` (exact RAW/WAR/WAW
predecessors from the catalogue's footprints, via last-access tracking per buffer region) -> `counter_plan` (producers
grouped into counters by the granularity of each producer->consumer edge; waits that the stage-level knowledge already
implies are dropped) -> `assign` (workers and the order within each queue). Every wait points to lower ids and queues
are either in ascending-id order or in the start order of a simulated execution that honours every wait, so a lowered
schedule never deadlocks.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from megasynth.ir.catalogue import FUSED_OPROJ, OP_ORDER, Geometry, footprint
from megasynth.ir.schedule import FORMAT, Schedule, parse_schedule
from megasynth.kernels.gpu.pack import K_ALIGN
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.strategy import Strategy, qk_norm_mode, whole_head_qkv


@dataclass
class Stage:
    """All instructions of one op in one layer; the unit of an all-join dependency."""

    op: str
    layer: int | None
    args: list[dict[str, int]] = field(default_factory=list)
    deps: list[int] = field(default_factory=list)  # indices of producer stages (the naive chain; informational)


def _tiles(total: int, tile: int, align: int = 1) -> list[tuple[int, int]]:
    tile = max(align, tile - tile % align)
    return [(s, min(s + tile, total)) for s in range(0, total, tile)]


def plan_stages(spec: ModelSpec, strategy: Strategy) -> list[Stage]:
    """The decode step as stages in execution order, each with its producer stages."""
    c = spec.config
    t = strategy.tiles
    splits = min(strategy.attn_splits, spec.max_seq_len)
    stages: list[Stage] = [Stage("embed", None, [{"start": s, "end": e} for s, e in
                                                _tiles(c.hidden_size, t.get("embed", c.hidden_size))])]

    def add(op: str, layer: int | None, args: list[dict[str, int]], deps: list[int]) -> int:
        stages.append(Stage(op, layer, args, deps))
        return len(stages) - 1

    def rows_k(op: str, rows: int, ks: int, k_align: int = K_ALIGN) -> list[dict[str, int]]:
        # K parts of whole k_align columns (v10 streams a part's weights by TMA from its first column), rounded up so
        # that the split count is what the strategy asks for where the columns allow it
        part = -(-ks // strategy.k_splits.get(op, 1))
        kt = _tiles(ks, -(-part // k_align) * k_align, k_align)
        return [{"start": s, "end": e, "k_start": k0, "k_end": k1} for s, e in _tiles(rows, t.get(op, 16))
                for k0, k1 in kt]

    seqs = [{"seq": b} for b in range(spec.batch)] if spec.batch > 1 else [{}]  # attention is per sequence
    # where the QK-norm is applied: after QKV (its tiles may then cut heads into pairs), before attention (apart) or
    # by attention itself (in_attention, the k row's cache write after the layer's attention)
    # ('auto': `qk_norm_mode`)
    qk_mode = qk_norm_mode(spec, strategy.qk_norm) if c.qk_norm else "in_qkv"
    apart = qk_mode != "in_qkv"
    # RoPE pairs; whole heads for the QK-norm inside QKV and for a batch that runs on interpreter v9 (which computes
    # QKV a head at a time; a QK-norm applied apart or inside attention runs on v10 only, any batch on pair tiles)
    qkv_align = c.hd if not apart and (c.qk_norm or whole_head_qkv(spec)) else 2
    in_attn = {"qk_norm": 1} if qk_mode == "in_attention" else {}
    prev = 0
    for layer in range(c.num_hidden_layers):
        qkv = add("attn_norm_qkv_rope_sq" if apart else "attn_norm_qkv_rope", layer,
                  [{"start": s, "end": e} for s, e in
                   _tiles(c.qkv_size, t.get("attn_norm_qkv_rope", c.hd), qkv_align)], [prev])
        if qk_mode == "apart":
            qkv = add("qk_norm_apply", layer, [{"kv_head": g} for g in range(c.num_key_value_heads)], [qkv])
        part = add("attn_partial", layer, [{"kv_head": g, "split": s, "splits": splits, **seq, **in_attn}
                                           for seq in seqs for g in range(c.num_key_value_heads)
                                           for s in range(splits)], [qkv])
        if strategy.fuse_attn_reduce:  # o_proj merges the splits of its K range's heads itself
            oproj = add(FUSED_OPROJ, layer, [{**a, "splits": splits} for a in
                                             rows_k("o_proj_residual", c.hidden_size, c.q_size, c.hd)], [part])
        else:
            red = add("attn_reduce", layer, [{"start": g * c.group_size, "end": (g + 1) * c.group_size,
                                              "splits": splits, **seq} for seq in seqs
                                             for g in range(c.num_key_value_heads)], [part])
            oproj = add("o_proj_residual", layer, rows_k("o_proj_residual", c.hidden_size, c.q_size), [red])
        if in_attn:  # the new k rows into the cache, once every split has read the cache: off the chain
            add("qk_norm_apply", layer, [{"kv_head": g, "k_only": 1} for g in range(c.num_key_value_heads)], [part])
        gate = add("mlp_norm_gate_up", layer, [{"start": s, "end": e} for s, e in
                                               _tiles(c.intermediate_size, t.get("mlp_norm_gate_up", 16))], [oproj])
        prev = add("down_proj_residual", layer, rows_k("down_proj_residual", c.hidden_size, c.intermediate_size),
                   [gate])
    add("final_norm_lm_head", None, [{"start": s, "end": e} for s, e in
                                    _tiles(c.vocab_size, t.get("final_norm_lm_head", 256))], [prev])
    return stages


@dataclass
class Flat:
    """The instructions of a lowering in id order (id = index)."""

    op: list[str]
    layer: list[int | None]
    args: list[dict[str, int]]
    stage: list[int]  # stage index of each instruction
    stages: list[Stage]
    first: list[int]  # first id of each stage


def flatten(stages: list[Stage]) -> Flat:
    flat = Flat([], [], [], [], stages, [])
    for si, st in enumerate(stages):
        flat.first.append(len(flat.op))
        for a in st.args:
            flat.op.append(st.op)
            flat.layer.append(st.layer)
            flat.args.append(a)
            flat.stage.append(si)
    return flat


class _Segments:
    """Last-access state of one buffer over disjoint element segments: the last writers (one writer, or the reducers
    since the last write), the readers since, and for a reducer group the predecessors each new reducer needs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.bounds = [0, size]
        self.full: list[int] = []  # readers of the whole buffer, in order; a segment's start at `mark`
        self.state: list[list[Any]] = [[set(), "write", [], set(), 0]]  # [last, kind, readers, base, mark]

    def _split(self, x: int) -> None:
        k = bisect.bisect_left(self.bounds, x)
        if k < len(self.bounds) and self.bounds[k] == x:
            return
        last, kind, readers, base, mark = self.state[k - 1]
        self.bounds.insert(k, x)
        self.state.insert(k, [set(last), kind, list(readers), set(base), mark])

    def span(self, start: int, end: int) -> range:
        self._split(start)
        self._split(end)
        return range(bisect.bisect_left(self.bounds, start), bisect.bisect_left(self.bounds, end))


def direct_dependencies(flat: Flat, geo: Geometry) -> list[set[int]]:
    """For each instruction, the earlier instructions it conflicts with directly (last writer for reads; last
    writers and readers since for writes; reducers commute with each other). Ordering these orders every
    conflicting pair by transitivity."""
    segs: dict[str, _Segments] = {name: _Segments(size) for name, size in geo.buffers().items()}
    deps: list[set[int]] = []
    version: dict[str, int] = defaultdict(int)
    read_cache: dict[tuple[str, int, int, int], frozenset[int]] = {}
    for b in range(len(flat.op)):
        acc = footprint(geo, flat.op[b], flat.layer[b] if flat.layer[b] is not None else -1, flat.args[b])
        mine: set[int] = set()
        for kind, buf, s, e in sorted(acc, key=lambda a: a[0] != "read"):
            if s >= e:
                continue
            seg = segs[buf]
            if kind == "read":
                key = (buf, s, e, version[buf])
                hit = read_cache.get(key)
                found: set[int] = set()
                whole = s == 0 and e == seg.size
                if whole:
                    seg.full.append(b)
                for k in seg.span(s, e) if hit is None or not whole else ():
                    st = seg.state[k]
                    found |= st[0]
                    if not whole:
                        st[2].append(b)
                if hit is None:
                    hit = read_cache[key] = frozenset(found)
                mine |= hit
                continue
            version[buf] += 1
            for k in seg.span(s, e):
                st = seg.state[k]
                mark = len(seg.full)
                if kind == "write":
                    mine |= st[0]
                    mine.update(st[2])
                    mine.update(seg.full[st[4]:])
                    seg.state[k] = [{b}, "write", [], set(), mark]
                elif st[1] == "reduce" and not st[2] and st[4] == mark:
                    mine |= st[3]
                    st[0].add(b)
                else:
                    base = st[0] | set(st[2]) | set(seg.full[st[4]:])
                    mine |= base
                    seg.state[k] = [{b}, "reduce", [], base, mark]
        mine.discard(b)
        deps.append(mine)
    return deps


def _group_key(flat: Flat, geo: Geometry, i: int, granularity: str, chunks: int) -> int:
    """Which counter group of its stage instruction i belongs to, for one consumer edge."""
    if granularity == "all":
        return 0
    if granularity == "tile":
        return i - flat.first[flat.stage[i]]
    if granularity == "chunk":
        st = flat.stage[i]
        return (i - flat.first[st]) * chunks // len(flat.stages[st].args)
    c, a, op = geo.cfg, flat.args[i], flat.op[i]
    if op == "attn_reduce":
        return a["start"] // c.group_size
    if op in ("attn_partial", "qk_norm_apply"):
        return a["kv_head"]
    if op in ("attn_norm_qkv_rope", "attn_norm_qkv_rope_sq"):
        r = a["start"]
        if r < c.q_size:
            return r // c.hd // c.group_size
        return (r - c.q_size) // c.hd % c.num_key_value_heads
    rows = {"embed": c.hidden_size, "o_proj_residual": c.hidden_size, FUSED_OPROJ: c.hidden_size,
            "down_proj_residual": c.hidden_size,
            "mlp_norm_gate_up": c.intermediate_size, "final_norm_lm_head": c.vocab_size}[op]
    return a["start"] * c.num_key_value_heads // rows


@dataclass
class CounterPlan:
    waits: list[list[tuple[int, int]]]  # per instruction: (counter, value)
    signals: list[list[tuple[int, int]]]  # per instruction: (counter, add)
    counters: int
    groups_of: list[list[int]]  # per instruction: the groups (ids into `members`) it waits on
    members: list[list[int]]  # per group: its instructions


def counter_plan(flat: Flat, geo: Geometry, deps: list[set[int]], strategy: Strategy) -> CounterPlan:
    """Group producers into counters per edge granularity and turn direct dependencies into waits, dropping waits on
    stages that another wait already implies complete."""
    n, ns = len(flat.op), len(flat.stages)
    group_id: dict[tuple[int, str, int, int], int] = {}  # (stage, granularity, chunks, key) -> group
    members: list[list[int]] = []
    g_stage: list[int] = []
    g_mask: list[int | None] = []
    cmask = [0] * n  # per instruction: bitmask of stages known complete before it starts
    groups_of: list[list[int]] = [[] for _ in range(n)]

    gran_of = {(p, q): (strategy.granularity(p, q), strategy.n_chunks(p, q)) for p in OP_ORDER for q in OP_ORDER}
    stg, first = flat.stage, flat.first
    size = [len(st.args) for st in flat.stages]
    gcache: dict[tuple[int, str], int | list[int]] = {}

    def groups(st: int, consumer_op: str) -> int | list[int]:
        """The group of each instruction of stage `st` for one consumer op (an int when it is one group)."""
        hit = gcache.get((st, consumer_op))
        if hit is not None:
            return hit
        gran, ch = gran_of[(flat.stages[st].op, consumer_op)]
        ids = range(first[st], first[st] + size[st])
        keys = [_group_key(flat, geo, j, gran, ch) for j in ids]
        out: list[int] = []
        for j, k in zip(ids, keys, strict=True):
            key = (st, gran, ch if gran == "chunk" else 0, k)
            g = group_id.get(key)
            if g is None:
                g = group_id[key] = len(members)
                members.append([])
                g_stage.append(st)
                g_mask.append(None)
            members[g].append(j)
            out.append(g)
        for g in set(out):
            members[g] = sorted(set(members[g]))
        result: int | list[int] = out[0] if len(set(out)) == 1 else out
        gcache[(st, consumer_op)] = result
        return result

    for b in range(n):
        opb = flat.op[b]
        d = sorted(deps[b])
        cands: set[int] = set()
        k = 0
        while k < len(d):
            st = stg[d[k]]
            k2 = bisect.bisect_left(d, first[st] + size[st], k)
            arr = groups(st, opb)
            if isinstance(arr, int):
                cands.add(arr)
            else:
                base = first[st]
                cands.update(arr[a - base] for a in d[k:k2])
            k = k2
        known = 0
        for g in sorted(cands, key=lambda g: -g_stage[g]):
            st = g_stage[g]
            if st >= stg[b]:
                raise ValueError(f"instruction {b} ({opb}) depends on its own stage; the lowering cannot order it")
            if known >> st & 1:
                continue
            if g_mask[g] is None:
                m = (1 << st) if len(members[g]) == size[st] else 0
                for j in members[g]:
                    m |= cmask[j]
                g_mask[g] = m
            known |= g_mask[g]
            groups_of[b].append(g)
        cmask[b] = known

    # Counters: one per used group, or per (op, granularity, key) across layers with cumulative values.
    used = sorted({g for gs in groups_of for g in gs}, key=lambda g: (g_stage[g], g))
    counter_of: dict[int, int] = {}
    value_of: dict[int, int] = {}
    shared: dict[tuple, int] = {}
    total: dict[int, int] = defaultdict(int)
    # Reserve counter = stage index for whole-stage groups so the naive baseline keeps its numbering.
    next_counter = ns
    taken: set[int] = set()
    for g in used:
        st = g_stage[g]
        if strategy.counter_sharing == "across_layers":
            key = next(k for k, v in group_id.items() if v == g)
            skey = (flat.stages[st].op, key[1], key[2], key[3])
            if skey not in shared:
                shared[skey] = next_counter
                next_counter += 1
            c = shared[skey]
        elif len(members[g]) == size[st] and st not in taken:
            c = st
            taken.add(st)
        else:
            c = next_counter
            next_counter += 1
        counter_of[g] = c
        total[c] += len(members[g])
        value_of[g] = total[c]
    waits: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    signals: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for g in used:
        for j in members[g]:
            signals[j].append((counter_of[g], 1))
    for b in range(n):
        for g in groups_of[b]:
            waits[b].append((counter_of[g], value_of[g]))
    for j in range(n):
        signals[j] = sorted(set(signals[j]))
    return CounterPlan(waits, signals, next_counter, groups_of, members)


# ----------------------------------------------------------------------------------------------------------------
# Worker assignment and queue order


def nominal_durations(flat: Flat, geo: Geometry, workers: int, ctx: int = 1024) -> list[float]:
    """Per-instruction µs from the cost model at fair-share bandwidth (a stage's instructions stream together)."""
    from megasynth.lowering.costmodel import instruction_cost, load_params, nominal_us

    params = load_params()
    out = []
    for i in range(len(flat.op)):
        nbytes, _ = instruction_cost(geo, flat.op[i], flat.layer[i], flat.args[i], ctx)
        active = min(workers, len(flat.stages[flat.stage[i]].args))
        out.append(nominal_us(params, flat.op[i], nbytes, active))
    return out


def _ranks(plan: CounterPlan, dur: list[float], hop: float) -> list[float]:
    """Upward rank: the longest time from an instruction's start to the end of the step."""
    n = len(dur)
    member_of: list[list[int]] = [[] for _ in range(n)]
    for g, mem in enumerate(plan.members):
        for j in mem:
            member_of[j].append(g)
    grank = [0.0] * len(plan.members)
    rank = [0.0] * n
    for i in range(n - 1, -1, -1):
        rank[i] = dur[i] + max((grank[g] for g in member_of[i]), default=0.0)
        for g in plan.groups_of[i]:
            grank[g] = max(grank[g], rank[i] + hop)
    return rank


def list_schedule(plan: CounterPlan, dur: list[float], workers: int, fixed: list[int] | None = None,
                  hop: float = 0.61) -> list[list[int]]:
    """Critical-path list scheduling over the counter groups: the highest-rank ready instruction goes to the first
    free worker (or to its fixed worker). Queues come out in simulated start order, a legal execution."""
    n = len(dur)
    rank = _ranks(plan, dur, hop)
    left = [len(gs) for gs in plan.groups_of]
    g_left = [len(m) for m in plan.members]
    g_done = [0.0] * len(plan.members)
    waiting_on: dict[int, list[int]] = defaultdict(list)
    for b, gs in enumerate(plan.groups_of):
        for g in gs:
            waiting_on[g].append(b)
    group_of_member: list[list[int]] = [[] for _ in range(n)]
    for g, mem in enumerate(plan.members):
        for j in mem:
            group_of_member[j].append(g)
    pending: list[tuple[float, float, int]] = [(0.0, -rank[i], i) for i in range(n) if left[i] == 0]
    heapq.heapify(pending)
    avail_global: list[tuple[float, int]] = []
    avail_fixed: dict[int, list[tuple[float, int]]] = defaultdict(list)
    wof = [0] * n
    wfree = [0.0] * workers
    running: list[tuple[float, int]] = []
    queues: list[list[int]] = [[] for _ in range(workers)]
    idle = set(range(workers))
    now, done, steps = 0.0, 0, 0
    while done < n:
        steps += 1
        if steps > 4 * n + 10:
            raise RuntimeError("list scheduling made no progress; this is a bug")
        while pending and pending[0][0] <= now:
            _, r, i = heapq.heappop(pending)
            if fixed is None:
                heapq.heappush(avail_global, (r, i))
            else:
                heapq.heappush(avail_fixed[fixed[i]], (r, i))
        if fixed is None:
            for w in sorted(idle, key=lambda w: wfree[w]):
                if not avail_global:
                    break
                _, i = heapq.heappop(avail_global)
                idle.discard(w)
                queues[w].append(i)
                wof[i] = w
                heapq.heappush(running, (now + dur[i], i))
                wfree[w] = now + dur[i]
        else:
            for w in list(idle):
                if avail_fixed.get(w):
                    _, i = heapq.heappop(avail_fixed[w])
                    idle.discard(w)
                    queues[w].append(i)
                    wof[i] = w
                    heapq.heappush(running, (now + dur[i], i))
        nxt = min(running[0][0] if running else float("inf"), pending[0][0] if pending else float("inf"))
        if nxt == float("inf"):
            raise RuntimeError("list scheduling stalled with instructions left; this is a bug")
        now = max(now, nxt)
        while running and running[0][0] <= now:
            t, i = heapq.heappop(running)
            done += 1
            idle.add(wof[i])
            for g in group_of_member[i]:
                g_left[g] -= 1
                g_done[g] = max(g_done[g], t)
                if g_left[g] == 0:
                    for b in waiting_on[g]:
                        left[b] -= 1
                        if left[b] == 0:
                            ready = max(g_done[h] for h in plan.groups_of[b]) + hop
                            heapq.heappush(pending, (ready, -rank[b], b))
    return queues


def assign(flat: Flat, geo: Geometry, plan: CounterPlan, workers: int, strategy: Strategy) -> list[list[int]]:
    """Queues (lists of ids) for the strategy's assignment and order."""
    n = len(flat.op)
    how = strategy.assignment
    if how == "round_robin" and strategy.order == "id":
        return [list(range(w, n, workers)) for w in range(workers)]
    dur = nominal_durations(flat, geo, workers)
    if how == "critical_path":
        queues = list_schedule(plan, dur, workers)
        return [sorted(q) for q in queues] if strategy.order == "id" else queues
    if how == "round_robin":
        worker = [i % workers for i in range(n)]
    elif how == "zigzag":
        worker = [p if p < workers else 2 * workers - 1 - p for p in (i % (2 * workers) for i in range(n))]
    elif how == "cost_balanced":
        worker = [0] * n
        load = [(0.0, w) for w in range(workers)]
        for st, stage in enumerate(flat.stages):
            ids = range(flat.first[st], flat.first[st] + len(stage.args))
            for i in sorted(ids, key=lambda i: -dur[i]):
                t, w = heapq.heappop(load)
                worker[i] = w
                heapq.heappush(load, (t + dur[i], w))
    else:  # spatial: a contiguous range of workers per op
        share: dict[str, float] = defaultdict(float)
        for i in range(n):
            share[flat.op[i]] += dur[i]
        for op, s in strategy.spatial.items():
            if op in share:
                share[op] = s * sum(share.values()) / max(1e-9, sum(strategy.spatial.values()))
        ops = [op for op in OP_ORDER if op in share]
        tot = sum(share[op] for op in ops)
        lo, ranges = 0, {}
        for k, op in enumerate(ops):
            width = max(1, round(workers * share[op] / tot))
            hi = workers if k == len(ops) - 1 else min(workers - (len(ops) - 1 - k), lo + width)
            lo = min(lo, workers - 1)
            ranges[op] = (lo, max(lo + 1, hi))
            lo = max(lo + 1, hi)
        nxt: dict[str, int] = defaultdict(int)
        worker = []
        for i in range(n):
            a, b = ranges[flat.op[i]]
            worker.append(a + nxt[flat.op[i]] % (b - a))
            nxt[flat.op[i]] += 1
    if strategy.order == "critical_path":
        return list_schedule(plan, dur, workers, fixed=worker)
    queues: list[list[int]] = [[] for _ in range(workers)]
    for i in range(n):
        queues[worker[i]].append(i)
    return queues


def lower(spec: ModelSpec, workers: int, strategy: Strategy | None = None, proposer: str = "naive") -> Schedule:
    """Lower a model to a complete schedule. The default strategy is the naive baseline: one all-join counter per
    stage, round-robin over workers in id order."""
    strategy = strategy or Strategy()
    splits = min(strategy.attn_splits, spec.max_seq_len)
    geo = Geometry(spec.config, spec.max_seq_len, splits, spec.batch)
    stages = plan_stages(spec, strategy)
    flat = flatten(stages)
    plan = counter_plan(flat, geo, direct_dependencies(flat, geo), strategy)
    queues = assign(flat, geo, plan, workers, strategy)
    instructions: list[dict[str, Any]] = []
    for i in range(len(flat.op)):
        ins: dict[str, Any] = {"id": i, "op": flat.op[i], "args": flat.args[i],
                               "waits": [{"counter": c, "value": v} for c, v in plan.waits[i]],
                               "signals": [{"counter": c, "add": a} for c, a in plan.signals[i]]}
        if flat.layer[i] is not None:
            ins["layer"] = flat.layer[i]
        instructions.append(ins)
    doc = {
        "format": FORMAT,
        "model": {"name": spec.name, "config": spec.config.to_hf(), "max_seq_len": spec.max_seq_len,
                  **({"batch": spec.batch} if spec.batch > 1 else {})},
        "target": {"workers": workers, "device": "NVIDIA H200"},
        "buffers": geo.buffers(),
        "counters": plan.counters,
        "instructions": instructions,
        "queues": queues,
        "meta": {"proposer": proposer, "strategy": strategy.model_dump(mode="json"), "parent": None},
    }
    return parse_schedule(doc)
