"""Shared test fixtures: the tiny model configs, the HF `LlamaForCausalLM` oracle built from our weights, and tiny
checkpoints of each family written by transformers."""

from __future__ import annotations

from typing import Any

import pytest

from megasynth.ir.model import ModelConfig
from megasynth.lowering.models import MODELS

TINY = ["tiny", "tiny-mha", "tiny-gqa4"]


def hf_llama(cfg: ModelConfig, weights: dict[str, Any], max_position_embeddings: int = 4096) -> Any:
    """An fp32 eager `transformers.LlamaForCausalLM` with `weights` loaded (the oracle for kernels/reference.py)."""
    from megasynth.kernels.hf import hf_causal_lm

    model = hf_causal_lm(cfg, weights, "llama", max_position_embeddings=max_position_embeddings)
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


#: Tiny configs of each family transformers can build, as `save_hf_checkpoint` takes them: (config class, kwargs).
HF_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128,
                              "tie_word_embeddings": True, "rope_theta": 1000000.0, "max_position_embeddings": 64,
                              "rms_norm_eps": 1e-6}),
    "qwen2": ("Qwen2Config", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                              "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 64,
                              "rms_norm_eps": 1e-6}),
    "llama-hd": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                 "vocab_size": 128, "tie_word_embeddings": False, "max_position_embeddings": 64,
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                 "rope_theta": 500000.0, "rms_norm_eps": 1e-5}),
    "mistral": ("MistralConfig", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 128,
                                  "tie_word_embeddings": False, "sliding_window": None, "max_position_embeddings": 64,
                                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-5}),
}


def save_hf_checkpoint(folder: Any, family: str, seed: int = 0, **overrides: Any) -> Any:
    """Write a tiny random checkpoint of `family` (HF_TINY) with transformers' `save_pretrained`; return the model.

    Parameters are redrawn so that activations stay O(1) (HF's 0.02 init makes the logits nearly flat, and greedy
    tokens a coin toss): matrices normal / sqrt(fan_in), norm weights 1 + 0.1 normal, biases 0.1 normal."""
    import math

    import torch
    import transformers

    cls_name, kwargs = HF_TINY[family]
    kwargs = {**kwargs, **overrides}
    rope = kwargs.pop("rope_scaling", None)
    kwargs["rope_parameters"] = {"rope_type": "default", **(rope or {}), "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(folder))
    return model


def shift_k_splits(schedule: Any, op: str, by: int) -> Any:
    """`schedule` with each of `op`'s interior K boundaries moved `by` columns (a K split of a hand-written
    schedule, off the lowering's equal parts): every instruction whose K range starts at a boundary starts there,
    every one ending at it ends there. Coverage stays exact."""
    from megasynth.ir.schedule import parse_schedule

    doc = schedule.to_json()
    ranges = [ins["args"] for ins in doc["instructions"] if ins["op"] == op]
    ends = {a["k_end"] for a in ranges}
    starts = {a["k_start"] for a in ranges}
    for a in ranges:
        if a["k_start"] in ends:
            a["k_start"] += by
        if a["k_end"] in starts:
            a["k_end"] += by
    return parse_schedule(doc)
