"""The torch.compile variant's step on the CPU: inductor must update the KV caches in place (one row per layer) and
read the weights where they lie, with one graph per ctx and no graph break; a compiled step that copies the whole
cache every step times the copy, not the step."""

from __future__ import annotations

import re

import torch

from megasynth.lowering.models import get_model
from megasynth.measure.compile import compile_step, compiled_step, dynamo_stats
from megasynth.measure.options import BenchOptions
from megasynth.measure.torch_step import (
    CHECK_TOL,
    bf16_decode_step,
    bf16_rope,
    compare,
    kv_history,
    kv_write_index,
    prefill,
)
from megasynth.measure.variants import bf16_step_fn, new_state

_BUFFER = re.compile(r"empty_strided_\w+\(\(([^)]*)\)")


def _buffer_numels(code: str) -> list[int]:
    """Element counts of the buffers the generated wrapper allocates (empty_strided_cpu/cuda((sizes), ...))."""
    out = []
    for m in _BUFFER.finditer(code):
        n = 1
        for s in (s.strip() for s in m.group(1).split(",")):
            if s:
                n *= int(s)  # static shapes: a symbolic size fails here, as it should
        out.append(n)
    return out


def test_compiled_step_keeps_the_kv_cache_in_place() -> None:
    """At 3 consecutive positions, as the compile worker does (one compile per ctx): the logits are the plain step's
    (up to inductor's fp32 fusions), one graph and no graph break, the cache written at its own address at row pos
    only, and no generated buffer as large as one layer's cache slab or any weight matrix (the defect: a slice
    assignment into the [L, nKV, S, hd] cache became a functional scatter that copied the whole cache per layer)."""
    from torch._inductor.utils import run_and_get_code

    model = "tiny-qwen3"  # GQA and QK-norm
    spec = get_model(model)
    cfg = spec.config
    st = new_state(spec, BenchOptions(model=model, device="cpu"))
    slab = cfg.num_key_value_heads * spec.max_seq_len * cfg.hd
    bf16_step_fn(st)  # lays the weights out
    assert st.step_weights is not None
    smallest_weight = min(t.numel() for lw in st.step_weights.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    for ctx in (6, 7, 8):
        st.ctx = ctx
        hist = kv_history(cfg, spec.max_seq_len, ctx, 0)
        with torch.inference_mode():
            prefill(st.k, st.v, hist)
            plain = bf16_step_fn(st)()
            k_plain, v_plain = st.k.clone(), st.v.clone()
            prefill(st.k, st.v, hist)
            k_before, v_before = st.k.clone(), st.v.clone()
            ptrs = (st.k.data_ptr(), st.v.data_ptr())
            fn = compile_step(compiled_step(st)[0], None, "inductor")
            with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit would give no code
                out, codes = run_and_get_code(fn)
            for _ in range(2):
                fn()
        assert dynamo_stats() == {"graphs": 1, "graph_breaks": 0}, ctx
        check = compare(out, plain)
        assert check["argmax_match"] and check["rel_l2"] < CHECK_TOL, (ctx, check)
        assert (st.k.data_ptr(), st.v.data_ptr()) == ptrs
        pos = ctx - 1
        for cache, before, want in ((st.k, k_before, k_plain), (st.v, v_before, v_plain)):
            rest = torch.ones(cache.shape[2], dtype=torch.bool)
            rest[pos] = False
            assert torch.equal(cache[:, :, rest], before[:, :, rest])  # history and the unused rows untouched
            torch.testing.assert_close(cache[:, :, pos].float(), want[:, :, pos].float(), atol=0.1, rtol=0.05)
            assert not torch.equal(cache[:, :, pos], before[:, :, pos])  # the row was written
        sizes = _buffer_numels("\n".join(codes))
        assert sizes, "no buffer allocation found in the generated code"
        assert max(sizes) < min(slab, smallest_weight), (ctx, max(sizes), slab, smallest_weight)


def test_index_put_write_is_the_plain_step_bit_for_bit() -> None:
    """Eager, the K/V write by index_put_ (`kv_at`) gives the plain step's logits and caches exactly."""
    spec = get_model("tiny-qwen2")
    cfg = spec.config
    st = new_state(spec, BenchOptions(model="tiny-qwen2", device="cpu"))
    st.ctx = 9
    hist = kv_history(cfg, spec.max_seq_len, st.ctx, 3)
    with torch.inference_mode():
        prefill(st.k, st.v, hist)
        plain = bf16_step_fn(st)()
        k_plain, v_plain = st.k.clone(), st.v.clone()
        prefill(st.k, st.v, hist)
        cos, sin = bf16_rope(cfg, st.pos, "cpu")
        out = bf16_decode_step(cfg, st.step_weights, st.k, st.v, st.token, st.pos, cos, sin,
                               kv_write_index(cfg, st.pos, "cpu"))
    assert torch.equal(out, plain) and torch.equal(st.k, k_plain) and torch.equal(st.v, v_plain)


def test_compiled_step_reads_only_its_static_tensors() -> None:
    """Every tensor the compiled graph takes is one `compiled_step` lists (fixed addresses: a CUDA graph replays
    them, inductor's CUDA graphs are told they are static); no weight is cast or copied into a new input."""
    spec = get_model("tiny-qwen3")
    st = new_state(spec, BenchOptions(model="tiny-qwen3", device="cpu"))
    st.ctx = 5
    seen: list[torch.Tensor] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        seen.extend(t for t in inputs if isinstance(t, torch.Tensor))
        return gm.forward

    step_fn, statics = compiled_step(st)
    with torch.inference_mode():
        compile_step(step_fn, None, backend)()
    assert seen and dynamo_stats()["graph_breaks"] == 0
    static = {(t.data_ptr(), t.dtype, tuple(t.shape)) for t in statics}
    assert {(t.data_ptr(), t.dtype, tuple(t.shape)) for t in seen} <= static
    assert len(statics) == len({id(t) for t in statics})
