"""`synth check`: the megakernel path (CPU executor) against transformers on tiny checkpoints written by
`save_pretrained`, one per family, and its refusals (exit 2, the file and the key named, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import HF_TINY, save_hf_checkpoint

from megasynth.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _check(folder: Path, *extra: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["check", "--weights", str(folder), "--tokens", "3", *extra])
    assert "Traceback" not in res.output
    return res.exit_code, res.output


@pytest.mark.parametrize("family", list(HF_TINY))
def test_check_agrees_with_transformers(tmp_path: Path, family: str) -> None:
    save_hf_checkpoint(tmp_path, family)
    code, out = _check(tmp_path)
    assert code == 0, out
    assert out.rstrip().endswith("agree")
    steps = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(steps) == 3
    for _, _, err, ours, theirs in steps:
        assert float(err) <= 1e-4 and ours == theirs


def test_check_fails_on_disagreement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers side that differs (here: its logits shifted on one token) makes the check exit 1."""
    import megasynth.commands.check as check_mod

    save_hf_checkpoint(tmp_path, "mistral")
    real = check_mod._hf_runner

    def skewed(folder: Path):  # noqa: ANN202
        run = real(folder)

        def logits(tokens: list[int]):  # noqa: ANN202
            out = run(tokens).clone()
            out[7] += 0.01 * out.norm()
            return out
        return logits

    monkeypatch.setattr(check_mod, "_hf_runner", skewed)
    code, out = _check(tmp_path)
    assert code == 1, out
    assert "MISMATCH" in out and "DISAGREE" in out


def test_check_bad_input_exits_2(tmp_path: Path) -> None:
    code, out = _check(tmp_path / "missing")
    assert code == 2 and "missing" in out
    (tmp_path / "empty").mkdir()
    code, out = _check(tmp_path / "empty")
    assert code == 2 and "no config.json" in out
    ckpt = tmp_path / "ckpt"
    save_hf_checkpoint(ckpt, "qwen2")
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in [("use_sliding_window", True), ("num_experts", 4), ("model_type", "gpt2"),
                       ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
                       ("rms_norm_eps", -1.0)]:
        (ckpt / "config.json").write_text(json.dumps({**config, key: value}))
        code, out = _check(ckpt)
        assert code == 2, (key, out)
        assert f"{ckpt / 'config.json'}: $.{key}" in out, out
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "model.safetensors").unlink()
    code, out = _check(ckpt)
    assert code == 2 and "neither model.safetensors" in out
    code, out = _check(ckpt, "--prompt", "1,x")
    assert code == 2 and "--prompt" in out
