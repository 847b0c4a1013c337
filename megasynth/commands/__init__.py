"""The `synth` subcommands that live outside megasynth/cli.py, one module each (search, bench + generate, runs,
calibrate); megasynth.cli attaches them, and one whose third-party package is missing becomes a stand-in."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from megasynth.lowering.models import ModelSpec

MAX_SEQ_LEN_HELP = ("Longest context the schedule, its proofs and the KV cache cover (positions 0..N-1), up to the "
                    "model's max_position_embeddings.")


def int_list(text: str, option: str, what: str = "an integer") -> list[int]:
    """A comma-separated list of integers as an option spells it (`--ctx 128,1024`, `--batch 1,2,4`); empty items
    are skipped, and an item that is no integer is click's bad-parameter error naming the option."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not {what}", param_hint=option) from None
    return out


def max_seq_len_option(default: str = "the model row's max_seq_len") -> Callable[[Callable[..., Any]], Any]:
    """`--max-seq-len N` as every command that lowers or runs a model spells it (None when not given); `default`
    says in the help what None means."""
    return click.option("--max-seq-len", "max_seq_len", type=int, default=None, metavar="N",
                        help=f"{MAX_SEQ_LEN_HELP} [default: {default}]")


def batch_option(what: str) -> Callable[[Callable[..., Any]], Any]:
    """`--batch N` (1-16): sequences decoded together per step, each with its own KV cache slot and position."""
    return click.option("--batch", "batch", type=click.IntRange(1, 16), default=1, show_default=True, metavar="N",
                        help=f"Sequences decoded together per step (one KV cache slot and position each): {what}")


def model_spec(model_name: str, max_seq_len: int | None, batch: int | None = None) -> ModelSpec:
    """The spec of `--model` at `--max-seq-len` and `--batch`: an unknown model is click's bad-parameter error on
    --model, a length the model cannot take exits 2 with the message (it names the value, the limit and the
    option)."""
    from megasynth.lowering.models import MaxSeqLenError, get_model, with_batch

    try:
        return with_batch(get_model(model_name, max_seq_len), batch)
    except MaxSeqLenError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyError as exc:
        raise click.BadParameter(str(exc.args[0]), param_hint="--model") from None


def kernel_options_option(more: str = "") -> Callable[[Callable[..., Any]], Any]:
    """`--kernel-option KEY=VALUE` (repeatable): a field of the megakernel's interpreter config; `more` ends its
    help."""
    return click.option("--kernel-option", "kernel_options", multiple=True, metavar="KEY=VALUE",
                        help="An interpreter setting of the megakernel, repeatable: a field of StreamConfig (v10, on "
                             "Hopper) or KernelConfig (v9), e.g. inflight=4, batch_hilo=true or x_dtype=fp32; "
                             f"interpreter=v9 runs v9 on Hopper.{more}")


def kernel_options_config(items: tuple[str, ...] | list[str], model_name: str, max_seq_len: int | None, batch: int,
                          device: str) -> Any:
    """The interpreter config `--kernel-option` asks for at `batch` (None where it gives none: the Megakernel's own
    choice), checked before anything runs: a bad item is click's bad-parameter error naming it."""
    if not items:
        return None
    from megasynth.kernels.gpu import kernel_config

    try:
        return kernel_config(items, batch=batch, device=device, cfg=model_spec(model_name, max_seq_len, batch).config)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel-option") from None
