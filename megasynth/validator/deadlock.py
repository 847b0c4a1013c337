"""Deadlock: counters only grow and each worker is sequential, so the maximal execution is unique; compute it by
fixpoint and, when it stalls, say which instructions are stuck on which counters and the wait-for cycle if any."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import networkx as nx

from megasynth.ir.program import Finding, Program


@dataclass
class Execution:
    """The unique maximal execution: the order instructions complete in, and where each worker stopped."""

    order: list[int]  # instruction indices in one legal completion order
    counters: list[int]  # final counter values
    stuck: list[int]  # per worker: index of the instruction it is stuck at, or -1 when its queue finished

    @property
    def complete(self) -> bool:
        return all(s == -1 for s in self.stuck)


def maximal_execution(prog: Program) -> Execution:
    """Run every worker as far as the counters allow (event-driven: a worker is re-checked when a counter it waits on
    grows; a woken worker resumes at its first wait not yet met). Linear in instructions + waits + wake-ups."""
    counters = [0] * prog.counters
    head = [0] * len(prog.queues)
    met = [0] * len(prog.queues)  # per worker: how many of its head's waits are met (counters only grow)
    blocked_on: dict[int, list[int]] = defaultdict(list)
    ready = list(range(len(prog.queues)))
    order: list[int] = []
    waits, signals = prog.waits, prog.signals
    while ready:
        w = ready.pop()
        queue = prog.queues[w]
        while head[w] < len(queue):
            i = queue[head[w]]
            ws, k = waits[i], met[w]
            while k < len(ws) and counters[ws[k][0]] >= ws[k][1]:
                k += 1
            if k < len(ws):  # blocked on its first unmet wait; woken when that counter grows
                met[w] = k
                blocked_on[ws[k][0]].append(w)
                break
            met[w] = 0
            order.append(i)
            head[w] += 1
            for c, add in signals[i]:
                counters[c] += add
                if c in blocked_on:
                    ready.extend(blocked_on.pop(c))
    stuck = [q[head[w]] if head[w] < len(q) else -1 for w, q in enumerate(prog.queues)]
    return Execution(order, counters, stuck)


def deadlock_findings(prog: Program, ex: Execution) -> list[Finding]:
    """Explain a stall: each stuck instruction, its unmet waits (current vs needed), and a wait-for cycle."""
    if ex.complete:
        return []
    stuck = [i for i in ex.stuck if i != -1]
    stuck_set = set(stuck)
    # Who could still add to each counter: the stuck instructions and everything queued behind them.
    pending_signallers: dict[int, list[int]] = defaultdict(list)
    pending_adds: dict[int, int] = defaultdict(int)
    for w, i in enumerate(ex.stuck):
        if i == -1:
            continue
        for j in prog.queues[w][prog.qpos[i]:]:
            for c, add in prog.signals[j]:
                pending_signallers[c].append(j)
                pending_adds[c] += add
    graph = nx.DiGraph()
    lines = []
    details = []
    for i in stuck:
        unmet = [(c, v) for c, v in prog.waits[i] if ex.counters[c] < v]
        for c, v in unmet:
            reach = ex.counters[c] + pending_adds[c]
            if reach < v:
                why = "unreachable: all adds together reach only " + str(reach)
            else:
                own = [j for j in pending_signallers[c] if prog.worker[j] == prog.worker[i]]
                others = [j for j in pending_signallers[c] if prog.worker[j] != prog.worker[i]]
                parts = []
                if own:
                    parts.append("needs " + ", ".join(prog.label(j) for j in own[:3]) +
                                 (" ..." if len(own) > 3 else "") + " queued behind it on its own worker")
                if others:
                    parts.append("needs " + ", ".join(f"{prog.label(j)} (worker {prog.worker[j]}, stuck behind "
                                                      f"{prog.label(ex.stuck[prog.worker[j]])})"
                                                      for j in others[:3]) + (" ..." if len(others) > 3 else ""))
                why = "its signallers are blocked: " + "; ".join(parts)
            lines.append(f"{prog.label(i)} (worker {prog.worker[i]}) waits on counter {c}: {ex.counters[c]} of "
                         f"{v} ({why})")
            details.append({"instruction": prog.ids[i], "worker": prog.worker[i], "counter": c,
                            "current": ex.counters[c], "needed": v, "reachable": reach})
            for j in pending_signallers[c]:
                # i waits for j; j is behind (or is) the stuck head of its worker.
                head = ex.stuck[prog.worker[j]]
                graph.add_edge(i, head, counter=c)
    cycle_ids: list[int] = []
    try:
        cycle = nx.find_cycle(graph)
        cycle_ids = [prog.ids[u] for u, _, *_ in cycle]
        lines.append("wait-for cycle: " + " -> ".join(prog.label(u) for u, _, *_ in cycle) +
                     f" -> {prog.label(cycle[0][0])}")
    except nx.NetworkXNoCycle:
        pass
    done = len(ex.order)
    msg = f"deadlock: {done} of {prog.n} instructions complete, {len(stuck_set)} workers stuck; " + "; ".join(lines)
    return [Finding("deadlock", msg, [prog.ids[i] for i in stuck],
                    prog.path(stuck[0]), {"stuck": details, "cycle": cycle_ids})]
