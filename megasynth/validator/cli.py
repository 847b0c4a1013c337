"""`validate FILE...`: exit 0 accepted, 1 rejected, 2 malformed or usage error (docs/design.md §3). A schedule-set
file is validated member by member: each member is a report of its own, named by the set and its range."""

from __future__ import annotations

import json
import sys

import click

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import schema
from megasynth.ir.schedule_set import ScheduleSet, load_schedule_or_set
from megasynth.validator.verify import Options, Report, gc_paused, verify


def format_text(report: Report) -> str:
    st = report.stats
    member = f" (set {st['set']}, positions {st['positions'][0]}-{st['positions'][1] - 1})" if "set" in st else ""
    lines = [f"{report.file}{member}: {report.verdict.upper()}"]
    for f in report.findings:
        lines.append(f"  [{f.category}] {f.message}")
        for extra in f.details.get("text", []):
            lines.append(f"      {extra}")
    parts = [f"{st.get('instructions', 0)} instructions"]
    for key in ("conflicting_pairs", "proven_by_graph", "proven_by_z3", "counterexamples", "unchecked_pairs",
                "interleavings", "replay_witnesses"):
        if key in st:
            parts.append(f"{st[key]} {key.replace('_', ' ')}")
    parts.append(" ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items()))
    lines.append("  stats: " + ", ".join(parts))
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False), metavar="FILE...")
@click.option("--schema", "print_schema", is_flag=True, help="Print the JSON Schema of the format and exit.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif"]), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the report here instead of stdout.")
@click.option("--interleavings", type=click.IntRange(0, 10_000_000), default=1000, show_default=True,
              help="Adversarial interleavings replayed against shadow memory.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the replay and of z3.")
@click.option("--pipelined", is_flag=True, help="Consecutive instructions of a worker may overlap.")
@click.option("--budget", type=click.FloatRange(0, None, min_open=True), default=Options.budget, show_default=True,
              help="Seconds z3 may spend on the pairs the graph pass leaves (the size of model it accepts grows with "
              "it); pairs still undecided make the schedule 'unproven'.")
@click.option("--jobs", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Validate several files in parallel processes.")
def main(files: tuple[str, ...], print_schema: bool, fmt: str, output: str | None, interleavings: int, seed: int,
         pipelined: bool, budget: float, jobs: int) -> None:
    """Prove megakernel schedules free of races and deadlocks, or show an interleaving that breaks them. A schedule
    set (one schedule per context range) is checked as a set and each member proven."""
    if print_schema:
        click.echo(json.dumps(schema(), indent=2))
        return
    if not files:
        raise click.UsageError("give at least one schedule file (or --schema)")
    options = Options(interleavings=interleavings, seed=seed, pipelined=pipelined, budget=budget)
    reports: list[Report] = []
    malformed: list[ScheduleError] = []
    if jobs > 1 and len(files) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(files))) as pool:
            outcomes = list(pool.map(_verify_file, files, [options] * len(files)))
    else:
        outcomes = [_verify_file(name, options) for name in files]
    for out in outcomes:
        if isinstance(out, ScheduleError):
            malformed.append(out)
        else:
            reports.extend(out)
    text = _render(fmt, reports, malformed)
    if output:
        from megasynth.atomic import write_text_atomic
        write_text_atomic(output, text + "\n")
    else:
        click.echo(text)
    if output or fmt != "text":  # the text report on stdout already names each malformed file: say it once
        for exc in malformed:
            click.echo(f"error: {exc}", err=True)
    sys.exit(2 if malformed else (0 if all(r.accepted for r in reports) else 1))


def _verify_file(name: str, options: Options) -> list[Report] | ScheduleError:
    """Validate one file (a schedule, or every member of a set); a malformed one comes back as its `ScheduleError`
    (picklable, for `--jobs`)."""
    try:
        with gc_paused():
            loaded = load_schedule_or_set(name)
            if not isinstance(loaded, ScheduleSet):
                return [verify(loaded, name, options)]
            reports = []
            for (lo, hi), sched, member in zip(loaded.ranges(), loaded.schedules, loaded.files, strict=True):
                report = verify(sched, member, options)
                report.stats.update(set=name, positions=[lo, hi])
                reports.append(report)
            return reports
    except ScheduleError as exc:
        exc.file = exc.file or name
        return exc


def _render(fmt: str, reports: list[Report], malformed: list[ScheduleError]) -> str:
    if fmt == "json":
        doc = {"reports": [r.to_json() for r in reports],
               "malformed": [{"file": e.file, "path": e.path, "message": e.message} for e in malformed]}
        return json.dumps(doc, indent=1)
    if fmt == "sarif":
        from megasynth.validator.sarif import to_sarif
        return json.dumps(to_sarif(reports, malformed), indent=1)
    out = [format_text(r) for r in reports]
    out += [f"{e.file}: MALFORMED\n  {e.path}: {e.message}" for e in malformed]
    return "\n".join(out)


if __name__ == "__main__":
    main()
