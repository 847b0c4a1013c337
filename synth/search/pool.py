"""The parallel pool: `jobs` worker processes (spawned) lower, patch and validate proposals ahead of the main
process, which alone estimates or times them (the GPU belongs to one process) and records them. Used by
`Search` when it runs with more than one job; what to submit and what to do with a result stays in the loop."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from synth.lowering.models import get_model
from synth.runs.rundir import schedule_key
from synth.search.evaluate import Verdict, build
from synth.search.proposers.base import Proposal
from validator.errors import ScheduleError
from validator.schedule import Schedule, parse_schedule
from validator.verify import Options, verify


def prepare(model: str, workers: int, proposal: Proposal, interleavings: int, seed: int,
            claim_schedule: Callable[[str], int | None] | None = None
            ) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None, int | None]:
    """Worker process: lower + patch + validate one proposal. Returns (schedule JSON, build error, report JSON,
    duplicate_of). With `claim_schedule` (`synth.search.claims.ScheduleClaim`), the schedule's key is claimed
    between lowering and validating; when another claim has it, nothing is validated and duplicate_of is its slot."""
    spec = get_model(model)
    try:
        schedule = build(spec, workers, proposal)
    except (ScheduleError, ValueError) as exc:
        return None, str(exc), None, None
    if claim_schedule is not None and (holder := claim_schedule(schedule_key(schedule))) is not None:
        return None, None, None, holder
    report = verify(schedule, None, Options(interleavings=interleavings, seed=seed))
    return schedule.to_json(), None, report.to_json(), None


@dataclass
class Prepared:
    """A proposal as a worker left it: its schedule (None when it did not build: the evaluator then records why) and
    the validator's verdict on it."""

    proposal: Proposal
    schedule: Schedule | None
    verdict: Verdict | None
    duplicate_of: int | None = None  # the slot of the claim that has this schedule already (nothing validated)


class Pool:
    """Worker processes preparing proposals; a context manager around a spawn-context process pool."""

    def __init__(self, jobs: int, model: str, workers: int, interleavings: int, seed: int) -> None:
        self.jobs, self.model, self.workers, self.interleavings, self.seed = jobs, model, workers, interleavings, seed
        self.inflight: dict[cf.Future[Any], Proposal] = {}

    def __enter__(self) -> Pool:
        self.executor = cf.ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
        self.executor.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.executor.__exit__(*exc)

    def __len__(self) -> int:
        """Proposals submitted and not yet handed back."""
        return len(self.inflight)

    def submit(self, proposal: Proposal, claim_schedule: Callable[[str], int | None] | None = None) -> None:
        """Hand one proposal to a worker (`claim_schedule`: see `prepare`)."""
        fut = self.executor.submit(prepare, self.model, self.workers, proposal, self.interleavings, self.seed,
                                   claim_schedule)
        self.inflight[fut] = proposal

    def finished(self) -> Iterator[Prepared]:
        """Wait until at least one proposal is prepared, then hand back every one that is (in completion-set order)."""
        done, _ = cf.wait(list(self.inflight), return_when=cf.FIRST_COMPLETED)
        for fut in done:
            proposal = self.inflight.pop(fut)
            doc, _error, report, duplicate_of = fut.result()
            schedule = parse_schedule(doc) if doc is not None else None
            verdict = Verdict(report) if schedule is not None and report is not None else None
            yield Prepared(proposal, schedule, verdict, duplicate_of)
