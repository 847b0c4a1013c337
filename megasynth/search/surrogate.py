"""The cheap fidelity of the search: a strategy's step time from the cost model on a few layers, extrapolated.

Layers of a decode step are identical, so after the first one the simulated schedule repeats with a fixed period.
`Surrogate` lowers the strategy for the model cut to `LAYERS` layers (5x fewer instructions for llama-1b, 10x for
llama-8b), simulates it, and adds the steady-state period (the end of layer 2 minus the end of layer 1) for each
layer it left out. On llama-1b and llama-8b this matches the full estimate exactly for most strategies and within
~2 % for the rest (critical-path list scheduling, which is not periodic); it takes ~0.1 s where lowering and
estimating the whole model takes ~1-10 s. Proposers use it to rank many strategies before the loop spends a
candidate (a full validation, then the GPU) on the best of them; every number it gives is an estimate.

With `jobs > 1` the strategies of one `many` call are estimated by spawned worker processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import os
import signal
import threading
from dataclasses import replace
from typing import Any

from megasynth.ir.program import resolve
from megasynth.lowering.costmodel import CostParams, simulate
from megasynth.lowering.lower import lower
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.strategy import Strategy
from megasynth.search.interrupts import interrupts_held
from megasynth.search.proposers.base import strategy_key

LAYERS = 3  # layers simulated: the first settles the pipeline, layers 1 -> 2 give the period


def cut(spec: ModelSpec, layers: int = LAYERS) -> ModelSpec:
    """The model spec with only its first `layers` layers (unchanged when it has no more)."""
    if spec.config.num_hidden_layers <= layers:
        return spec
    return replace(spec, config=replace(spec.config, num_hidden_layers=layers))


def extrapolated_ms(spec: ModelSpec, workers: int, strategy: Strategy, params: CostParams, ctx: int) -> float:
    """Estimated ms per step of the full model from a `LAYERS`-layer simulation plus the steady-state period per
    missing layer (inf when the strategy does not lower)."""
    small = cut(spec)
    try:
        prog = resolve(lower(small, workers, strategy))
        _, end, _, span = simulate(prog, params, ctx)
    except ValueError:
        return math.inf
    missing = spec.config.num_hidden_layers - small.config.num_hidden_layers
    if missing > 0:
        last: dict[int, float] = {}
        for i in range(prog.n):
            layer = prog.layer[i]
            if layer is not None:
                last[layer] = max(last.get(layer, 0.0), end[i])
        span += missing * max(0.0, last[2] - last[1])
    return (span + params.launch_us) / 1000


def _worker(args: tuple[ModelSpec, int, dict[str, Any], dict[str, Any], int]) -> float:
    spec, workers, strategy, params, ctx = args
    return extrapolated_ms(spec, workers, Strategy.model_validate(strategy), CostParams.from_json(params), ctx)


def _init_worker() -> None:
    """A cost-model process's start: Ctrl-C is the search's to handle (`interrupts`), and the process ends with the
    search's, however that ends (a killed search would otherwise leave its idle workers behind for good)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(0)), daemon=True).start()


class Surrogate:
    """Cached extrapolated estimates for one model, worker count, context and cost model."""

    def __init__(self, spec: ModelSpec, workers: int, params: CostParams, ctx: int, jobs: int = 1) -> None:
        self.spec, self.workers, self.params, self.ctx, self.jobs = spec, workers, params, ctx, jobs
        self.cache: dict[str, float] = {}
        self._pool: cf.ProcessPoolExecutor | None = None

    def __call__(self, strategy: Strategy) -> float:
        return self.many([strategy])[0]

    def many(self, strategies: list[Strategy]) -> list[float]:
        """Estimates of several strategies (the ones not cached computed in parallel when jobs > 1)."""
        keys = [strategy_key(s) for s in strategies]
        todo = {k: s for k, s in zip(keys, strategies, strict=True) if k not in self.cache}
        if todo:
            for k, ms in zip(todo, self._run(list(todo.values())), strict=True):
                self.cache[k] = ms
        return [self.cache[k] for k in keys]

    def _run(self, strategies: list[Strategy]) -> list[float]:
        if self.jobs <= 1 or len(strategies) < 2:
            return [extrapolated_ms(self.spec, self.workers, s, self.params, self.ctx) for s in strategies]
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker)
            with interrupts_held():  # each submit spawns a process (none idle yet): none of them gets Ctrl-C
                for _ in range(self.jobs):
                    self._pool.submit(int)
        # the whole spec, not its name: a name would lose the batch, the context length and a checkpoint's config
        args = [(self.spec, self.workers, s.model_dump(mode="json"), self.params.to_json(), self.ctx)
                for s in strategies]
        try:
            return list(self._pool.map(_worker, args, chunksize=max(1, len(args) // (4 * self.jobs))))
        except cf.process.BrokenProcessPool:  # a worker died (memory?): from now on, one process
            self._pool, self.jobs = None, 1
            return [extrapolated_ms(self.spec, self.workers, s, self.params, self.ctx) for s in strategies]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
