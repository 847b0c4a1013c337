"""The PyTorch side of the bench: the decode step as a user would write it in plain bf16 PyTorch (the baseline the
megakernel is compared with), transformers' model of the family (Llama, Qwen2, Qwen3) on the same weights, the random
KV history every variant attends over, and the check of a variant's logits against the fp32 reference
(`megasynth.kernels.reference`, the oracle)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megasynth.ir.model import ModelConfig
from megasynth.measure.options import BenchError, Skip

#: relative L2 error of the logits against the fp32 reference within which a step computes the reference's logits
CHECK_TOL = 2e-2
#: the error a PyTorch step may have and still be the best PyTorch line, with the same greedy token: a plain bf16 step
#: rounds every activation to bf16, which on random-weight llama-1b puts its logits ~3e-2 from the fp32 reference
#: (llama-8b ~2.6e-2; the megakernel, computing in fp32, ~3e-6); a wrong step (say, RoPE off) is off by ~1
PYTORCH_TOL = 5e-2
#: in a batch, a sequence whose greedy token differs is a near-tie (rounding, not a wrong step) when the reference's
#: top-2 margin is at most this many rms errors of its logits
NEAR_TIE = 3.0


def kv_history(cfg: ModelConfig, max_seq_len: int, ctx: int, seed: int, batch: int | None = None) -> tuple[Any, Any]:
    """Random K/V for positions [0, ctx - 1) (fp32, CPU, seeded): the history every variant attends over,
    [L, nKV, ctx - 1, hd]; for a `batch`, [L, B, nKV, ctx - 1, hd] with a history of its own per sequence (sequence 0
    gets the batch-1 history, so a batch extends the batch-1 run rather than replacing it)."""
    import torch

    if batch is not None:
        pairs = [kv_history(cfg, max_seq_len, ctx, seed + 104729 * b) for b in range(batch)]
        return torch.stack([p[0] for p in pairs], dim=1), torch.stack([p[1] for p in pairs], dim=1)
    gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * ctx)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max(ctx - 1, 0), cfg.hd)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def prefill(k_cache: Any, v_cache: Any, hist: tuple[Any, Any]) -> None:
    """Write the history into caches [L, nKV, S, hd] (or [L, B, nKV, S, hd], a batch's) and zero the rest (so a
    stale step cannot leak in)."""
    n = hist[0].shape[-2]
    for cache, h in zip((k_cache, v_cache), hist, strict=True):
        cache.zero_()
        cache[..., :n, :].copy_(h.to(device=cache.device, dtype=cache.dtype))


def batch_tokens(token: int, batch: int, vocab_size: int) -> list[int]:
    """The token each sequence of a batch decodes: `token`, then the next ids (each sequence its own token, so a
    step that mixed up sequences would show in the logits)."""
    return [(token + b) % vocab_size for b in range(batch)]


@contextlib.contextmanager
def static_rope(cfg: ModelConfig, pos: int, device: str) -> Iterator[None]:
    """Serve `kernels.reference.rope_cos_sin` from device tensors made once, so the reference step can be captured
    in a CUDA graph (its host-to-device copy from pageable memory cannot be)."""
    from megasynth.kernels import reference

    orig = reference.rope_cos_sin
    cos, sin = orig(cfg, pos, device)

    def cached(c: ModelConfig, p: int, d: Any = "cpu") -> tuple[Any, Any]:
        return cos, sin

    reference.rope_cos_sin = cached  # type: ignore[assignment]
    try:
        yield
    finally:
        reference.rope_cos_sin = orig  # type: ignore[assignment]


@dataclass
class StepLayer:
    attn_norm: Any
    wqkv: Any  # [q + 2 kv, H]: Q, K and V in one matrix
    wo: Any
    mlp_norm: Any
    w_gate_up: Any  # [2 I, H]: gate and up in one matrix
    w_down: Any
    bqkv: Any = None  # [q + 2 kv] with qkv_bias (Qwen2), else None
    qk_norm: Any = None  # [nH + nKV, hd] with qk_norm (Qwen3): q_norm per query head, then k_norm per KV head


@dataclass
class StepWeights:
    """The weights laid out for the bf16 step, made once: bf16, QKV and gate/up each one matrix."""

    embed: Any
    final_norm: Any
    lm_head: Any
    layers: list[StepLayer]

    def tensors(self) -> list[Any]:
        """Every tensor the step reads (the features a model lacks are None and left out)."""
        out = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers:
            out += [t for t in (lw.attn_norm, lw.wqkv, lw.wo, lw.mlp_norm, lw.w_gate_up, lw.w_down, lw.bqkv,
                                lw.qk_norm) if t is not None]
        return out


def step_weights(cfg: ModelConfig, weights: dict[str, Any]) -> StepWeights:
    """Cast to bf16, concatenate gate and up, and stack the QK-norm weights per head (copies only where needed: bf16
    weights are shared, not copied)."""
    import torch

    def bf(t: Any) -> Any:
        return t.to(torch.bfloat16).contiguous()

    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd
    layers = []
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        qk_norm = None
        if cfg.qk_norm:  # one multiply after one F.rms_norm over all q and k heads
            qk_norm = torch.cat([bf(weights[p + "q_norm"]).expand(nh, hd), bf(weights[p + "k_norm"]).expand(nkv, hd)])
        layers.append(StepLayer(bf(weights[p + "attn_norm"]), bf(weights[p + "wqkv"]), bf(weights[p + "wo"]),
                                bf(weights[p + "mlp_norm"]),
                                torch.cat([bf(weights[p + "w_gate"]), bf(weights[p + "w_up"])]),
                                bf(weights[p + "w_down"]),
                                bf(weights[p + "bqkv"]) if cfg.qkv_bias else None, qk_norm))
    return StepWeights(bf(weights["embed"]), bf(weights["final_norm"]), bf(weights["lm_head"]), layers)


def bf16_rope(cfg: ModelConfig, pos: int, device: Any) -> tuple[Any, Any]:
    """cos and sin [hd] at `pos` in bf16 (computed in float64 by the reference, rounded once, as HF Llama does)."""
    import torch

    from megasynth.kernels.reference import rope_cos_sin

    cos, sin = rope_cos_sin(cfg, pos, device)
    return cos.to(torch.bfloat16), sin.to(torch.bfloat16)


def bf16_decode_step(cfg: ModelConfig, w: StepWeights, k_cache: Any, v_cache: Any, token: int, pos: int,
                     cos: Any, sin: Any, kv_at: tuple[Any, Any] | None = None) -> Any:
    """The decode step in plain bf16 PyTorch, the strongest a user writes without custom kernels: activations,
    weights and KV cache in bf16 (cuBLAS accumulates in fp32), one QKV matmul (with its bias, Qwen2) and one gate/up
    matmul per layer, `F.rms_norm` (also over each q and k head before RoPE, Qwen3), RoPE on Q and K together,
    `F.scaled_dot_product_attention` with GQA over the cache up to `pos`. Returns fp32 logits [V]; writes the new K/V
    at `pos`. A baseline only: the oracle stays megasynth.kernels.reference.

    `kv_at` (`kv_write_index`: the layer indices and `pos` as device tensors) writes the same K/V rows with one
    `index_put_` on the whole cache instead of a slice assignment, for torch.compile: functionalization turns a slice
    assignment into a view of the [L, nKV, S, hd] cache into a select_scatter that inductor does not reinplace, so
    the compiled step rebuilds (copies) the whole cache every step; an index_put_ it updates in place."""
    import torch.nn.functional as F

    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd, cfg.rms_norm_eps
    dim, half = (cfg.hidden_size,), hd // 2
    x = w.embed[token:token + 1]  # [1, H]
    for layer, lw in enumerate(w.layers):
        qkv = F.linear(F.rms_norm(x, dim, lw.attn_norm, eps), lw.wqkv, lw.bqkv)
        qk = qkv[0, :cfg.q_size + cfg.kv_size].view(nh + nkv, hd)
        if lw.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), eps=eps) * lw.qk_norm
        rot = _rotate_half(qk, half)
        qk = qk * cos + rot * sin
        k_new, v_new = qk[nh:], qkv[0, cfg.q_size + cfg.kv_size:].view(nkv, hd)
        if kv_at is None:
            k_cache[layer, :, pos] = k_new
            v_cache[layer, :, pos] = v_new
        else:
            at = (kv_at[0][layer:layer + 1], slice(None), kv_at[1])  # [1] indices: one [1, nKV, hd] row block
            k_cache[at] = k_new[None]
            v_cache[at] = v_new[None]
        o = F.scaled_dot_product_attention(qk[:nh].view(1, nh, 1, hd), k_cache[layer, :, :pos + 1][None],
                                           v_cache[layer, :, :pos + 1][None], enable_gqa=nh != nkv)
        x = x + F.linear(o.reshape(1, nh * hd), lw.wo)
        gate, up = F.linear(F.rms_norm(x, dim, lw.mlp_norm, eps), lw.w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, lw.w_down)
    return F.linear(F.rms_norm(x, dim, w.final_norm, eps), w.lm_head).float().reshape(-1)


def bf16_decode_batch(cfg: ModelConfig, w: StepWeights, k_cache: Any, v_cache: Any, token_ids: Any, pos: int,
                      cos: Any, sin: Any, kv_at: tuple[Any, Any] | None = None) -> Any:
    """`bf16_decode_step` for a batch of B sequences at the same `pos`, as one step: every matmul over [B, H]
    activations (each weight read once for the whole batch), SDPA of [B, nH, 1, hd] queries over each sequence's
    cache slot [B, nKV, pos + 1, hd] (equal positions: no mask), the new K/V written into each slot at `pos`.
    `token_ids` is a device int64 tensor [B] (fixed address, so a CUDA graph replays the step); the caches are
    [L, B, nKV, S, hd]. Returns fp32 logits [B, V]. The batch-1 bench keeps `bf16_decode_step`; with one slot this
    computes its logits bit for bit.

    `kv_at` as for `bf16_decode_step` (`kv_write_index`): one `index_put_` per cache, for torch.compile."""
    import torch.nn.functional as F

    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd, cfg.rms_norm_eps
    dim, half, qkv_end = (cfg.hidden_size,), hd // 2, cfg.q_size + cfg.kv_size
    b = k_cache.shape[1]
    x = w.embed[token_ids]  # [B, H]
    for layer, lw in enumerate(w.layers):
        qkv = F.linear(F.rms_norm(x, dim, lw.attn_norm, eps), lw.wqkv, lw.bqkv)  # [B, q + 2 kv]
        qk = qkv[:, :qkv_end].view(b, nh + nkv, hd)
        if lw.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), eps=eps) * lw.qk_norm
        rot = _rotate_half(qk, half)
        qk = qk * cos + rot * sin
        k_new, v_new = qk[:, nh:], qkv[:, qkv_end:].view(b, nkv, hd)  # [B, nKV, hd]
        if kv_at is None:
            k_cache[layer, :, :, pos] = k_new
            v_cache[layer, :, :, pos] = v_new
        else:
            at = (kv_at[0][layer:layer + 1], slice(None), slice(None), kv_at[1])  # one [1, B, nKV, hd] block
            k_cache[at] = k_new[None]
            v_cache[at] = v_new[None]
        o = F.scaled_dot_product_attention(qk[:, :nh].view(b, nh, 1, hd), k_cache[layer, :, :, :pos + 1],
                                           v_cache[layer, :, :, :pos + 1], enable_gqa=nh != nkv)
        x = x + F.linear(o.reshape(b, nh * hd), lw.wo)
        gate, up = F.linear(F.rms_norm(x, dim, lw.mlp_norm, eps), lw.w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, lw.w_down)
    return F.linear(F.rms_norm(x, dim, w.final_norm, eps), w.lm_head).float()


def kv_write_index(cfg: ModelConfig, pos: int, device: Any) -> tuple[Any, Any]:
    """`bf16_decode_step`'s `kv_at`: every layer's index [L] and `pos` [1] (int64, made once, fixed addresses so a
    CUDA graph can replay the step). One-element index tensors, not 0-d ones, which dynamo reads back to the host."""
    import torch

    return (torch.arange(cfg.num_hidden_layers, device=device),
            torch.tensor([pos], dtype=torch.int64, device=device))


def _rotate_half(x: Any, half: int) -> Any:
    """rotate_half: [-x2, x1] of the two halves of the last dimension (HF Llama's RoPE layout)."""
    import torch

    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def hf_model(cfg: ModelConfig, weights: dict[str, Any], device: str, dtype: Any, model_type: str | None = None) -> Any:
    """transformers' model of the config's family (`megasynth.kernels.hf`: Qwen3ForCausalLM with qk_norm,
    Qwen2ForCausalLM with qkv_bias, else LlamaForCausalLM; `model_type` names one, e.g. "mistral") with our weights,
    transformers' default attention (raises Skip when transformers is missing)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Skip("transformers is not installed") from None
    from megasynth.kernels.hf import HFStateMismatch, hf_causal_lm

    try:
        return hf_causal_lm(cfg, weights, model_type, device=device, dtype=dtype, max_position_embeddings=131072,
                            attn_implementation=None)
    except HFStateMismatch as exc:
        raise BenchError(str(exc)) from None


def compare(logits: Any, ref: Any) -> dict[str, Any]:
    """Relative L2 error against the reference logits and whether the greedy token agrees. For a batch's logits
    [B, V] the error is over all of them (`rel_l2_max`: the worst sequence's) and the greedy token must agree for
    every sequence except near-ties: a sequence whose reference top-2 margin is within NEAR_TIE times the rms error
    of its logits may flip by rounding alone (with many sequences one such tie is likely, and would otherwise
    disqualify a correct bf16 step); `argmax_agree` counts the sequences that agree, `near_ties` those excused."""
    if ref.dim() == 2 and tuple(logits.shape) == tuple(ref.shape):
        a2, b2 = logits.detach().float().cpu(), ref.detach().float().cpu()
        per_seq = [compare(x, y) for x, y in zip(a2, b2, strict=True)]
        ties = [not c["argmax_match"] and c["ref_top2_margin"] <= NEAR_TIE * c["rel_l2"] * float(y.norm())
                / len(y) ** 0.5 for c, y in zip(per_seq, b2, strict=True)]
        out = compare(a2.reshape(-1), b2.reshape(-1))
        out.update(argmax_match=all(c["argmax_match"] or tie for c, tie in zip(per_seq, ties, strict=True)),
                   argmax_agree=sum(c["argmax_match"] for c in per_seq), near_ties=sum(ties),
                   ref_top2_margin=min(c["ref_top2_margin"] for c in per_seq),
                   rel_l2_max=max(c["rel_l2"] for c in per_seq))
        return out
    a, b = logits.detach().float().reshape(-1).cpu(), ref.detach().float().reshape(-1).cpu()
    if a.shape != b.shape:
        return {"rel_l2": None, "argmax_match": False, "note": f"shape {tuple(a.shape)} != {tuple(b.shape)}"}
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    top2 = b.topk(2).values
    return {"rel_l2": rel, "argmax_match": bool(a.argmax() == b.argmax()),
            "ref_top2_margin": float(top2[0] - top2[1])}


def check_ok(check: dict[str, Any] | None, tol: float = CHECK_TOL) -> bool:
    """Whether a variant's logits are within `tol` of the reference's (relative L2; of a batch, every sequence's)."""
    check = check or {}
    rel = check.get("rel_l2_max", check.get("rel_l2"))
    return rel is not None and rel <= tol


def greedy_agreement(cfg: ModelConfig, weights: dict[str, Any], tokens: list[int], max_seq_len: int, device: str,
                     margin: float = 0.05) -> dict[str, Any]:
    """Teacher-force `tokens` (prompt first) through the reference: at each position, does its argmax equal the next
    token? Disagreements where the reference's top-2 margin exceeds `margin` are real errors, not near-ties."""
    import torch

    from megasynth.kernels.reference import decode_step, new_kv_cache

    k, v = new_kv_cache(cfg, max_seq_len, dtype=weights["embed"].dtype, device=device)
    agree, clear = 0, []
    with torch.inference_mode():
        for pos in range(len(tokens) - 1):
            top = decode_step(cfg, weights, k, v, tokens[pos], pos).topk(2)
            if int(top.indices[0]) == tokens[pos + 1]:
                agree += 1
            elif float(top.values[0] - top.values[1]) > margin:
                clear.append(pos)
    return {"steps": len(tokens) - 1, "agree": agree, "clear_mismatches": clear, "margin": margin}
