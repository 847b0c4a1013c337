"""The search's settings (`SearchConfig`), shared by the loop, the evaluator and the pool, and how the defaults that
depend on the machine (`--jobs`) are resolved. Kept apart from the loop so that dependencies point one way:
config <- evaluate <- pool <- loop."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasynth.lowering.costmodel import CostParams
from megasynth.runs.study import HEARTBEAT_S, LEASE_S

#: Most worker processes `--jobs` defaults to: beyond this the main process (estimating or timing each candidate,
#: and keeping the study) is the bottleneck, and every worker holds a model's lowering in memory.
MAX_DEFAULT_JOBS = 8


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the platform has one (a container or `taskset`
    limits it below `os.cpu_count()`), else the machine's count."""
    count = getattr(os, "process_cpu_count", None)  # Python 3.13+: honours the affinity mask and -X cpu_count
    if count is not None:
        return max(1, count() or 1)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_jobs(gpu: bool, cores: int | None = None) -> int:
    """Worker processes for `--jobs` when it is not given. On a GPU one core is left to the main process, which times
    every candidate while the workers lower and validate the next ones; on a CPU the main process only estimates
    (milliseconds per candidate) while validation dominates, so every core validates. At most MAX_DEFAULT_JOBS
    either way; 1 (no pool at all) on a machine with one core."""
    cores = available_cores() if cores is None else max(1, cores)
    return max(1, min(MAX_DEFAULT_JOBS, cores - 1 if gpu else cores))


@dataclass
class SearchConfig:
    model: str = "llama-1b"
    workers: int | None = None  # None: the GPU's SM count, else 132
    proposer: str = "auto"
    budget: int = 50  # candidates in the study (all processes together), baseline included
    time_limit: float | None = None  # seconds for this process
    seed: int = 0
    runs_dir: Path = Path("runs")
    run: str | None = None  # run name to create, or to resume with `resume=True`
    resume: bool = False
    storage: str | None = None
    interleavings: int = 200
    final_interleavings: int = 1000
    ctx: int = 1024
    max_seq_len: int | None = None  # the schedules' max_seq_len; None: the model row's (a resumed run keeps its own)
    sequences: int = 1  # --batch: sequences per step (a resumed run keeps its own), timed or estimated
    batch: int = 4  # proposals asked for per round
    jobs: int | None = None  # processes lowering+validating ahead of the timer; None: `default_jobs`
    prescreen: float = 1.5  # GPU only: skip timing when the estimate is worse than prescreen x the best estimate
    #: GPU only: at the end, the `finalists` fastest candidates are timed again side by side in `final_rounds`
    #: rounds and best/ gets the lowest median (`search.finals`); fewer than 2 finalists: no finals
    finalists: int = 4
    final_rounds: int = 3
    gpu: bool | None = None  # None: use the GPU when CUDA is present
    progress: bool = True  # a progress bar when stderr is a terminal, else a plain line per finished candidate
    cost_params: CostParams | None = None
    llm: dict[str, Any] = field(default_factory=dict)  # the agent's --llm-* options (proposers.llm.LLMOptions)
    notice: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))
    lease_s: float = LEASE_S  # a claim whose owner was silent this long is taken over (see megasynth.runs.study)
    heartbeat_s: float = HEARTBEAT_S  # how often this process refreshes its claims
