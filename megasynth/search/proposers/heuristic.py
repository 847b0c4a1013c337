"""The hand-written seeds: strategies written by people from the H200 measurements (docs/perf-notes.md), offered in
order (at a batch, adapted to it by `for_batch`), then hill climbing around the best accepted candidate. One
labelled proposer among the others (`seeds` in the runs); the searches that need no seeds are `descent`, `evolve`
and `tpe`."""

from __future__ import annotations

import random
from typing import Any

from megasynth.lowering.strategy import SearchSpace, Strategy, for_batch
from megasynth.search.proposers.base import Proposal, Result, SearchContext, strategy_key

_V9 = {"embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 64,
       "down_proj_residual": 16, "final_norm_lm_head": 1024}
_Q32 = {**_V9, "attn_norm_qkv_rope": 32}
_D32K2 = {"tiles": {**_Q32, "down_proj_residual": 32}, "k_splits": {"o_proj_residual": 1, "down_proj_residual": 2}}
_ATTN_FINE = {"attn_norm_qkv_rope->attn_partial": "head", "attn_partial->attn_reduce": "head"}

#: Hand-ordered starting points: (rationale, strategy fields), best measured first (llama-1b, H200, ctx 1024, on the
#: v10 interpreter unless said otherwise; the measurements behind each are in docs/perf-notes.md). Tile sizes in rows.
SEEDS: list[tuple[str, dict[str, Any]]] = [
    ("hand-tuned on v10: QKV pair tiles 32, down 32 rows K-split 2, gate/up 64, LM head 1024, 16 splits (0.892 ms)",
     {"attn_splits": 16, **_D32K2}),
    ("hand-tuned on v10: QKV pair tiles of 32 rows on the v9 seed (0.920 ms)", {"attn_splits": 16, "tiles": _Q32}),
    ("the v9 hand seed: flash-decode 16 splits + larger tiles (0.955 ms on v10)", {"attn_splits": 16, "tiles": _V9}),
    ("v10 best + one-wave LM head (972 rows: -0.5 % measured on the 32-row-QKV schedule)",
     {"attn_splits": 16, "tiles": {**_D32K2["tiles"], "final_norm_lm_head": 972}, "k_splits": _D32K2["k_splits"]}),
    ("v10 best with 8 attention splits (+0.5 % measured on the 32-row-QKV schedule)", {"attn_splits": 8, **_D32K2}),
    ("v10 best, critical-path list scheduling", {"attn_splits": 16, "assignment": "critical_path", **_D32K2}),
    ("v10 best, per-KV-head dependencies on the attention edges", {"attn_splits": 16, "edges": _ATTN_FINE, **_D32K2}),
    ("v10 best, down waits for its K chunk of gate/up only",
     {"attn_splits": 16, **_D32K2, "edges": {"mlp_norm_gate_up->down_proj_residual": "chunk"},
      "chunks": {"mlp_norm_gate_up->down_proj_residual": 2}}),
]


def _base() -> dict[str, Any]:
    return Strategy().model_dump(mode="json")


def seed_strategies() -> list[tuple[str, Strategy]]:
    """The seeds as strategies (for the proposer and for tests that compare against the hand-tuned best)."""
    out = []
    for why, fields in SEEDS:
        d = {**_base(), **fields}
        d["tiles"] = {**_base()["tiles"], **fields.get("tiles", {})}
        out.append((why, Strategy.model_validate(d)))
    return out


class HeuristicProposer:
    """Seeds first, then hill climbing (1-2 knob mutations of the best accepted candidate), then random points."""

    name = "seeds"

    def __init__(self, space: SearchSpace, seed: int = 0, hill_climb: bool = True) -> None:
        self.space = space
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.next_seed = 0
        self.hill_climb = hill_climb

    def _fresh(self, strategy: Strategy) -> bool:
        key = strategy_key(strategy)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        out: list[Proposal] = []
        for h in ctx.history:
            self.seen.add(strategy_key(h.proposal.strategy, h.proposal.patches))
        seeds = seed_strategies()
        if self.space.spec.batch > 1:  # written for one sequence: adapted as the batch measurements say
            seeds = [(f"{why}; adapted to batch {self.space.spec.batch} (for_batch)", for_batch(st, self.space.spec))
                     for why, st in seeds]
        while len(out) < n and self.next_seed < len(seeds):
            why, st = seeds[self.next_seed]
            self.next_seed += 1
            if self._fresh(st):
                out.append(Proposal(st, [], why, self.name))
        tries = 0
        while self.hill_climb and len(out) < n and tries < 200:
            tries += 1
            if ctx.best is not None and self.rng.random() < 0.8:
                st = self.space.mutate(ctx.best.proposal.strategy, self.rng, self.rng.choice([1, 1, 2]))
                why, parent = "hill climbing: mutate the best", ctx.best.candidate
            else:
                st, why, parent = self.space.random(self.rng), "random point of the strategy space", None
            if self._fresh(st):
                out.append(Proposal(st, [], why, self.name, parent))
        return out

    def observe(self, result: Result) -> None:
        self.seen.add(strategy_key(result.proposal.strategy, result.proposal.patches))
