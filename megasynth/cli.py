"""`synth`: lower, search, bench and browse runs. Subcommands live in their own modules and register here."""

from __future__ import annotations

import sys
from typing import Any

import click

from megasynth.commands import batch_option, max_seq_len_option
from megasynth.ir.errors import ScheduleError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Synthesize megakernel schedules for Llama-family decode (Llama, Mistral, Qwen2.5, Qwen3), prove them safe, time
    them, keep the best in runs/."""


@main.command("models")
def models_cmd() -> None:
    """List the model specs (any Hugging Face checkpoint folder of the family also works as --model DIR)."""
    from rich.console import Console

    console = Console()
    console.print(models_table(console.width))


#: Console width from which `synth models` also shows each row's description.
WIDE = 120


def models_table(width: int = 80) -> Any:
    """The model rows as a rich Table: names never wrap; the description column only on a console of WIDE columns
    or more (at 80 columns the sizes fill the line)."""
    from rich.table import Table

    from megasynth.lowering.models import MODELS

    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    table.add_column("name", no_wrap=True)
    wide = width >= WIDE
    if wide:
        table.add_column("model", overflow="fold", ratio=1)
    for head in ("hidden", "inter", "layers", "heads", "kv", "hd", "vocab", "seq", "qkv"):
        table.add_column(head, justify="right", no_wrap=True)
    for spec in MODELS.values():
        c = spec.config
        qkv = "+".join(x for x, on in (("bias", c.qkv_bias), ("norm", c.qk_norm)) if on) or "-"
        row = [str(v) for v in (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                                c.num_key_value_heads, c.hd, c.vocab_size, spec.max_seq_len)]
        table.add_row(spec.name, *([spec.description] if wide else []), *row, qkv)
    return table


@main.command("lower")
@click.option("--model", "model_name", default="llama-1b", show_default=True,
              help="A model name (synth models) or a Hugging Face checkpoint folder (its config.json).")
@click.option("--workers", type=click.IntRange(1, 4096), default=132, show_default=True)
@click.option("--strategy", "strategy_file", type=click.Path(dir_okay=False), help="Strategy JSON.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="schedule.json", show_default=True,
              help="Where to write the schedule (atomically); a name ending in .gz is written gzip-compressed.")
@max_seq_len_option()
@batch_option("attention per sequence, every weight tile once for all of them")
def lower_cmd(model_name: str, workers: int, strategy_file: str | None, output: str, max_seq_len: int | None,
              batch: int) -> None:
    """Lower a model into a complete schedule (default: the naive round-robin baseline)."""
    from megasynth.commands import model_spec
    from megasynth.ir.schedule import dump_schedule
    from megasynth.lowering.lower import lower
    from megasynth.lowering.strategy import load_strategy

    spec = model_spec(model_name, max_seq_len, batch)
    try:
        strategy = load_strategy(strategy_file) if strategy_file else None
        schedule = lower(spec, workers, strategy, proposer="naive" if strategy is None else "manual")
    except ScheduleError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    try:
        dump_schedule(schedule, output)
    except OSError as exc:
        click.echo(f"error: {output}: cannot write: {exc.strerror or exc}", err=True)
        sys.exit(2)
    lens = [len(q) for q in schedule.queues]
    click.echo(f"{output}: {len(schedule.instructions)} instructions, {schedule.counters} counters, "
               f"{workers} workers, queue length {min(lens)}..{max(lens)}", err=True)


def _missing(name: str, package: str) -> click.Command:
    """A stand-in for a subcommand whose module needs a package that is not installed (e.g. on a bare GPU image)."""

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(unavailable: needs the Python package {package!r})")
    def stand_in() -> None:
        raise click.ClickException(f"`synth {name}` needs the Python package {package!r}: pip install {package}")

    return stand_in


def _register() -> None:
    """Attach the subcommands that live in other modules; one whose third-party import fails becomes a stand-in
    that says which package is missing, so the other commands keep working."""
    import importlib

    for module, name in [("megasynth.commands.search", "search"), ("megasynth.commands.bench", "bench"),
                         ("megasynth.commands.bench", "generate"), ("megasynth.commands.runs", "runs"),
                         ("megasynth.commands.calibrate", "calibrate"), ("megasynth.commands.check", "check"),
                         ("megasynth.commands.search", "strategy_schema")]:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue
            if exc.name and not exc.name.startswith("megasynth"):
                main.add_command(_missing(name, exc.name.split(".")[0]), name)
                continue
            raise
        cmd = getattr(mod, name, None)
        if cmd is not None:
            main.add_command(cmd, name.replace("_", "-"))


_register()

if __name__ == "__main__":
    main()
