"""`synth models`: every row, names whole, within 80 columns; descriptions on a wide console."""

from __future__ import annotations

from click.testing import CliRunner
from rich.console import Console

from megasynth.cli import main, models_table
from megasynth.lowering.models import MODELS


def test_models_fit_80_columns() -> None:
    res = CliRunner().invoke(main, ["models"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    names = [line.split()[0] for line in lines[1:] if line.strip()]
    assert names == list(MODELS)
    row = next(line.split() for line in lines if line.startswith("qwen2.5-7b "))
    assert row[1:] == ["3584", "18944", "28", "28", "4", "128", "152064", "4096", "bias"]
    assert "…" not in res.output


def test_models_wide_console_shows_descriptions() -> None:
    console = Console(width=160, record=True)
    console.print(models_table(160))
    text = console.export_text()
    assert "Mistral-7B-v0.3" in text and "Qwen3-0.6B" in text
    assert max(len(line) for line in text.splitlines()) <= 160
