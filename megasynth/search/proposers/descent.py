"""The multi-fidelity proposer: coordinate descent over the search space on the cost model, then hill climbing on
the real measurements with the cost model ranking the moves. It needs no seeds: it starts from the naive lowering.

1. Model descent (cheap fidelity, `megasynth.search.surrogate`): from the start point, estimate every point that
   differs in one knob (every choice of it), and the joint moves that change an op's K-split with its tile scaled
   to keep the instruction count, and move to the best, until none is better. Nothing here costs a candidate
   (~400 estimates for llama-1b, ~0.15 s each, spread over `jobs` processes).
2. Proposals (full fidelity: validation, then the GPU, or the full cost model on a CPU): the optimum, then for each
   knob the best point estimated with another value of it, best first, `first_batch` of them: the alternatives
   the model rates nearest, one per knob, where it is most likely to be wrong by a few %.
3. Measured hill climbing: around the best *measured* candidate, its neighbours ranked by the cost model; those
   the model rates within `tolerance` of the centre are proposed, the best move of each knob first, then each
   knob's second best, and so on (the model is a few % off, so a neighbour it rates slightly worse may measure
   better, and its ranking among the values of one knob is finer than it can tell). A measurement better by more
   than the timing noise (`noise`) moves the centre. When the neighbourhood is spent it widens (two steps per
   knob, then pairs of the best single moves); when that is spent too, the proposer has nothing more and a chain
   moves on (`auto`: to evolution).

Only stage 2 and 3 spend candidates, so a GPU run times only the points the cost model ranks highest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from megasynth.lowering.costmodel import CostParams
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.strategy import K_SPLIT_OPS, SearchSpace, Strategy
from megasynth.search.proposers.base import Proposal, Result, SearchContext, strategy_key
from megasynth.search.surrogate import Surrogate

MIN_GAIN = 1e-3  # a move must improve the estimate by this fraction to count as better
MAX_STEPS = 40  # descent steps
FULL = 1 << 10  # reach that covers every choice of a knob


class DescentProposer:
    name = "descent"

    def __init__(self, space: SearchSpace, spec: ModelSpec, workers: int, params: CostParams, ctx: int = 1024,
                 start: Strategy | None = None, first_batch: int = 8, tolerance: float = 0.02, jobs: int = 1,
                 noise: float = 0.003, surrogate: Surrogate | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.space = space
        self.progress = progress
        self.model = surrogate or Surrogate(spec, workers, params, ctx, jobs)
        self.start = start or Strategy()
        self.first_batch, self.tolerance, self.noise = first_batch, tolerance, noise
        self.seen: set[str] = set()  # proposed, or evaluated by the loop
        self.observed: set[str] = set()  # evaluated by the loop
        self.shortlist: list[tuple[float, Strategy]] | None = None  # stage 2, best first
        self.shortlist_opt: Strategy = self.start  # the optimum of stage 1
        self.stage2: set[str] = set()  # keys proposed in stage 2
        self.centre: str | None = None  # key of the measured centre of stage 3
        self.centre_ms: float | None = None
        self.centre_result: Result | None = None
        self.reach = 1
        self.done = False

    @property
    def exhausted(self) -> bool:
        """True once every stage has nothing more to offer (a chain then moves on)."""
        return self.done

    # -- stage 1 ---------------------------------------------------------------------------------------------
    def moves(self, strategy: Strategy, reach: int = 1) -> list[tuple[str, Strategy]]:
        """Neighbours of a strategy as (what changed, the strategy): `reach` steps of each knob, and a K-split
        with the op's tile scaled to keep its instruction count."""
        out = []
        for k in self.space.knobs:
            for v in self.space.neighbours(strategy, k.name, reach):
                out.append((f"{k.name}={v}", self.space.with_value(strategy, k.name, v)))
        for op in K_SPLIT_OPS:
            kname, tname = f"k_splits.{op}", f"tiles.{op}"
            ks, tile = self.space.value(strategy, kname), self.space.value(strategy, tname)
            for ks2 in self.space.by_name[kname].choices:
                if ks2 == ks:
                    continue
                want = tile * ks2 / ks
                t2 = min(self.space.by_name[tname].choices, key=lambda t: abs(math.log(t / want)))
                st = self.space.with_value(self.space.with_value(strategy, kname, ks2), tname, t2)
                out.append((f"{kname}={ks2}+{tname}={t2}", st))
        return out

    def descend(self, start: Strategy) -> tuple[Strategy, float]:
        """Steepest descent on the cheap fidelity from `start`, over every choice of every knob; returns the local
        optimum and its estimate."""
        cur, cur_ms = start, self.model(start)
        t0 = time.monotonic()
        for step in range(MAX_STEPS):
            moves = self.moves(cur, FULL)
            ests = self.model.many([s for _, s in moves])
            k = min(range(len(moves)), key=lambda j: ests[j]) if moves else -1
            if self.progress is not None:
                best = min(cur_ms, ests[k]) if k >= 0 else cur_ms
                self.progress(f"cost-model descent: step {step + 1}, {len(self.model.cache)} strategies estimated "
                              f"in {time.monotonic() - t0:.0f} s, best {best:.4f} ms (estimated)")
            if k < 0 or not ests[k] < cur_ms * (1 - MIN_GAIN):
                break
            cur, cur_ms = moves[k][1], ests[k]
        return cur, cur_ms

    def _stage1(self) -> list[tuple[float, Strategy]]:
        """The descent, then the first batch: the optimum, and for each knob (or K-split with its tile) the best
        other value of it, best first: the GPU measures the alternatives the model rates nearest, one per knob,
        instead of near copies of the optimum."""
        opt, opt_ms = self.descend(self.start)
        moves = self.moves(opt, FULL)  # estimated already: the last step of the descent
        ests = self.model.many([s for _, s in moves])
        best_per_knob: dict[str, tuple[float, Strategy]] = {}
        for (what, st), ms in zip(moves, ests, strict=True):
            knob = what.split("=")[0]
            if ms < math.inf and (knob not in best_per_knob or ms < best_per_knob[knob][0]):
                best_per_knob[knob] = (ms, st)
        return [(opt_ms, opt)] + sorted(best_per_knob.values(), key=lambda t: t[0])

    # -- stages 2 and 3 --------------------------------------------------------------------------------------
    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        for h in ctx.history:
            self.seen.add(strategy_key(h.proposal.strategy, h.proposal.patches))
        if self.shortlist is None:
            self.shortlist = self._stage1()
            self.shortlist_opt = self.shortlist[0][1] if self.shortlist else self.start
        out: list[Proposal] = []
        while self.shortlist and len(out) < n and len(self.stage2) < self.first_batch:
            ms, st = self.shortlist.pop(0)
            if self._fresh(st):
                what = "its optimum" if not self.stage2 else "the best alternative for " + ", ".join(
                    k for k, v in _diff(self.space, self.shortlist_opt, st).items())
                self.stage2.add(strategy_key(st))
                out.append(Proposal(st, [], f"cost-model descent from the naive lowering, {what} (estimated "
                                    f"{ms:.4f} ms)", self.name))
        if len(out) < n and not self.done and not (self.stage2 - self.observed):  # stage 3 once the batch is measured
            out += self._stage3(ctx, n - len(out))
        return out

    def _fresh(self, st: Strategy) -> bool:
        key = strategy_key(st)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def _stage3(self, ctx: SearchContext, n: int) -> list[Proposal]:
        best = ctx.best
        if best is None or best.ms is None or best.proposal.patches:
            self.done = not self.shortlist
            return []
        if self.centre is not None and self.centre_ms is not None and best.ms > self.centre_ms * (1 - self.noise) \
                and strategy_key(best.proposal.strategy) != self.centre:
            best = self.centre_result or best  # within the timing noise of the centre: stay
        cst = best.proposal.strategy
        ckey = strategy_key(cst)
        if ckey != self.centre:
            self.centre, self.centre_ms, self.centre_result, self.reach = ckey, best.ms, best, 1
        base = self.model(cst)
        out: list[Proposal] = []
        while len(out) < n:
            moves = [(what, s) for what, s in self.moves(cst, self.reach) if strategy_key(s) not in self.seen]
            if self.reach > 2:
                moves = [(what, s) for what, s in self._pairs(cst) if strategy_key(s) not in self.seen]
            ests = self.model.many([s for _, s in moves])
            ranked = _knob_by_knob(sorted((e, what, s) for e, (what, s) in zip(ests, moves, strict=True)
                                          if e < base * (1 + self.tolerance)))
            for e, what, s in ranked:
                if len(out) >= n:
                    break
                if self._fresh(s):
                    out.append(Proposal(s, [], f"hill climbing on the measurements around {best.candidate} "
                                        f"({best.ms:.4f} ms): {what}, estimated {100 * (e / base - 1):+.1f}%",
                                        self.name, best.candidate))
            if len(out) >= n or (ranked and len(out) > 0):
                break
            if self.reach > 2:
                self.done = True  # the neighbourhood of the best is spent: free the estimating processes
                self.model.close()
                break
            self.reach += 1
        return out

    def _pairs(self, st: Strategy) -> list[tuple[str, Strategy]]:
        """Two single moves at once, from the eight the cost model rates best."""
        singles = self.moves(st)
        ests = self.model.many([s for _, s in singles])
        top = [singles[k] for k in sorted(range(len(singles)), key=lambda k: ests[k])[:8]]
        out = []
        for a in range(len(top)):
            for b in range(a + 1, len(top)):
                da, db = _diff(self.space, st, top[a][1]), _diff(self.space, st, top[b][1])
                if set(da) & set(db):
                    continue
                out.append((f"{top[a][0]} & {top[b][0]}", self.space.from_point({**da, **db}, st)))
        return out

    def close(self) -> None:
        """Stop the cost-model processes (the search calls this when it ends)."""
        self.model.close()

    def observe(self, result: Result) -> None:
        key = strategy_key(result.proposal.strategy, result.proposal.patches)
        self.seen.add(key)
        self.observed.add(key)


def _knob_by_knob(ranked: list[tuple[float, str, Strategy]]) -> list[tuple[float, str, Strategy]]:
    """Moves ranked by estimate, re-ordered to take the best move of each knob first, then each knob's second best,
    and so on: the model's differences of a few 0.1 % between values of one knob are below what it can tell, and a
    measurement per knob says more than three of one."""
    rounds: dict[str, int] = {}
    keyed = []
    for k, (e, what, s) in enumerate(ranked):
        knob = what.split("=")[0]
        rounds[knob] = rounds.get(knob, -1) + 1
        keyed.append((rounds[knob], k, (e, what, s)))
    return [m for _, _, m in sorted(keyed, key=lambda t: (t[0], t[1]))]


def _diff(space: SearchSpace, a: Strategy, b: Strategy) -> dict[str, Any]:
    """The knobs whose values differ from a to b, with b's values."""
    pa, pb = space.point(a), space.point(b)
    return {k: v for k, v in pb.items() if pa[k] != v}
