"""The proposer named on the command line (`resolve_proposer`), and how `auto` combines them: without an LLM, the
hand-written seeds, then the multi-fidelity descent, then evolution (`ChainProposer`); with an LLM endpoint, the
agent, then that built-in chain once the agent stops (`FallbackProposer`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megasynth.lowering.costmodel import CostParams, load_params
from megasynth.lowering.models import ModelSpec, get_model
from megasynth.lowering.strategy import SearchSpace
from megasynth.search.proposers.base import Proposal, Proposer, Result, SearchContext

#: Proposer names on the command line (`heuristic` is the old name of `seeds`).
NAMES = ("auto", "descent", "seeds", "heuristic", "evolve", "tpe", "llm")
#: How many hand-written seeds `auto` times next to the search (the best three measured ones).
AUTO_SEEDS = 3


class ChainProposer:
    """Stages in order, each until it is spent: a stage with a quota stops after that many proposals; one without
    stops when it returns nothing and says it is `exhausted` (or has no such property: then nothing means spent).
    A stage that returns nothing but is not exhausted is waiting for results, and so is the chain."""

    name = "auto"

    def __init__(self, stages: list[tuple[Proposer, int | None]]) -> None:
        self.stages = stages
        self.at = 0
        self.given = 0  # proposals of the current stage

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        out: list[Proposal] = []
        while len(out) < n and self.at < len(self.stages):
            stage, quota = self.stages[self.at]
            want = n - len(out) if quota is None else min(n - len(out), quota - self.given)
            got = stage.propose(ctx, want) if want > 0 else []
            out += got
            self.given += len(got)
            spent = (quota is not None and self.given >= quota) or \
                (not got and getattr(stage, "exhausted", True))
            if not spent:
                if not got:
                    break  # waiting for results
                continue
            self.at, self.given = self.at + 1, 0
            if out:  # hand these out before the next stage starts: its first call can take minutes (the descent)
                break
        return out

    def observe(self, result: Result) -> None:
        for stage, _ in self.stages:
            stage.observe(result)

    def close(self) -> None:
        for stage, _ in self.stages:
            close_proposer(stage)


def close_proposer(proposer: Any) -> None:
    """Release what a proposer holds (the descent's cost-model processes), if it holds anything."""
    close = getattr(proposer, "close", None)
    if callable(close):
        close()


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
                self.notice("auto: the LLM agent stopped proposing; the built-in search (seeds, descent, evolve) "
                            "takes over")
        return self.builtin.propose(ctx, n)

    def observe(self, result: Result) -> None:
        self.agent.observe(result)
        self.builtin.observe(result)

    def close(self) -> None:
        close_proposer(self.agent)
        close_proposer(self.builtin)


def builtin_chain(space: SearchSpace, seed: int, descent: Proposer) -> ChainProposer:
    """`auto` without an LLM: the best hand-written seeds (so the run times them side by side with the search), the
    multi-fidelity descent from the naive lowering, then evolution from everything accepted."""
    from megasynth.search.proposers.evolve import EvolveProposer
    from megasynth.search.proposers.heuristic import HeuristicProposer

    return ChainProposer([(HeuristicProposer(space, seed, hill_climb=False), AUTO_SEEDS), (descent, None),
                          (EvolveProposer(space, seed), None)])


def check_proposer(name: str, **llm_options: Any) -> None:
    """What `resolve_proposer` refuses, without building anything (a search checks it before it makes its run
    folder): an unknown name, `llm` without an endpoint, an agent setting that is no number. Raises ValueError."""
    from megasynth.search.proposers.llm import LLMOptions, agent_configured

    if name not in NAMES:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(NAMES)}")
    if name == "llm" and not agent_configured():
        raise ValueError("--proposer llm needs OPENAI_API_KEY or OPENAI_BASE_URL (an OpenAI-compatible endpoint)")
    if name in ("llm", "auto") and agent_configured():
        LLMOptions.from_env(**llm_options)


def resolve_proposer(name: str, spec_name: str | ModelSpec, workers: int, seed: int = 0, run_dir: Path | None = None,
                     notice: Callable[[str], None] | None = None, *, ctx: int = 1024,
                     params: CostParams | None = None, jobs: int = 1,
                     progress: Callable[[str], None] | None = None, **llm_options: Any) -> Proposer:
    """Build the proposer named on the command line. `llm` needs an endpoint (OPENAI_API_KEY/OPENAI_BASE_URL);
    `auto` uses the LLM agent when one is configured, else the built-in chain (saying so in one line). `ctx`,
    `params`, `jobs` and `progress` are the descent's: the context it estimates at, the cost model, its processes, and
    where it reports its first stage (minutes on a CPU for the larger models)."""
    from megasynth.search.proposers.descent import DescentProposer
    from megasynth.search.proposers.evolve import EvolveProposer
    from megasynth.search.proposers.heuristic import HeuristicProposer

    check_proposer(name, **llm_options)
    spec = spec_name if isinstance(spec_name, ModelSpec) else get_model(spec_name)
    space = SearchSpace(spec, workers)

    def descent() -> DescentProposer:
        return DescentProposer(space, spec, workers, params or load_params(), ctx, jobs=jobs, progress=progress)

    if name in ("seeds", "heuristic"):
        return HeuristicProposer(space, seed)
    if name == "descent":
        return descent()
    if name == "evolve":
        return EvolveProposer(space, seed)
    if name == "tpe":
        from megasynth.search.proposers.tpe import TPEProposer

        return TPEProposer(space, seed)
    if name in ("llm", "auto"):
        try:
            from megasynth.search.proposers import llm
        except ImportError:  # pragma: no cover - the agent module is part of the package
            llm = None  # type: ignore[assignment]
        if llm is not None and llm.agent_configured():
            opts = llm.LLMOptions.from_env(**llm_options)
            agent = llm.LLMProposer(spec, workers, opts, run_dir=run_dir)
            if name == "llm":
                return agent
            return FallbackProposer(agent, builtin_chain(space, seed, descent()), notice)
        if notice:
            notice(f"auto: no OPENAI_API_KEY / OPENAI_BASE_URL, so no LLM agent: the {AUTO_SEEDS} best hand-written "
                   "seeds, then the cost-model descent, then evolve")
        return builtin_chain(space, seed, descent())
    raise AssertionError(name)  # (check_proposer refused every other name)
