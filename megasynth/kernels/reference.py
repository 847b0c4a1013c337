"""The PyTorch reference decode step: the independent oracle the executors and the catalogue are checked by.

Plain functions that read like the equations (gpt-fast style). It deliberately does not call the catalogue's compute
functions; it shares only the RoPE frequencies (`megasynth.ir.catalogue.rope_inv_freq`, one owner of Llama-3 scaling)
and the KV cache layout [L, nKV, S, hd].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megasynth.ir.catalogue import rope_inv_freq
from megasynth.ir.model import ModelConfig

Weights = dict[str, torch.Tensor]


def new_kv_cache(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed K and V caches shaped [L, nKV, S, hd] (the catalogue's layout), or [L, B, nKV, S, hd] with one slot
    per sequence for a `batch`."""
    shape = (cfg.num_hidden_layers, *(() if batch is None else (batch,)), cfg.num_key_value_heads, max_seq_len,
             cfg.hd)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def rope_cos_sin(cfg: ModelConfig, pos: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles at position `pos`, fp32 [hd] (HF layout: the half-angles repeated).

    Angles are computed in float64 so that long positions stay exact to fp32 rounding; shared with the executors.
    """
    inv_freq = torch.tensor(rope_inv_freq(cfg), dtype=torch.float64)
    angles = pos * inv_freq
    emb = torch.cat([angles, angles])
    return emb.cos().float().to(device), emb.sin().float().to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of x [heads, hd]."""
    return x * cos + rotate_half(x) * sin


def attention(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [nH, hd] over keys/values [nKV, T, hd] with GQA; returns [nH * hd]."""
    keys = keys.repeat_interleave(cfg.group_size, dim=0)  # [nH, T, hd]
    values = values.repeat_interleave(cfg.group_size, dim=0)
    scores = torch.einsum("hd,htd->ht", q, keys) / math.sqrt(cfg.hd)
    return torch.einsum("ht,htd->hd", scores.softmax(dim=-1), values).reshape(-1)


def decode_step(cfg: ModelConfig, weights: Weights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                token: int, pos: int) -> torch.Tensor:
    """One decode step: fp32 logits [V] of `token` at position `pos`; appends its K/V at `pos` into the caches.

    Computes in fp32 from weights of any dtype; the caches keep their own dtype (K/V are rounded on the way in).
    """
    if not 0 <= token < cfg.vocab_size:
        raise ValueError(f"token {token} outside the vocabulary [0, {cfg.vocab_size})")
    if not 0 <= pos < k_cache.shape[2]:
        raise ValueError(f"pos {pos} outside the KV cache [0, {k_cache.shape[2]})")
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd, cfg.rms_norm_eps
    cos, sin = rope_cos_sin(cfg, pos, k_cache.device)
    x = weights["embed"][token].float()
    for layer in range(cfg.num_hidden_layers):
        names = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
                 *(("bqkv",) if cfg.qkv_bias else ()), *(("q_norm", "k_norm") if cfg.qk_norm else ()))
        w = {name: weights[f"layers.{layer}.{name}"].float() for name in names}
        # attention block: x = x + wo @ attention(rope(qk_norm(q)), rope(qk_norm(k)), v)
        qkv = w["wqkv"] @ rms_norm(x, w["attn_norm"], eps)
        if cfg.qkv_bias:  # Qwen2: q, k and v projections carry a bias
            qkv = qkv + w["bqkv"]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        q, k = q.view(nh, hd), k.view(nkv, hd)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
            q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
        q = apply_rope(q, cos, sin)
        k_cache[layer, :, pos] = apply_rope(k, cos, sin).to(k_cache.dtype)
        v_cache[layer, :, pos] = v.view(nkv, hd).to(v_cache.dtype)
        o = attention(cfg, q, k_cache[layer, :, :pos + 1].float(), v_cache[layer, :, :pos + 1].float())
        x = x + w["wo"] @ o
        # MLP block: x = x + w_down @ (silu(w_gate @ h) * (w_up @ h))
        h = rms_norm(x, w["mlp_norm"], eps)
        x = x + w["w_down"] @ (F.silu(w["w_gate"] @ h) * (w["w_up"] @ h))
    return weights["lm_head"].float() @ rms_norm(x, weights["final_norm"], eps)


def decode_batch(cfg: ModelConfig, weights: Weights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tokens: list[int], positions: list[int]) -> torch.Tensor:
    """One decode step of a batch: each sequence alone, with its own cache slot ([L, B, nKV, S, hd]) and its own
    position; fp32 logits [B, V]. The oracle for batched schedules is the batch-1 step, sequence by sequence."""
    if not len(tokens) == len(positions) == k_cache.shape[1] == v_cache.shape[1]:
        raise ValueError(f"{len(tokens)} tokens, {len(positions)} positions and caches of {k_cache.shape[1]} slots "
                         "must agree")
    return torch.stack([decode_step(cfg, weights, k_cache[:, b], v_cache[:, b], t, p)
                        for b, (t, p) in enumerate(zip(tokens, positions, strict=True))])
