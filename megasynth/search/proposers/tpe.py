"""A model-based proposer: Optuna's TPE sampler over the strategy knobs (an in-memory study of its own, told how
each of its proposals fared). Complements `evolve` when the budget is small and the knobs interact."""

from __future__ import annotations

from typing import Any

from megasynth.lowering.strategy import SearchSpace, Strategy
from megasynth.search.proposers.base import Proposal, Result, SearchContext, strategy_key

MAX_TRIES = 20  # suggestions per wanted proposal before giving up on finding a new one


def _suggest(trial: Any, space: SearchSpace) -> Strategy:
    return space.from_point({k.name: trial.suggest_categorical(k.name, list(k.choices)) for k in space.knobs})


class TPEProposer:
    name = "tpe"

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        import optuna

        self.space = space
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
        self.pending: dict[str, int] = {}  # strategy key -> trial number of this proposer's study
        self.seen: set[str] = set()

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        import optuna

        for h in ctx.history:
            self.seen.add(strategy_key(h.proposal.strategy, h.proposal.patches))
        out: list[Proposal] = []
        for _ in range(MAX_TRIES * max(1, n)):
            if len(out) >= n:
                break
            trial = self.study.ask()
            st = _suggest(trial, self.space)
            key = strategy_key(st)
            if key in self.seen:
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            self.seen.add(key)
            self.pending[key] = trial.number
            out.append(Proposal(st, [], "TPE suggestion from the results so far", self.name))
        return out

    def observe(self, result: Result) -> None:
        import optuna

        key = strategy_key(result.proposal.strategy, result.proposal.patches)
        self.seen.add(key)
        number = self.pending.pop(key, None)
        if number is None:
            return
        if result.accepted and result.ms is not None:
            self.study.tell(number, result.ms)
        else:
            self.study.tell(number, state=optuna.trial.TrialState.FAIL)
