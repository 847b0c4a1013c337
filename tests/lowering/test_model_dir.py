"""`synth lower --model DIR`: a checkpoint folder's config.json decides the model; what the megakernel cannot run
exits 2 naming the file and the key. The new named rows lower into schedules the validator accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.cli import main as synth_main
from megasynth.ir.model import ModelConfig
from megasynth.ir.schedule import load_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS
from megasynth.validator.verify import verify

QWEN3_TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False}


def _lower(tmp_path: Path, model: str) -> tuple[object, Path]:
    out = tmp_path / "schedule.json"
    res = CliRunner().invoke(synth_main, ["lower", "--model", model, "--workers", "4", "-o", str(out)])
    return res, out


def test_lower_a_checkpoint_folder(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_TINY))
    res, out = _lower(tmp_path, str(ckpt))
    assert res.exit_code == 0, res.output
    schedule = load_schedule(out)
    cfg = ModelConfig.from_hf(schedule.model.config)
    assert cfg.qk_norm and cfg.hd == 32 and schedule.model.max_seq_len == 64
    assert schedule.model.name == str(ckpt.resolve())
    assert verify(schedule).accepted


@pytest.mark.parametrize(("key", "value"), [("num_experts", 8), ("use_sliding_window", True),
                                            ("model_type", "phi3"), ("rope_theta", -1.0)])
def test_lower_refuses_what_the_megakernel_cannot_run(tmp_path: Path, key: str, value: object) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**QWEN3_TINY, key: value}))
    res, out = _lower(tmp_path, str(ckpt))
    assert res.exit_code == 2
    assert f"config.json: $.{key}" in res.output
    assert "Traceback" not in res.output and not out.exists()


def test_lower_missing_folder_exits_2(tmp_path: Path) -> None:
    res, _ = _lower(tmp_path, str(tmp_path / "nowhere") + "/")
    assert res.exit_code == 2 and "not a checkpoint folder" in res.output


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_new_rows_lower_and_validate(name: str) -> None:
    """The published sizes lower into complete schedules; the QK-norm rows get whole-head QKV tiles."""
    spec = MODELS[name]
    schedule = lower(spec, 132)
    report = verify(schedule)
    assert report.accepted
    if spec.config.qk_norm:
        hd = spec.config.hd
        assert all(ins.args["start"] % hd == 0 for ins in schedule.instructions if ins.op == "attn_norm_qkv_rope")
