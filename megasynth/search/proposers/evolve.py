"""The evolutionary proposer: tournament selection over the accepted candidates, uniform crossover of strategies,
knob mutations, and patch mutations (move a critical-path instruction to another worker, keeping queue order by id)."""

from __future__ import annotations

import random
from typing import Any

from megasynth.lowering.strategy import SearchSpace, Strategy
from megasynth.search.proposers.base import Proposal, Result, SearchContext, strategy_key

#: Knobs that change the instruction list (ids); patches only carry over when these agree.
PLAN_KNOBS = ("tiles", "k_splits", "attn_splits")


class EvolveProposer:
    name = "evolve"

    def __init__(self, space: SearchSpace, seed: int = 0, population: int = 8, p_crossover: float = 0.4,
                 p_patch: float = 0.25) -> None:
        self.space = space
        self.rng = random.Random(seed)
        self.population = population
        self.p_crossover = p_crossover
        self.p_patch = p_patch
        self.seen: set[str] = set()

    def _pool(self, ctx: SearchContext) -> list[Result]:
        acc = [r for r in ctx.history if r.accepted and r.ms is not None]
        acc.sort(key=lambda r: r.ms or 0.0)
        return acc[: self.population]

    def _pick(self, pool: list[Result]) -> Result:
        a, b = self.rng.choice(pool), self.rng.choice(pool)
        return a if (a.ms or 0.0) <= (b.ms or 0.0) else b

    def _crossover(self, a: Strategy, b: Strategy) -> Strategy:
        da, db = a.model_dump(mode="json"), b.model_dump(mode="json")
        child = {k: (da[k] if self.rng.random() < 0.5 else db[k]) for k in da}
        return Strategy.model_validate(child)

    def _patch(self, parent: Result, workers: int) -> list[dict[str, Any]]:
        path = (parent.profile or {}).get("critical_path") or []
        if not path:
            return []
        ident = self.rng.choice(path)
        return [{"op": "move", "id": int(ident), "worker": self.rng.randrange(workers)}]

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        for h in ctx.history:
            self.seen.add(strategy_key(h.proposal.strategy, h.proposal.patches))
        pool = self._pool(ctx)
        out: list[Proposal] = []
        tries = 0
        while len(out) < n and tries < 50 * max(1, n):
            tries += 1
            if not pool:
                st, patches, why, parent = self.space.random(self.rng), [], "random (no accepted parents yet)", None
            else:
                p1 = self._pick(pool)
                patches = list(p1.proposal.patches)
                if len(pool) > 1 and self.rng.random() < self.p_crossover:
                    p2 = self._pick(pool)
                    st = self._crossover(p1.proposal.strategy, p2.proposal.strategy)
                    why = f"crossover of {p1.candidate} and {p2.candidate}"
                    if self.rng.random() < 0.5:
                        st = self.space.mutate(st, self.rng)
                        why += " + mutation"
                elif self.rng.random() < self.p_patch and p1.profile:
                    st = p1.proposal.strategy
                    patches = patches + self._patch(p1, ctx.workers)
                    why = f"patch of {p1.candidate}: move a critical-path instruction"
                else:
                    st = self.space.mutate(p1.proposal.strategy, self.rng, self.rng.choice([1, 1, 2, 3]))
                    why = f"mutation of {p1.candidate}"
                parent = p1.candidate
                d1, ds = p1.proposal.strategy.model_dump(), st.model_dump()
                if any(d1[k] != ds[k] for k in PLAN_KNOBS):
                    patches = []  # ids differ: the parent's patches do not apply
            key = strategy_key(st, patches)
            if key in self.seen:
                continue
            self.seen.add(key)
            out.append(Proposal(st, patches, why, self.name, parent))
        return out

    def observe(self, result: Result) -> None:
        self.seen.add(strategy_key(result.proposal.strategy, result.proposal.patches))
