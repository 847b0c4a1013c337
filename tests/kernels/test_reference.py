"""megasynth/kernels/reference.py against Hugging Face `LlamaForCausalLM` (fp32, eager) on the tiny configs, and the
checkpoint round trip of megasynth/kernels/weights.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_llama
from safetensors.torch import save_file

from megasynth.ir.model import ModelConfig
from megasynth.kernels.reference import decode_step, new_kv_cache
from megasynth.kernels.weights import (
    WeightsError,
    config_from_hf_dir,
    load_hf_weights,
    random_weights,
    to_hf_state_dict,
    weight_shapes,
)

PROMPT_LEN = 12
pytestmark = pytest.mark.usefixtures("single_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference_logits(cfg: ModelConfig, weights: dict, tokens: list[int], max_seq_len: int) -> list[torch.Tensor]:
    k, v = new_kv_cache(cfg, max_seq_len)
    return [decode_step(cfg, weights, k, v, t, pos) for pos, t in enumerate(tokens)]


def hf_logits(cfg: ModelConfig, weights: dict, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one full causal forward: row t is the next-token logits of the prefix [0, t]."""
    model = hf_llama(cfg, weights)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def prompt(cfg: ModelConfig, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()


def test_reference_matches_transformers(tiny: tuple[ModelConfig, int]) -> None:
    cfg, max_seq = tiny
    weights = random_weights(cfg, seed=3)
    tokens = prompt(cfg)
    ours = reference_logits(cfg, weights, tokens, max_seq)
    theirs = hf_logits(cfg, weights, tokens)
    for pos in range(len(tokens)):
        assert rel_err(ours[pos], theirs[pos]) <= 1e-4, f"pos {pos}: {rel_err(ours[pos], theirs[pos])}"
    # the logits are not degenerate: they move with the position and have O(1)-ish spread
    assert rel_err(ours[0], ours[-1]) > 0.1
    assert 0.1 < float(ours[-1].std()) < 100


def test_reference_late_positions_rope_scaling() -> None:
    """tiny-gqa4 uses Llama-3 RoPE scaling with original_max_position_embeddings 16: go well past it."""
    from megasynth.lowering.models import MODELS

    spec = MODELS["tiny-gqa4"]
    cfg = spec.config
    weights = random_weights(cfg, seed=5)
    tokens = prompt(cfg, n=48, seed=2)
    ours = reference_logits(cfg, weights, tokens, spec.max_seq_len)
    theirs = hf_logits(cfg, weights, tokens)
    for pos in (0, 15, 16, 31, 47):
        assert rel_err(ours[pos], theirs[pos]) <= 1e-4, f"pos {pos}"


def test_random_weights_are_seeded_and_tied(tiny: tuple[ModelConfig, int]) -> None:
    cfg, _ = tiny
    a, b, c = random_weights(cfg, seed=0), random_weights(cfg, seed=0), random_weights(cfg, seed=1)
    assert set(a) == set(weight_shapes(cfg)) | {"lm_head"}
    for name, shape in weight_shapes(cfg).items():
        assert tuple(a[name].shape) == shape
        assert torch.equal(a[name], b[name])
    assert not torch.equal(a["embed"], c["embed"])
    assert (a["lm_head"] is a["embed"]) == cfg.tie_word_embeddings
    bf = random_weights(cfg, seed=0, dtype=torch.bfloat16)
    assert bf["layers.0.wqkv"].dtype == torch.bfloat16
    assert torch.equal(bf["layers.0.wqkv"], a["layers.0.wqkv"].to(torch.bfloat16))


def test_bf16_cache_close_to_fp32() -> None:
    """Weights and caches in bf16 still give logits near the fp32 ones (the scale of the init keeps them O(1))."""
    from megasynth.lowering.models import MODELS

    spec = MODELS["tiny"]
    cfg = spec.config
    w32, w16 = random_weights(cfg), random_weights(cfg, dtype=torch.bfloat16)
    k32, v32 = new_kv_cache(cfg, spec.max_seq_len)
    k16, v16 = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16)
    for pos, t in enumerate(prompt(cfg, n=6)):
        a = decode_step(cfg, w32, k32, v32, t, pos)
        b = decode_step(cfg, w16, k16, v16, t, pos)
        assert b.dtype == torch.float32
        assert rel_err(b, a) < 0.05
    assert k16.dtype == torch.bfloat16 and k16[:, :, :6].abs().sum() > 0


def write_checkpoint(folder, cfg: ModelConfig, weights: dict, sharded: bool = False, **extra_cfg) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sd = to_hf_state_dict(weights, cfg)
    if sharded:
        names = sorted(sd)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in halves.items():
            save_file({k: sd[k] for k in keys}, str(folder / file))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(sd, str(folder / "model.safetensors"))
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          **cfg.to_hf(), **extra_cfg}
    (folder / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("sharded", [False, True])
def test_load_hf_checkpoint(tmp_path, tiny: tuple[ModelConfig, int], sharded: bool) -> None:
    cfg, max_seq = tiny
    weights = random_weights(cfg, seed=7)
    write_checkpoint(tmp_path / "ckpt", cfg, weights, sharded=sharded)
    cfg2 = config_from_hf_dir(tmp_path / "ckpt")
    assert cfg2 == cfg
    loaded = load_hf_weights(tmp_path / "ckpt", cfg2)
    assert set(loaded) == set(weights)
    for name in weights:
        assert torch.equal(loaded[name], weights[name]), name
    assert (loaded["lm_head"] is loaded["embed"]) == cfg.tie_word_embeddings
    tokens = prompt(cfg, n=6)
    ours = reference_logits(cfg2, loaded, tokens, max_seq)
    theirs = hf_logits(cfg, weights, tokens)
    for pos in range(len(tokens)):
        assert rel_err(ours[pos], theirs[pos]) <= 1e-4


def test_config_transformers5_rope_parameters(tmp_path) -> None:
    """transformers 5 writes `rope_parameters` (theta inside) instead of rope_theta/rope_scaling."""
    from megasynth.lowering.models import MODELS

    cfg = MODELS["tiny-gqa4"].config
    hf = {k: v for k, v in cfg.to_hf().items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {**cfg.rope_scaling_dict(), "rope_theta": cfg.rope_theta}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert config_from_hf_dir(tmp_path) == cfg


def test_load_errors_name_the_tensor(tmp_path) -> None:
    from megasynth.lowering.models import MODELS

    cfg = MODELS["tiny-mha"].config
    weights = random_weights(cfg)
    sd = to_hf_state_dict(weights, cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_hf_weights(tmp_path, cfg)

    sd = to_hf_state_dict(weights, cfg)
    sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:-1].clone()
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"k_proj\.weight has shape \[63, 64\], the config needs \[64, 64\]"):
        load_hf_weights(tmp_path, cfg)

    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="model.safetensors: cannot open"):
        load_hf_weights(tmp_path, cfg)
    with pytest.raises(WeightsError, match="neither model.safetensors"):
        load_hf_weights(tmp_path / "empty", cfg)
    with pytest.raises(WeightsError, match="no config.json"):
        config_from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{\"hidden_size\": 64")
    with pytest.raises(WeightsError, match="cannot read config.json"):
        config_from_hf_dir(tmp_path)


LLAMA_32_1B_CONFIG = {  # config.json of meta-llama/Llama-3.2-1B as published on the Hub
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}


def test_config_of_the_real_llama_1b(tmp_path) -> None:
    from megasynth.lowering.models import MODELS

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B_CONFIG))
    assert config_from_hf_dir(tmp_path) == MODELS["llama-1b"].config
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_32_1B_CONFIG, "hidden_act": "gelu"}))
    with pytest.raises(WeightsError, match=r"\$\.hidden_act = 'gelu'"):
        config_from_hf_dir(tmp_path)


def test_bf16_checkpoint_loads_in_any_dtype(tmp_path) -> None:
    from megasynth.lowering.models import MODELS

    cfg = MODELS["tiny"].config
    weights = random_weights(cfg, dtype=torch.bfloat16)
    write_checkpoint(tmp_path, cfg, weights)
    as_bf16 = load_hf_weights(tmp_path, cfg, dtype=torch.bfloat16)
    as_fp32 = load_hf_weights(tmp_path, cfg)
    for name in weights:
        assert as_bf16[name].dtype == torch.bfloat16 and torch.equal(as_bf16[name], weights[name])
        assert as_fp32[name].dtype == torch.float32 and torch.equal(as_fp32[name], weights[name].float())
