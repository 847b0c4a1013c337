"""Named model specs (a table, as gpt-fast does): `llama-1b` is a row, not a class. A checkpoint folder stands in
for a name anywhere a model is asked for: its config.json decides the architecture (`get_model`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megasynth.ir.model import CheckpointConfigError, ModelConfig, read_hf_config

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
#: The context a spec made from a checkpoint folder is lowered for (capped by its max_position_embeddings), as the
#: named Llama rows are.
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    config: ModelConfig
    max_seq_len: int
    #: The published model's longest context (`max_position_embeddings`); `None` for the test configs.
    max_position_embeddings: int | None = None
    #: The checkpoint folder the spec was read from (`--model DIR`); its weights go with it.
    weights_dir: str | None = None
    #: Sequences decoded per step (each with its own KV cache slot and position).
    batch: int = 1


class ModelNotFound(KeyError):
    """Neither a known name nor a checkpoint folder the megakernel can run; `args[0]` is the message (a KeyError, as
    the commands catch it to exit 2 with the message)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _llama(hidden, inter, layers, heads, kv, vocab, head_dim=None, theta=500000.0, tie=True, rope=None, eps=1e-5,
           qkv_bias=False, qk_norm=False):
    return ModelConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, head_dim=head_dim,
                       rope_theta=theta, rms_norm_eps=eps, tie_word_embeddings=tie, rope_scaling=rope,
                       qkv_bias=qkv_bias, qk_norm=qk_norm)


def _qwen3(hidden, inter, layers, heads, kv, tie):
    return _llama(hidden, inter, layers, heads, kv, 151936, 128, theta=1000000.0, tie=tie, eps=1e-6, qk_norm=True)


def _qwen25(hidden, inter, layers, heads, kv, vocab, tie):
    return _llama(hidden, inter, layers, heads, kv, vocab, hidden // heads, theta=1000000.0, tie=tie, eps=1e-6,
                  qkv_bias=True)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("llama-1b", "Llama-3.2-1B", _llama(2048, 8192, 16, 32, 8, 128256, 64, rope=_LLAMA3_ROPE), 4096,
                  131072),
        ModelSpec("llama-3b", "Llama-3.2-3B", _llama(3072, 8192, 28, 24, 8, 128256, 128, rope=_LLAMA3_ROPE), 4096,
                  131072),
        ModelSpec("llama-8b", "Llama-3.1-8B", _llama(4096, 14336, 32, 32, 8, 128256, 128, tie=False,
                                                    rope=_LLAMA3_ROPE), 4096, 131072),
        ModelSpec("qwen3-0.6b", "Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, 8, tie=True), 4096, 40960),
        ModelSpec("qwen3-1.7b", "Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, 8, tie=True), 4096, 40960),
        ModelSpec("qwen3-4b", "Qwen3-4B", _qwen3(2560, 9728, 36, 32, 8, tie=True), 4096, 40960),
        ModelSpec("qwen3-8b", "Qwen3-8B", _qwen3(4096, 12288, 36, 32, 8, tie=False), 4096, 40960),
        ModelSpec("qwen2.5-0.5b", "Qwen2.5-0.5B", _qwen25(896, 4864, 24, 14, 2, 151936, tie=True), 4096, 32768),
        ModelSpec("qwen2.5-1.5b", "Qwen2.5-1.5B", _qwen25(1536, 8960, 28, 12, 2, 151936, tie=True), 4096, 131072),
        ModelSpec("qwen2.5-7b", "Qwen2.5-7B", _qwen25(3584, 18944, 28, 28, 4, 152064, tie=False), 4096, 131072),
        ModelSpec("mistral-7b-v0.3", "Mistral-7B-v0.3", _llama(4096, 14336, 32, 32, 8, 32768, 128, theta=1000000.0,
                                                               tie=False), 4096, 32768),
        ModelSpec("tiny", "test config: 2 layers, hidden 128, 4 heads, 2 KV heads (GQA)",
                  _llama(128, 256, 2, 4, 2, 256, 32, theta=10000.0), 64),
        ModelSpec("tiny-mha", "test config: 2 layers, hidden 64, 2 heads, no GQA, untied head",
                  _llama(64, 160, 2, 2, 2, 96, 32, theta=10000.0, tie=False), 32),
        ModelSpec("tiny-gqa4", "test config: 3 layers, hidden 256, 8 heads, 2 KV heads, Llama-3 RoPE scaling",
                  _llama(256, 512, 3, 8, 2, 320, 32, rope={**_LLAMA3_ROPE, "original_max_position_embeddings": 16}),
                  128),
        ModelSpec("tiny-qwen3", "test config: Qwen3 family (QK-norm), 2 layers, hidden 256, 4 heads of 128, untied",
                  _llama(256, 512, 2, 4, 2, 320, 128, theta=1000000.0, tie=False, eps=1e-6, qk_norm=True), 64),
        ModelSpec("tiny-qwen2", "test config: Qwen2 family (QKV bias), 2 layers, hidden 192, 6 heads, 2 KV heads",
                  _llama(192, 320, 2, 6, 2, 288, 32, theta=1000000.0, eps=1e-6, qkv_bias=True), 64),
    ]
}


def spec_from_checkpoint(folder: str | Path, max_seq_len: int | None = None) -> ModelSpec:
    """The spec of a Hugging Face checkpoint folder: its config.json decides the architecture and sizes; the context
    is `max_seq_len` (default: DEFAULT_MAX_SEQ_LEN, capped by max_position_embeddings). Raises `ModelNotFound` with
    the file and the key of a config the megakernel cannot run."""
    try:
        hf = read_hf_config(folder)
    except CheckpointConfigError as exc:
        raise ModelNotFound(str(exc)) from None
    limit = hf.max_position_embeddings or DEFAULT_MAX_SEQ_LEN
    seq = min(DEFAULT_MAX_SEQ_LEN, limit) if max_seq_len is None else max_seq_len
    where = str(Path(folder).resolve())  # the name a run records: it must find the folder again from any cwd
    return ModelSpec(where, f"{hf.model_type} checkpoint {Path(folder).name}", hf.config, seq,
                     hf.max_position_embeddings, where)


class MaxSeqLenError(ValueError):
    """A `--max-seq-len` the model cannot take; `str()` names the value, the limit and the option (the commands
    turn it into exit 2)."""


def with_max_seq_len(spec: ModelSpec, max_seq_len: int | None) -> ModelSpec:
    """`spec` lowered for contexts up to `max_seq_len` (None: the row's own). The KV cache and every proof cover
    positions [0, max_seq_len), so it may not exceed the model's `max_position_embeddings` (RoPE is defined up to
    it); a test config without one takes any positive length."""
    if max_seq_len is None or max_seq_len == spec.max_seq_len:
        return spec
    limit = spec.max_position_embeddings
    if max_seq_len < 1 or (limit is not None and max_seq_len > limit):
        bound = f"[1, {limit}] (its max_position_embeddings)" if limit is not None else "at least 1"
        raise MaxSeqLenError(f"--max-seq-len {max_seq_len} is out of range for {spec.name}: it must be {bound}")
    return replace(spec, max_seq_len=max_seq_len)


MAX_BATCH = 16  # what the commands offer; the format allows more


class BatchError(ValueError):
    """A batch size the commands do not take; the message names it and the range."""


def with_batch(spec: ModelSpec, batch: int | None) -> ModelSpec:
    """`spec` for `batch` sequences per step (None: its own, 1 unless set)."""
    if batch is None or batch == spec.batch:
        return spec
    if not 1 <= batch <= MAX_BATCH:
        raise BatchError(f"--batch {batch} is out of range: it must be in [1, {MAX_BATCH}]")
    return replace(spec, batch=batch)


def get_model(name: str, max_seq_len: int | None = None) -> ModelSpec:
    """A named row, or the spec of a checkpoint folder (`name` is a directory, or a path that names one: it
    contains a path separator), for contexts up to `max_seq_len` (None: the row's default, see
    `with_max_seq_len`). Raises `ModelNotFound` (a KeyError) with a message that says why, `MaxSeqLenError` for a
    length the model cannot take."""
    if name in MODELS:
        return with_max_seq_len(MODELS[name], max_seq_len)
    path = Path(name)
    if path.is_dir() or "/" in name or (path.exists() and not path.is_dir()):
        return with_max_seq_len(spec_from_checkpoint(path), max_seq_len)
    raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(MODELS)}; or a checkpoint folder") from None
