"""The parallel pool: `jobs` worker processes (spawned) lower, patch and validate proposals ahead of the main
process, which alone estimates or times them (the GPU belongs to one process) and records them. Used by
`Search` when it runs with more than one job; what to submit and what to do with a result stays in the loop.

Each worker is its own process with its own pipe and works on one proposal at a time, so a worker that dies (a
crash, the kernel's OOM killer, a `kill`) is known by its process sentinel and fails only the proposal it held:
that proposal comes back with `failure` saying how the worker died, a fresh worker takes its place, and the
search goes on (a `concurrent.futures` pool would instead break as a whole, failing every proposal in flight).

Ctrl-C in a terminal sends SIGINT to every process of the search; the workers start with it blocked
(`interrupts.interrupts_held`, as do the descent's cost-model processes), so that the main process alone decides what an
interrupt does: it stops them and says what the run kept, instead of each worker printing a KeyboardInterrupt
traceback.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import signal
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import Schedule, parse_schedule
from megasynth.lowering.models import ModelSpec, get_model
from megasynth.runs.rundir import schedule_key
from megasynth.search.evaluate import Verdict, build
from megasynth.search.interrupts import interrupts_held
from megasynth.search.proposers.base import Proposal
from megasynth.validator.verify import Options, verify

ClaimSchedule = Callable[[str], int | None]
Prepare = Callable[[str | ModelSpec, int, Proposal, int, int, ClaimSchedule | None],
                   tuple[dict[str, Any] | None, str | None, dict[str, Any] | None, int | None]]


def prepare(model: str | ModelSpec, workers: int, proposal: Proposal, interleavings: int, seed: int,
            claim_schedule: ClaimSchedule | None = None
            ) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None, int | None]:
    """Worker process: lower + patch + validate one proposal. Returns (schedule JSON, build error, report JSON,
    duplicate_of). With `claim_schedule` (`megasynth.search.claims.ScheduleClaim`), the schedule's key is claimed
    between lowering and validating; when another claim has it, nothing is validated and duplicate_of is its slot."""
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    try:
        schedule = build(spec, workers, proposal)
    except (ScheduleError, ValueError) as exc:
        return None, str(exc), None, None
    if claim_schedule is not None and (holder := claim_schedule(schedule_key(schedule))) is not None:
        return None, None, None, holder
    report = verify(schedule, None, Options(interleavings=interleavings, seed=seed))
    return schedule.to_json(), None, report.to_json(), None


def _serve(conn: mpc.Connection, target: Prepare, model: str | ModelSpec, workers: int, interleavings: int,
           seed: int) -> None:
    """A worker's loop: one (proposal, schedule claim) in, its prepared result out, until told to stop (None) or the
    parent is gone. Ctrl-C is the parent's (it stops the workers): the worker starts with SIGINT blocked
    (`interrupts.interrupts_held`), and ignores it from here on, since a blocked signal still reaches any thread a
    library starts with it unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        proposal, claim_schedule = task
        conn.send(target(model, workers, proposal, interleavings, seed, claim_schedule))


def death_reason(exitcode: int | None) -> str:
    """How a worker process ended, in words (a negative exit code is the signal that killed it)."""
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (out of memory, or killed)" if -exitcode == signal.SIGKILL else ""
        return f"it was killed by {name}{why}"
    return f"it exited with status {exitcode}"


@dataclass
class Prepared:
    """A proposal as a worker left it: its schedule (None when it did not build: the evaluator then records why) and
    the validator's verdict on it; `failure` when the worker died on it (the proposal is then not rebuilt)."""

    proposal: Proposal
    schedule: Schedule | None
    verdict: Verdict | None
    failure: str | None = None
    duplicate_of: int | None = None  # the slot of the claim that has this schedule already (nothing validated)


class _Worker:
    def __init__(self, ctx: Any, target: Prepare, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, target, *args), daemon=True)
        self.proc.start()
        child.close()
        self.task: tuple[Proposal, ClaimSchedule | None] | None = None


class Pool:
    """Worker processes preparing proposals, one proposal per worker at a time; a context manager."""

    def __init__(self, jobs: int, model: str | ModelSpec, workers: int, interleavings: int, seed: int,
                 target: Prepare = prepare) -> None:
        self.jobs, self.model, self.workers, self.interleavings, self.seed = jobs, model, workers, interleavings, seed
        self.target = target
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[_Worker] = []
        self.pending: deque[tuple[Proposal, ClaimSchedule | None]] = deque()
        self.deaths = 0

    def _spawn(self) -> _Worker:
        with interrupts_held():
            return _Worker(self.ctx, self.target, (self.model, self.workers, self.interleavings, self.seed))

    def __enter__(self) -> Pool:
        self.procs = [self._spawn() for _ in range(self.jobs)]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):  # Ctrl-C: stop now, not after the task
            for w in self.procs:
                w.proc.terminate()  # (a worker writes nothing but its schedule claim, one database transaction)
        for w in self.procs:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self.procs:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)
            w.conn.close()
        self.procs = []

    def __len__(self) -> int:
        """Proposals submitted and not yet handed back."""
        return len(self.pending) + sum(1 for w in self.procs if w.task is not None)

    def submit(self, proposal: Proposal, claim_schedule: ClaimSchedule | None = None) -> None:
        """Hand one proposal to a worker, or queue it until one is free (`claim_schedule`: see `prepare`)."""
        self.pending.append((proposal, claim_schedule))
        self._dispatch()

    def _dispatch(self) -> None:
        for w in self.procs:
            if not self.pending:
                return
            if w.task is None:
                w.task = self.pending.popleft()
                try:
                    w.conn.send(w.task)
                except (OSError, ValueError):
                    pass  # it died: finished() sees its sentinel and fails this proposal

    def finished(self) -> Iterator[Prepared]:
        """Wait until at least one proposal is prepared (or its worker died), then hand back every one that is."""
        busy = [w for w in self.procs if w.task is not None]
        if not busy:
            return
        ready = set(mpc.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
        for k, w in enumerate(self.procs):
            if w.task is None or (w.conn not in ready and w.proc.sentinel not in ready):
                continue
            (proposal, _claim), w.task = w.task, None
            try:  # a sentinel or an end of file with nothing to read: the worker is gone
                result = w.conn.recv() if w.conn.poll() else None
            except (EOFError, OSError):
                result = None
            if result is None:  # the worker died holding this proposal: fail it alone, replace the worker
                w.proc.join(timeout=5)  # the pipe can close a moment before the process can be reaped
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(timeout=5)
                reason = death_reason(w.proc.exitcode)
                w.conn.close()
                self.procs[k] = self._spawn()
                self.deaths += 1
                yield Prepared(proposal, None, None, f"the worker process lowering and validating this candidate "
                                                     f"died: {reason}; the search went on with a fresh worker")
                continue
            doc, _error, report, duplicate_of = result
            schedule = parse_schedule(doc) if doc is not None else None
            verdict = Verdict(report) if schedule is not None and report is not None else None
            yield Prepared(proposal, schedule, verdict, duplicate_of=duplicate_of)
        self._dispatch()
