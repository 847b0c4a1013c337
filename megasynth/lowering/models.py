"""Named model specs (a table, as gpt-fast does): `llama-1b` is a row, not a class."""

from __future__ import annotations

from dataclasses import dataclass

from megasynth.ir.model import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    config: ModelConfig
    max_seq_len: int


def _llama(hidden, inter, layers, heads, kv, vocab, head_dim=None, theta=500000.0, tie=True, rope=None):
    return ModelConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, head_dim=head_dim,
                       rope_theta=theta, rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_scaling=rope)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("llama-1b", "Llama-3.2-1B", _llama(2048, 8192, 16, 32, 8, 128256, 64, rope=_LLAMA3_ROPE), 4096),
        ModelSpec("llama-3b", "Llama-3.2-3B", _llama(3072, 8192, 28, 24, 8, 128256, 128, rope=_LLAMA3_ROPE), 4096),
        ModelSpec("llama-8b", "Llama-3.1-8B", _llama(4096, 14336, 32, 32, 8, 128256, 128, tie=False,
                                                    rope=_LLAMA3_ROPE), 4096),
        ModelSpec("tiny", "test config: 2 layers, hidden 128, 4 heads, 2 KV heads (GQA)",
                  _llama(128, 256, 2, 4, 2, 256, 32, theta=10000.0), 64),
        ModelSpec("tiny-mha", "test config: 2 layers, hidden 64, 2 heads, no GQA, untied head",
                  _llama(64, 160, 2, 2, 2, 96, 32, theta=10000.0, tie=False), 32),
        ModelSpec("tiny-gqa4", "test config: 3 layers, hidden 256, 8 heads, 2 KV heads, Llama-3 RoPE scaling",
                  _llama(256, 512, 3, 8, 2, 320, 32, rope={**_LLAMA3_ROPE, "original_max_position_embeddings": 16}),
                  128),
    ]
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
