"""The byte arithmetic of the GPU memory check (megasynth/ir/model.py): KV cache, workspace, and the message of a
model that does not fit."""

from __future__ import annotations

import pytest

from megasynth.ir.model import DoesNotFit, check_fits, gpu_memory_parts, kv_cache_bytes, kv_cache_part, workspace_bytes
from megasynth.lowering.models import MODELS


def test_kv_cache_bytes() -> None:
    c = MODELS["llama-1b"].config  # 16 layers, 8 KV heads, head_dim 64
    assert kv_cache_bytes(c, 131072) == 16 * 8 * 131072 * 64 * 2 * 2 == 4_294_967_296
    assert kv_cache_bytes(c, 4096, dtype_bytes=4) == 16 * 8 * 4096 * 64 * 2 * 4
    assert kv_cache_bytes(MODELS["llama-8b"].config, 131072) == 32 * 8 * 131072 * 128 * 2 * 2  # 17.2 GB
    text, n = kv_cache_part(c, 131072)
    assert n == 4_294_967_296
    assert text == "KV cache for max_seq_len 131072 (16 layers x 8 KV heads x 64 x 2 x bf16 = 4.29 GB)"


def test_workspace_grows_with_the_rope_tables() -> None:
    c = MODELS["llama-1b"].config
    vectors = 4 * (2048 + 2 * 2048 + 8192 + 128256)
    assert workspace_bytes(c, 1) == vectors + 4 * 2 * 32
    assert workspace_bytes(c, 131072) - workspace_bytes(c, 1) == 4 * 2 * 131071 * 32


def test_check_fits_message_names_every_part() -> None:
    c = MODELS["llama-1b"].config
    parts = gpu_memory_parts(c, 131072)
    assert [n for _, n in parts] == [kv_cache_bytes(c, 131072), c.weight_bytes(2), workspace_bytes(c, 131072)]
    total = sum(n for _, n in parts)
    check_fits(parts, total)  # exactly enough
    with pytest.raises(DoesNotFit) as err:
        check_fits(parts, total - 1)
    with pytest.raises(DoesNotFit) as err:
        check_fits(parts, int(5.1e9))
    assert str(err.value) == (
        "KV cache for max_seq_len 131072 (16 layers x 8 KV heads x 64 x 2 x bf16 = 4.29 GB) + weights 2.47 GB + "
        "workspace 0.03 GB = 6.80 GB does not fit in 5.10 GB of free GPU memory")
    with pytest.raises(DoesNotFit, match=r"^weights 1.00 GB = 1.00 GB does not fit in 0.50 GB of host memory$"):
        check_fits([("weights", 10**9)], 5 * 10**8, "host memory")
    assert [d for d, _ in gpu_memory_parts(c, 4096, weights=False)][1] == "workspace"
