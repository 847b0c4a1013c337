"""The proposer plug-in point: the search loop asks a proposer for candidates and tells it how each one fared.

A proposal is a strategy (see `lowering.strategy`) plus optional explicit patches applied to the lowered schedule
(see `lowering.patches`). The loop lowers, patches, validates (proof + interleavings), then times on the GPU or
estimates with the cost model, and reports back a `Result`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from megasynth.lowering.strategy import Strategy


@dataclass
class Proposal:
    strategy: Strategy
    patches: list[dict[str, Any]] = field(default_factory=list)
    rationale: str = ""
    proposer: str = ""
    parent: str | None = None  # candidate id this one was derived from


@dataclass
class Result:
    """How a proposal fared. `ms` is measured on the GPU when `estimated` is False, else the cost model's."""

    candidate: str  # candidate id within the run
    proposal: Proposal
    accepted: bool
    ms: float | None = None
    estimated: bool = True
    error: str | None = None  # lowering/patch error (malformed) when the proposal could not be built
    counterexample: dict[str, Any] | None = None  # validator finding(s) for rejected ones, compact JSON
    profile: dict[str, Any] | None = None  # per-op time, per-SM idle, critical path of the timed/estimated run
    screened: float | None = None  # the cost model's estimate (ms) when it screened the proposal out (not validated)


@dataclass
class SearchContext:
    """What a proposer may look at: the model, the hardware, the best so far, and the history."""

    model: str
    workers: int
    device: str
    best: Result | None
    history: list[Result]
    baseline_ms: float | None
    estimated: bool


class Proposer(Protocol):
    name: str

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        """Return up to `n` new proposals (fewer, or none, is fine: the loop moves on)."""
        ...

    def observe(self, result: Result) -> None:
        """Learn from one evaluated proposal."""
        ...


def strategy_key(strategy: Strategy, patches: list[dict[str, Any]] | None = None) -> str:
    """A canonical text of a proposal, so that a proposer does not offer the same one twice."""
    import json

    return json.dumps([strategy.model_dump(mode="json"), patches or []], sort_keys=True)
