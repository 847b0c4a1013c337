"""`synth search` (the search loop into runs/; with --ctx-ranges one run per context range and their schedule set) and
`synth strategy-schema` (the strategy JSON Schema)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from megasynth.commands import batch_option, int_list, max_seq_len_option, model_spec
from megasynth.ir.errors import ScheduleError

if TYPE_CHECKING:
    from megasynth.search.config import SearchConfig
    from megasynth.search.loop import SearchSummary


@click.command("search")
@click.option("--model", "model_name", default="llama-1b", show_default=True, help="Model spec (synth models).")
@click.option("--workers", type=click.IntRange(1, 4096), default=None,
              help="Workers (persistent programs). Default: the GPU's SM count, else 132.")
@click.option("--proposer", type=click.Choice(["auto", "descent", "seeds", "heuristic", "evolve", "tpe", "llm"]),
              default="auto", show_default=True,
              help="descent = cost-model descent from the naive lowering, then hill climbing on the measurements (no "
              "seeds); seeds (alias heuristic) = the hand-written strategies; auto = the LLM agent when "
              "OPENAI_API_KEY/OPENAI_BASE_URL is set, else the 3 best seeds, then descent, then evolve.")
@click.option("--budget", type=click.IntRange(1, 100_000), default=50, show_default=True,
              help="Candidates in the study (baseline included; shared by every process on the same storage).")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None, help="Seconds for this process.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", "resume", default=None, metavar="RUN", help="Continue runs/RUN (or join it).")
@click.option("--run", "run_name", default=None, metavar="NAME", help="Name of a new run (default model-time-seed).")
@click.option("--storage", default=None, metavar="URL",
              help="The study's database (default sqlite:///runs/<run>/study.db). Processes on several machines "
              "split one study's work when they share a storage (postgresql://user@host/db, with the "
              "[distributed] extra) and a --run/--resume name.")
@click.option("--lease", type=click.FloatRange(min=1), default=120, show_default=True,
              help="Seconds after which a candidate claimed by a silent process (another machine gone or cut off) "
              "is taken over; a dead process of this machine is noticed within seconds.")
@click.option("--runs-dir", type=click.Path(file_okay=False), default="runs", show_default=True)
@click.option("--interleavings", type=click.IntRange(0, 1_000_000), default=200, show_default=True,
              help="Adversarial interleavings replayed per candidate during the search (the best gets "
              "--final-interleavings).")
@click.option("--final-interleavings", type=click.IntRange(0, 1_000_000), default=1000, show_default=True)
@click.option("--finalists", type=click.IntRange(0, 100), default=4, show_default=True,
              help="GPU: at the end, time this many of the fastest candidates again side by side and keep the "
              "lowest median in best/ (finals.json; 0 or 1: no finals).")
@click.option("--final-rounds", type=click.IntRange(1, 100), default=3, show_default=True,
              help="GPU: rounds of the finals.")
@click.option("--ctx", type=click.IntRange(1, 1 << 20), default=None,
              help="Context length the schedules are timed/estimated at, at most max_seq_len. [default: 1024, or "
                   "max_seq_len if smaller]")
@click.option("--ctx-ranges", "ctx_ranges", callback=lambda ctx, param, value: _parse_ranges(value), default=None,
              metavar="UP_TO[,UP_TO...]",
              help="Search one schedule per context range instead of one (range k: contexts of up to UP_TO[k] "
              "tokens; the last must be max_seq_len): one run <run>.ctx<UP_TO> each, timed at its UP_TO with the "
              "other options, then the schedule set <runs-dir>/<run>.set.json. Not with --ctx or --resume.")
@max_seq_len_option()
@batch_option("timed on the GPU (interpreter v10; v9 where v10 cannot build the batch) "
              "or estimated with --cpu; the best schedule may differ per batch")
@click.option("--cost-params", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Cost-model parameters (default: megasynth/data/h200_costmodel.json).")
@click.option("--cpu", is_flag=True, help="Estimate with the cost model even when CUDA is present.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None,
              help="Worker processes that lower and validate candidates while this process times (GPU) or estimates "
              "(CPU) them [default: the cores this process may use, less one for the timer on a GPU, at most 8; 1 "
              "runs everything in this process].")
@click.option("--no-progress", is_flag=True,
              help="No progress on stderr (by default a progress bar on a terminal, else one line per candidate).")
@click.option("--llm-model", default=None, metavar="NAME", help="Agent: model name (default $OPENAI_MODEL, else "
              "gpt-4o-mini). Endpoint: OPENAI_BASE_URL / OPENAI_API_KEY (see docs/agent.md).")
@click.option("--llm-max-calls", type=click.IntRange(1, 100_000), default=None,
              help="Agent: API calls per run, retries included [default: 30].")
@click.option("--llm-temperature", type=click.FloatRange(0, 2), default=None, help="Agent: temperature [default: 0.7].")
@click.option("--llm-timeout", type=click.FloatRange(min=0.1), default=None,
              help="Agent: seconds per request before it is retried [default: 120].")
def search(model_name: str, workers: int | None, proposer: str, budget: int, time_limit: float | None, seed: int,
           resume: str | None, run_name: str | None, storage: str | None, lease: float, runs_dir: str,
           interleavings: int,
           final_interleavings: int, finalists: int, final_rounds: int,
           ctx: int | None, ctx_ranges: list[int] | None, max_seq_len: int | None,
           cost_params: str | None, cpu: bool,
           jobs: int | None,
           no_progress: bool,
           llm_model: str | None, llm_max_calls: int | None, llm_temperature: float | None,
           llm_timeout: float | None, batch: int) -> None:
    """Search schedules for a model: propose, prove safe, time (GPU) or estimate (CPU), keep them in runs/."""
    from megasynth.lowering.costmodel import CostParamsError, load_params
    from megasynth.runs.rundir import run_name_problem
    from megasynth.search.config import SearchConfig

    # every check of the input comes before the run folder is made: a search that cannot start leaves nothing behind
    for value, option in ((run_name, "--run"), (resume, "--resume")):
        problem = run_name_problem(value) if value is not None else None
        if problem is not None:
            raise click.BadParameter(f"{value!r}: {problem}", param_hint=option)
    if resume and run_name and resume != run_name:
        raise click.BadParameter("give either --resume RUN or --run NAME", param_hint="--run")
    if resume and ctx_ranges is None:
        model_name, batch, max_seq_len, ctx, workers = _resumed_settings(
            click.get_current_context(), Path(runs_dir) / resume,
            {"model_name": model_name, "batch": batch, "max_seq_len": max_seq_len, "ctx": ctx, "workers": workers})
    spec = model_spec(model_name, max_seq_len, batch)
    if ctx_ranges is not None:
        if ctx is not None:
            raise click.BadParameter("--ctx-ranges and --ctx do not go together: each range is timed at its own "
                                     "UP_TO", param_hint="--ctx-ranges")
        if resume:
            raise click.BadParameter("--ctx-ranges and --resume do not go together: --ctx-ranges starts new runs "
                                     "(resume a range's run <run>.ctx<UP_TO> alone with --resume)",
                                     param_hint="--ctx-ranges")
        if ctx_ranges[-1] != spec.max_seq_len:
            raise click.BadParameter(f"the last range must end at max_seq_len {spec.max_seq_len} (got "
                                     f"{ctx_ranges[-1]})", param_hint="--ctx-ranges")
    elif ctx is None:
        ctx = min(1024, spec.max_seq_len)
    elif ctx > spec.max_seq_len:
        raise click.BadParameter(f"{ctx} exceeds max_seq_len {spec.max_seq_len} of {spec.name} (raise it with "
                                 f"--max-seq-len)", param_hint="--ctx")
    try:
        params = load_params(cost_params) if cost_params else None
    except CostParamsError as exc:  # it names the file, the JSON path and the value
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    cfg = SearchConfig(model=model_name, workers=workers, proposer=proposer, budget=budget, time_limit=time_limit,
                       seed=seed, runs_dir=Path(runs_dir), run=resume or run_name, resume=bool(resume),
                       storage=storage, lease_s=lease, interleavings=interleavings,
                       final_interleavings=final_interleavings, finalists=finalists, final_rounds=final_rounds,
                       ctx=ctx or spec.max_seq_len,  # (--ctx-ranges: each range's own, below)
                       max_seq_len=max_seq_len, sequences=batch, gpu=False if cpu else None,
                       progress=not no_progress,
                       cost_params=params, jobs=jobs, notice=lambda m: click.echo(m, err=True),
                       llm={"model": llm_model, "max_calls": llm_max_calls, "temperature": llm_temperature,
                            "timeout_s": llm_timeout})
    if ctx_ranges is None:
        search_once(cfg)
    else:
        search_ranges(cfg, ctx_ranges, model_name, spec.max_seq_len)


def _given(ctx: click.Context, options: dict[str, str]) -> list[str]:
    """The options among `options` (parameter name -> option) that the user gave, on the command line or through the
    environment, rather than left at their default."""
    from click.core import ParameterSource

    return [opt for name, opt in options.items()
            if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]


#: What a resumed run keeps of its own: (parameter, option, run.json key, the value a run without that key had).
_RESUMED = (("model_name", "--model", "model", None), ("batch", "--batch", "batch", 1),
            ("max_seq_len", "--max-seq-len", "max_seq_len", None), ("ctx", "--ctx", "ctx", None),
            ("workers", "--workers", "workers", None))


def _resumed_settings(ctx: click.Context, path: Path, values: dict[str, Any]) -> tuple[Any, ...]:
    """`--resume`: the model, batch, max_seq_len, ctx and workers of the run at `path` (its run.json) for each of
    them the user left out, so that `--resume RUN` alone continues it as it was; one given that differs from the
    run's is a bad parameter naming both (a run's candidates are only comparable under one setting). A run with no
    run.json here (one to join through --storage) is left to the search, which asks the study."""
    if not (path / "run.json").is_file():
        return tuple(values[name] for name, *_ in _RESUMED)
    try:
        info = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        click.echo(f"error: {path / 'run.json'}: cannot read the run's settings ({exc})", err=True)
        sys.exit(2)
    if not isinstance(info, dict):
        click.echo(f"error: {path / 'run.json'}: $: expected an object, got {type(info).__name__}", err=True)
        sys.exit(2)
    given = _given(ctx, {name: option for name, option, *_ in _RESUMED})
    out = []
    for name, option, key, old_default in _RESUMED:
        theirs = info.get(key, old_default)
        kind = str if key == "model" else int
        if theirs is not None and (not isinstance(theirs, kind) or isinstance(theirs, bool)):
            click.echo(f"error: {path / 'run.json'}: $.{key}: expected {'a string' if kind is str else 'an integer'}"
                       f", got {json.dumps(theirs)}", err=True)
            sys.exit(2)
        mine = values[name]
        if theirs is None:
            out.append(mine)
        elif option in given and mine != theirs:
            raise click.BadParameter(f"{mine}: run {path.name} was searched with {option} {theirs}; leave {option} "
                                     f"out to continue it with the run's", param_hint=option)
        else:
            out.append(theirs)
    return tuple(out)


def _parse_ranges(value: str | None) -> list[int] | None:
    """`--ctx-ranges`: positive whole numbers, comma-separated, strictly increasing (the last is checked against
    max_seq_len once the model is known)."""
    if value is None:
        return None
    bounds: list[int] = []
    for n in int_list(value, "--ctx-ranges", "a whole number (give UP_TO[,UP_TO...], e.g. 4096,32768,131072)"):
        if n < 1:
            raise click.BadParameter(f"{n}: a range's UP_TO is at least 1", param_hint="--ctx-ranges")
        if bounds and n <= bounds[-1]:
            raise click.BadParameter(f"{n} does not follow {bounds[-1]}: the ranges' UP_TO go in strictly "
                                     "increasing order", param_hint="--ctx-ranges")
        bounds.append(n)
    if not bounds:
        raise click.BadParameter("give at least one UP_TO", param_hint="--ctx-ranges")
    return bounds


def search_once(cfg: SearchConfig) -> SearchSummary:
    """One search (`synth search` at one --ctx): run it, print its summary; an error in the settings exits 2."""
    from megasynth.kernels.gpu.timing import GpuHangError
    from megasynth.search.loop import SearchInterrupted, run_search

    try:
        summary = run_search(cfg)
    except SearchInterrupted as exc:  # Ctrl-C: one line, what is kept and how to go on (no traceback, no "Aborted!")
        if exc.started:
            click.echo(f"interrupted: {exc.kept} candidates kept in {exc.run_dir}; continue with "
                       f"{_resume_command(cfg, exc.run_dir.name)}", err=True)
        else:
            click.echo(f"interrupted before run {exc.run_dir} started; nothing to resume", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted before the search started; nothing was written", err=True)
        sys.exit(130)
    except (ValueError, ScheduleError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except GpuHangError as exc:  # the candidate is kept in the run as evidence; --resume continues in a new process
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    label = " (estimated by the cost model)" if summary.estimated else " (measured on the GPU)"
    click.echo(f"{summary.run_dir}: {summary.evaluated} candidates evaluated here, {summary.accepted} accepted, "
               f"{summary.screened} screened by the cost model, {summary.rejected} rejected, {summary.seconds:.1f} s")
    if summary.best_ms is not None:
        sp = f", {summary.speedup:.3f}x vs naive {summary.baseline_ms:.4f} ms" if summary.speedup else ""
        click.echo(f"best {summary.best}: {summary.best_ms:.4f} ms{sp}{label}")
        if summary.finals is not None:
            from megasynth.runs.report import finals_text

            click.echo("finals: " + finals_text(summary.finals))
        if summary.estimated and cfg.sequences > 1:  # estimates rank a batch's schedules; they are not its times
            click.echo(f"note: the cost model is fitted at batch 1 and does not price a batch's staging: on "
                       f"interpreter v10 its estimates of the candidates of llama-1b's batch-8 and batch-16 searches "
                       f"ran from 25 % under (the naive lowering) to 15 % over the measured steps (docs/search.md); "
                       f"time it: synth bench --batch {cfg.sequences} --schedule "
                       f"{summary.run_dir}/best/schedule.json.gz")
    if len(summary.best_by_proposer) > 1:  # side by side: each proposer's best, against the hand-written seeds'
        seeds = summary.best_by_proposer.get("seeds")
        parts = []
        for who, (cid, ms) in sorted(summary.best_by_proposer.items(), key=lambda kv: kv[1][1]):
            vs = f" ({100 * (ms / seeds[1] - 1):+.1f}% vs the best seed)" if seeds and who != "seeds" else ""
            parts.append(f"{who} {cid} {ms:.4f} ms{vs}")
        click.echo("best per proposer: " + "; ".join(parts))
    usage_file = Path(summary.run_dir) / "agent_usage.json"
    if usage_file.exists():  # the LLM agent ran: its calls and tokens (details in agent.jsonl)
        u = json.loads(usage_file.read_text(encoding="utf-8"))
        cost = f", ${u['cost_usd']:.4f}" if u.get("cost_usd") is not None else ""
        click.echo(f"agent {u.get('model')}: {u.get('calls')} calls, {u.get('total_tokens')} tokens{cost}, "
                   f"{u.get('proposals')} proposals ({u.get('accepted')} accepted, {u.get('rejected')} rejected)")
    return summary


def _resume_command(cfg: SearchConfig, run: str) -> str:
    """The command that continues an interrupted run: --resume takes the model, batch, context and workers from the
    run itself; what it does not record for this process (where runs live, the budget, the proposer, the study,
    --cpu) is repeated."""
    import shlex

    from megasynth.runs.study import without_password

    parts = ["synth", "search", "--resume", run]
    if cfg.runs_dir != Path("runs"):
        parts += ["--runs-dir", str(cfg.runs_dir)]
    parts += ["--budget", str(cfg.budget)]
    if cfg.proposer != "auto":
        parts += ["--proposer", cfg.proposer]
    if cfg.storage:
        parts += ["--storage", without_password(cfg.storage)]
    if cfg.gpu is False:
        parts.append("--cpu")
    return shlex.join(parts)


def search_ranges(cfg: SearchConfig, bounds: list[int], model: str, max_seq_len: int) -> None:
    """`--ctx-ranges`: one ordinary search per range, `<run>.ctx<UP_TO>` timed at UP_TO (the range's most expensive
    context) with `cfg`'s other settings, one after another; then the schedule set `<runs-dir>/<run>.set.json` of
    their best schedules. A range with no accepted schedule stops there: no set, exit 1."""
    from megasynth.atomic import write_json_atomic
    from megasynth.ir.schedule_set import set_document
    from megasynth.runs.rundir import RunDir, stored

    base = cfg.run or RunDir.new_name(cfg.model, cfg.seed)
    rows: list[tuple[int, str, float, Path]] = []  # up_to, run name, best ms, best schedule file
    for up_to in bounds:
        name = f"{base}.ctx{up_to}"
        click.echo(f"range up_to {up_to}: run {name}, timed at --ctx {up_to}")
        summary = search_once(replace(cfg, ctx=up_to, run=name, resume=False))
        best = stored(Path(summary.run_dir) / "best" / "schedule.json")
        if summary.best_ms is None or best is None:
            click.echo(f"error: range up_to {up_to} (run {name}) ended with no accepted schedule; the set is not "
                       "written", err=True)
            sys.exit(1)
        rows.append((up_to, name, summary.best_ms, best))
    set_file = cfg.runs_dir / f"{base}.set.json"
    meta: dict[str, Any] = {"model": model, "max_seq_len": max_seq_len, "runs": [r[1] for r in rows]}
    command = RunDir(cfg.runs_dir / rows[0][1]).info.get("command")
    if command:
        meta["command"] = command
    write_json_atomic(set_file, set_document(bounds, [str(r[3]) for r in rows], set_file, meta))
    for up_to, name, ms, _ in rows:
        click.echo(f"up_to {up_to}: {name} best {ms:.4f} ms")
    click.echo(f"schedule set: {set_file}")


@click.command("strategy-schema")
@click.option("--patches", is_flag=True, help="Print the schema of one patch instead.")
@click.option("--space", "space_model", default=None, metavar="MODEL",
              help="Print the values the built-in search tries for each knob on MODEL instead (see --workers).")
@click.option("--workers", type=click.IntRange(1, 4096), default=132, show_default=True,
              help="SMs the search space is for (one-wave tiles and splits depend on it).")
@batch_option("the search space at that batch (from batch 8 the weight tiles are whole tile slots) with --space.")
def strategy_schema(patches: bool, space_model: str | None, workers: int, batch: int) -> None:
    """Print the JSON Schema of a strategy (what `synth lower --strategy` takes), of a patch, or the search space."""
    given = _given(click.get_current_context(), {"workers": "--workers", "batch": "--batch"})
    if patches and space_model is not None:
        raise click.UsageError("--patches and --space do not go together: give --patches for the patch schema, or "
                               "--space MODEL for the search space")
    if given and space_model is None:
        named = " and ".join(given)
        raise click.UsageError(f"{named} only {'shapes' if len(given) == 1 else 'shape'} the search space (--space "
                               f"MODEL): add --space MODEL, or leave {named} out")
    if space_model is not None:
        from megasynth.lowering.models import get_model, with_batch
        from megasynth.lowering.strategy import SearchSpace

        try:
            spec = with_batch(get_model(space_model), batch)
        except KeyError as exc:
            raise click.BadParameter(str(exc.args[0]), param_hint="--space") from None
        click.echo("\n".join(SearchSpace(spec, workers).describe()))
    elif patches:
        from megasynth.lowering.patches import patch_schema

        click.echo(json.dumps(patch_schema(), indent=1))
    else:
        from megasynth.lowering.strategy import strategy_schema as schema

        click.echo(json.dumps(schema(), indent=1))
