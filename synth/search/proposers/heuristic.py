"""The heuristic proposer: hand-ordered families of strategies known to help (critical-path list scheduling,
cost balancing, finer dependencies on the attention edges, flash-decode splits, larger tiles), then hill climbing
around the best accepted candidate. Also owns the strategy space (`random_strategy`, `mutate`) that evolve reuses."""

from __future__ import annotations

import random
from typing import Any

from synth.lowering.strategy import ASSIGNMENTS, GRANULARITIES, ORDERS, Strategy
from synth.search.proposers.base import Proposal, Result, SearchContext

TILE_CHOICES: dict[str, list[int]] = {
    "attn_norm_qkv_rope": [64, 128, 192, 256],
    "o_proj_residual": [8, 16, 32, 64],
    "mlp_norm_gate_up": [16, 32, 64, 128],
    "down_proj_residual": [8, 16, 32, 64],
    "final_norm_lm_head": [256, 512, 1024, 2048],
}
K_SPLIT_CHOICES = [1, 2, 4, 8]
ATTN_SPLIT_CHOICES = [1, 2, 4, 8, 16]
#: Edges where a finer dependency can overlap work (the rest are all-to-all: a norm reads the whole of x).
FINE_EDGES = ["attn_norm_qkv_rope->attn_partial", "attn_partial->attn_reduce", "attn_reduce->o_proj_residual",
              "mlp_norm_gate_up->down_proj_residual"]
CHUNK_CHOICES = [2, 4, 8, 16, 32]

_ATTN_FINE = {"attn_norm_qkv_rope->attn_partial": "head", "attn_partial->attn_reduce": "head"}

_T = {"embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 16,
      "down_proj_residual": 16, "final_norm_lm_head": 256}
_BIG = {**_T, "mlp_norm_gate_up": 64, "final_norm_lm_head": 1024}

#: Hand-ordered starting points: (rationale, strategy fields). The first ones follow what the H200 showed
#: (scripts/gpu_check.py, ctx 1024): splitting the KV sequence and larger MLP / LM-head tiles helped (fewer
#: instructions, less dispatch and wait overhead); all-tile dependencies and cost-balanced placement hurt.
SEEDS: list[tuple[str, dict[str, Any]]] = [
    ("flash-decode 8 splits + larger gate/up and LM-head tiles", {"attn_splits": 8, "tiles": _BIG}),
    ("flash-decode 4 splits + larger tiles", {"attn_splits": 4, "tiles": _BIG}),
    ("flash-decode 16 splits + larger tiles", {"attn_splits": 16, "tiles": _BIG}),
    ("critical-path list scheduling with larger tiles", {"assignment": "critical_path", "attn_splits": 8,
                                                         "tiles": _BIG}),
    ("larger QKV tiles too", {"attn_splits": 8, "tiles": {**_BIG, "attn_norm_qkv_rope": 128}}),
    ("larger o_proj/down tiles too", {"attn_splits": 8, "tiles": {**_BIG, "o_proj_residual": 32,
                                                                  "down_proj_residual": 32}}),
    ("per-KV-head dependencies on the attention edges only", {"attn_splits": 8, "tiles": _BIG, "edges": _ATTN_FINE}),
    ("gate/up tiles 32 (more instructions than SMs x 2)", {"attn_splits": 8,
                                                           "tiles": {**_BIG, "mlp_norm_gate_up": 32}}),
    ("largest tiles (fewer instructions than SMs for some ops)",
     {"attn_splits": 4, "tiles": {**_BIG, "mlp_norm_gate_up": 128, "down_proj_residual": 32, "o_proj_residual": 32,
                                  "final_norm_lm_head": 2048}}),
    ("critical-path list scheduling on the cost model", {"assignment": "critical_path"}),
    ("cost-balanced assignment per stage", {"assignment": "cost_balanced"}),
    ("per-KV-head dependencies on the attention edges + critical path",
     {"assignment": "critical_path", "edges": _ATTN_FINE}),
    ("flash-decode: split the KV sequence in 4, per-head attention deps",
     {"assignment": "critical_path", "edges": _ATTN_FINE, "attn_splits": 4}),
    ("K-split o_proj by head so it starts as soon as its heads are merged",
     {"assignment": "critical_path", "attn_splits": 4, "k_splits": {"o_proj_residual": 4, "down_proj_residual": 1},
      "edges": {**_ATTN_FINE, "attn_reduce->o_proj_residual": "head"}}),
    ("K-split down_proj in chunks so it overlaps gate/up",
     {"assignment": "critical_path", "attn_splits": 4, "k_splits": {"o_proj_residual": 1, "down_proj_residual": 4},
      "edges": {**_ATTN_FINE, "mlp_norm_gate_up->down_proj_residual": "chunk"},
      "chunks": {"mlp_norm_gate_up->down_proj_residual": 4}}),
    ("zig-zag assignment", {"assignment": "zigzag", "attn_splits": 4, "tiles": _BIG}),
    ("spatial partition of SMs per op with fine attention deps",
     {"assignment": "spatial", "edges": _ATTN_FINE, "attn_splits": 4, "order": "critical_path"}),
    ("round-robin placement, critical-path order within queues",
     {"order": "critical_path", "attn_splits": 4, "tiles": _BIG}),
]


def _base() -> dict[str, Any]:
    return Strategy().model_dump(mode="json")


def random_strategy(rng: random.Random) -> Strategy:
    """A uniformly drawn point of the space (each knob independently)."""
    d = _base()
    for op, choices in TILE_CHOICES.items():
        d["tiles"][op] = rng.choice(choices)
    d["k_splits"] = {op: rng.choice(K_SPLIT_CHOICES) for op in ("o_proj_residual", "down_proj_residual")}
    d["attn_splits"] = rng.choice(ATTN_SPLIT_CHOICES)
    d["edges"] = {e: rng.choice(GRANULARITIES[:3]) for e in FINE_EDGES if rng.random() < 0.7}
    d["chunks"] = {e: rng.choice(CHUNK_CHOICES) for e in d["edges"] if d["edges"][e] == "chunk"}
    d["assignment"] = rng.choice(ASSIGNMENTS)
    d["order"] = rng.choice(ORDERS)
    return Strategy.model_validate(d)


def mutate(strategy: Strategy, rng: random.Random, n: int = 1) -> Strategy:
    """Change `n` randomly chosen knobs of a strategy."""
    d = strategy.model_dump(mode="json")
    for _ in range(n):
        knob = rng.choice(["tile", "tile", "k_split", "attn_splits", "edge", "edge", "assignment", "order", "chunks"])
        if knob == "tile":
            op = rng.choice(list(TILE_CHOICES))
            d["tiles"][op] = rng.choice(TILE_CHOICES[op])
        elif knob == "k_split":
            d["k_splits"][rng.choice(["o_proj_residual", "down_proj_residual"])] = rng.choice(K_SPLIT_CHOICES)
        elif knob == "attn_splits":
            d["attn_splits"] = rng.choice(ATTN_SPLIT_CHOICES)
        elif knob == "edge":
            d["edges"][rng.choice(FINE_EDGES)] = rng.choice(GRANULARITIES[:3])
        elif knob == "chunks":
            e = rng.choice(FINE_EDGES)
            d["chunks"][e] = rng.choice(CHUNK_CHOICES)
        elif knob == "assignment":
            d["assignment"] = rng.choice(ASSIGNMENTS)
        else:
            d["order"] = rng.choice(ORDERS)
    return Strategy.model_validate(d)


def strategy_key(strategy: Strategy, patches: list[dict[str, Any]] | None = None) -> str:
    """A canonical text of a proposal, to avoid evaluating the same one twice."""
    import json

    return json.dumps([strategy.model_dump(mode="json"), patches or []], sort_keys=True)


class HeuristicProposer:
    """Seeds first, then hill climbing (1-2 knob mutations of the best accepted candidate), then random points."""

    name = "heuristic"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.next_seed = 0

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
        while len(out) < n and self.next_seed < len(SEEDS):
            why, fields = SEEDS[self.next_seed]
            self.next_seed += 1
            st = Strategy.model_validate({**_base(), **fields})
            if self._fresh(st):
                out.append(Proposal(st, [], why, self.name))
        tries = 0
        while len(out) < n and tries < 200:
            tries += 1
            if ctx.best is not None and self.rng.random() < 0.8:
                st = mutate(ctx.best.proposal.strategy, self.rng, self.rng.choice([1, 1, 2]))
                why, parent = "hill climbing: mutate the best", ctx.best.candidate
            else:
                st, why, parent = random_strategy(self.rng), "random point of the strategy space", None
            if self._fresh(st):
                out.append(Proposal(st, [], why, self.name, parent))
        return out

    def observe(self, result: Result) -> None:
        self.seen.add(strategy_key(result.proposal.strategy, result.proposal.patches))
