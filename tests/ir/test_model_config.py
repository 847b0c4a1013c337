"""megasynth/ir/model.py: every config value is checked (schedules included: `validate` calls a bad config
malformed at its JSON path), Hugging Face config.json files of the family map onto ModelConfig, and what the megakernel
cannot run is refused with the key named. The named rows carry the published sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ConfigError, ModelConfig, from_hf_checkpoint, read_hf_config
from megasynth.ir.schedule import load_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS, ModelNotFound, get_model
from megasynth.validator.cli import main as validate_main
from megasynth.validator.verify import verify

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize(("key", "value"), [
    ("rope_theta", math.nan), ("rope_theta", math.inf), ("rope_theta", 0.0), ("rope_theta", -1.0),
    ("rope_theta", "1e4"), ("rope_theta", True), ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0),
    ("rms_norm_eps", math.nan), ("hidden_size", 0), ("vocab_size", 1.5), ("num_hidden_layers", True),
    ("head_dim", 15), ("num_key_value_heads", 3), ("tie_word_embeddings", 1), ("qk_norm", "yes"),
    ("qkv_bias", None), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 32.0}),
])
def test_bad_values_are_refused_with_their_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf({**TINY, key: value})
    assert info.value.key.split(".")[0] == key, info.value


def test_missing_size_is_named() -> None:
    with pytest.raises(ConfigError, match="vocab_size is missing"):
        ModelConfig.from_hf({k: v for k, v in TINY.items() if k != "vocab_size"})


def test_llama_config_reads_as_before() -> None:
    """New fields appear in a schedule's model.config only when set: Llama schedules keep their exact text."""
    hf = MODELS["llama-1b"].config.to_hf()
    assert set(hf) == {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "vocab_size", "head_dim", "rope_theta", "rms_norm_eps",
                       "tie_word_embeddings", "rope_scaling"}
    qwen = MODELS["qwen3-0.6b"].config.to_hf()
    assert qwen["qk_norm"] is True and "qkv_bias" not in qwen
    assert ModelConfig.from_hf(qwen) == MODELS["qwen3-0.6b"].config
    assert ModelConfig.from_hf(MODELS["qwen2.5-7b"].config.to_hf()) == MODELS["qwen2.5-7b"].config


def _schedule_with(tmp_path: Path, **config: Any) -> Path:
    doc = lower(get_model("tiny"), 4).to_json()
    doc["model"]["config"].update(config)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(doc))
    return file


@pytest.mark.parametrize(("key", "value"), [("rope_theta", math.nan), ("rms_norm_eps", -1.0),
                                            ("rope_theta", -5.0), ("num_key_value_heads", 3), ("head_dim", 33)])
def test_validate_calls_a_bad_config_malformed(tmp_path: Path, key: str, value: Any) -> None:
    file = _schedule_with(tmp_path, **{key: value})
    with pytest.raises(ScheduleError) as info:
        verify(load_schedule(file), str(file))
    assert info.value.path == f"$.model.config.{key}"
    res = CliRunner().invoke(validate_main, [str(file)])
    assert res.exit_code == 2
    assert f"$.model.config.{key}" in res.output
    assert "Traceback" not in res.output


def test_validate_accepts_the_same_schedule_with_a_good_config(tmp_path: Path) -> None:
    res = CliRunner().invoke(validate_main, [str(_schedule_with(tmp_path))])
    assert res.exit_code == 0, res.output


QWEN3_0_6B = {  # config.json of Qwen/Qwen3-0.6B as published on the Hub
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN25_7B = {  # config.json of Qwen/Qwen2.5-7B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 152064}
MISTRAL_7B_V03 = {  # config.json of mistralai/Mistral-7B-v0.3
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 32768}


@pytest.mark.parametrize(("row", "config"), [("qwen3-0.6b", QWEN3_0_6B), ("qwen2.5-7b", QWEN25_7B),
                                             ("mistral-7b-v0.3", MISTRAL_7B_V03)])
def test_published_configs_are_the_named_rows(row: str, config: dict[str, Any]) -> None:
    hf = from_hf_checkpoint(config)
    assert hf.config == MODELS[row].config
    assert hf.max_position_embeddings == MODELS[row].max_position_embeddings


@pytest.mark.parametrize(("base", "key", "value"), [
    (QWEN3_0_6B, "num_experts", 128), (QWEN3_0_6B, "model_type", "qwen3_moe"),
    (MISTRAL_7B_V03, "num_local_experts", 8), (QWEN3_0_6B, "n_routed_experts", 64),
    (QWEN3_0_6B, "use_sliding_window", True), (QWEN25_7B, "use_sliding_window", True),
    (MISTRAL_7B_V03, "sliding_window", 4096), (QWEN3_0_6B, "layer_types", ["full_attention", "sliding_attention"]),
    (QWEN3_0_6B, "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (QWEN3_0_6B, "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
    (QWEN3_0_6B, "model_type", "gemma"), (QWEN3_0_6B, "hidden_act", "gelu"), (QWEN3_0_6B, "attention_bias", True),
    (MISTRAL_7B_V03, "attention_bias", True), (MISTRAL_7B_V03, "mlp_bias", True),
    (MISTRAL_7B_V03, "rope_theta", float("nan")), (QWEN25_7B, "rms_norm_eps", -1e-6),
    (QWEN25_7B, "max_position_embeddings", 0), (QWEN25_7B, "num_key_value_heads", 5),
])
def test_unsupported_configs_are_refused_with_the_key(tmp_path: Path, base: dict[str, Any], key: str,
                                                     value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        from_hf_checkpoint({**base, key: value})
    assert info.value.key == key, info.value
    (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
    with pytest.raises(ModelNotFound, match=rf"config\.json: \$\.{key} "):
        get_model(str(tmp_path))


def test_architecture_without_model_type(tmp_path: Path) -> None:
    config = {k: v for k, v in QWEN3_0_6B.items() if k != "model_type"}
    assert from_hf_checkpoint(config).config.qk_norm
    with pytest.raises(ConfigError, match="architectures"):
        from_hf_checkpoint({**config, "architectures": ["GPT2LMHeadModel"]})


def test_get_model_reads_a_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    spec = get_model(str(tmp_path))
    assert spec.config == MODELS["qwen2.5-7b"].config
    assert spec.max_seq_len == 4096 and spec.weights_dir == str(tmp_path)
    assert read_hf_config(tmp_path).model_type == "qwen2"
    with pytest.raises(ModelNotFound, match="not a checkpoint folder"):
        get_model(str(tmp_path / "sub") + "/")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelNotFound, match="no config.json"):
        get_model(str(tmp_path / "sub"))
    with pytest.raises(ModelNotFound, match="unknown model 'qwen9'"):
        get_model("qwen9")


def test_named_rows() -> None:
    """The published sizes (Hub config.json files), checked by the parameter counts they give."""
    rows = {name: MODELS[name].config for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                                                   "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "mistral-7b-v0.3")}
    billions = {name: cfg.weight_bytes(1) / 1e9 for name, cfg in rows.items()}
    expect = {"qwen3-0.6b": 0.60, "qwen3-1.7b": 1.72, "qwen3-4b": 4.02, "qwen3-8b": 8.19, "qwen2.5-0.5b": 0.49,
              "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62, "mistral-7b-v0.3": 7.25}
    for name, b in expect.items():
        assert billions[name] == pytest.approx(b, abs=0.02), name
    assert all(c.qk_norm and not c.qkv_bias and c.hd == 128 for n, c in rows.items() if n.startswith("qwen3"))
    assert all(c.qkv_bias and not c.qk_norm for n, c in rows.items() if n.startswith("qwen2.5"))
    assert [rows[n].tie_word_embeddings for n in rows] == [True, True, True, False, True, True, False, False]
