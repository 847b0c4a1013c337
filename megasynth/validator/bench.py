"""Speed benchmark of the validator (not a test): `python -m validator.bench [FILE...] [--interleavings N ...]`
prints seconds per phase for each schedule. Without files it lowers the naive llama-1b and llama-8b schedules (or
those of `--strategy FILE`) with the `synth lower` command (a subprocess, so `validator` keeps importing nothing from
`synth`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from megasynth.ir.schedule import load_schedule
from megasynth.validator.verify import Options, gc_paused, verify

PHASES = ("load", "structure", "coverage", "deadlock", "graph", "z3", "replay")


def _lower(model: str, folder: Path, strategy: str | None, batch: int = 1) -> Path:
    out = folder / (f"{model}.json" if batch == 1 else f"{model}-batch{batch}.json")
    cmd = [sys.executable, "-c", "from megasynth.cli import main; main()", "lower", "--model", model, "-o", str(out),
           "--batch", str(batch)]
    subprocess.run(cmd + (["--strategy", strategy] if strategy else []), check=True, capture_output=True)
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--models", default="llama-1b,llama-8b", show_default=True, help="Lowered when no FILE is given.")
@click.option("--interleavings", "counts", multiple=True, type=int, default=(1000, 10000), show_default=True)
@click.option("--strategy", type=click.Path(exists=True, dir_okay=False),
              help="Strategy JSON for the models lowered when no FILE is given (`synth lower --strategy`).")
@click.option("--batch", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Sequences per step of the models lowered when no FILE is given (`synth lower --batch`).")
@click.option("--seed", type=int, default=0, show_default=True)
def main(files: tuple[str, ...], models: str, counts: tuple[int, ...], strategy: str | None, batch: int,
         seed: int) -> None:
    """Time every phase of `validate` on real schedules."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(f) for f in files] or [_lower(m, Path(tmp), strategy, batch) for m in models.split(",") if m]
        header = f"{'schedule':<14}{'instr':>8}{'pairs':>11}{'interl.':>9}" + "".join(f"{p:>10}" for p in PHASES) + \
            f"{'total':>9}  verdict"
        click.echo(header)
        for path in paths:
            for count in counts:
                t = time.perf_counter()
                with gc_paused():  # as `validate` does
                    schedule = load_schedule(path)
                    load = time.perf_counter() - t
                    report = verify(schedule, str(path), Options(interleavings=count, seed=seed))
                total = time.perf_counter() - t
                secs = {"load": load, **report.seconds}
                click.echo(f"{path.stem:<14}{report.stats['instructions']:>8}"
                           f"{report.stats.get('conflicting_pairs', 0):>11}{count:>9}"
                           + "".join(f"{secs.get(p, 0.0):>10.2f}" for p in PHASES)
                           + f"{total:>9.2f}  {report.verdict}" + _how(report.stats))


def _how(stats: dict) -> str:
    """How the verdict was reached, where it took more than the plain graph pass."""
    parts = [f"{stats[k]} {k.replace('_', ' ')}" for k in ("proven_by_z3", "gated_signals", "graph_rounds")
             if stats.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


if __name__ == "__main__":
    main()
