"""The proposer named on the command line (`resolve_proposer`), and the two that `auto` chains: the heuristic's seeds,
then evolution (`ChainProposer`); the LLM agent, then the built-in search once the agent stops (`FallbackProposer`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from synth.lowering.models import get_model
from synth.search.proposers.base import Proposal, Proposer, Result, SearchContext


class ChainProposer:
    """`auto` without an LLM: the heuristic's seeds first, then evolution."""

    name = "auto"

    def __init__(self, first: Proposer, then: Proposer, switch_after: int) -> None:
        self.first, self.then, self.switch_after = first, then, switch_after
        self.asked = 0

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        out: list[Proposal] = []
        if self.asked < self.switch_after:
            out = self.first.propose(ctx, min(n, self.switch_after - self.asked))
            self.asked += len(out)
            if not out:
                self.asked = self.switch_after
        if len(out) < n:
            out += self.then.propose(ctx, n - len(out))
        return out

    def observe(self, result: Result) -> None:
        self.first.observe(result)
        self.then.observe(result)


class FallbackProposer:
    """`auto` with an LLM endpoint: the agent while it can propose; once it stops for good (call budget spent, or an
    endpoint error that retrying cannot fix) the built-in search takes over, so the budget is still used."""

    name = "auto"

    def __init__(self, agent: Proposer, builtin: Proposer, notice: Callable[[str], None] | None = None) -> None:
        self.agent, self.builtin, self.notice = agent, builtin, notice
        self.switched = False

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        if not self.switched:
            out = self.agent.propose(ctx, n)
            if out or not getattr(self.agent, "exhausted", False):
                return out
            self.switched = True
            if self.notice:
                self.notice("auto: the LLM agent stopped proposing; the built-in search (heuristic, then evolve) "
                            "takes over")
        return self.builtin.propose(ctx, n)

    def observe(self, result: Result) -> None:
        self.agent.observe(result)
        self.builtin.observe(result)


def resolve_proposer(name: str, spec_name: str, workers: int, seed: int = 0, run_dir: Path | None = None,
                     notice: Callable[[str], None] | None = None, **llm_options: Any) -> Proposer:
    """Build the proposer named on the command line. `llm` needs an endpoint (OPENAI_API_KEY/OPENAI_BASE_URL);
    `auto` uses the LLM agent when one is configured, else heuristic then evolve (saying so in one line)."""
    from synth.search.proposers.evolve import EvolveProposer
    from synth.search.proposers.heuristic import SEEDS, HeuristicProposer

    if name == "heuristic":
        return HeuristicProposer(seed)
    if name == "evolve":
        return EvolveProposer(seed)
    if name == "tpe":
        from synth.search.proposers.tpe import TPEProposer

        return TPEProposer(seed)
    if name in ("llm", "auto"):
        try:
            from synth.search.proposers import llm
        except ImportError:  # pragma: no cover - the agent module is part of the package
            llm = None  # type: ignore[assignment]
        if llm is not None and llm.agent_configured():
            opts = llm.LLMOptions.from_env(**llm_options)
            agent = llm.LLMProposer(get_model(spec_name), workers, opts, run_dir=run_dir)
            if name == "llm":
                return agent
            builtin = ChainProposer(HeuristicProposer(seed), EvolveProposer(seed), len(SEEDS))
            return FallbackProposer(agent, builtin, notice)
        if name == "llm":
            raise ValueError("--proposer llm needs OPENAI_API_KEY or OPENAI_BASE_URL (an OpenAI-compatible endpoint)")
        if notice:
            notice("auto: no OPENAI_API_KEY / OPENAI_BASE_URL, so no LLM agent: heuristic proposer, then evolve")
        return ChainProposer(HeuristicProposer(seed), EvolveProposer(seed), len(SEEDS))
    raise ValueError(f"unknown proposer {name!r}; choose heuristic, evolve, tpe, llm or auto")
