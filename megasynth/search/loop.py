"""The search loop: propose -> lower -> patch -> validate -> time (GPU) or estimate (cost model) -> runs/<run>/.

This module is the loop and its bookkeeping (the study, resume, the baseline, duplicates, stopping, progress); its
settings are `megasynth.search.config`, one candidate's evaluation is `megasynth.search.evaluate`, the worker processes
of `--jobs` are `megasynth.search.pool`, the claims that split the work between processes are `megasynth.runs.study`
(with the proposal keys and the Optuna study of `megasynth.search.claims`), and the proposers' selection is
`megasynth.search.proposers.auto`.

Every candidate is a claim of the study (SQLite `runs/<run>/study.db` by default, any SQLAlchemy URL with `storage`,
e.g. PostgreSQL) and, once done, an Optuna trial; several processes or machines work one study. A process claims a
slot (the candidate id: slot 7 is `c0007`) and the proposal before it lowers it, and the schedule's key before it
validates it, so the budget is exact and no schedule is evaluated twice; the proposers see every process's outcomes.
Candidate `c0000` is always the naive baseline, so speed-ups are measured side by side. Rejected candidates are kept
with the validator's counterexample (`rejected/<id>.json`). On a GPU (CUDA present) the cost model pre-screens and the
accepted candidates are timed on the persistent interpreter; on a CPU they are estimated and labelled `estimated`.

Validation during the search replays `interleavings` adversarial executions per candidate (default 200, on top of the
full race proof); a candidate that becomes the best is re-validated with `final_interleavings` (default 1000) before
it is written to best/. On a GPU the search ends with finals (`search.finals`): the fastest few timed again side by
side, and best/ gets the winner.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import Schedule
from megasynth.kernels.gpu.timing import GpuHangError
from megasynth.lowering.costmodel import load_params
from megasynth.lowering.models import get_model, with_batch
from megasynth.lowering.strategy import parse_strategy
from megasynth.runs.rundir import BASELINE, RunDir, candidate_id, schedule_key, status_of
from megasynth.runs.study import Claims, StorageError, shown, study_name, without_password
from megasynth.search.claims import ScheduleClaim, SharedStudy, open_study, proposal_key
from megasynth.search.config import SearchConfig, available_cores, default_jobs
from megasynth.search.evaluate import (
    Evaluator,
    Standing,
    baseline_proposal,
    cuda_available,
    default_workers,
    gpu_name,
)
from megasynth.search.finals import run_finals
from megasynth.search.interrupts import InterruptWatch
from megasynth.search.pool import Pool, Prepared
from megasynth.search.proposers.auto import check_proposer, close_proposer, resolve_proposer
from megasynth.search.proposers.base import Proposal, Proposer, Result, SearchContext

MAX_EMPTY_ROUNDS = 5  # proposer rounds with no new proposal before the search stops
MAX_DUPLICATES = 500  # proposals held elsewhere or repeating an evaluated schedule, per process, before it stops
POLL_S = 0.5  # between looks at the study while every slot is taken and some are still being evaluated elsewhere
STOP, WAIT = "stop", "wait"


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
    finals: dict[str, Any] | None = None  # finals.json when best/ holds its winner (`search.finals`)

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.baseline_ms:
            return self.baseline_ms / self.best_ms
        return None


def result_from_outcome(cid: str, doc: dict[str, Any]) -> tuple[Result, float | None] | None:
    """A candidate's outcome (`RunDir.outcome`, as the study keeps it) as the proposers' `Result`, with its cost-model
    estimate; None when its strategy no longer parses."""
    rec = doc.get("record") or {}
    try:
        st = parse_strategy(rec.get("strategy", {}))
    except ScheduleError:
        return None
    prop = Proposal(st, list(rec.get("patches", [])), rec.get("rationale", ""), rec.get("proposer", ""),
                    rec.get("parent"))
    if doc.get("accepted"):
        return (Result(cid, prop, True, rec["ms"], bool(rec.get("estimated", True)),
                       profile={"critical_path": rec.get("critical_path", [])}), rec.get("estimate_ms"))
    screened = rec.get("estimate_ms") if rec.get("reason") == "screened" else None
    return Result(cid, prop, False, error=rec.get("error"), counterexample=rec.get("findings"),
                  screened=screened), None


# --------------------------------------------------------------------------------------------------------------
# The loop


class Search:
    """One process's part of a search (see module docstring)."""

    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self.interrupts = InterruptWatch()
        # like every check here, before the run folder exists: a search refused leaves none
        check_proposer(cfg.proposer, **cfg.llm)
        self.spec = with_batch(get_model(cfg.model, cfg.max_seq_len), cfg.sequences)
        self.gpu = cuda_available() if cfg.gpu is None else cfg.gpu
        self.workers = cfg.workers or default_workers()
        self.params = cfg.cost_params or load_params()
        if cfg.resume:
            if not cfg.run:
                raise ValueError("--resume needs the run name")
            path = cfg.runs_dir / cfg.run
            if not (path / "run.json").exists() and cfg.storage is None:
                raise ValueError(f"cannot resume {path}: it has no run.json")
        else:
            path = cfg.runs_dir / (cfg.run or RunDir.new_name(cfg.model, cfg.seed))
        self.run = RunDir(path)
        if cfg.resume and (path / "run.json").exists():
            info = self.run.info
            if info.get("model") != cfg.model:
                raise ValueError(f"run {path} is for model {info.get('model')!r}, not {cfg.model!r}")
            if info.get("max_seq_len") is not None and info["max_seq_len"] != self.spec.max_seq_len:
                if cfg.max_seq_len is not None:
                    raise ValueError(f"run {path} is for max_seq_len {info['max_seq_len']}, not {cfg.max_seq_len}")
                self.spec = with_batch(get_model(cfg.model, int(info["max_seq_len"])), self.spec.batch)
            if int(info.get("batch", 1)) != self.spec.batch:
                if cfg.sequences != 1:
                    raise ValueError(f"run {path} is for --batch {info.get('batch', 1)}, not {cfg.sequences}")
                self.spec = with_batch(self.spec, int(info["batch"]))
            theirs = info.get("workers")
            if theirs is not None and cfg.workers is not None and int(theirs) != cfg.workers:
                raise ValueError(f"run {path} is for --workers {theirs}, not {cfg.workers}")
            self.workers = int(theirs) if theirs is not None else self.workers
        self.standing = Standing()
        self.evaluator = Evaluator(cfg, self.spec, self.workers, self.gpu, self.params, self.run, self.standing)
        self.proposer: Proposer | None = None
        self.shared: SharedStudy | None = None
        self.known: set[int] = set()  # slots whose outcome this process has seen
        self.queue: list[Proposal] = []
        # proposals skipped while another process was evaluating them: tried again when the proposer has nothing
        # new (if that process dies, its claim is freed and nobody else would propose them again)
        self.deferred: list[Proposal] = []
        self.evaluated = self.dups = self.empty_rounds = 0
        self.stopping = False

    # -- the study --------------------------------------------------------------------------------------------
    @property
    def claims(self) -> Claims:
        assert self.shared is not None, "the study is opened by run_loop"
        return self.shared.claims

    def _open(self) -> None:
        """Open the study and its claims, and agree with the processes already on it about the run's settings."""
        cfg = self.cfg
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ValueError("the search keeps its study in Optuna, which is not installed here (pip install optuna, "
                             "or carry its wheels to the GPU machine)") from None
        if cfg.storage is None:
            self.run.path.mkdir(parents=True, exist_ok=True)
        url = cfg.storage or f"sqlite:///{(self.run.path / 'study.db').resolve()}"
        self.shared = open_study(url, study_name(self.run.path.name))
        name = self.run.path.name
        if cfg.resume and not (self.run.path / "run.json").exists() and self.claims.info() is None:
            raise ValueError(f"cannot resume {self.run.path}: it has no run.json, and {shown(url)} has no run {name}")
        theirs = self.claims.settle_info({"model": cfg.model, "workers": self.workers, "ctx": cfg.ctx,
                                          "max_seq_len": self.spec.max_seq_len, "batch": self.spec.batch})
        if theirs.get("batch", 1) != self.spec.batch:
            raise ValueError(f"run {name} in {shown(url)} is for --batch {theirs.get('batch', 1)}, not "
                             f"{self.spec.batch}")
        if theirs.get("model") != cfg.model:
            raise ValueError(f"run {name} in {shown(url)} is for model {theirs.get('model')!r}, not {cfg.model!r}")
        if theirs.get("max_seq_len", self.spec.max_seq_len) != self.spec.max_seq_len:
            raise ValueError(f"run {name} in {shown(url)} is for --max-seq-len {theirs['max_seq_len']}, not "
                             f"{self.spec.max_seq_len}")
        if theirs.get("ctx") != cfg.ctx:
            raise ValueError(f"run {name} in {shown(url)} estimates at --ctx {theirs.get('ctx')}, not {cfg.ctx}")
        if theirs.get("workers") != self.workers:
            if cfg.workers is not None:  # (left out, it is this machine's SM count: the run's wins)
                raise ValueError(f"run {name} in {shown(url)} is for --workers {theirs.get('workers')}, not "
                                 f"{cfg.workers}")
            self.workers = self.evaluator.workers = int(theirs["workers"])

    def _adopt(self) -> None:
        """A study or run folder made before claims existed: record its candidates as done claims (slot = candidate
        id), so that their ids are not reused and their schedules are not evaluated again."""
        assert self.shared is not None
        if not self.claims.empty():
            return
        numbers = {t.number for t in self.shared.study.get_trials(deepcopy=False)}
        on_disk = {int(c[1:]) for c in (*self.run.accepted(), *self.run.rejected()) if c[1:].isdigit()}
        rows: list[dict[str, Any]] = []
        pkeys: set[str] = set()
        skeys: set[str] = set()
        for n in sorted(numbers | on_disk):
            doc = self.run.outcome(candidate_id(n))
            got = result_from_outcome(candidate_id(n), doc) if doc else None
            pk = proposal_key(got[0].proposal) if got else f"legacy:{n}"
            pk = pk if pk not in pkeys else f"legacy:{n}"
            rec = doc["record"] if doc else {}
            sk = rec.get("schedule_key") if rec.get("reason") != "screened" else None
            sk = sk if sk not in skeys else None
            pkeys.add(pk)
            if sk:
                skeys.add(sk)
            rows.append({"slot": n, "proposal_key": pk, "schedule_key": sk, "result": json.dumps(doc) if doc else None,
                         "trial": n if n in numbers else None})
        if rows and self.claims.adopt(rows):
            self.cfg.notice(f"{len(rows)} candidates made before claims existed are now claims of the study")

    def _sync(self) -> int:
        """Learn the outcomes other processes recorded since the last look (proposers see the whole study, not only
        this process's candidates). Returns the number of candidates done under the budget."""
        assert self.proposer is not None
        done = self.claims.done()
        new = done - self.known
        for slot, doc in sorted(self.claims.results(new).items()):
            cid = candidate_id(slot)
            got = result_from_outcome(cid, doc) if cid not in self.standing.results else None
            if got is not None:
                self.standing.remember(*got)
                key = (doc.get("record") or {}).get("schedule_key")
                if key:
                    self.standing.keys.setdefault(key, cid)
                self.proposer.observe(got[0])
        self.known |= new
        return sum(1 for s in done if s < self.cfg.budget)

    def _reap(self) -> None:
        """Free the claims of processes that are gone, and record the Optuna trials of outcomes they left
        unrecorded."""
        assert self.shared is not None
        for slot, owner, salvaged in self.claims.reap(self.cfg.lease_s, 3 * self.cfg.heartbeat_s, self._salvage):
            self.cfg.notice(f"{candidate_id(slot)}: its process ({owner}) is gone; " + (
                "its files were complete, so it counts" if salvaged else "the slot is free again"))
        for slot, owner, doc in self.claims.orphans(self.cfg.lease_s):
            cid = candidate_id(slot)
            done = [t.number for t in self.shared.study.get_trials(deepcopy=False)
                    if t.user_attrs.get("candidate") == cid and t.user_attrs.get("pid") == owner]
            self.claims.set_trial(slot, done[0] if done else self.shared.add_trial(cid, doc, owner))

    def _salvage(self, slot: int, key: str | None) -> dict[str, Any] | None:
        """The outcome a process that died holding `slot` left complete in this run folder (timing.json or
        rejected/<id>.json is written last), when it is that claim's schedule; else None."""
        doc = self.run.outcome(candidate_id(slot))
        return doc if doc is not None and key and doc["record"].get("schedule_key") == key else None

    def context(self) -> SearchContext:
        timer, st = self.evaluator.timer, self.standing
        return SearchContext(self.cfg.model, self.workers, timer.device if timer else "cost model (CPU)",
                             st.best, st.history, st.baseline_ms, not self.gpu)

    # -- claims -------------------------------------------------------------------------------------------------
    def _next_claim(self, batch: int, busy: bool = False) -> tuple[int, Proposal] | str:
        """The next proposal this process holds a slot for, as (slot, proposal); WAIT when every slot under the
        budget is taken but some are still being evaluated (by this or another process); STOP when the budget is
        spent or the proposers have nothing new. Proposals another process holds or finished are skipped (one
        query each: they are not lowered)."""
        cfg = self.cfg
        assert self.proposer is not None
        retrying = False
        while not self.stopping:
            if BASELINE not in self.standing.results:  # slot 0 is the naive baseline, whoever takes it
                base = baseline_proposal()
                got = self.claims.claim(proposal_key(base), range(0, 1))
                if got.slot is not None:
                    return got.slot, base
            if not self.queue:
                if sum(self.claims.count(cfg.budget)) >= cfg.budget:  # no slot to fill: do not ask the proposer
                    return self._when_full()
                self._sync()
                self.queue = list(self.proposer.propose(self.context(), batch))
                if not self.queue and self.deferred:
                    self.queue, self.deferred = self.deferred, []
                    retrying = True
                if not self.queue:
                    if not busy:
                        self._reap()  # (a process that died holding a claim must not keep this one waiting)
                    if busy or self.claims.count(cfg.budget)[1] > 0:
                        # candidates are still being evaluated (here or by another process): a proposer that waits
                        # for their measurements (the descent's hill climbing) gets another turn once they are in
                        return WAIT
                    self.empty_rounds += 1
                    if self.empty_rounds >= MAX_EMPTY_ROUNDS:
                        cfg.notice(f"the proposer had nothing new for {MAX_EMPTY_ROUNDS} rounds; stopping")
                        self.stopping = True
                    continue
                self.empty_rounds = 0
            got = self.claims.claim(proposal_key(self.queue[0]), range(1, cfg.budget))
            if got.slot is not None:
                return got.slot, self.queue.pop(0)
            if got.holder is not None:  # another process holds or finished this proposal: the next one
                skipped = self.queue.pop(0)
                if got.holder not in self.claims.done():
                    self.deferred.append(skipped)
                    if retrying and not self.queue:  # every deferred one is still held: let them finish
                        if not busy:
                            self._reap()  # (unless their process is gone: then their claims are free again)
                        return WAIT
                else:
                    self._repeated()
                continue
            return self._when_full()
        return STOP

    def _when_full(self) -> str:
        """Every slot under the budget is taken: STOP when all are done, else WAIT for the running ones (after
        taking over those of processes that are gone)."""
        self._reap()
        done, _running = self.claims.count(self.cfg.budget)
        return WAIT if done < self.cfg.budget else STOP

    def _repeated(self) -> None:
        self.dups += 1
        if self.dups > MAX_DUPLICATES and not self.stopping:
            self.cfg.notice(f"{MAX_DUPLICATES} proposals were held elsewhere or repeated earlier schedules; stopping")
            self.stopping = True

    def _evaluate(self, slot: int, proposal: Proposal, prepared: Prepared | None = None) -> None:
        """Evaluate a claimed proposal (lowering it here unless a pool worker did) and record its outcome; a schedule
        that another claim already has gives the slot back instead."""
        cid = candidate_id(slot)
        self.run.discard(cid)  # files a process that died holding this slot may have left
        schedule: Schedule | None = None
        if prepared is None:
            try:
                schedule = self.evaluator.build(proposal)
            except (ScheduleError, ValueError):
                schedule = None  # evaluate() records why, as a rejected candidate
            holder = self.claims.claim_schedule(slot, schedule_key(schedule)) if schedule is not None else None
        else:
            schedule, holder = prepared.schedule, prepared.duplicate_of
        if holder is not None:  # the same schedule as another claim's: tell the proposer, spend no candidate on it
            self.claims.release(slot)
            self._repeated()
            old = self.standing.results.get(same := candidate_id(holder))
            assert self.proposer is not None  # (told even before `same` has an outcome: a proposer waiting for every
            # proposal it made to come back, as the descent does, must not wait for this one)
            self.proposer.observe(Result(same, proposal, old.accepted if old else False, old.ms if old else None,
                                         not self.gpu, error=f"the same schedule as {same}"))
            return
        res = self.evaluator.evaluate(cid, proposal, schedule, prepared.verdict if prepared else None,
                                      prepared.failure if prepared else None)
        self._finish(slot, res)

    def _finish(self, slot: int, res: Result) -> None:
        """Record an outcome: the claim (done, with the candidate's files as JSON), then the Optuna trial."""
        assert self.shared is not None and self.proposer is not None
        cid = candidate_id(slot)
        doc = self.run.outcome(cid) or {"accepted": False, "record": {"candidate": cid, "error": res.error},
                                        "validation": None}
        screened = doc["record"].get("reason") == "screened"  # not validated: its schedule may be tried again
        if not self.claims.finish(slot, doc, keep_schedule_key=not screened):
            self.cfg.notice(f"{cid}: this process was silent for over {self.cfg.lease_s:g} s and another process took "
                            "the slot; this outcome is not recorded in the study")
            return
        self.claims.set_trial(slot, self.shared.add_trial(cid, doc, self.claims.owner))
        self.known.add(slot)
        self.evaluated += 1
        self.standing.remember(res, (res.profile or {}).get("makespan_ms"))
        self.proposer.observe(res)
        if res.accepted:
            self.run.write_leaderboard()

    # -- the loop ----------------------------------------------------------------------------------------------
    def run_loop(self) -> SearchSummary:
        """Run this process's part of the search. Ctrl-C (SIGINT to the terminal's process group) reaches this
        process alone: the worker processes it starts never get it (`interrupts.interrupts_held`) and are stopped by it,
        so a KeyboardInterrupt here is one clean stop (claims given back, leaderboard written); `InterruptWatch`
        makes sure one comes even where Python swallows the first."""
        with self.interrupts:
            return self._run_loop()

    def _run_loop(self) -> SearchSummary:
        cfg = self.cfg
        t_start = time.monotonic()
        self._open()
        self.run.init({"model": cfg.model, "max_seq_len": self.spec.max_seq_len, "batch": self.spec.batch,
                       "seed": cfg.seed,
                       "workers": self.workers, "ctx": cfg.ctx,
                       "proposer": cfg.proposer, "budget": cfg.budget,
                       "storage": without_password(cfg.storage) if cfg.storage else "study.db",
                       "interleavings": {"search": cfg.interleavings, "best": cfg.final_interleavings},
                       "gpu": gpu_name() if self.gpu else None, "estimated": not self.gpu,
                       "cost_model": self.params.source})
        self._adopt()
        # the descent's cost-model processes: every usable core (its first stage runs while the pool has at most the
        # seeds to validate, so the cores would otherwise idle)
        jobs = min(16, available_cores())
        bar = _Progress(cfg.budget, cfg.progress, sys.stderr.isatty())
        self.proposer = resolve_proposer(cfg.proposer, self.spec, self.workers, cfg.seed, self.run.path, cfg.notice,
                                         ctx=cfg.ctx, params=self.params, jobs=jobs, progress=bar.message,
                                         **{"seq": cfg.ctx, **cfg.llm})
        self._reap()
        self._catch_up_best()
        self.claims.start_heartbeat(cfg.heartbeat_s)
        try:
            jobs = cfg.jobs if cfg.jobs is not None else default_jobs(self.gpu)
            if jobs > 1:
                self._run_parallel(bar, jobs, t_start)
            else:
                self._run_sequential(bar, t_start)
            self._reap()  # record the trials of outcomes whose process died before it could
            self._catch_up_best()  # ... and write best/ for a faster one that such a process recorded
            if self.gpu and cfg.finalists >= 2 and cfg.final_rounds >= 1:
                self._finals()
        finally:
            close_proposer(self.proposer)
            self.claims.stop()
            try:
                self.claims.release_all()  # an interrupted process gives its slots back at once
            except StorageError:
                pass
            bar.close()
            self.run.write_leaderboard()
        return self.summary(self.evaluated, time.monotonic() - t_start)

    def _finals(self) -> None:
        """Time the fastest candidates again side by side and put the winner in best/ (`search.finals`). A failure
        other than a hung GPU leaves best/ as the search left it, with a notice."""
        cfg = self.cfg
        try:
            doc = run_finals(self.run, self.evaluator.gpu_timer(), cfg.finalists, cfg.final_rounds, cfg.notice)
            if doc is not None and not self.evaluator.promote_winner(doc["winner"], doc):
                cfg.notice(f"finals: {doc['winner']} won but is not in best/ (rejected by the full replay, or "
                           "another process sharing the run promoted a faster one since)")
        except GpuHangError:
            raise
        except Exception as exc:  # noqa: BLE001 - the search's result stands without the finals: say why
            cfg.notice(f"finals not run: {type(exc).__name__}: {exc}"[:500])

    def _catch_up_best(self) -> None:
        """Write best/ for the fastest candidate recorded in the shared study when best/ is behind it: a process
        killed between recording a new best and writing best/ (on a resume, or one of several processes sharing the
        run, at the end) leaves its candidate on disk and in the study but not in best/. Not when best/ holds the
        winner of finals that timed that candidate too: they decided between the two side by side."""
        self._sync()
        best, on_disk = self.standing.best, self.run.best_ms()
        finals = self.run.finals()
        if best is not None and finals is not None and self.run.best_candidate() == finals.get("winner") \
                and best.candidate in {e.get("candidate") for e in finals["entries"]}:
            return
        if best is not None and best.ms is not None and (on_disk is None or best.ms < on_disk) \
                and best.candidate in self.run.accepted():  # (another machine's best has no files here)
            self.evaluator.promote_again(best)

    def _timed_out(self, t_start: float) -> bool:
        """Whether to stop taking new work: the time limit reached (or Ctrl-C, raised here once a loop step)."""
        self.interrupts.check()
        limit = self.cfg.time_limit
        if limit is not None and time.monotonic() - t_start > limit and not self.stopping:
            self.cfg.notice(f"time limit of {limit:g} s reached")
            self.stopping = True
        return self.stopping

    def _run_sequential(self, bar: _Progress, t_start: float) -> None:
        while True:
            bar.update(self._sync(), self.standing, not self.gpu)
            if self._timed_out(t_start):
                break
            nxt = self._next_claim(self.cfg.batch)
            if nxt == STOP:
                break
            if nxt == WAIT:
                time.sleep(POLL_S)
                continue
            assert isinstance(nxt, tuple)
            self._evaluate(*nxt)

    def _run_parallel(self, bar: _Progress, jobs: int, t_start: float) -> None:
        """Like the sequential loop, but `jobs` worker processes lower and validate claimed proposals ahead of this
        process, which estimates or times them (the GPU is used by this process only). A worker records the
        schedule's key in the claim before it validates, so a repeated schedule is not validated twice either."""
        cfg = self.cfg
        assert self.shared is not None
        slots: dict[int, int] = {}  # id(proposal) -> its slot
        with Pool(jobs, self.spec, self.workers, cfg.interleavings, cfg.seed) as pool:
            while True:
                bar.update(self._sync(), self.standing, not self.gpu)
                waiting = False
                while not self._timed_out(t_start) and len(pool) < jobs:
                    nxt = self._next_claim(max(cfg.batch, jobs), busy=len(pool) > 0)
                    if nxt == STOP:
                        self.stopping = True
                        break
                    if nxt == WAIT:
                        waiting = True
                        break
                    assert isinstance(nxt, tuple)
                    slot, proposal = nxt
                    slots[id(proposal)] = slot
                    pool.submit(proposal, ScheduleClaim(self.claims.url, self.claims.study, self.claims.owner, slot))
                if not pool:
                    if self.stopping:
                        break
                    if waiting:
                        time.sleep(POLL_S)
                    continue
                for prepared in pool.finished():
                    self._evaluate(slots.pop(id(prepared.proposal)), prepared.proposal, prepared)

    def summary(self, evaluated: int, seconds: float) -> SearchSummary:
        acc = self.run.accepted()
        rej = self.run.rejected()
        screened = sum(status_of(r) == "screened" for r in rej.values())
        best = min(acc.items(), key=lambda kv: kv[1]["ms"]) if acc else None
        finals = self.run.finals()
        winner = finals.get("winner") if finals is not None else None
        if winner in acc and self.run.best_candidate() == winner:  # best/ holds the finals' winner
            best = (winner, acc[winner])
        else:
            finals = None
        return SearchSummary(self.run.path, evaluated, len(acc), len(rej) - screened, best[0] if best else None,
                             best[1]["ms"] if best else None,
                             acc.get(BASELINE, {}).get("ms") or self.standing.baseline_ms, not self.gpu, seconds,
                             screened=screened, best_by_proposer=self.run.best_per_proposer(), finals=finals)


class _Progress:
    """How far the search is, on stderr: a rich progress bar with the best so far on a terminal; elsewhere (CI, a
    `| tee` log) a plain line per finished candidate, and one every LINE_EVERY_S while none finishes, so that a log
    shows the search is alive; nothing when disabled."""

    LINE_EVERY_S = 10.0

    def __init__(self, total: int, enabled: bool, terminal: bool) -> None:
        self.total = total
        self.mode = "off" if not enabled else "bar" if terminal else "lines"
        self.done: int | None = None
        self.seen = 0  # results of the standing already reported
        self.t0 = self.last_line = time.monotonic()
        if self.mode != "bar":
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]search"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), transient=False,
                                 console=Console(stderr=True))  # (stdout keeps the summary alone)
        self.task = self.progress.add_task("", total=total)
        self.progress.start()

    @staticmethod
    def best_text(standing: Standing, estimated: bool) -> str:
        best, baseline = standing.best, standing.baseline_ms
        if best is None or best.ms is None:
            return ""
        text = f"best {best.candidate} {best.ms:.4f} ms" + (" (estimated)" if estimated else "")
        if baseline:
            text += f"  {baseline / best.ms:.2f}x vs naive"
        return text

    @staticmethod
    def outcome(res: Result) -> str:
        if res.accepted:
            return f"{res.candidate} accepted {res.ms:.4f} ms" if res.ms is not None else f"{res.candidate} accepted"
        if res.screened is not None:
            return f"{res.candidate} screened"
        return f"{res.candidate} rejected"

    def update(self, done: int, standing: Standing, estimated: bool) -> None:
        if self.mode == "bar":
            self.progress.update(self.task, completed=done, description=self.best_text(standing, estimated))
        elif self.mode == "lines":
            now = time.monotonic()
            first = self.done is None  # (on a resume the results so far are not news: the count says them)
            new = [] if first else standing.history[self.seen:]
            idle = not first and done == self.done and not new
            if idle and now - self.last_line < self.LINE_EVERY_S:
                return
            self.seen, self.done, self.last_line = len(standing.history), done, now
            parts = [f"search {done}/{self.total}", f"{now - self.t0:.0f} s"]
            if new:
                parts.append(", ".join(self.outcome(r) for r in new[-3:]) + (f" (+{len(new) - 3} more)"
                                                                              if len(new) > 3 else ""))
            elif idle:
                parts.append("waiting for candidates in progress")
            parts.append(self.best_text(standing, estimated))
            print("  ".join(p for p in parts if p), file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        """A line of what the search is doing between candidates (a proposer's long computation)."""
        if self.mode == "bar":
            self.progress.console.print(text)
        elif self.mode == "lines":
            self.last_line = time.monotonic()
            print(f"search {self.done or 0}/{self.total}  {self.last_line - self.t0:.0f} s  {text}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.mode == "bar":
            self.progress.stop()


class SearchInterrupted(Exception):
    """The search stopped on Ctrl-C. `kept`: the candidates its run folder holds (every one whole: files are written
    atomically, and a candidate cut short is discarded when the run is resumed); `started`: whether the run folder
    has its run.json (else there is nothing to resume)."""

    def __init__(self, run_dir: Path, kept: int, started: bool) -> None:
        super().__init__(f"interrupted: {kept} candidates kept in {run_dir}")
        self.run_dir, self.kept, self.started = run_dir, kept, started


def run_search(cfg: SearchConfig) -> SearchSummary:
    """Run (or resume, or join) a search; returns what this run folder holds at the end. Ctrl-C during the search
    raises SearchInterrupted, saying what was kept (before the run exists, the KeyboardInterrupt itself)."""
    search = Search(cfg)
    try:
        return search.run_loop()
    except KeyboardInterrupt:
        run = search.run
        try:
            kept = len(run.accepted()) + len(run.rejected())
        except (OSError, ValueError):
            kept = 0
        raise SearchInterrupted(run.path, kept, (run.path / "run.json").is_file()) from None
