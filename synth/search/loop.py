"""The search loop: propose -> lower -> patch -> validate -> time (GPU) or estimate (cost model) -> runs/<run>/.

This module is the loop and its bookkeeping (the Optuna study, resume, the baseline, duplicates, stopping); one
candidate's evaluation is `synth.search.evaluate`, the worker processes of `--jobs` are `synth.search.pool`, and the
proposers' selection is `synth.search.proposers.auto`.

Every candidate is a trial of an Optuna study (SQLite `runs/<run>/study.db` by default, any Optuna storage URL with
`storage`), so several processes or machines can work one study; candidate ids are the trial numbers (`c0007`).
Candidate `c0000` is always the naive baseline, so speed-ups are measured side by side. Rejected candidates are kept
with the validator's counterexample (`rejected/<id>.json`). On a GPU (CUDA present) the cost model pre-screens and the
accepted candidates are timed on the persistent interpreter; on a CPU they are estimated and labelled `estimated`.

Validation during the search replays `interleavings` adversarial executions per candidate (default 200, on top of the
full race proof); a candidate that becomes the best is re-validated with `final_interleavings` (default 1000) before
it is written to best/.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from synth.lowering.costmodel import CostParams, load_params
from synth.lowering.models import get_model
from synth.lowering.strategy import parse_strategy
from synth.runs.rundir import BASELINE, RunDir, candidate_id, schedule_key, status_of
from synth.search.evaluate import (
    Evaluator,
    Standing,
    Verdict,
    baseline_proposal,
    cuda_available,
    default_workers,
    gpu_name,
)
from synth.search.pool import Pool
from synth.search.proposers.auto import resolve_proposer
from synth.search.proposers.base import Proposal, Proposer, Result, SearchContext
from validator.errors import ScheduleError
from validator.schedule import Schedule

STUDY = "megasynth"
MAX_EMPTY_ROUNDS = 5  # proposer rounds with no new proposal before the search stops
ORPHAN_AGE_S = 120  # a RUNNING trial with no owner recorded this long after its start is stale
MAX_DUPLICATES = 500  # proposals that lower to an already evaluated schedule, per process, before it stops


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
    batch: int = 4  # proposals asked for per round
    jobs: int | None = None  # processes lowering+validating ahead of the timer; None: GPU min(8, cores - 1), CPU 1
    prescreen: float = 1.5  # GPU only: skip timing when the estimate is worse than prescreen x the best estimate
    gpu: bool | None = None  # None: use the GPU when CUDA is present
    progress: bool = True
    cost_params: CostParams | None = None
    llm: dict[str, Any] = field(default_factory=dict)  # the agent's --llm-* options (proposers.llm.LLMOptions)
    notice: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))


@dataclass
class SearchSummary:
    run_dir: Path
    evaluated: int
    accepted: int
    rejected: int
    best: str | None
    best_ms: float | None
    baseline_ms: float | None
    estimated: bool
    seconds: float
    screened: int = 0  # left out by the cost model before validation (not counted in `rejected`)
    best_by_proposer: dict[str, tuple[str, float]] = field(default_factory=dict)  # proposer -> (candidate, ms)

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.baseline_ms:
            return self.baseline_ms / self.best_ms
        return None


# --------------------------------------------------------------------------------------------------------------
# The loop


class Search:
    """One process's part of a search (see module docstring)."""

    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self.spec = get_model(cfg.model)
        self.gpu = cuda_available() if cfg.gpu is None else cfg.gpu
        self.workers = cfg.workers or default_workers()
        self.params = cfg.cost_params or load_params()
        if cfg.resume:
            if not cfg.run:
                raise ValueError("--resume needs the run name")
            path = cfg.runs_dir / cfg.run
            if not (path / "run.json").exists():
                raise ValueError(f"cannot resume {path}: it has no run.json")
        else:
            path = cfg.runs_dir / (cfg.run or RunDir.new_name(cfg.model, cfg.seed))
        self.run = RunDir(path)
        if cfg.resume:
            info = self.run.info
            if info.get("model") != cfg.model:
                raise ValueError(f"run {path} is for model {info.get('model')!r}, not {cfg.model!r}")
            self.workers = int(info.get("workers", self.workers))
        self.standing = Standing()
        self.evaluator = Evaluator(cfg, self.spec, self.workers, self.gpu, self.params, self.run, self.standing)
        self.proposer: Proposer | None = None

    # -- study -------------------------------------------------------------------------------------------------
    def _study(self) -> Any:
        try:
            import optuna
        except ImportError:
            raise ValueError("the search keeps its study in Optuna, which is not installed here (pip install optuna, "
                             "or carry its wheels to the GPU machine)") from None

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = self.cfg.storage or f"sqlite:///{(self.run.path / 'study.db').resolve()}"
        if storage.startswith("sqlite:///"):
            from optuna.storages import RDBStorage

            storage = RDBStorage(storage, engine_kwargs={"connect_args": {"timeout": 60}})
        return optuna.create_study(study_name=f"{STUDY}-{self.run.path.name}", storage=storage,
                                   direction="minimize", load_if_exists=True)

    # -- history (resume) -------------------------------------------------------------------------------------
    def _load_history(self) -> None:
        """Rebuild what earlier processes found from the run folder (the files are the source of truth)."""
        for cid, t in self.run.accepted().items():
            try:
                st = parse_strategy(t.get("strategy", {}))
            except ScheduleError:
                continue
            prop = Proposal(st, list(t.get("patches", [])), t.get("rationale", ""), t.get("proposer", ""),
                            t.get("parent"))
            res = Result(cid, prop, True, t["ms"], bool(t.get("estimated", True)),
                         profile={"critical_path": t.get("critical_path", [])})
            self.standing.remember(res, t.get("estimate_ms"))
            if t.get("schedule_key"):
                self.standing.keys.setdefault(t["schedule_key"], cid)
        for cid, r in self.run.rejected().items():
            try:
                st = parse_strategy(r.get("strategy", {}))
            except ScheduleError:
                continue
            prop = Proposal(st, list(r.get("patches", [])), r.get("rationale", ""), r.get("proposer", ""),
                            r.get("parent"))
            screened = r.get("estimate_ms") if r.get("reason") == "screened" else None
            self.standing.history.append(Result(cid, prop, False, error=r.get("error"),
                                                counterexample=r.get("findings"), screened=screened))
            if r.get("schedule_key") and r.get("reason") != "screened":
                self.standing.keys.setdefault(r["schedule_key"], cid)

    def context(self) -> SearchContext:
        timer, st = self.evaluator.timer, self.standing
        return SearchContext(self.cfg.model, self.workers, timer.device if timer else "cost model (CPU)",
                             st.best, st.history, st.baseline_ms, not self.gpu)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run_loop(self) -> SearchSummary:
        cfg = self.cfg
        t_start = time.monotonic()
        self.run.init({"model": cfg.model, "seed": cfg.seed, "workers": self.workers, "ctx": cfg.ctx,
                       "proposer": cfg.proposer, "budget": cfg.budget, "storage": cfg.storage or "study.db",
                       "interleavings": {"search": cfg.interleavings, "best": cfg.final_interleavings},
                       "gpu": gpu_name() if self.gpu else None, "estimated": not self.gpu,
                       "cost_model": self.params.source})
        study = self._study()
        self._reap(study)
        self._load_history()
        best, on_disk = self.standing.best, self.run.best_ms()
        if best is not None and best.ms is not None and (on_disk is None or best.ms < on_disk):
            self.evaluator.promote_again(best)  # killed between recording it and writing best/
        jobs = min(16, max(1, (os.cpu_count() or 2) - 1))  # the descent's cost-model processes
        self.proposer = resolve_proposer(cfg.proposer, cfg.model, self.workers, cfg.seed, self.run.path, cfg.notice,
                                         ctx=cfg.ctx, params=self.params, jobs=jobs, **{"seq": cfg.ctx, **cfg.llm})
        for r in self.standing.history:
            self.proposer.observe(r)
        evaluated = 0
        queue: list[Proposal] = []
        empty_rounds = 0
        dups = 0
        bar = _Progress(cfg.budget, cfg.progress)
        try:
            if not (self.run.path / "candidates" / BASELINE / "timing.json").exists():
                self._evaluate_baseline(study, bar)
                evaluated += 1
            jobs = cfg.jobs if cfg.jobs is not None else (min(8, max(1, (os.cpu_count() or 2) - 1)) if self.gpu else 1)
            if jobs > 1:
                evaluated += self._run_parallel(study, bar, jobs, t_start)
                return self.summary(evaluated, time.monotonic() - t_start)
            while True:
                done = len(study.get_trials(deepcopy=False))
                bar.update(done, self.standing.best, self.standing.baseline_ms, not self.gpu)
                if done >= cfg.budget:
                    break
                if cfg.time_limit is not None and time.monotonic() - t_start > cfg.time_limit:
                    cfg.notice(f"time limit of {cfg.time_limit:g} s reached")
                    break
                if not queue:
                    queue = list(self.proposer.propose(self.context(), cfg.batch))
                    if not queue:
                        empty_rounds += 1
                        if empty_rounds >= MAX_EMPTY_ROUNDS:
                            cfg.notice(f"the proposer had nothing new for {MAX_EMPTY_ROUNDS} rounds; stopping")
                            break
                        continue
                    empty_rounds = 0
                proposal = queue.pop(0)
                try:
                    built: Schedule | None = self.evaluator.build(proposal)
                except (ScheduleError, ValueError):
                    built = None  # evaluate() records why, as a rejected candidate
                if built is not None and (same := self.standing.keys.get(schedule_key(built))) is not None:
                    # The same schedule as an earlier candidate: tell the proposer, spend no trial on it.
                    dups += 1
                    if dups > MAX_DUPLICATES:
                        cfg.notice(f"{MAX_DUPLICATES} proposals repeated earlier schedules; stopping")
                        break
                    old = self.standing.results.get(same)
                    self.proposer.observe(Result(same, proposal, old.accepted if old else False,
                                                 old.ms if old else None, not self.gpu,
                                                 error=f"the same schedule as {same}"))
                    continue
                trial = study.ask()
                cid = candidate_id(trial.number)
                if cid == BASELINE:  # another process created the study: it is ours to evaluate the baseline
                    self._tell_baseline(study, trial, bar)
                    evaluated += 1
                    queue.insert(0, proposal)
                    continue
                self._run_trial(study, trial, cid, proposal, built)
                evaluated += 1
        finally:
            bar.close()
            self.run.write_leaderboard()
        return self.summary(evaluated, time.monotonic() - t_start)

    def _run_parallel(self, study: Any, bar: _Progress, jobs: int, t_start: float) -> int:
        """Like the sequential loop, but `jobs` worker processes lower and validate proposals ahead of this process,
        which estimates or times them (the GPU is used by this process only). Returns candidates evaluated."""
        cfg = self.cfg
        assert self.proposer is not None
        evaluated = empty_rounds = dups = 0
        queue: list[Proposal] = []
        stop = False
        with Pool(jobs, cfg.model, self.workers, cfg.interleavings, cfg.seed) as pool:
            while True:
                done = len(study.get_trials(deepcopy=False))
                bar.update(done, self.standing.best, self.standing.baseline_ms, not self.gpu)
                if cfg.time_limit is not None and time.monotonic() - t_start > cfg.time_limit and not stop:
                    cfg.notice(f"time limit of {cfg.time_limit:g} s reached")
                    stop = True
                while not stop and len(pool) < jobs and done + len(pool) < cfg.budget:
                    if not queue:
                        queue = list(self.proposer.propose(self.context(), max(cfg.batch, jobs)))
                        if not queue:
                            empty_rounds += 1
                            if empty_rounds >= MAX_EMPTY_ROUNDS and not pool:
                                cfg.notice(f"the proposer had nothing new for {MAX_EMPTY_ROUNDS} rounds; stopping")
                                stop = True
                            break
                        empty_rounds = 0
                    pool.submit(queue.pop(0))
                if not pool:
                    if stop or done >= cfg.budget or empty_rounds >= MAX_EMPTY_ROUNDS:
                        break
                    continue
                for prepared in pool.finished():
                    proposal, schedule = prepared.proposal, prepared.schedule
                    if schedule is not None and (same := self.standing.keys.get(schedule_key(schedule))) is not None:
                        dups += 1
                        old = self.standing.results.get(same)
                        self.proposer.observe(Result(same, proposal, old.accepted if old else False,
                                                     old.ms if old else None, not self.gpu,
                                                     error=f"the same schedule as {same}"))
                        if dups > MAX_DUPLICATES:
                            cfg.notice(f"{MAX_DUPLICATES} proposals repeated earlier schedules; stopping")
                            stop = True
                        continue
                    if len(study.get_trials(deepcopy=False)) >= cfg.budget:
                        continue
                    trial = study.ask()
                    cid = candidate_id(trial.number)
                    if cid == BASELINE:
                        self._tell_baseline(study, trial, bar)
                        evaluated += 1
                        trial = study.ask()
                        cid = candidate_id(trial.number)
                    if prepared.failure is not None:  # its worker died: this candidate fails alone
                        self._run_trial(study, trial, cid, proposal, failure=prepared.failure)
                    elif schedule is None:  # evaluate() records the build error as a rejected candidate
                        self._run_trial(study, trial, cid, proposal)
                    else:
                        self._run_trial(study, trial, cid, proposal, schedule, prepared.verdict)
                    evaluated += 1
        return evaluated

    def _reap(self, study: Any) -> None:
        """Trials left RUNNING by a killed process of this machine (its pid is gone) are marked FAIL, so they stop
        counting as in flight; their candidates are re-proposed by nobody and their partial files are ignored."""
        import optuna

        host = _pid().split(":")[0]
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            owner = str(t.user_attrs.get("pid", ""))
            h, _, pid = owner.partition(":")
            if not owner:  # killed between ask() and recording its owner: stale once it is old
                started = t.datetime_start.timestamp() if t.datetime_start else time.time()
                if time.time() - started < ORPHAN_AGE_S:
                    continue
            elif h != host or not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            except (ValueError, RuntimeError):
                continue
            self.cfg.notice(f"{candidate_id(t.number)}: its process ({owner}) is gone; marked failed")

    def _evaluate_baseline(self, study: Any, bar: Any) -> None:
        trials = study.get_trials(deepcopy=False)
        if not trials:
            self._tell_baseline(study, study.ask(), bar)
            return
        # Trial 0 exists but its files do not: a run killed during the baseline (or another process is on it).
        t0 = trials[0]
        if t0.state.name == "RUNNING" and t0.user_attrs.get("pid") != _pid() and \
                time.time() - t0.datetime_start.timestamp() < 600:
            return  # another live process is evaluating it
        res = self.evaluator.evaluate(BASELINE, baseline_proposal())
        self.standing.remember(res, (res.profile or {}).get("makespan_ms"))
        if t0.state.name == "RUNNING":
            import optuna

            try:
                study.tell(0, res.ms) if res.accepted else study.tell(0, state=optuna.trial.TrialState.FAIL)
            except (ValueError, RuntimeError):
                pass

    def _tell_baseline(self, study: Any, trial: Any, bar: Any) -> None:
        self._run_trial(study, trial, BASELINE, baseline_proposal())

    def _run_trial(self, study: Any, trial: Any, cid: str, proposal: Proposal, schedule: Schedule | None = None,
                   report: Verdict | None = None, failure: str | None = None) -> None:
        import optuna

        for key, value in (("candidate", cid), ("proposer", proposal.proposer), ("rationale", proposal.rationale),
                           ("parent", proposal.parent), ("pid", _pid()),
                           ("strategy", proposal.strategy.model_dump(mode="json")), ("patches", proposal.patches)):
            trial.set_user_attr(key, value)
        res = self.evaluator.evaluate(cid, proposal, schedule, report, failure)
        if res.accepted and res.ms is not None:
            study.tell(trial.number, res.ms)
        else:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        est = (res.profile or {}).get("makespan_ms")
        self.standing.remember(res, est)
        assert self.proposer is not None
        self.proposer.observe(res)
        if res.accepted:
            self.run.write_leaderboard()

    def summary(self, evaluated: int, seconds: float) -> SearchSummary:
        acc = self.run.accepted()
        screened = sum(status_of(r) == "screened" for r in self.run.rejected().values())
        best = min(acc.items(), key=lambda kv: kv[1]["ms"]) if acc else None
        return SearchSummary(self.run.path, evaluated, len(acc), len(self.run.rejected()) - screened,
                             best[0] if best else None, best[1]["ms"] if best else None,
                             acc.get(BASELINE, {}).get("ms"), not self.gpu, seconds, screened=screened,
                             best_by_proposer=self.run.best_per_proposer())


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


class _Progress:
    """A rich progress bar with the best so far (silent when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]search"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), transient=False)
        self.task = self.progress.add_task("", total=total)
        self.progress.start()

    def update(self, done: int, best: Result | None, baseline: float | None, estimated: bool) -> None:
        if not self.enabled:
            return
        text = ""
        if best is not None and best.ms is not None:
            text = f"best {best.candidate} {best.ms:.4f} ms" + (" (estimated)" if estimated else "")
            if baseline:
                text += f"  {baseline / best.ms:.2f}x vs naive"
        self.progress.update(self.task, completed=done, description=text)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def run_search(cfg: SearchConfig) -> SearchSummary:
    """Run (or resume, or join) a search; returns what this run folder holds at the end."""
    return Search(cfg).run_loop()
