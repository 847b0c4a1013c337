"""`synth calibrate`: fit the cost model to GPU measurements and report its error on measurements left out.

Two fits, picked by the prior's kernel: for interpreter v10 (a prior with `ring_bytes`, the committed file) every
free parameter is fitted to whole-step times (`megasynth.search.calibrate.fit_steps`) of the GPU-measured candidates of
`--fit-run` runs, the steps of `--measured` files and the traces they carry; for v9 (`ring_bytes` 0) the per-op
least squares on traced instructions, then the hop latency (and one SM's peak with `--fit-run`) on makespans.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import click

from megasynth.ir.errors import ScheduleError


@click.command("calibrate")
@click.argument("traces", nargs=-1, type=click.Path(dir_okay=False, exists=True))
@click.option("--schedule", "schedules", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="The schedule of each trace, in the same order (default: schedule.json[.gz] beside each trace). "
              "Traces and schedules may be gzip-compressed, as a run's best/ keeps them.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the fitted parameters here (e.g. megasynth/data/h200_costmodel.json).")
@click.option("--prior", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Starting parameters (default: the committed H200 file); its kernel picks the fit.")
@click.option("--allow-estimated", is_flag=True, help="Accept traces labelled estimated (tests only).")
@click.option("--fit-run", "fit_runs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A runs/<run> folder of a GPU search: fit to its measured candidates (and its best's trace).")
@click.option("--measured", "measured_files", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="A megasynth-measured-steps/1 file (steps lowered from recorded strategies): fit to its steps too.")
@click.option("--check-run", "check_runs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A runs/<run> folder of a GPU search left out of the fit: report the error on its candidates. "
              "Alone (nothing to fit), it checks the prior (default: the committed model) and writes nothing.")
@click.option("--check-measured", "check_measured", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="A megasynth-measured-steps/1 file left out of the fit: report the error on each of its steps. "
              "Alone (nothing to fit), it checks the prior and writes nothing.")
@click.option("--holdout", type=click.FloatRange(0, 0.9), default=0.3, show_default=True,
              help="v10: this fraction of the measured steps (picked by a hash of their names) is left out of the fit "
              "and reported.")
@click.option("--max-fit", type=click.IntRange(4, 100_000), default=40, show_default=True,
              help="v10: steps the optimisation uses at most (spread over the measured times; all are reported).")
@click.option("--iterations", type=click.IntRange(1, 100), default=12, show_default=True)
@click.option("--free", "free", default=None, metavar="NAME,...",
              help="v10: fit only these parameters (e.g. attn_mma_flop_rate, overhead_us:<op>); the rest stay the "
              "prior's, and the output keeps the prior's record of its own fit beside this one's.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="v10: processes [default: cores - 1].")
def calibrate(traces: tuple[str, ...], schedules: tuple[str, ...], output: str | None, prior: str | None,
              allow_estimated: bool, fit_runs: tuple[str, ...], measured_files: tuple[str, ...],
              check_runs: tuple[str, ...], check_measured: tuple[str, ...], holdout: float, max_fit: int,
              iterations: int, free: str | None, jobs: int | None) -> None:
    """Fit the cost model to GPU measurements (runs, measured-step files, traces) and report its error."""
    from megasynth.lowering.costmodel import load_params

    if schedules and len(schedules) != len(traces):
        raise click.BadParameter(f"{len(schedules)} schedules for {len(traces)} traces", param_hint="--schedule")
    pairs, devices = _read_traces(traces, schedules, allow_estimated)
    try:
        base = load_params(prior)  # a CostParamsError names the file, the JSON path and the value
        _check_inputs(list(fit_runs), list(check_runs), list(measured_files) + list(check_measured))
        if (check_runs or check_measured) and not (traces or fit_runs or measured_files):  # the model as it is
            _check_only(base, list(check_runs), list(check_measured))
            return
        if check_measured:
            raise click.UsageError("--check-measured checks the model as it is: give it without anything to fit")
        if base.ring_bytes > 0:
            doc = _fit_v10(pairs, base, list(fit_runs), list(measured_files), list(check_runs), holdout, max_fit,
                           iterations, jobs or max(1, (os.cpu_count() or 2) - 1), ", ".join(sorted(devices)),
                           _free_names(free, base), _prior_fit(prior))
        elif free:
            raise click.UsageError("--free picks parameters of the v10 step fit; this prior is v9's")
        else:
            if not pairs:
                raise click.UsageError("a v9 prior fits per-op parameters on traces: give at least one TRACE")
            doc = _fit_v9(pairs, base, list(fit_runs), list(check_runs), ", ".join(sorted(devices)))
    except (ValueError, ScheduleError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if output:
        from megasynth.atomic import write_json_atomic

        write_json_atomic(output, doc)
        click.echo(f"wrote {output}")


def _check_inputs(fit_runs: list[str], check_runs: list[str], measured: list[str]) -> None:
    """Every run folder and measured-steps file checked before anything is fitted or printed: a folder that is no
    run, a run with nothing measured or a malformed step is a ValueError naming it (exit 2), not an empty fit or an
    error halfway through."""
    from megasynth.search.calibrate import check_measured, require_measured_run

    for run in fit_runs:
        require_measured_run(run, "fit")
    for run in check_runs:
        require_measured_run(run, "check")
    for path in measured:
        check_measured(path)


def _check_only(params: Any, check_runs: list[str], check_measured: list[str] | None = None) -> None:
    """The error of `params` on the GPU-measured candidates of runs it was not fitted on, per run and in all, and on
    each step of measured-steps files (one line a step: a file holds few, often one per batch or context)."""
    from megasynth.search.calibrate import error_summary, file_steps, run_steps

    skipped: list[str] = []
    every = []
    for run in check_runs:
        steps = run_steps([run], skipped)
        every += steps
        click.echo(_errors_line(f"{run} (not fitted)", error_summary(steps, params)))
    for path in check_measured or []:
        steps = file_steps([path])
        every += steps
        summary = error_summary(steps, params)
        for row in summary["rows"]:
            click.echo(f"  {row['step']}: estimated {row['estimated_ms']:.3f} ms, measured {row['measured_ms']:.3f} "
                       f"({row['error_pct']:+.1f} %)")
        click.echo(_errors_line(f"{path} (not fitted)", summary))
    for why in skipped:
        click.echo(f"note: left out {why}")
    if len(check_runs) + len(check_measured or []) > 1:
        click.echo(_errors_line("all (not fitted)", error_summary(every, params)) + " (goal: median <= 3%, max <= 10%)")


def _free_names(text: str | None, base: Any) -> list[str] | None:
    """--free's names, each one the step fit knows (a usage error names one it does not)."""
    from megasynth.search.calibrate import free_param_names

    if not text:
        return None
    known = free_param_names(base)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise click.BadParameter(f"unknown parameter {', '.join(bad) or repr(text)}; known: {', '.join(known)}",
                                 param_hint="--free")
    return names


def _prior_fit(prior: str | None) -> dict[str, Any] | None:
    """The prior file's records of its fit (`fit`) and of later fits of some of its parameters (`refits`), which a
    fit of some parameters keeps."""
    from megasynth.lowering.costmodel import DATA

    try:
        doc = json.loads(Path(prior or DATA).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {k: doc[k] for k in ("fit", "refits") if k in doc} if isinstance(doc, dict) and "fit" in doc else None


def _read_traces(traces: tuple[str, ...], schedules: tuple[str, ...], allow_estimated: bool
                 ) -> tuple[list[tuple[dict[str, Any], Any]], set[str]]:
    from megasynth.ir.schedule import loads_schedule
    from megasynth.runs.rundir import stored

    pairs, devices = [], set()
    for k, tpath in enumerate(traces):
        try:
            trace = json.loads(_read_maybe_gz(Path(tpath)))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            click.echo(f"error: {tpath}: $: cannot read trace: {exc}", err=True)
            sys.exit(2)
        meta = trace.get("metadata", {}) if isinstance(trace, dict) else {}
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            click.echo(f"error: {tpath}: $.traceEvents: not a trace (a list of events is required)", err=True)
            sys.exit(2)
        if meta.get("estimated") and not allow_estimated:
            click.echo(f"error: {tpath}: $.metadata.estimated: this trace is a cost-model estimate, not a GPU "
                       "measurement", err=True)
            sys.exit(2)
        devices.add(str(meta.get("device")))
        spath = Path(schedules[k]) if schedules else (stored(Path(tpath).with_name("schedule.json"))
                                                        or Path(tpath).with_name("schedule.json"))
        try:
            text = _read_maybe_gz(spath)
        except (OSError, UnicodeDecodeError) as exc:
            click.echo(f"error: {spath}: $: cannot read file: {getattr(exc, 'strerror', None) or exc}", err=True)
            sys.exit(2)
        try:
            pairs.append((trace, loads_schedule(text, str(spath))))
        except ScheduleError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
    return pairs, devices


def _read_maybe_gz(path: Path) -> str:
    """A file's text, decompressed when it is gzip (a run's best/trace.json.gz and best/schedule.json.gz)."""
    from megasynth.atomic import read_text

    return read_text(path)


def _errors_line(what: str, summary: dict[str, Any]) -> str:
    if not summary["n"]:
        return f"{what}: no measured steps"
    return (f"{what}: median |error| {summary['median_abs_pct_error']:.2f}%, max {summary['max_abs_pct_error']:.2f}% "
            f"over {summary['n']} measured steps")


def _fit_v10(pairs: list[tuple[dict[str, Any], Any]], base: Any, fit_runs: list[str], measured_files: list[str],
             check_runs: list[str], holdout: float, max_fit: int, iterations: int, jobs: int,
             device: str, free: list[str] | None = None, prior_fit: dict[str, Any] | None = None) -> dict[str, Any]:
    from dataclasses import replace

    from megasynth.ir.program import resolve
    from megasynth.search.calibrate import (
        Step,
        _add_trace,
        error_summary,
        file_steps,
        fit_steps,
        run_steps,
        split_held_out,
        subsample,
    )

    skipped: list[str] = []
    steps = run_steps(fit_runs, skipped) + file_steps(measured_files)
    for why in skipped:
        click.echo(f"note: left out {why}")
    for trace, schedule in pairs:  # a trace alone: its kernel makespan and op means
        st = Step(f"trace {trace.get('metadata', {}).get('schedule_sha256') or len(steps)}", resolve(schedule),
                  int(trace.get("metadata", {}).get("ctx") or 1024), None)
        _add_trace(st, trace)
        steps.append(st)
    if not steps and (fit_runs or measured_files):
        raise ValueError("nothing to fit: every measured step of the given runs and files was left out (see the "
                         "notes above)")
    if not steps:
        raise ValueError("nothing to fit: give --fit-run, --measured or traces")
    fit_set, held = split_held_out(steps, holdout)
    used = subsample(fit_set, max_fit)
    click.echo(f"fitting {len(used)} of {len(fit_set)} steps ({len(held)} held out) with {jobs} processes")
    result = fit_steps(used, base, free=free, iterations=iterations, jobs=jobs, notice=click.echo)
    what = " + ".join(", ".join(names) for names in (fit_runs, measured_files) if names)
    what += f"{' + ' if what else ''}{len(pairs)} traces" if pairs else ""
    source = f"fitted to {len(fit_set)} measured steps ({what})" + (f" ({device})" if device else "")
    notes = ("synth calibrate (v10 step fit): " + ", ".join(result.free) + " fitted by Levenberg-Marquardt to the log "
             "error of whole-step times (and traced makespans and per-op means); "
             f"{len(held)} steps held out. Refit: synth calibrate --fit-run <GPU run folder>... "
             "[--measured <steps file>] -o megasynth/data/h200_costmodel.json")
    if free:  # some parameters refitted: the rest, and where they came from, stay the prior's
        source = f"{base.source}; then {', '.join(result.free)} {source}"
        notes = f"{base.notes} Then: {notes}"
    params = replace(result.params, source=source, notes=notes)
    fitted = error_summary(fit_set, params)
    click.echo(_errors_line("fit", fitted))
    held_sum = error_summary(held, params)
    click.echo(_errors_line("held out (not fitted)", held_sum) + " (goal: median <= 3%, max <= 10%)")
    doc_fit: dict[str, Any] = {"mode": "steps", "free": result.free, "iterations": result.iterations,
                               "fit_runs": fit_runs, "measured": measured_files, "holdout": holdout,
                               "fitted": fitted, "held_out": held_sum}
    if check_runs:
        check = error_summary(run_steps(check_runs, skipped), params)
        click.echo(_errors_line("check runs (not fitted)", check))
        doc_fit["check"] = {"runs": check_runs, **check}
    if free and prior_fit:
        return {**params.to_json(), "fit": prior_fit["fit"], "refits": [*prior_fit.get("refits", []), doc_fit]}
    return {**params.to_json(), "fit": doc_fit}


def _fit_v9(pairs: list[tuple[dict[str, Any], Any]], base: Any, fit_runs: list[str], check_runs: list[str],
            device: str) -> dict[str, Any]:
    from megasynth.search.calibrate import PEAK_GRID, fit, measured_steps

    measured = measured_steps(fit_runs) if fit_runs else None
    result = fit(pairs, base, device, measured=measured, peaks=PEAK_GRID if measured else None)
    click.echo(f"{'op':<22} {'n':>6} {'eff':>7} {'overhead_us':>12} {'med |err| %':>12}")
    for op, r in result.per_op.items():
        click.echo(f"{op:<22} {r['n']:>6} {r['eff']:>7.3f} {r['overhead_us']:>12.3f} "
                   f"{r['median_abs_pct_error']:>12.2f}")
    med = result.median_abs_pct_error
    click.echo(f"makespan: median absolute error {med:.2f}% over {len(result.makespans)} schedules"
               + (" (goal <= 10%)" if med is not None else ""))
    fit_doc: dict[str, Any] = {"per_op": result.per_op, "makespans": result.makespans, "median_abs_pct_error": med,
                               "fit_runs": fit_runs, "sm_peak": result.params.sm_peak, "hop_us": result.params.hop_us}
    if check_runs:
        from megasynth.search.calibrate import check_runs as check

        rows = check(check_runs, result.params)
        cmed = statistics.median(abs(r["error_pct"]) for r in rows) if rows else None
        fit_doc["check"] = {"runs": check_runs, "schedules": rows, "median_abs_pct_error": cmed}
        click.echo(f"held-out check: median absolute error {cmed:.2f}% over {len(rows)} measured schedules"
                   if rows else "held-out check: no GPU-measured candidates in those runs")
    return {**result.params.to_json(), "fit": fit_doc}
