"""transformers' model of a catalogue config with our weights: the oracle the tests compare the reference with and the
HF baseline of the bench. The family (`ModelConfig` has no model_type) is the one the config's features name:
`qk_norm` is Qwen3, `qkv_bias` Qwen2, else Llama; Mistral (the Llama architecture without a sliding window, which
the checkpoint reader refuses) is built only when asked for by name, as it computes what Llama does."""

from __future__ import annotations

from typing import Any

from megasynth.ir.model import HF_FAMILIES, ModelConfig


class HFStateMismatch(ValueError):
    """The transformers model's parameters and our weights' names disagree (the message lists a few of each)."""


def hf_family(cfg: ModelConfig, model_type: str | None = None) -> str:
    """The HF model_type of `cfg` (a key of `HF_FAMILIES`): `model_type` when given (checked against the config's
    features), else the one its features name."""
    inferred = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    if model_type is None:
        return inferred
    if model_type not in HF_FAMILIES:
        raise ValueError(f"model_type {model_type!r}: not one of {', '.join(HF_FAMILIES)}")
    _, bias, qk_norm, _ = HF_FAMILIES[model_type]
    if (bias, qk_norm) != (cfg.qkv_bias, cfg.qk_norm):
        raise ValueError(f"model_type {model_type!r} has qkv_bias={bias}, qk_norm={qk_norm}; the config has "
                         f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}")
    return model_type


def hf_config(cfg: ModelConfig, model_type: str | None = None, max_position_embeddings: int = 4096,
              attn_implementation: str | None = "eager") -> Any:
    """The transformers config of `cfg` (LlamaConfig, MistralConfig, Qwen2Config or Qwen3Config)."""
    import transformers

    family = hf_family(cfg, model_type)
    scaling = cfg.rope_scaling_dict()
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    # rope_theta and rope_scaling too: transformers before 5 reads those, 5 reads rope_parameters
    return transformers.AutoConfig.for_model(
        family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.hd, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope, rope_theta=cfg.rope_theta,
        rope_scaling=scaling, max_position_embeddings=max_position_embeddings, sliding_window=None, **extra)


def hf_causal_lm(cfg: ModelConfig, weights: dict[str, Any], model_type: str | None = None, device: Any = "cpu",
                 dtype: Any = None, max_position_embeddings: int = 4096,
                 attn_implementation: str | None = "eager") -> Any:
    """transformers' `*ForCausalLM` of `cfg`'s family with `weights` (the catalogue's packing) loaded, in eval mode,
    on `device` in `dtype` (default fp32). Raises `HFStateMismatch` when a parameter is missing or left over (a tied
    head's `lm_head.weight` is the embedding, not missing)."""
    import torch
    import transformers

    from megasynth.kernels.weights import to_hf_state_dict

    config = hf_config(cfg, model_type, max_position_embeddings, attn_implementation)
    arch = HF_FAMILIES[hf_family(cfg, model_type)][0]
    with torch.device(device):  # initialise on the device: a 1B model's random init on the CPU takes long
        model = getattr(transformers, arch)(config).to(dtype=dtype or torch.float32)
    state = to_hf_state_dict(weights, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    del state
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise HFStateMismatch(f"HF state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()
