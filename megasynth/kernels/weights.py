"""Model weights in the catalogue's packing: seeded random weights, and Hugging Face safetensors checkpoints.

Names and shapes (megasynth/ir/catalogue.py): `embed` [V,H]; per layer `layers.{l}.attn_norm` [H], `layers.{l}.wqkv`
[q+2kv, H] (HF q_proj, k_proj, v_proj stacked by rows), `layers.{l}.wo` [H, nH*hd], `layers.{l}.mlp_norm` [H],
`layers.{l}.w_gate` [I,H], `layers.{l}.w_up` [I,H], `layers.{l}.w_down` [H,I]; `final_norm` [H]; `lm_head` [V,H],
the very same tensor as `embed` when the head is tied. With `qkv_bias` (Qwen2), `layers.{l}.bqkv` [q+2kv] (HF q, k, v
biases stacked); with `qk_norm` (Qwen3), `layers.{l}.q_norm` [hd] and `layers.{l}.k_norm` [hd].
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from megasynth.ir.model import CheckpointConfigError, HFModel, ModelConfig, read_hf_config

Weights = dict[str, torch.Tensor]


class WeightsError(ValueError):
    """A checkpoint does not fit the config: the message names the file and the tensor."""


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name with its shape, in a fixed order (the order random_weights draws them)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes.update({
            p + "attn_norm": (h,),
            p + "wqkv": (cfg.qkv_size, h),
            **({p + "bqkv": (cfg.qkv_size,)} if cfg.qkv_bias else {}),
            **({p + "q_norm": (cfg.hd,), p + "k_norm": (cfg.hd,)} if cfg.qk_norm else {}),
            p + "wo": (h, cfg.q_size),
            p + "mlp_norm": (h,),
            p + "w_gate": (i, h),
            p + "w_up": (i, h),
            p + "w_down": (h, i),
        })
    shapes["final_norm"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    return shapes


def random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], gen: torch.Generator,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """One weight drawn by the rule of `random_weights` (fp32, on `device`, from `gen`, which must live there)."""
    if name.endswith(".bqkv"):
        return 0.1 * torch.randn(shape, generator=gen, device=device)
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    t = torch.randn(shape, generator=gen, device=device)
    if name != "embed":
        return t / math.sqrt(shape[1])
    return t / math.sqrt(cfg.hidden_size) if cfg.tie_word_embeddings else t


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", draw_on: str = "cpu") -> Weights:
    """Seeded random weights that keep activations O(1) over many layers (so bf16 comparisons mean something).

    Matrices are normal / sqrt(fan_in), so a matvec of an O(1) vector is O(1); norm weights are 1 + 0.1 * normal,
    QKV biases 0.1 * normal.
    The embedding is normal / sqrt(H) when tied (logits O(1)) and normal otherwise (`random_tensor` owns the rule).
    Values are drawn from one `torch.Generator(seed)` on `draw_on` in `weight_shapes` order, then cast and moved
    tensor by tensor (peak extra memory: one tensor). The default draws on the CPU, so the values do not depend on
    the device; `draw_on="cuda"` draws on the GPU (llama-1b in about a second instead of ~20 s) with values of its
    own.
    """
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    out: Weights = {}
    for name, shape in weight_shapes(cfg).items():
        out[name] = random_tensor(cfg, name, shape, gen, draw_on).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        out["lm_head"] = out["embed"]
    return out


# --------------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def _hf_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our name -> the HF tensor names it is made of (several are stacked by rows)."""
    names: dict[str, list[str]] = {"embed": ["model.embed_tokens.weight"]}
    for layer in range(cfg.num_hidden_layers):
        p, hf = f"layers.{layer}.", f"model.layers.{layer}."
        names.update({
            p + "attn_norm": [hf + "input_layernorm.weight"],
            p + "wqkv": [hf + f"self_attn.{x}_proj.weight" for x in "qkv"],
            **({p + "bqkv": [hf + f"self_attn.{x}_proj.bias" for x in "qkv"]} if cfg.qkv_bias else {}),
            **({p + "q_norm": [hf + "self_attn.q_norm.weight"], p + "k_norm": [hf + "self_attn.k_norm.weight"]}
               if cfg.qk_norm else {}),
            p + "wo": [hf + "self_attn.o_proj.weight"],
            p + "mlp_norm": [hf + "post_attention_layernorm.weight"],
            p + "w_gate": [hf + "mlp.gate_proj.weight"],
            p + "w_up": [hf + "mlp.up_proj.weight"],
            p + "w_down": [hf + "mlp.down_proj.weight"],
        })
    names["final_norm"] = ["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    return names


def _hf_part_shapes(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    if name.endswith((".wqkv", ".bqkv")):
        rest = shape[1:]
        return [(cfg.q_size, *rest), (cfg.kv_size, *rest), (cfg.kv_size, *rest)]
    return [shape]


def to_hf_state_dict(weights: Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of load_hf_weights: HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` names (no
    `lm_head.weight` when tied).

    Tensors are fresh copies (no shared storage), so the result can go straight to `safetensors.torch.save_file`.
    """
    out: dict[str, torch.Tensor] = {}
    for name, hf_names in _hf_names(cfg).items():
        if len(hf_names) == 1:
            out[hf_names[0]] = weights[name].clone()
        else:
            parts = torch.split(weights[name], [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            out.update({n: t.clone() for n, t in zip(hf_names, parts, strict=True)})
    return out


def config_from_hf_dir(path: str | Path) -> ModelConfig:
    """Read a checkpoint folder's config.json (each family's HF defaults where a key is absent); anything the
    megakernel cannot run raises `WeightsError` naming the file and the key."""
    return read_checkpoint(path).config


def read_checkpoint(path: str | Path) -> HFModel:
    """`config_from_hf_dir` with the family and the longest context (`max_position_embeddings`)."""
    try:
        return read_hf_config(path)
    except CheckpointConfigError as exc:
        raise WeightsError(str(exc)) from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: cannot read $.weight_map: {exc}") from None
        return {name: folder / file for name, file in weight_map.items()}
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as fh:
                return {name: single for name in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
        except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
            raise WeightsError(f"{single}: cannot open: {exc}") from None
    raise WeightsError(f"{folder}: neither model.safetensors nor model.safetensors.index.json found")


def load_hf_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Weights:
    """Load an HF safetensors checkpoint folder (Llama, Mistral, Qwen2, Qwen3) into the catalogue's packing; shapes
    are checked against cfg."""
    from safetensors import safe_open

    folder = Path(path)
    where = _tensor_files(folder)
    handles: dict[Path, Any] = {}

    def get(hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = where.get(hf_name)
        if file is None:
            raise WeightsError(f"{folder}: tensor {hf_name} is missing from the checkpoint")
        if file not in handles:
            try:
                handles[file] = safe_open(str(file), framework="pt")
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
                raise WeightsError(f"{file}: cannot open: {exc}") from None
        try:
            t = handles[file].get_tensor(hf_name)
        except Exception as exc:  # noqa: BLE001 (a missing key in a broken index lands here)
            raise WeightsError(f"{file}: cannot read tensor {hf_name}: {exc}") from None
        if tuple(t.shape) != shape:
            raise WeightsError(f"{file}: tensor {hf_name} has shape {list(t.shape)}, the config needs {list(shape)}")
        return t

    out: Weights = {}
    shapes = weight_shapes(cfg)
    for name, hf_names in _hf_names(cfg).items():
        parts = [get(n, s) for n, s in zip(hf_names, _hf_part_shapes(cfg, name, shapes[name]), strict=True)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        out[name] = t.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        out["lm_head"] = out["embed"]
    return out


def model_weights(cfg: ModelConfig, weights_dir: str | Path | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Weights:
    """The weights a command runs on (`--weights DIR`): a Hugging Face checkpoint folder, whose config.json must
    describe `cfg`; else random weights from `seed`."""
    if weights_dir is None:
        return random_weights(cfg, seed=seed, dtype=dtype, device=device)
    found = config_from_hf_dir(weights_dir)
    if found != cfg:
        diff = [k for k, v in found.to_hf().items() if cfg.to_hf().get(k) != v]
        raise WeightsError(f"{Path(weights_dir) / 'config.json'}: does not match the model spec "
                           f"(differs in {', '.join(diff) or 'its sizes'})")
    return load_hf_weights(weights_dir, cfg, dtype=dtype, device=device)
