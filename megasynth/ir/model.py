"""The Llama-family model configuration a schedule refers to (HF-style sizes), with no torch dependency."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-family decoder, named as in Hugging Face's `LlamaConfig`."""

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

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")

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
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return dtype_bytes * (lyr * per_layer + self.vocab_size * h + head + h)

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def to_hf(self) -> dict[str, Any]:
        out = asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict()
        return out

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from an HF-style dict; unknown keys (architectures, torch_dtype, ...) are ignored."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if isinstance(kwargs.get("rope_scaling"), dict):
            kwargs["rope_scaling"] = tuple(sorted(kwargs["rope_scaling"].items()))
        return cls(**kwargs)
