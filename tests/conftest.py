"""Shared test fixtures: the tiny model configs and the HF `LlamaForCausalLM` oracle built from our weights."""

from __future__ import annotations

from typing import Any

import pytest

from megasynth.ir.model import ModelConfig
from megasynth.lowering.models import MODELS

TINY = ["tiny", "tiny-mha", "tiny-gqa4"]


def hf_llama(cfg: ModelConfig, weights: dict[str, Any], max_position_embeddings: int = 4096) -> Any:
    """An fp32 eager `transformers.LlamaForCausalLM` with `weights` loaded (the oracle for kernels/reference.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megasynth.kernels.weights import to_hf_state_dict

    rope = {"rope_type": "default", **(cfg.rope_scaling_dict() or {}), "rope_theta": cfg.rope_theta}
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.hd, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                         rope_parameters=rope, max_position_embeddings=max_position_embeddings,
                         attn_implementation="eager", dtype=torch.float32)
    model = LlamaForCausalLM(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(to_hf_state_dict(weights, cfg), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(params=TINY)
def tiny(request: pytest.FixtureRequest) -> tuple[ModelConfig, int]:
    """(config, max_seq_len) of each tiny test model."""
    spec = MODELS[request.param]
    return spec.config, spec.max_seq_len


@pytest.fixture
def single_thread() -> Any:
    """Run torch on one thread: the tiny models' ops are far too small for a thread pool (5x faster on 2 busy cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
