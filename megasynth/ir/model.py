"""The decoder configuration a schedule refers to (HF-style sizes), and how a Hugging Face config.json maps onto it.

No torch dependency. The family: Llama-3.x, Mistral, Qwen2/Qwen2.5 (bias on the q, k, v projections) and Qwen3
(RMSNorm over each q and k head before RoPE). Everything the megakernel cannot run (mixture of experts, sliding-window
attention, other RoPE scalings, other architectures) is refused with a `ConfigError` that names the config key.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

#: RoPE scalings the catalogue computes (`rope_inv_freq`); "default" means none.
ROPE_TYPES = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """A model config the megakernel cannot run, or one that is malformed; `key` is the config key at fault."""

    def __init__(self, key: str, message: str) -> None:
        self.key, self.message = key, message
        super().__init__(f"{key} {message}")


def _number(key: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(key, f"must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-family decoder, named as in Hugging Face's `LlamaConfig`, plus the two variations the
    catalogue computes: `qkv_bias` (Qwen2: q, k and v projections carry a bias) and `qk_norm` (Qwen3: each q and k head
    is RMS-normalised with its own weights of size head_dim before RoPE)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    #: Llama-3 RoPE frequency scaling as sorted (key, value) pairs (hashable); `None` for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0 \
                and isinstance(self.hidden_size, int):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", f"= {self.num_key_value_heads} must divide num_attention_heads = "
                                                     f"{self.num_attention_heads}")
        if self.head_dim % 2:  # type: ignore[operator]
            raise ConfigError("head_dim", f"must be even (RoPE rotates pairs), got {self.head_dim}")
        _number("rope_theta", self.rope_theta)
        _number("rms_norm_eps", self.rms_norm_eps)
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        try:
            scaling = dict(self.rope_scaling)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError("rope_scaling", f"must be an object or null, got {self.rope_scaling!r}") from None
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ROPE_TYPES:
            raise ConfigError("rope_scaling", f"type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)} "
                                              "or none)")
        for key in _LLAMA3_KEYS:
            _number(f"rope_scaling.{key}", scaling.get(key))
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ConfigError("rope_scaling.high_freq_factor", "must be greater than low_freq_factor")

    # Derived sizes, named once so that every module agrees on them.
    @property
    def hd(self) -> int:
        return int(self.head_dim)  # type: ignore[arg-type]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.hd

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.hd

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights (tied head counted once)."""
        h, i, lyr = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * self.qkv_size + self.q_size * h + 2 * h * i + i * h + 2 * h
        per_layer += self.qkv_size if self.qkv_bias else 0
        per_layer += 2 * self.hd if self.qk_norm else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return dtype_bytes * (lyr * per_layer + self.vocab_size * h + head + h)

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def to_hf(self) -> dict[str, Any]:
        """The schedule's `model.config`: HF names; `qkv_bias` and `qk_norm` only when set, so that a Llama config
        reads exactly as it always has."""
        out = asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict()
        for name in ("qkv_bias", "qk_norm"):
            if not out[name]:
                del out[name]
        return out

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from an HF-style dict; unknown keys (architectures, torch_dtype, ...) are ignored. Raises
        `ConfigError` (a ValueError) naming the key that is missing or invalid."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        for f in fields(cls):
            if f.default is MISSING and f.name not in kwargs:
                raise ConfigError(f.name, "is missing")
        if isinstance(kwargs.get("rope_scaling"), dict):
            kwargs["rope_scaling"] = tuple(sorted(kwargs["rope_scaling"].items()))
        elif kwargs.get("rope_scaling") is not None:
            raise ConfigError("rope_scaling", f"must be an object or null, got {kwargs['rope_scaling']!r}")
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# Device memory: what a model at a max_seq_len needs, checked before anything is allocated

_GB = 1e9
_DTYPE_NAMES = {1: "fp8", 2: "bf16", 4: "fp32"}


class DoesNotFit(Exception):
    """Device memory too small for a model at its max_seq_len; the message names every part, the total and the free
    bytes (the commands exit 2 with it)."""


def kv_cache_bytes(cfg: ModelConfig, max_seq_len: int, dtype_bytes: int = 2) -> int:
    """Bytes of the K and V caches, each [layers, KV heads, max_seq_len, head_dim]."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_seq_len * cfg.hd * dtype_bytes


def kv_cache_part(cfg: ModelConfig, max_seq_len: int, dtype_bytes: int = 2, batch: int = 1) -> tuple[str, int]:
    """The KV cache as a (description, bytes) part of `check_fits`, its product spelled out (one slot per sequence of
    a batch)."""
    n = kv_cache_bytes(cfg, max_seq_len, dtype_bytes) * batch
    dtype = _DTYPE_NAMES.get(dtype_bytes, f"{dtype_bytes} bytes")
    seqs = f" x {batch} sequences" if batch > 1 else ""
    return (f"KV cache for max_seq_len {max_seq_len} ({cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV "
            f"heads x {cfg.hd} x 2 x {dtype}{seqs} = {n / _GB:.2f} GB)", n)


def workspace_bytes(cfg: ModelConfig, max_seq_len: int, batch: int = 1) -> int:
    """The GPU interpreter's fp32 workspace: activations (x, q, attn, act, logits; per sequence of a batch) and the
    RoPE cos/sin tables [max_seq_len, head_dim / 2] each."""
    vectors = cfg.hidden_size + 2 * cfg.q_size + cfg.intermediate_size + cfg.vocab_size
    return 4 * (vectors * batch + 2 * max_seq_len * (cfg.hd // 2))


def check_fits(parts: list[tuple[str, int]], free: int, where: str = "free GPU memory") -> None:
    """Raise `DoesNotFit` when the parts (description, bytes) together exceed `free` bytes. A part's description is
    used as it is when it names its size (contains "GB"), else its size is appended."""
    total = sum(n for _, n in parts)
    if total <= free:
        return
    text = " + ".join(d if "GB" in d else f"{d} {n / _GB:.2f} GB" for d, n in parts)
    raise DoesNotFit(f"{text} = {total / _GB:.2f} GB does not fit in {free / _GB:.2f} GB of {where}")


def gpu_memory_parts(cfg: ModelConfig, max_seq_len: int, weights: bool = True,
                     batch: int = 1) -> list[tuple[str, int]]:
    """What the GPU interpreter allocates for `cfg` at `max_seq_len` (and `batch` sequences): its bf16 KV cache, its
    copy of the weights (bf16 matrices; counted whole, an upper bound when the embedding is already on the GPU in
    bf16 and is shared) and its workspace."""
    parts = [kv_cache_part(cfg, max_seq_len, batch=batch)]
    if weights:
        parts.append(("weights", cfg.weight_bytes(2)))
    parts.append(("workspace", workspace_bytes(cfg, max_seq_len, batch)))
    return parts


# --------------------------------------------------------------------------------------------------------------
# Hugging Face config.json -> ModelConfig


#: model_type -> (the architecture's name, qkv_bias, qk_norm, default head_dim or None for hidden / heads).
HF_FAMILIES: dict[str, tuple[str, bool, bool, int | None]] = {
    "llama": ("LlamaForCausalLM", False, False, None),
    "mistral": ("MistralForCausalLM", False, False, None),
    "qwen2": ("Qwen2ForCausalLM", True, False, None),
    "qwen3": ("Qwen3ForCausalLM", False, True, 128),
}
_ARCHITECTURES = {arch: mt for mt, (arch, *_) in HF_FAMILIES.items()}
#: Keys that mean a mixture-of-experts model (Qwen-MoE, Mixtral, DeepSeek), when they hold a number > 0.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class HFModel:
    """What a checkpoint's config.json says: its family, the catalogue's config and its longest context."""

    model_type: str
    config: ModelConfig
    max_position_embeddings: int | None


def _rope_from_hf(config: dict[str, Any]) -> tuple[Any, dict[str, Any] | None, str]:
    """(rope_theta, scaling or None, the key the scaling came from), from either the transformers 4 keys or
    transformers 5's `rope_parameters`."""
    params = config.get("rope_parameters")
    theta = config.get("rope_theta")
    scaling, key = config.get("rope_scaling"), "rope_scaling"
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling, key = {k: v for k, v in params.items() if k != "rope_theta"}, "rope_parameters"
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return (theta if theta is not None else 10000.0), scaling, key


def _model_type(config: dict[str, Any]) -> str:
    mt = config.get("model_type")
    if mt is None:  # older files name only the class
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0] if isinstance(archs, list) and archs else archs
        if arch not in _ARCHITECTURES:
            raise ConfigError("architectures", f"= {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})")
        return _ARCHITECTURES[arch]
    if mt not in HF_FAMILIES:
        raise ConfigError("model_type", f"= {mt!r} is not supported (supported: {', '.join(HF_FAMILIES)})")
    return str(mt)


def from_hf_checkpoint(config: dict[str, Any]) -> HFModel:
    """Map a checkpoint's config.json (a dict) onto the catalogue, with each family's HF defaults where a key is
    absent; raise `ConfigError` naming the key of anything the megakernel cannot run."""
    if not isinstance(config, dict):
        raise ConfigError("$", "must be a JSON object")
    for key in MOE_KEYS:
        if config.get(key):
            raise ConfigError(key, f"= {config[key]!r}: mixture-of-experts models are not supported")
    mt = _model_type(config)
    _, qkv_bias, qk_norm, default_hd = HF_FAMILIES[mt]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError("hidden_act", f"= {act!r}; only 'silu' (SwiGLU) is supported")
    if config.get("mlp_bias"):
        raise ConfigError("mlp_bias", "= true; MLP biases are not supported")
    if mt != "qwen2" and config.get("attention_bias"):  # Llama, Mistral and Qwen3 would bias o_proj too
        raise ConfigError("attention_bias", "= true; attention biases are not supported for "
                                            f"{mt} (o_proj has none in the megakernel)")
    max_pos = config.get("max_position_embeddings")
    if mt in ("qwen2", "qwen3"):
        if config.get("use_sliding_window"):
            raise ConfigError("use_sliding_window", "= true; sliding-window attention is not supported")
    else:
        window = config.get("sliding_window")
        if window is not None and not (isinstance(max_pos, int) and isinstance(window, int) and window >= max_pos):
            raise ConfigError("sliding_window", f"= {window!r} (max_position_embeddings = {max_pos!r}); "
                                                "sliding-window attention is not supported")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise ConfigError("layer_types", "has a layer other than 'full_attention': sliding-window attention is "
                                         "not supported")
    theta, scaling, rope_key = _rope_from_hf(config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES:
        raise ConfigError(rope_key, f"type {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                                    f"(supported: {', '.join(ROPE_TYPES)} or none)")
    head_dim = config.get("head_dim")
    if head_dim is None and default_hd is not None:
        head_dim = default_hd
    kv = config.get("num_key_value_heads")
    hf = {**config, "rope_theta": theta, "rope_scaling": scaling, "head_dim": head_dim,
          "num_key_value_heads": kv if kv is not None else config.get("num_attention_heads"),
          "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
          "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
          "qkv_bias": qkv_bias, "qk_norm": qk_norm}
    if max_pos is not None and (not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos <= 0):
        raise ConfigError("max_position_embeddings", f"must be a positive integer, got {max_pos!r}")
    return HFModel(mt, ModelConfig.from_hf(hf), max_pos)


class CheckpointConfigError(ValueError):
    """A checkpoint folder's config.json is missing, unreadable or unsupported; the message names the file and the
    key (`$.key`)."""


def read_hf_config(folder: str | Path) -> HFModel:
    """Read and map a checkpoint folder's config.json (`from_hf_checkpoint`); raise `CheckpointConfigError`."""
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointConfigError(f"{path}: not a checkpoint folder")
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointConfigError(f"{file}: no config.json in the checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointConfigError(f"{file}: cannot read config.json: {exc}") from None
    try:
        return from_hf_checkpoint(config)
    except ConfigError as exc:
        where = "$" if exc.key == "$" else f"$.{exc.key}"
        raise CheckpointConfigError(f"{file}: {where} {exc.message}") from None
