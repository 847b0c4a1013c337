"""The search loop: propose -> lower -> patch -> validate -> time (GPU) or estimate (cost model) -> runs/<run>/.

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

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from synth.lowering.costmodel import CostParams, Estimate, estimate, load_params
from synth.lowering.lower import lower
from synth.lowering.models import get_model
from synth.lowering.patches import apply_patches
from synth.lowering.strategy import Strategy, parse_strategy
from synth.runs.rundir import BASELINE, RunDir, candidate_id, schedule_key
from synth.search.proposers.base import Proposal, Proposer, Result, SearchContext
from validator.errors import ScheduleError
from validator.schedule import Schedule, parse_schedule
from validator.verify import Options, Report, verify

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

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.baseline_ms:
            return self.baseline_ms / self.best_ms
        return None


# --------------------------------------------------------------------------------------------------------------
# Proposers


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


# --------------------------------------------------------------------------------------------------------------
# Timing


def cuda_available() -> bool:
    """True when torch sees a CUDA device (torch is imported only to ask; triton never is on a CPU)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def default_workers() -> int:
    """The GPU's SM count when CUDA is present, else 132 (an H100/H200)."""
    if cuda_available():
        import torch

        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return 132


class GpuTimer:
    """Times schedules on the persistent interpreter (one compiled kernel; each schedule is new tables). Every timed
    schedule's logits are first compared with the naive schedule's at the same position (a kernel bug in a new
    tiling shows up here, not in the leaderboard)."""

    TOLERANCE = 2e-2  # relative L2 of the logits (bf16 weights, different reduction orders)

    def __init__(self, schedule: Schedule, ctx: int, reps: int = 50, seed: int = 0) -> None:
        import torch

        from kernels.gpu import Megakernel
        from kernels.weights import weight_shapes
        from validator.model import ModelConfig

        assert schedule.model is not None
        cfg = ModelConfig.from_hf(schedule.model.config)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        weights: dict[str, Any] = {}
        for name, shape in weight_shapes(cfg).items():  # the scaling of kernels.weights.random_weights, on the GPU
            if len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device="cuda")
            elif name == "embed" and cfg.tie_word_embeddings:
                t = torch.randn(shape, generator=gen, device="cuda") / math.sqrt(cfg.hidden_size)
            elif name == "embed":
                t = torch.randn(shape, generator=gen, device="cuda")
            else:
                t = torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1])
            weights[name] = t.to(torch.bfloat16)
        if cfg.tie_word_embeddings:
            weights["lm_head"] = weights["embed"]
        self.mk = Megakernel(schedule, weights)
        self.mk.k_cache.normal_(generator=gen)  # a random KV history: attention reads real data
        self.mk.v_cache.normal_(generator=gen)
        self.ctx, self.reps = ctx, reps
        self.token = 7
        self.device = torch.cuda.get_device_name(0)
        self.reference = self._logits(schedule)

    def _logits(self, schedule: Schedule) -> Any:
        self.mk.set_schedule(schedule)
        return self.mk.step(self.token, self.ctx - 1).float().clone()

    def check(self, schedule: Schedule) -> float:
        """Relative L2 distance of this schedule's logits from the naive schedule's."""
        got = self._logits(schedule)
        return float((got - self.reference).norm() / self.reference.norm())

    def time(self, schedule: Schedule) -> dict[str, Any]:
        from kernels.gpu import time_schedule

        out = time_schedule(self.mk, schedule, self.ctx, reps=self.reps)
        return {**out, "ms": out["median_ms"], "estimated": False, "source": f"GPU ({self.device})"}

    def trace(self, schedule: Schedule) -> dict[str, Any] | None:
        try:
            from kernels.trace import schedule_sha256

            self.mk.set_schedule(schedule)
            meta = {"model": schedule.model.name if schedule.model else None,
                    "schedule_sha256": schedule_sha256(schedule.to_json())}
            return self.mk.traced_step(self.token, self.ctx - 1, meta)
        except Exception as exc:  # noqa: BLE001 - a trace is evidence, not a result: say why it is missing
            print(f"note: no GPU trace for the best schedule: {exc}", file=sys.stderr)
            return None


# --------------------------------------------------------------------------------------------------------------
# The loop


def _profile(est: Estimate, keep_trace: bool) -> dict[str, Any]:
    out: dict[str, Any] = {**est.summary(), "critical_path": est.critical_path}
    if keep_trace:
        out["trace"] = est.trace
    return out


def _findings_json(report: Report) -> dict[str, Any]:
    data = report.to_json()
    data["findings"] = data["findings"][:5]
    return data


class _Verdict:
    """A validator report carried back from a worker process as JSON (what `evaluate` reads of a `Report`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.accepted = data.get("verdict") == "accepted"

    def to_json(self) -> dict[str, Any]:
        return self.data


def _prepare(model: str, workers: int, proposal: Proposal, interleavings: int, seed: int
             ) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None]:
    """Worker process: lower + patch + validate one proposal. Returns (schedule JSON, build error, report JSON)."""
    search = Search.__new__(Search)
    search.spec = get_model(model)
    search.workers = workers
    try:
        schedule = search.build(proposal)
    except (ScheduleError, ValueError) as exc:
        return None, str(exc), None
    report = verify(schedule, None, Options(interleavings=interleavings, seed=seed))
    return schedule.to_json(), None, report.to_json()


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
        self.timer: GpuTimer | None = None
        self.history: list[Result] = []
        self.best: Result | None = None
        self.best_est: float | None = None
        self.baseline_ms: float | None = None
        self.proposer: Proposer | None = None
        self.keys: dict[str, str] = {}  # schedule_key -> the candidate that has it
        self.results: dict[str, Result] = {}

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
            self._remember(res, t.get("estimate_ms"))
            if t.get("schedule_key"):
                self.keys.setdefault(t["schedule_key"], cid)
        for cid, r in self.run.rejected().items():
            try:
                st = parse_strategy(r.get("strategy", {}))
            except ScheduleError:
                continue
            prop = Proposal(st, list(r.get("patches", [])), r.get("rationale", ""), r.get("proposer", ""),
                            r.get("parent"))
            self.history.append(Result(cid, prop, False, error=r.get("error"), counterexample=r.get("findings")))
            if r.get("schedule_key") and r.get("reason") != "screened":
                self.keys.setdefault(r["schedule_key"], cid)

    def _remember(self, res: Result, est_ms: float | None) -> None:
        self.history.append(res)
        self.results[res.candidate] = res
        if res.candidate == BASELINE:
            self.baseline_ms = res.ms
        if res.accepted and res.ms is not None and (self.best is None or res.ms < (self.best.ms or math.inf)):
            self.best = res
        if est_ms is not None and (self.best_est is None or est_ms < self.best_est):
            self.best_est = est_ms

    def context(self) -> SearchContext:
        return SearchContext(self.cfg.model, self.workers, self.timer.device if self.timer else "cost model (CPU)",
                             self.best, self.history, self.baseline_ms, not self.gpu)

    # -- one candidate -------------------------------------------------------------------------------------------
    def build(self, proposal: Proposal) -> Schedule:
        schedule = lower(self.spec, self.workers, proposal.strategy, proposal.proposer or "naive")
        schedule = apply_patches(schedule, proposal.patches)
        schedule.meta.update({"proposer": proposal.proposer or "naive", "parent": proposal.parent,
                              "rationale": proposal.rationale})
        return schedule

    def evaluate(self, cid: str, proposal: Proposal, schedule: Schedule | None = None,
                 report: Report | _Verdict | None = None) -> Result:
        """Lower, patch, validate, time or estimate one proposal and write it to the run folder."""
        cfg = self.cfg
        t0 = time.perf_counter()
        record: dict[str, Any] = {"candidate": cid, "proposer": proposal.proposer, "parent": proposal.parent,
                                  "rationale": proposal.rationale,
                                  "strategy": proposal.strategy.model_dump(mode="json"), "patches": proposal.patches,
                                  "estimated": not self.gpu}
        try:
            schedule = schedule or self.build(proposal)
        except (ScheduleError, ValueError) as exc:
            record.update(reason="malformed", error=str(exc))
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, error=str(exc))
        record["schedule_key"] = key = schedule_key(schedule)
        self.keys.setdefault(key, cid)
        try:
            est = estimate(schedule, cfg.ctx, self.params)
        except ValueError as exc:  # deadlock: the validator says it precisely
            est = None
            record["estimate_error"] = str(exc)
        if (self.gpu and est is not None and self.best_est is not None and cid != BASELINE
                and est.makespan_ms > cfg.prescreen * self.best_est):
            record.update(reason="screened", error=f"estimate {est.makespan_ms:.4f} ms is over {cfg.prescreen}x the "
                          f"best estimate {self.best_est:.4f} ms; not validated or timed")
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, error=record["error"])
        if report is None:
            report = verify(schedule, cid, Options(interleavings=cfg.interleavings, seed=cfg.seed))
        validation = {**report.to_json(), "interleavings": cfg.interleavings}
        if not report.accepted:
            data = _findings_json(report)
            record.update(reason="rejected", findings=data["findings"], validation=data,
                          seconds=round(time.perf_counter() - t0, 3))
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, counterexample={"findings": data["findings"]})
        if self.gpu:
            if self.timer is None:
                self.timer = GpuTimer(self.build(_baseline_proposal()), cfg.ctx)
            try:
                err = self.timer.check(schedule)
                timing = self.timer.time(schedule) if err <= GpuTimer.TOLERANCE else {}
            except Exception as exc:  # noqa: BLE001 - a watchdog hang or a kernel limit: keep it as evidence
                record.update(reason="gpu_error", error=f"{type(exc).__name__}: {exc}"[:2000], validation=validation)
                self.run.save_rejected(cid, record)
                cfg.notice(f"{cid}: the GPU run failed: {record['error'][:200]}")
                return Result(cid, proposal, False, error=record["error"])
            if not err <= GpuTimer.TOLERANCE:
                record.update(reason="gpu_mismatch", error=f"logits differ from the naive schedule's by {err:.3g} "
                              f"(relative L2 > {GpuTimer.TOLERANCE}): a kernel bug for this schedule",
                              validation=validation)
                self.run.save_rejected(cid, record)
                return Result(cid, proposal, False, error=record["error"])
            timing["check_rel_l2"] = err
        else:
            assert est is not None
            timing = {"ms": est.makespan_ms, "estimated": True, "source": f"cost model ({self.params.source})"}
        if est is not None:
            timing["estimate"] = est.summary()
            timing["estimate_ms"] = est.makespan_ms
            timing["critical_path"] = est.critical_path
        timing.update({k: record[k] for k in ("proposer", "parent", "rationale", "strategy", "patches",
                                              "schedule_key")})
        timing.update(ctx=cfg.ctx, workers=self.workers, seconds=round(time.perf_counter() - t0, 3))
        if self.baseline_ms:
            timing["speedup_vs_naive"] = round(self.baseline_ms / timing["ms"], 4)
        self.run.save_candidate(cid, schedule, validation, timing)
        res = Result(cid, proposal, True, timing["ms"], not self.gpu,
                     profile=_profile(est, keep_trace=False) if est is not None else None)
        if self.best is None or timing["ms"] < (self.best.ms or math.inf):
            full = self._promote(cid, schedule, timing, est, res)
            if full is not None:  # the full interleaving count found what the shorter replay missed: demote it
                import shutil

                data = _findings_json(full)
                record.update(reason="rejected", findings=data["findings"], validation=data)
                self.run.save_rejected(cid, record)
                shutil.rmtree(self.run.path / "candidates" / cid, ignore_errors=True)
                return Result(cid, proposal, False, counterexample={"findings": data["findings"]})
        return res

    def _promote(self, cid: str, schedule: Schedule, timing: dict[str, Any], est: Estimate | None,
                 res: Result) -> Report | None:
        """A new best: re-validate with the full interleaving count, then write best/. Returns the report when that
        re-validation rejects the candidate (it is then not promoted)."""
        cfg = self.cfg
        full = verify(schedule, cid, Options(interleavings=cfg.final_interleavings, seed=cfg.seed))
        if not full.accepted:
            cfg.notice(f"{cid}: accepted with {cfg.interleavings} interleavings but rejected with "
                       f"{cfg.final_interleavings}; not promoted")
            return full
        on_disk = self.run.best_ms()
        if on_disk is not None and on_disk <= timing["ms"] and (self.run.path / "best" / "schedule.json").exists():
            return None  # another process sharing the run found a better one
        trace = self.timer.trace(schedule) if self.timer else (est.trace if est else None)
        validation = {**full.to_json(), "interleavings": cfg.final_interleavings}
        self.run.save_best(cid, schedule, validation, timing, trace)
        if est is not None:
            res.profile = _profile(est, keep_trace=True)
        if self.best is not None and self.best.profile:
            self.best.profile.pop("trace", None)
        return None

    # -- the loop ----------------------------------------------------------------------------------------------
    def run_loop(self) -> SearchSummary:
        cfg = self.cfg
        t_start = time.monotonic()
        self.run.init({"model": cfg.model, "seed": cfg.seed, "workers": self.workers, "ctx": cfg.ctx,
                       "proposer": cfg.proposer, "budget": cfg.budget, "storage": cfg.storage or "study.db",
                       "interleavings": {"search": cfg.interleavings, "best": cfg.final_interleavings},
                       "gpu": _gpu_name() if self.gpu else None, "estimated": not self.gpu,
                       "cost_model": self.params.source})
        study = self._study()
        self._reap(study)
        self._load_history()
        self.proposer = resolve_proposer(cfg.proposer, cfg.model, self.workers, cfg.seed, self.run.path, cfg.notice,
                                         **{"seq": cfg.ctx, **cfg.llm})
        for r in self.history:
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
                bar.update(done, self.best, self.baseline_ms, not self.gpu)
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
                    built: Schedule | None = self.build(proposal)
                except (ScheduleError, ValueError):
                    built = None  # evaluate() records why, as a rejected candidate
                if built is not None and (same := self.keys.get(schedule_key(built))) is not None:
                    # The same schedule as an earlier candidate: tell the proposer, spend no trial on it.
                    dups += 1
                    if dups > MAX_DUPLICATES:
                        cfg.notice(f"{MAX_DUPLICATES} proposals repeated earlier schedules; stopping")
                        break
                    old = self.results.get(same)
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
        import concurrent.futures as cf
        import multiprocessing

        cfg = self.cfg
        assert self.proposer is not None
        evaluated = empty_rounds = dups = 0
        queue: list[Proposal] = []
        inflight: dict[cf.Future[Any], Proposal] = {}
        stop = False
        with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            while True:
                done = len(study.get_trials(deepcopy=False))
                bar.update(done, self.best, self.baseline_ms, not self.gpu)
                if cfg.time_limit is not None and time.monotonic() - t_start > cfg.time_limit and not stop:
                    cfg.notice(f"time limit of {cfg.time_limit:g} s reached")
                    stop = True
                while not stop and len(inflight) < jobs and done + len(inflight) < cfg.budget:
                    if not queue:
                        queue = list(self.proposer.propose(self.context(), max(cfg.batch, jobs)))
                        if not queue:
                            empty_rounds += 1
                            if empty_rounds >= MAX_EMPTY_ROUNDS and not inflight:
                                cfg.notice(f"the proposer had nothing new for {MAX_EMPTY_ROUNDS} rounds; stopping")
                                stop = True
                            break
                        empty_rounds = 0
                    proposal = queue.pop(0)
                    fut = pool.submit(_prepare, cfg.model, self.workers, proposal, cfg.interleavings, cfg.seed)
                    inflight[fut] = proposal
                if not inflight:
                    if stop or done >= cfg.budget or empty_rounds >= MAX_EMPTY_ROUNDS:
                        break
                    continue
                finished, _ = cf.wait(list(inflight), return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    proposal = inflight.pop(fut)
                    doc, error, report = fut.result()
                    schedule = parse_schedule(doc) if doc is not None else None
                    if schedule is not None and (same := self.keys.get(schedule_key(schedule))) is not None:
                        dups += 1
                        old = self.results.get(same)
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
                    if schedule is None:  # evaluate() records the build error as a rejected candidate
                        self._run_trial(study, trial, cid, proposal)
                    else:
                        self._run_trial(study, trial, cid, proposal, schedule,
                                        _Verdict(report) if report is not None else None)
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
        res = self.evaluate(BASELINE, _baseline_proposal())
        self._remember(res, (res.profile or {}).get("makespan_ms"))
        if t0.state.name == "RUNNING":
            import optuna

            try:
                study.tell(0, res.ms) if res.accepted else study.tell(0, state=optuna.trial.TrialState.FAIL)
            except (ValueError, RuntimeError):
                pass

    def _tell_baseline(self, study: Any, trial: Any, bar: Any) -> None:
        self._run_trial(study, trial, BASELINE, _baseline_proposal())

    def _run_trial(self, study: Any, trial: Any, cid: str, proposal: Proposal, schedule: Schedule | None = None,
                   report: _Verdict | None = None) -> None:
        import optuna

        for key, value in (("candidate", cid), ("proposer", proposal.proposer), ("rationale", proposal.rationale),
                           ("parent", proposal.parent), ("pid", _pid()),
                           ("strategy", proposal.strategy.model_dump(mode="json")), ("patches", proposal.patches)):
            trial.set_user_attr(key, value)
        res = self.evaluate(cid, proposal, schedule, report)
        if res.accepted and res.ms is not None:
            study.tell(trial.number, res.ms)
        else:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        est = (res.profile or {}).get("makespan_ms")
        self._remember(res, est)
        assert self.proposer is not None
        self.proposer.observe(res)
        if res.accepted:
            self.run.write_leaderboard()

    def summary(self, evaluated: int, seconds: float) -> SearchSummary:
        acc = self.run.accepted()
        rej = self.run.rejected()
        best = min(acc.items(), key=lambda kv: kv[1]["ms"]) if acc else None
        return SearchSummary(self.run.path, evaluated, len(acc), len(rej), best[0] if best else None,
                             best[1]["ms"] if best else None, acc.get(BASELINE, {}).get("ms"), not self.gpu, seconds)


def _gpu_name() -> str:
    import torch

    return str(torch.cuda.get_device_name(0))


def _baseline_proposal() -> Proposal:
    return Proposal(Strategy(), [], "the naive baseline: round-robin, one all-join counter per stage", "naive")


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
