"""`synth generate` checks `--schedule` and `--kernel-option` as `synth bench` does, before anything runs, on every
backend: a file it cannot read, a schedule of another batch or another model and an unknown interpreter field exit 2
with the message; where the tokens come from the PyTorch reference (no CUDA, or --backend reference) it says in one
line that the schedule and options were checked but not used, instead of ignoring them."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def _lower(path: Path, model: str = "tiny", *extra: str) -> str:
    code, out = _invoke("lower", "--model", model, "-o", str(path), *extra)
    assert code == 0, out
    return str(path)


@pytest.fixture()
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if generate gets as far as building its weights: the checks come before anything runs."""
    import megasynth.kernels.weights as weights_mod

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("generate built its weights before checking its input")

    monkeypatch.setattr(weights_mod, "model_weights", refuse)


def _tokens(out: str) -> list[str]:
    """generate's lines of token ids (stdout), without the notices and the rate line (stderr)."""
    return [line for line in out.splitlines() if line and all(part.isdigit() for part in line.split())]


def _generate(*extra: str) -> tuple[int, str]:
    return _invoke("generate", "--model", "tiny", "--tokens", "3", "--backend", "reference", *extra)


@pytest.mark.usefixtures("no_weights")
def test_generate_refuses_a_schedule_it_could_not_run(tmp_path: Path) -> None:
    good = _lower(tmp_path / "tiny.json")
    truncated = tmp_path / "truncated.json"
    truncated.write_text(Path(good).read_text()[:300])
    code, out = _generate("--schedule", str(truncated))
    assert code == 2 and f"{truncated}: $: invalid JSON" in out, out
    batch3 = _lower(tmp_path / "tiny_b3.json", "tiny", "--batch", "3")
    code, out = _generate("--schedule", batch3)
    assert code == 2 and f"{batch3}: $.model.batch: the schedule decodes batch 3, not 1" in out, out
    mha = _lower(tmp_path / "mha.json", "tiny-mha")
    code, out = _generate("--schedule", mha)
    assert code == 2 and f"{mha}: $.model.config: the schedule's model config is not tiny's" in out, out
    code, out = _generate("--schedule", good, "--batch", "2")  # a batch-1 schedule at batch 2
    assert code == 2 and "decodes batch 1, not 2" in out, out
    code, out = _generate("--schedule", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json: $: cannot read file" in out, out


@pytest.mark.usefixtures("no_weights")
def test_generate_refuses_an_unknown_kernel_option() -> None:
    code, out = _generate("--kernel-option", "foo=1")
    assert code == 2 and "--kernel-option" in out and "has no field 'foo'" in out, out


def test_generate_on_the_reference_says_the_schedule_is_not_used(tmp_path: Path) -> None:
    """A schedule (here gzip-compressed) and an option that pass the checks: the reference's tokens, as without
    them, and one notice line that names both and says where the tokens come from."""
    packed = _lower(tmp_path / "tiny.json.gz")
    code, plain = _generate()
    assert code == 0, plain
    assert "checked against" not in plain
    code, out = _generate("--schedule", packed, "--kernel-option", "num_stages=2")
    assert code == 0, out
    notes = [line for line in out.splitlines() if "checked against tiny at batch 1" in line]
    assert len(notes) == 1, out
    assert f"--schedule {packed}" in notes[0] and "--kernel-option num_stages=2" in notes[0]
    assert "tokens come from the PyTorch reference" in notes[0] and "not the megakernel" in notes[0]
    assert _tokens(out) == _tokens(plain) and len(_tokens(out)[0].split()) == 3  # the same greedy tokens
    code, out = _generate("--schedule", _lower(tmp_path / "b3.json", "tiny", "--batch", "3"), "--batch", "3")
    assert code == 0 and "checked against tiny at batch 3" in out, out
