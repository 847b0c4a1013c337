"""Random weights: one rule per tensor (`random_tensor`), which `random_weights` and the search's GPU timer both draw
by, tensor by tensor in `weight_shapes` order."""

from __future__ import annotations

import torch

from megasynth.kernels.weights import random_tensor, random_weights, weight_shapes
from megasynth.lowering.models import get_model


def test_random_weights_are_random_tensor_in_weight_shapes_order() -> None:
    """Drawing each tensor with `random_tensor` from one generator, as `search.evaluate.GpuTimer` does on the GPU,
    gives exactly `random_weights`."""
    for name in ("tiny-qwen2", "tiny-qwen3"):
        cfg = get_model(name).config
        gen = torch.Generator().manual_seed(7)
        drawn = {n: random_tensor(cfg, n, s, gen) for n, s in weight_shapes(cfg).items()}
        want = random_weights(cfg, seed=7)
        assert set(want) - set(drawn) <= {"lm_head"}
        assert all(torch.equal(drawn[n], want[n]) for n in drawn), name


def test_the_rule_per_kind_of_tensor() -> None:
    """QKV biases 0.1 normal (around 0), norm weights (QK-norm too) 1 + 0.1 normal, matrices normal / sqrt(fan_in),
    the embedding normal / sqrt(H) when the head is tied and normal otherwise."""
    gen = torch.Generator().manual_seed(0)
    q2, q3 = get_model("tiny-qwen2").config, get_model("tiny-qwen3").config
    bias = random_tensor(q2, "layers.0.bqkv", (4096,), gen)
    assert abs(float(bias.mean())) < 0.02 and 0.09 < float(bias.std()) < 0.11
    for cfg, name in ((q3, "layers.1.q_norm"), (q2, "final_norm")):
        norm = random_tensor(cfg, name, (4096,), gen)
        assert abs(float(norm.mean()) - 1) < 0.02 and 0.09 < float(norm.std()) < 0.11
    mat = random_tensor(q2, "layers.0.wo", (64, 400), gen)
    assert abs(float(mat.std()) * 20 - 1) < 0.05
    assert q2.tie_word_embeddings and not q3.tie_word_embeddings
    tied = random_tensor(q2, "embed", (64, q2.hidden_size), gen)
    untied = random_tensor(q3, "embed", (64, q3.hidden_size), gen)
    assert abs(float(tied.std()) * q2.hidden_size ** 0.5 - 1) < 0.05 and abs(float(untied.std()) - 1) < 0.05
