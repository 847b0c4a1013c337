"""`synth calibrate TRACE... [-o FILE]`: fit the cost model to GPU traces and report its makespan error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from validator.errors import ScheduleError


@click.command("calibrate")
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--schedule", "schedules", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="The schedule of each trace, in the same order (default: schedule.json beside each trace).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the fitted parameters here (e.g. synth/data/h200_costmodel.json).")
@click.option("--prior", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Starting parameters (default: the committed H200 file).")
@click.option("--allow-estimated", is_flag=True, help="Accept traces labelled estimated (tests only).")
@click.option("--fit-run", "fit_runs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A runs/<run> folder of a GPU search: fit hop latency and one SM's peak bandwidth to its measured "
              "whole-step times too (slower: a grid of fits).")
@click.option("--check-run", "check_runs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A runs/<run> folder of a GPU search: report the fitted model's error on every measured candidate.")
def calibrate(traces: tuple[str, ...], schedules: tuple[str, ...], output: str | None, prior: str | None,
              allow_estimated: bool, fit_runs: tuple[str, ...], check_runs: tuple[str, ...]) -> None:
    """Fit per-op cost-model parameters from GPU traces (kernels/trace.py format) and their schedules."""
    from synth.lowering.costmodel import load_params
    from synth.search.calibrate import fit
    from validator.atomic import write_json_atomic
    from validator.schedule import load_schedule

    if schedules and len(schedules) != len(traces):
        raise click.BadParameter(f"{len(schedules)} schedules for {len(traces)} traces", param_hint="--schedule")
    pairs = []
    devices = set()
    for k, tpath in enumerate(traces):
        try:
            trace = json.loads(Path(tpath).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
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
        spath = Path(schedules[k]) if schedules else Path(tpath).with_name("schedule.json")
        try:
            pairs.append((trace, load_schedule(spath)))
        except ScheduleError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
    from synth.search.calibrate import PEAK_GRID, measured_steps

    measured = measured_steps(list(fit_runs)) if fit_runs else None
    try:
        result = fit(pairs, load_params(prior), ", ".join(sorted(devices)), measured=measured,
                     peaks=PEAK_GRID if measured else None)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"{'op':<22} {'n':>6} {'eff':>7} {'overhead_us':>12} {'med |err| %':>12}")
    for op, r in result.per_op.items():
        click.echo(f"{op:<22} {r['n']:>6} {r['eff']:>7.3f} {r['overhead_us']:>12.3f} "
                   f"{r['median_abs_pct_error']:>12.2f}")
    med = result.median_abs_pct_error
    click.echo(f"makespan: median absolute error {med:.2f}% over {len(result.makespans)} schedules"
               + (" (goal <= 10%)" if med is not None else ""))
    fit_doc = {"per_op": result.per_op, "makespans": result.makespans, "median_abs_pct_error": med,
               "fit_runs": list(fit_runs), "sm_peak": result.params.sm_peak, "hop_us": result.params.hop_us}
    if check_runs:
        import statistics

        from synth.search.calibrate import check_runs as check

        rows = check(list(check_runs), result.params)
        cmed = statistics.median(abs(r["error_pct"]) for r in rows) if rows else None
        fit_doc["check"] = {"runs": list(check_runs), "schedules": rows, "median_abs_pct_error": cmed}
        click.echo(f"held-out check: median absolute error {cmed:.2f}% over {len(rows)} measured schedules"
                   if rows else "held-out check: no GPU-measured candidates in those runs")
    if output:
        write_json_atomic(output, {**result.params.to_json(), "fit": fit_doc})
        click.echo(f"wrote {output}")
