"""The validator's pipeline: structure -> coverage -> deadlock -> races; returns a `Report` with timings per phase."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megasynth.ir.program import Finding, resolve
from megasynth.ir.schedule import Schedule
from megasynth.validator.coverage import check_coverage
from megasynth.validator.deadlock import deadlock_findings, maximal_execution
from megasynth.validator.smt import DEFAULT_BUDGET_S


@dataclass
class Report:
    """A verdict and its evidence. `accepted` iff there are no findings."""

    file: str | None
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return not self.findings

    @property
    def verdict(self) -> str:
        return "accepted" if self.accepted else "rejected"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "verdict": self.verdict, "findings": [f.to_json() for f in self.findings],
                "stats": self.stats, "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}


@dataclass
class Options:
    interleavings: int = 1000
    seed: int = 0
    pipelined: bool = False
    races: bool = True  # the race phases (graph, z3, replay); off = structure, coverage and deadlock only
    budget: float = DEFAULT_BUDGET_S  # seconds z3 may spend on what the graph pass leaves (`--budget`)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: a schedule is millions of small objects (records, tuples), and the
    collections that building them triggers re-scan all of them (llama-8b: ~2 s of ~8 s). The validator makes no
    garbage cycles; the collector resumes afterwards (nested uses leave it to the outermost)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def verify(schedule: Schedule, file: str | None = None, options: Options | None = None) -> Report:
    """Validate a parsed schedule. Raises `ScheduleError` for structural defects (malformed, exit 2)."""
    with gc_paused():
        return _verify(schedule, file, options or Options())


def _verify(schedule: Schedule, file: str | None, options: Options) -> Report:
    report = Report(file)
    t = time.perf_counter()
    prog = resolve(schedule, file)
    report.seconds["structure"] = time.perf_counter() - t
    report.findings.extend(prog.findings)
    report.stats["instructions"] = prog.n
    report.stats["workers"] = len(prog.queues)
    report.stats["counters"] = prog.counters

    t = time.perf_counter()
    report.findings.extend(check_coverage(prog))
    report.seconds["coverage"] = time.perf_counter() - t

    t = time.perf_counter()
    ex = maximal_execution(prog)
    report.findings.extend(deadlock_findings(prog, ex))
    report.seconds["deadlock"] = time.perf_counter() - t

    if options.races:
        from megasynth.validator.races import check_races

        check_races(prog, report, options, ex)
    return report
