"""Interpreter v10 compiles for sm_90 without a GPU (Triton's bundled ptxas), with no spill stack and within the
227 KB of shared memory one CTA may use, for the model shapes it runs; so does v9. The register and shared-memory
budget is what a kernel change most often breaks (docs/perf-notes.md), and this catches it before any device time."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from megasynth.ir.model import ModelConfig

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)"),
    pytest.mark.usefixtures("single_thread"),
]


@pytest.mark.parametrize("model", ["tiny", "tiny-mha", "llama-1b", "llama-8b", "qwen3-0.6b"])
def test_v10_compiles_without_spills(model: str) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    _, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig())
    assert res.stack == 0, f"{model}: {res.stack} bytes of spill stack"
    assert res.shared <= SMEM_LIMIT, f"{model}: {res.shared} B of shared memory > {SMEM_LIMIT}"
    assert stream_geometry(spec.config, StreamConfig())["NS"] >= 4, "the ring should hold at least 4 slots"


@pytest.mark.parametrize("model", ["llama-1b", "tiny-qwen3", "qwen2"])
def test_v10_cp_fill_build(model: str) -> None:
    """With `cp_fill` (the default up to hidden size 2048) the batch-1 loader fills the ring by cp.async and never
    by TMA, arriving on each slot's barrier from its 32 threads, without spills; a batch, the tensor-core path,
    llama-3b and llama-8b keep TMA."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import CP_LOADER_REGS, StreamConfig, stream_config, stream_constexprs
    from megasynth.lowering.models import get_model, with_batch

    cfg = _qwen("qwen2") if model == "qwen2" else get_model(model).config  # qwen2: hidden 192, a part box
    sc = stream_config(cfg)
    consts = stream_constexprs(cfg, 64, sc, False)
    assert sc.cp_fill and consts["CPF"] and consts["LOADER_REGS"] == CP_LOADER_REGS
    kernel, res = compile_v10(cfg, 64, sc)
    ptx = kernel.asm["ptx"]
    assert res.stack == 0, f"{model}: {res.stack} bytes of spill stack"
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert "cp.async.bulk.tensor" not in ptx, "a cp.async build issues no TMA fill"
    assert not stream_constexprs(cfg, 64, dataclasses.replace(sc, mma=True), False)["CPF"]
    assert not stream_constexprs(cfg, 64, StreamConfig(), False)["CPF"]
    if model == "llama-1b":
        assert not stream_constexprs(with_batch(get_model(model), 8).config, 64, sc, False, 8)["CPF"]
        assert not any(stream_config(get_model(m).config).cp_fill for m in ("llama-3b", "llama-8b"))


def _qwen(family: str) -> ModelConfig:
    """Tiny configs of the two families beyond Llama. Qwen3: QK-norm, head_dim 128 (4 groups of 16 RoPE pairs per
    head) with hidden 256 and 4 heads (q rows 512 != hidden), untied head. Qwen2: q/k/v bias, hidden 192 (not a power of
    two: the last K box is zero-filled), 3 query heads per KV head."""
    if family == "qwen3":
        return ModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=320, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, qk_norm=True)
    return ModelConfig(hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, vocab_size=288, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_v10_compiles_qwen_families_without_spills(family: str) -> None:
    """The QKV bias and QK-norm builds fit the budget of the Llama build: no spill stack, shared memory within a CTA's
    (QK-norm keeps a head's unrotated groups in registers, not shared memory); the tensor-core build too."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig, stream_constexprs

    cfg = _qwen(family)
    consts = stream_constexprs(cfg, 64, StreamConfig(), False)
    assert (consts["QKV_BIAS"], consts["QK_NORM"]) == (family == "qwen2", family == "qwen3")
    assert consts["QG"] == (4 if family == "qwen3" else 1)  # hd 128: 64 pairs, 4 groups of 16
    if family == "qwen3":  # the head dimension is its own, not hidden / heads
        assert consts["HD"] == cfg.hd == 128 != cfg.hidden_size // cfg.num_attention_heads
    for sc in (StreamConfig(), StreamConfig(mma=True)):
        _, res = compile_v10(cfg, 64, sc)
        assert res.stack == 0, f"{family} {sc}: {res.stack} bytes of spill stack"
        assert res.shared <= SMEM_LIMIT, f"{family} {sc}: {res.shared} B of shared memory > {SMEM_LIMIT}"


def _qk_apart_params(ptx: str) -> tuple[str, str]:
    """The PTX names of the kernel parameters qk_sq_ptr and k_new_ptr: the two before timeout_ns, which is the
    second-last parameter that is not a pointer (seq_splits is the last; the TMA descriptors' expansion comes before
    them, Triton's scratch after)."""
    params = [ln for ln in ptx.splitlines() if ln.strip().startswith(".param") and "stream_megakernel_param_" in ln]
    last = [i for i, ln in enumerate(params) if ".ptr" not in ln][-2]
    names = [ln.split()[-1].rstrip(",") for ln in params[last - 2:last]]
    assert all(".ptr" in ln for ln in params[last - 2:last]), params[last - 2:last]
    return names[0], names[1]


def test_llama_build_has_none_of_the_family_code() -> None:
    """QKV bias and QK-norm are constexpr-gated: the Llama build never reads their weights (its only trace of them is
    two kernel parameters), the Qwen2 build reads the bias alone and the Qwen3 build the stacked norm weights alone.
    Likewise the QK-norm applied apart from QKV (attn_norm_qkv_rope_sq, qk_norm_apply): only the Qwen3 build reads
    its buffers `qk_sq` and `k_new`."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import get_model

    tiny = get_model("tiny").config
    # bqkv_ptr and qk_norm_ptr follow final_norm_ptr (the 13th argument): kernel parameters 13 and 14
    bias, norm = "[stream_megakernel_param_13]", "[stream_megakernel_param_14]"
    reads = {}
    for name, cfg in (("llama", tiny), ("qwen3", _qwen("qwen3")), ("qwen2", _qwen("qwen2"))):
        ptx = compile_v10(cfg, 64, StreamConfig())[0].asm["ptx"]
        assert ".global .align 1 stream_megakernel_param_14," in ptx  # a pointer, as bqkv_ptr and qk_norm_ptr are
        sq, knew = _qk_apart_params(ptx)
        reads[name] = (bias in ptx, norm in ptx, f"[{sq}]" in ptx and f"[{knew}]" in ptx)
    assert reads == {"llama": (False, False, False), "qwen3": (False, True, True), "qwen2": (True, False, False)}


def test_v10_qk_norm_apart_compiles_into_the_qwen3_build() -> None:
    """tiny-qwen3's build (the shape the GPU test of the QK-norm apart runs) holds both apart ops next to the QK-norm
    inside QKV and still fits: no spill stack, the shared memory of a CTA; the tensor-core build too. The apart ops
    add no shared memory (QKV-sq is QKV's slot sequence, qk_norm_apply reads no weights)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    spec = get_model("tiny-qwen3")
    for sc in (StreamConfig(), StreamConfig(mma=True)):
        kernel, res = compile_v10(spec.config, spec.max_seq_len, sc)
        assert res.stack == 0, f"{sc}: {res.stack} bytes of spill stack"
        geo = stream_geometry(spec.config, sc)
        assert res.shared <= SMEM_LIMIT and res.shared - geo["ring_bytes"] - geo["stage_bytes"] <= 1024, res
        sq, knew = _qk_apart_params(kernel.asm["ptx"])
        assert f"[{sq}]" in kernel.asm["ptx"] and f"[{knew}]" in kernel.asm["ptx"]


def test_v9_compiles_qwen_families_without_spills() -> None:
    from megasynth.kernels.gpu.offline import compile_v9
    from megasynth.kernels.gpu.v9 import KernelConfig

    for family in ("qwen3", "qwen2"):
        _, res = compile_v9(_qwen(family), 64, KernelConfig())
        assert res.stack == 0, f"{family}: {res.stack} bytes of spill stack"


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_stacked_family_weights(family: str) -> None:
    """stack_weights passes each family's extra weights as the kernels index them: `bqkv` [L, q+2kv] fp32, `qk_norm`
    [L, 2 hd] fp32 with q_norm first; an untied head keeps its own storage."""
    import torch

    from megasynth.kernels.gpu.runtime import stack_weights
    from megasynth.kernels.weights import random_weights

    cfg = _qwen(family)
    w = random_weights(cfg, seed=1)
    out = stack_weights(cfg, w, torch.device("cpu"))
    n = cfg.num_hidden_layers
    if family == "qwen3":
        assert "bqkv" not in out and out["qk_norm"].shape == (n, 2 * cfg.hd) and out["qk_norm"].dtype == torch.float32
        assert torch.equal(out["qk_norm"][1, :cfg.hd], w["layers.1.q_norm"].float())
        assert torch.equal(out["qk_norm"][1, cfg.hd:], w["layers.1.k_norm"].float())
        assert out["lm_head"].data_ptr() != out["embed"].data_ptr()
        assert torch.equal(out["lm_head"], w["lm_head"].to(torch.bfloat16))
    else:
        assert "qk_norm" not in out and out["bqkv"].shape == (n, cfg.qkv_size)
        assert torch.equal(out["bqkv"][1], w["layers.1.bqkv"].float())
        assert out["lm_head"].data_ptr() == out["embed"].data_ptr()
    assert out["wqkv"].shape == (n, cfg.qkv_size, cfg.hidden_size) and out["wo"].shape == (n, cfg.hidden_size,
                                                                                           cfg.q_size)


def test_v10_trace_build_fits_too() -> None:
    """The trace-enabled build (`Megakernel.traced_step`: timestamps from both partitions, the loader's included)
    fits the same budget: the shared-memory reserve is small (SMEM_RESERVE), so a trace build could tip it over."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model("llama-1b")
    _, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig(), trace=True)
    assert res.stack == 0 and res.shared <= SMEM_LIMIT


@pytest.mark.parametrize("model", ["tiny-gqa4", "llama-1b"])
def test_v10_tensor_core_path_compiles(model: str) -> None:
    """StreamConfig(mma=True): the compute warps issue wgmma on the ring's slots, with no spills and within shared
    memory (the staging buffer also holds the attention merge's fp32 scratch)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    kernel, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig(mma=True))
    assert res.stack == 0 and res.shared <= SMEM_LIMIT
    assert "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in kernel.asm["ptx"]


def test_tensor_core_path_geometry() -> None:
    """mma applies only where every K is a multiple of 64 (the [rows, K/64, 64] TMA view), with 2-box slots;
    it makes BK 256 and leaves room for the merge scratch after the attention chunks."""
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry, weight_box
    from megasynth.lowering.models import get_model

    geo = stream_geometry(get_model("llama-1b").config, StreamConfig(mma=True))
    assert geo["MMA"] and geo["BK"] == 256 and geo["NCH"] >= 2 * geo["NCHQ"]
    assert weight_box(geo)[0] == [16, 4, 64]
    tiny = stream_geometry(get_model("tiny").config, StreamConfig(mma=True))  # hidden 128 < BK: zero-filled
    # two chunks of activations; attention's lane partials ([GP, 8 warps, 2 hd] fp32) take four
    assert tiny["MMA"] and tiny["BK"] == 256 and tiny["NCH"] == 4
    assert not stream_geometry(get_model("tiny-mha").config, StreamConfig(mma=True))["MMA"]  # intermediate 160
    assert not stream_geometry(get_model("llama-1b").config, StreamConfig(mma=True, boxes=4))["MMA"]
    assert not stream_geometry(get_model("llama-1b").config, StreamConfig())["MMA"]  # off by default
    assert weight_box(stream_geometry(get_model("llama-1b").config, StreamConfig()))[0] == [16, 256]


def test_down_window_gives_the_staging_buffer_to_the_ring() -> None:
    """StreamConfig.down_window: at batch 1 the staging buffer holds what QKV, o_proj and attention's lane merge need
    and down's longer K goes in windows of it (KW), so the ring gains what the buffer gave up; where down's K fits
    anyway nothing changes (no windows), and a batch keeps its hidden-size windows."""
    from dataclasses import replace

    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    for name, before, after, slots in (("llama-1b", 32, 16, (12, 13)), ("qwen3-1.7b", 32, 16, (12, 13)),
                                       ("llama-8b", 64, 32, (10, 12))):
        c = get_model(name).config
        on, off = stream_geometry(c, StreamConfig()), stream_geometry(c, replace(StreamConfig(), down_window=False))
        assert (off["stage_bytes"] // 1024, on["stage_bytes"] // 1024) == (before, after)
        assert (off["NS"], on["NS"]) == slots
        assert off["stage_k"] == 0 and on["stage_k"] == on["NCHI"] * on["BK"] < c.intermediate_size
        assert on["stage_k"] >= max(c.hidden_size, c.q_size)  # o_proj and the LM head stay one window
    for name in ("llama-3b", "qwen3-0.6b", "tiny"):  # down's K already fits what the rest needs
        c = get_model(name).config
        assert stream_geometry(c, StreamConfig()) == stream_geometry(c, replace(StreamConfig(), down_window=False))
    c = get_model("llama-1b").config
    assert stream_geometry(c, StreamConfig(), 8)["stage_k"] == c.hidden_size


def test_tensor_core_attention_geometry_and_build() -> None:
    """attn_mma reads the ring's K/V on the tensor cores only where it can: 64-dim heads, K/V streamed into the
    ring, and its [16 num_warps, hd] fp32 group merge within the staging buffer as it is (llama-1b at batch 1, 8 and
    16; not on the smaller row-pair stage of batch 2, nor for 128-dim heads); the K/V boxes are then 128 B swizzled,
    and the build issues mma.sync without spills."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig, kv_box_layout, stream_geometry
    from megasynth.lowering.models import get_model

    on = StreamConfig(attn_mma=True)
    llama = get_model("llama-1b").config
    for batch in (1, 8, 16):
        geo = stream_geometry(llama, on, batch)
        assert geo["KV_RING"] == 2 and geo["stage_bytes"] >= 16 * on.num_warps * llama.hd * 4
        assert kv_box_layout(geo).swizzle_byte_width == 128
    assert stream_geometry(llama, on, 2)["KV_RING"] == 1
    assert stream_geometry(get_model("llama-8b").config, on)["KV_RING"] == 1  # 128-dim heads
    assert stream_geometry(llama, StreamConfig(attn_mma=True, kv_ring=False))["KV_RING"] == 0
    off = stream_geometry(llama, StreamConfig())  # off by default: measured slower (docs/perf-notes.md)
    assert off["KV_RING"] == 1 and kv_box_layout(off).swizzle_byte_width == 0
    kernel, res = compile_v10(llama, 4096, on)
    assert res.stack == 0 and res.shared <= SMEM_LIMIT
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in kernel.asm["ptx"]


def test_attention_rows_geometry_and_build() -> None:
    """attn_rows (the default) takes a batch's attention to the tensor cores with positions as rows only where a
    slot holds a K and a V block of 16 positions per compute warp in 128 B rows, or two slots do (llama-1b at batch 8
    and 16: 128 positions a slot, 128 B swizzled boxes; llama-8b's 128-dim heads at batch 8: K in one slot, V in the
    next, [128, 64] boxes), not at batch 1 or on row-pair slots, nor where a K block would take more than a slot;
    the batch-8 builds issue mma.sync (llama-1b's without spills)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import KV_ROWS, SMEM_LIMIT, StreamConfig, kv_box_layout, stream_geometry
    from megasynth.lowering.models import get_model

    on = StreamConfig()  # on by default
    llama = get_model("llama-1b").config
    for batch in (8, 16):
        geo = stream_geometry(llama, on, batch)
        assert (geo["KV_RING"], geo["BTK"], geo["KT"]) == (KV_ROWS, 16 * on.num_warps, 2)
        assert kv_box_layout(geo).swizzle_byte_width == 128
        assert stream_geometry(llama, StreamConfig(attn_rows=False), batch)["BTK"] == 64
    for batch in (1, 4):
        assert stream_geometry(llama, on, batch)["KV_RING"] == 1
    big = get_model("llama-8b").config  # 128-dim heads: K in one 32 KB slot, V in the next
    geo = stream_geometry(big, on, 8)
    assert (geo["KV_RING"], geo["BTK"], geo["KVW"]) == (KV_ROWS, 128, 64)
    assert stream_geometry(big, on, 16)["KV_RING"] == 1  # 16 KB slots: a K block would take two
    for cfg in (llama, big):
        kernel, res = compile_v10(cfg, 4096, on, batch=8)
        # llama-8b's stage of fp16 x in two pipelined groups spills 16 B (measured 2.7 % faster than the whole stage)
        assert res.stack <= (16 if cfg is big else 0) and res.shared <= SMEM_LIMIT
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in kernel.asm["ptx"]


def test_batch_activations_in_bf16() -> None:
    """A v10 batch keeps act and attn in bf16 (`StreamConfig.act_bf16`, the default): its products take the
    operand in bf16 anyway. Batch 1, hi/lo operands (`batch_hilo`) and act_bf16 off keep them in fp32; both
    batch-8 builds compile without spills."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    llama = get_model("llama-1b").config
    assert all(stream_geometry(llama, StreamConfig(), b)["ACT_BF16"] for b in (2, 3, 8, 16))
    assert not stream_geometry(llama, StreamConfig(), 1)["ACT_BF16"]
    assert not stream_geometry(llama, StreamConfig(batch_hilo=True), 8)["ACT_BF16"]
    assert not stream_geometry(llama, StreamConfig(act_bf16=False), 8)["ACT_BF16"]
    for sc in (StreamConfig(), StreamConfig(act_bf16=False)):
        kernel, res = compile_v10(llama, 4096, sc, batch=8)
        assert res.stack == 0
        for name in ("act_ptr", "attn_ptr"):  # the kernel's argument types
            assert f"%{name}: !tt.ptr<{'bf16' if sc.act_bf16 else 'f32'}>" in kernel.asm["ttgir"]


def test_batch_epilogue_takes_no_shared_scratch() -> None:
    """A tile batch's epilogue meets its halves in the slot it consumed (`_slot_exchange`), so the build needs no
    compiler scratch beyond the reserve and the ring takes what the staged operand leaves: 6 slots of 32 KB for
    llama-1b at batch 8, 5 at 16 and for llama-8b at 8, 6 of 16 KB for llama-8b at 16."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, SMEM_RESERVE, StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    sc = StreamConfig()
    for name, batch, slots, kt, build in (("llama-1b", 8, 6, 2, True), ("llama-1b", 16, 5, 2, False),
                                          ("llama-8b", 8, 5, 2, False), ("llama-8b", 16, 6, 1, True)):
        cfg = get_model(name).config
        geo = stream_geometry(cfg, sc, batch)
        assert (geo["NS"], geo["KT"]) == (slots, kt), name
        if build:
            _, res = compile_v10(cfg, 4096, sc, batch=batch)
            assert res.shared <= SMEM_LIMIT
            assert res.shared - geo["ring_bytes"] - geo["stage_bytes"] <= SMEM_RESERVE, name


def test_batch_stages_in_few_load_groups() -> None:
    """A batch's staging keeps up to `stage_values` values of loads in flight: x of a batch-16 llama-1b in one
    group, of llama-8b in two (16 K values took twice as many groups; at batch 8 llama-8b's fp16 x goes in two
    pipelined groups, fp32 x in one); a smaller budget gives more groups. The
    batch-16 llama-1b build with two K-packed QKV sub-chunks holds its one group's 128 values a thread without
    spilling (the default's four spill 32 B: `test_batch_products_one_wgmma_as_wide_as_the_operand`), and loads its K
    windows in 16-byte vectors. (o_proj's and down's windows start and end at any column; loaded element by element,
    they made 260 scalar bf16 loads through L2 in its PTX, each warp instruction eight times the sector requests of a
    vector one.)"""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    llama1, llama8 = get_model("llama-1b").config, get_model("llama-8b").config

    def groups(cfg, batch: int, **kw: int | str) -> int:
        geo = stream_geometry(cfg, StreamConfig(**kw), batch)
        return geo["NCHH"] // geo["CG"]

    assert [groups(llama1, b, stage_groups=1) for b in (8, 16)] == [1, 1]
    assert [groups(llama8, b) for b in (8, 16)] == [2, 2]
    assert [groups(llama8, b, x_dtype="fp32") for b in (8, 16)] == [1, 2]
    assert [groups(llama1, 16, stage_values=16384), groups(llama8, 16, stage_values=16384)] == [2, 4]
    kernel, res = compile_v10(llama1, 4096, StreamConfig(qkv_box_rows=32), batch=16)
    assert res.stack == 0
    assert kernel.asm["ptx"].count("ld.global.cg.b16") < 16


def test_a_small_batch_operand_is_staged_in_pipelined_groups() -> None:
    """By default a tile build's weight ops pipeline their stage (`_staged_rows_batch`) in 4 groups where the operand
    is at most `STAGE_PIPE_VALUES` values, QKV is K-packed at most 2 ways and each group holds at least 2 chunks
    (llama-1b's batch 8 with 32-row QKV boxes: groups of 2 chunks; qwen2.5-0.5b's 4 chunks go in 2 groups, as groups
    of one chunk spill); else, with x in fp16 (the tile builds' default), in 2 groups up to `STAGE_PIPE_F16_BATCH`
    sequences (llama-8b's batch 8, llama-1b's with its default 16-row QKV boxes) and whole above (their batch 16:
    their pipelined builds spill); with fp32 x in `stage_values`' groups where those are several (llama-8b's batch 16:
    two), llama-8b's batch 8 whole; every build on row-pair slots stages whole. A QK-norm model's RoPE-pair build at
    a hidden size in `STAGE_WHOLE_QK_PAIRS_HIDDEN` (qwen3-1.7b, whose pipelined builds spill) stages whole.
    `stage_groups` asks for a number of groups
    (1: the whole stage, in `stage_values`' groups one after the other), and a negative one is refused by name."""
    from megasynth.kernels.gpu.stream import STAGE_PIPE_VALUES, StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    llama1, llama8 = get_model("llama-1b").config, get_model("llama-8b").config

    def pipe(cfg, batch: int, **kw: int | str) -> tuple[bool, int]:
        geo = stream_geometry(cfg, StreamConfig(**kw), batch)
        return geo["SPIPE"], geo["NCHH"] // geo["CG"]

    assert 8 * llama1.hidden_size <= STAGE_PIPE_VALUES < 16 * llama1.hidden_size
    assert pipe(llama1, 8) == (True, 2) and pipe(llama1, 8, qkv_box_rows=32) == (True, 4)
    assert pipe(llama1, 8, x_dtype="fp32") == (False, 1)
    assert pipe(llama1, 8, stage_groups=2) == (True, 2)
    assert pipe(get_model("qwen2.5-0.5b").config, 8) == (True, 2)
    assert pipe(llama1, 8, stage_groups=1) == (False, 1)
    qwen06, qwen17 = get_model("qwen3-0.6b").config, get_model("qwen3-1.7b").config  # RoPE-pair QKV (`qk_pairs`)
    assert pipe(qwen17, 8) == (False, 1) and pipe(qwen06, 8) == (True, 2) and pipe(qwen17, 8, stage_groups=2)[0]
    assert pipe(qwen17, 8, qk_pairs=False) == (True, 4)  # its whole-head build as llama-1b's with 32-row boxes
    assert pipe(llama1, 16) == (False, 1) and pipe(llama8, 8) == (True, 2) and pipe(llama8, 16) == (False, 2)
    assert pipe(llama8, 8, x_dtype="fp32") == (False, 1) and pipe(llama8, 16, x_dtype="fp32") == (True, 2)
    assert pipe(llama8, 16, stage_groups=1) == (False, 2) and pipe(llama8, 16, stage_groups=2) == (True, 2)
    assert pipe(llama1, 16, stage_groups=4) == (True, 4)
    assert pipe(llama1, 4)[0] is False and pipe(llama1, 4, stage_groups=4)[0] is False  # row-pair slots
    with pytest.raises(ValueError, match="stage_groups"):
        stream_geometry(llama1, StreamConfig(stage_groups=-1), 8)


def test_sass_loops_keeps_the_innermost_loops() -> None:
    """`sass_loops` reads nvdisasm's listing: a backward branch closes a loop, and only loops with no other loop
    inside are kept, each with its body's opcodes (predicates dropped)."""
    from megasynth.kernels.gpu.offline import sass_loops

    listing = """
.L_x_0:
        /*0000*/                   MOV R1, R2 ;
.L_x_1:
        /*0010*/                   FFMA R3, R4, R5, R3 ;
        /*0020*/              @!P0 FMUL R3, R3, 0.5 ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
        /*0040*/                   BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   EXIT ;
"""
    (loop,) = sass_loops(listing)
    assert (loop.start, loop.end, loop.size) == (0x10, 0x30, 3)
    assert loop.ops == {"FFMA": 1, "FMUL": 1, "BRA": 1}
    assert loop.has(["FF", "BRA"]) and not loop.has(["MUFU"])


def _listing(body: list[str]) -> str:
    lines = [".L_x_0:"] + [f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body)]
    return "\n".join(lines + [f"        /*{16 * len(body):04x}*/                   BRA `(.L_x_0) ;", ""])


def test_loop_cycles_follow_dependency_chains() -> None:
    """`SassLoop.cycles` issues one instruction a cycle once its registers are ready: independent products take a
    cycle each; the same shuffle reductions cost more one value after another than interleaved (what made the
    base-2 softmax slower on llama-8b); a second warp fills the first one's stalls; an LDS.128 writes 4 registers."""
    from megasynth.kernels.gpu.offline import LATENCY, _dataflow, sass_loops

    (fma,) = sass_loops(_listing([f"FFMA R{10 + i}, R1, R2, R{10 + i}" for i in range(8)]))
    assert fma.cycles(warps=1) == 9  # 8 products and the branch

    def reduce(value: int) -> list[str]:
        return [ins for lane in (8, 4, 2, 1) for ins in (f"SHFL.BFLY PT, R{value + 1}, R{value}, {lane:#x}, 0x1f",
                                                          f"FADD R{value}, R{value}, R{value + 1}")]

    serial = sass_loops(_listing(reduce(20) + reduce(30)))[0]
    a, b = reduce(20), reduce(30)
    mixed = sass_loops(_listing([ins for pair in zip(a, b, strict=True) for ins in pair]))[0]
    assert serial.ops == mixed.ops
    chain = 4 * (LATENCY["SHFL"] + 5)  # one value's four levels, shuffle then add
    assert serial.cycles(warps=1) >= 2 * chain - 10 and mixed.cycles(warps=1) <= chain + 10
    assert serial.cycles(warps=2) < 2 * serial.cycles(warps=1)
    assert _dataflow("LDS.128 R40, [R197+0x2000]") == ("LDS.128", [40, 41, 42, 43], [197])
    assert _dataflow("@!P4 FFMA R1, R2.reuse, -R3, R1") == ("FFMA", [1], [2, 3, 1])
    assert _dataflow("ISETP.GE.AND P4, PT, R40, R191, PT") == ("ISETP.GE.AND", [], [40, 191])
    assert _dataflow("STS [R3+0x10], R4") == ("STS", [], [3, 4])


def test_attention_ring_loop_in_machine_code() -> None:
    """llama-1b's CUDA-core attention loop, read from the machine code: one innermost loop holds the ring wait, the
    shared loads and the exps, 12 of them a slot (the rescale and both blocks' weights, 4 heads). With attn_exp2 each
    is one MUFU.EX2 without the range check of `gl.exp` (no FSETP.GEU left), so the slot's loop is 4 instructions an
    exp shorter (`python scripts/compile_check.py --loops MUFU.EX2,LDS`). The weight loops and the K/V slots widen
    bf16 pairs with a shift and an AND each (`ptx.gl_bf16_to_f32`): no PRMT, at most one instruction an element."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10, sass, sass_loops
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model("llama-1b")
    loops = {}
    for exp2 in (False, True):
        kernel, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig(attn_exp2=exp2))
        assert res.stack == 0
        found = sass_loops(sass(kernel))
        (loops[exp2],) = [lp for lp in found if lp.has(["SYNCS.PHASECHK", "LDS", "MUFU.EX2"])]
        weights = [lp for lp in found if lp.has(["FFMA", "LDS.128", "BAR.SYNC"]) and not lp.has(["MUFU"])]
        assert len(weights) >= 4, [str(lp) for lp in found]
        for lp in weights + [loops[exp2]]:
            assert "PRMT" not in lp.ops, str(lp)
        for lp in weights:  # 16 rows x 8 K elements a thread: 32 products, 32 widenings
            widen = lp.ops["LOP3.LUT"] + lp.ops["SHF.L.U32"] + lp.ops["IMAD.U32"]
            assert lp.ops["FFMA"] == 32 and widen <= 34, str(lp)
    assert loops[False].ops["MUFU.EX2"] == loops[True].ops["MUFU.EX2"] == 12
    assert loops[False].ops["FSETP.GEU.AND"] == 12 and "FSETP.GEU.AND" not in loops[True].ops
    assert loops[False].size - loops[True].size >= 4 * 12 - 6, (loops[False], loops[True])
    # and its dependency chains shorter (measured 7-14 % faster at long contexts; docs/perf-notes.md)
    assert loops[True].cycles() < 0.9 * loops[False].cycles(), (loops[False].cycles(), loops[True].cycles())


def test_base2_softmax_is_the_default_where_it_pays() -> None:
    """`stream_config` turns the base-2 softmax on where it measured faster: with attention a function of its own
    (`attn_call`, Triton's stage hook present) for every shape; inlined, only for 64-dim heads or fewer than 4 query
    heads a group (llama-8b measured slower there). A plain StreamConfig() leaves it off."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu import stream
    from megasynth.kernels.gpu.stream import StreamConfig, attn_exp2_pays, stream_config
    from megasynth.lowering.models import get_model

    inlined = {"llama-1b": True, "qwen3-1.7b": True, "qwen3-0.6b": True, "llama-8b": False, "qwen3-8b": False,
               "qwen2.5-7b": False}
    assert stream.FUNCTIONS_OK, "Triton's stage hook is missing: attention stays inlined"
    assert all(stream_config(get_model(m).config).attn_exp2 for m in inlined)
    try:
        stream.FUNCTIONS_OK = False
        assert {m: attn_exp2_pays(get_model(m).config) for m in inlined} == inlined
    finally:
        stream.FUNCTIONS_OK = True
    assert stream_config(None) == StreamConfig() and not StreamConfig().attn_exp2 and StreamConfig().attn_call
    # 4 fills in flight from 8B-class hidden sizes (llama-8b measured faster with them, llama-1b and -3b slower)
    assert {m: stream_config(get_model(m).config).inflight for m in ("llama-1b", "llama-3b", "llama-8b", "qwen3-8b")
            } == {"llama-1b": 3, "llama-3b": 3, "llama-8b": 4, "qwen3-8b": 4}


def test_partition_barriers_renames_only_called_functions() -> None:
    """`ptx.partition_barriers` makes a called function's CTA barriers the compute partition's named barrier and leaves
    the kernel entry's (and its already named ones) as they are."""
    from megasynth.kernels.gpu.ptx import partition_barriers

    text = (".func (.param .b32 r) attn(\n.param .b32 a\n);\n"  # a prototype
            ".visible .entry stream_megakernel(\n)\n{\n\tbar.sync \t0;\n\tbar.sync \t0, 256;\n}\n"
            ".func (.param .b32 r) attn(\n.param .b32 a\n)\n{\n\tbar.sync \t0;\n\tbarrier.sync 0;\n"
            "\tbar.sync 0, 256;\n\tbar.sync 1;\n}\n")
    out = partition_barriers(text, 256)
    entry, func = out.split(".visible .entry")[1].split(".func")
    assert "bar.sync \t0;" in entry and entry.count("bar.sync") == 2
    assert func.count("bar.sync 0, 256;") == 3 and "bar.sync \t0;" not in func and "barrier.sync 0;" not in func
    assert "bar.sync 1;" in func  # another barrier id is not the partition's: left alone


def _function_barriers(ptx_text: str) -> dict[str, list[str]]:
    """The barriers of each called function in a kernel's PTX, by the function's (mangled) name."""
    import re

    funcs: dict[str, list[str]] = {}
    name = None
    for line in ptx_text.splitlines():
        if re.match(r"(\.visible\s+)?\.(func|entry)\b", line):
            head = line.split("(")[0]
            name = line.split(")")[-1].strip() if ".func" in head else None
            if name is not None:
                funcs.setdefault(name, [])
        elif name is not None and (m := re.search(r"\bbar(?:rier)?\.sync\S*\s+[^;]*;", line)):
            funcs[name].append(m.group(0))
    return funcs


def test_attention_function_holds_only_partition_barriers() -> None:
    """With `attn_call` attention compiles to a function of its own whose every barrier is the compute partition's
    (8 warps: `bar.sync 0, 256`), a CTA barrier there would wait for the loader warp forever, and its ring loop models
    at least a quarter faster than inlined on llama-8b, on the build it was measured on (5.48 -> 5.10 ms at ctx
    32768; down's K staged whole and loaded element by element: with `down_window` the inlined loop models 887
    cycles, the function's 766)."""
    pytest.importorskip("triton.experimental.gluon")
    from dataclasses import replace

    from megasynth.kernels.gpu.offline import compile_v10, sass, sass_loops
    from megasynth.kernels.gpu.stream import stream_config
    from megasynth.lowering.models import get_model

    spec = get_model("llama-8b")
    cycles = {}
    for call in (True, False):
        sc = replace(stream_config(spec.config), attn_call=call, op_call=False, down_window=False, k_vec=False)
        kernel, res = compile_v10(spec.config, spec.max_seq_len, sc)
        assert res.stack == 0
        funcs = _function_barriers(kernel.asm["ptx"])
        assert [name for name in funcs if "_op_attn_partial_" in name] == (list(funcs) if call else [])
        barriers = [b for found in funcs.values() for b in found]
        assert bool(barriers) == call and all(b.endswith("0, 256;") for b in barriers), barriers
        (loop,) = [lp for lp in sass_loops(sass(kernel)) if lp.has(["SYNCS.PHASECHK", "LDS", "MUFU.EX2"])]
        cycles[call] = loop.cycles()
    assert cycles[True] < 0.75 * cycles[False], cycles


@pytest.mark.parametrize("model", ["llama-1b", "qwen3-8b"])
def test_ops_as_functions(model: str) -> None:
    """With `op_call` (the default) each batch-1 instruction's op runs in `_single_op`, a function of its own that
    calls attention's, every barrier in both the compute partition's; nothing spills (qwen3-8b spilled 8 bytes with
    the ops inlined), and on llama-1b the loop that merges attention's split partials before o_proj models at least
    40 % faster than with the ops inlined (-1.2 % a step measured at ctx 1024)."""
    pytest.importorskip("triton.experimental.gluon")
    from dataclasses import replace

    from megasynth.kernels.gpu.offline import compile_v10, sass, sass_loops
    from megasynth.kernels.gpu.stream import stream_config
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    assert stream_config(spec.config).op_call
    merge = {}
    for call in (True, False):
        kernel, res = compile_v10(spec.config, spec.max_seq_len, replace(stream_config(spec.config), op_call=call))
        funcs = _function_barriers(kernel.asm["ptx"])
        assert any("_single_op_" in name for name in funcs) == call
        assert all(b.endswith("0, 256;") for found in funcs.values() for b in found), funcs
        if call:
            assert res.stack == 0
        merges = [lp.cycles() for lp in sass_loops(sass(kernel)) if lp.has(["LDG.E.STRONG", "MUFU.EX2", "FMUL"])]
        merge[call] = max(merges)
    if model == "llama-1b":
        assert merge[True] < 0.6 * merge[False], merge


@pytest.mark.parametrize("model", ["tiny", "tiny-mha", "tiny-gqa4", "llama-1b", "llama-3b", "llama-8b"])
def test_staging_buffer_holds_attentions_lane_partials(model: str) -> None:
    """Attention merges its warps' position lanes through the staging buffer ([GP, num_warps, 2 hd] fp32 per
    instruction: the weighted sums, each warp's max and denominator, padded to a power of two), so the buffer must
    hold them even where the activation vectors are short (tiny configs, 4 warps)."""
    from megasynth.kernels.gpu.stream import StreamConfig, stream_constexprs, stream_geometry
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    for sc in (StreamConfig(), StreamConfig(num_warps=4), StreamConfig(mma=True)):
        geo = stream_geometry(spec.config, sc)
        gp = stream_constexprs(spec.config, spec.max_seq_len, sc, False)["GP"]
        assert geo["stage_bytes"] >= gp * sc.num_warps * 2 * spec.config.hd * 4


def test_v9_still_compiles() -> None:
    from megasynth.kernels.gpu.offline import compile_v9
    from megasynth.kernels.gpu.v9 import KernelConfig
    from megasynth.lowering.models import get_model

    spec = get_model("tiny")
    kernel, res = compile_v9(spec.config, spec.max_seq_len, KernelConfig())
    assert res.stack == 0
    ptx = kernel.asm["ptx"]  # the counter protocol of kernels/gpu/ptx.py: acquire polls, release adds from thread 0
    assert "ld.acquire.gpu.global.b32" in ptx and "@%p0 red.release.gpu.global.add.s32" in ptx


def test_too_many_slots_is_a_clear_error() -> None:
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    with pytest.raises(ValueError, match="ring slots"):
        stream_geometry(get_model("llama-1b").config, StreamConfig(slots=64))


def test_v10_polls_counters_from_the_first_warp_only() -> None:
    """Only the first compute warp issues a counter's acquire load (the others wait at a CTA barrier): every acquire
    in the PTX is kernels/gpu/ptx.py's first-warp poll, and the signals are its release adds from thread 0."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model("tiny")
    kernel, _ = compile_v10(spec.config, spec.max_seq_len, StreamConfig())
    ptx = kernel.asm["ptx"]
    polls = ptx.count("ld.acquire.gpu.global.b32")
    assert polls > 0 and polls == ptx.count("@%p0 ld.acquire.gpu.global.b32")
    assert ptx.count("setp.lt.u32 %p0, %t0, 32; mov.u32") == polls
    assert "@%p0 red.release.gpu.global.add.s32" in ptx


def test_v9_batch_builds_compile_without_spills() -> None:
    """Interpreter v9's batch builds (the staged tensor-core operand) for sm_90: llama-1b at batch 8 and llama-8b at
    batch 16 without spills; at batch 4, where ptxas alone caps llama-1b's build at 128 registers and spills,
    `maxnreg=255` reaches the compiler and lifts the cap."""
    from megasynth.kernels.gpu.offline import compile_v9
    from megasynth.kernels.gpu.v9 import KernelConfig
    from megasynth.lowering.models import get_model

    for name, batch in (("llama-1b", 8), ("llama-8b", 16)):
        _, res = compile_v9(get_model(name).config, 1024, KernelConfig(), batch=batch)
        assert res.stack == 0, (name, batch, res)
    _, res = compile_v9(get_model("llama-1b").config, 1024, KernelConfig(maxnreg=255), batch=4)
    assert res.stack == 0 and res.regs > 128, res


@pytest.mark.parametrize("model, batch", [("tiny", 3), ("tiny-qwen2", 3), ("tiny", 8), ("llama-1b", 4),
                                          ("llama-1b", 8), ("llama-1b", 16), ("llama-8b", 8), ("tiny-qwen3", 3),
                                          ("qwen3-0.6b", 8), ("qwen3-1.7b", 8), ("qwen3-8b", 8)])
def test_v10_batch_builds_fit(model: str, batch: int) -> None:
    """Interpreter v10's batch builds for sm_90: no spill stack (llama-8b's batch 8 16 B; the Qwen3 builds' stage
    split as measured without spill, `STAGE_WHOLE_QK_PAIRS_HIDDEN`), shared
    memory within a CTA's; the staged operand
    (every sequence's vector, 1 or 2 bf16 rows per 64-wide sub-chunk, the batch padded to 8 rows at least on
    the [128, 64] tiles of a batch of 8 or more; 4 or 8 per 256-wide chunk on the row-pair slots of the others)
    leaves
    a ring of at least 5 slots of 16 KB (4 of 32 KB on tiles of 128 K columns) and holds attention's lane
    partials ([GP, num_warps, hd] fp32), even where the hidden size is one chunk (tiny-qwen2, whose down K then
    goes in two windows)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.pack import v10_tile_slots
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig, stream_constexprs, stream_geometry
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    for sc in (StreamConfig(), StreamConfig(batch_hilo=True)):
        geo = stream_geometry(spec.config, sc, batch)
        consts = stream_constexprs(spec.config, spec.max_seq_len, sc, False, batch)
        tile = v10_tile_slots(spec.config, batch, sc.batch_tiles)  # [128, 64] tiles; else the row-pair slots
        assert geo["MMA"] and geo["TILE"] == consts["TILE"] == tile and consts["NB"] == batch
        assert consts["NBP"] >= (max(8, batch) if tile else batch)
        per_sub = 2 if sc.batch_hilo else 1  # operand rows per sequence and 64-column sub-chunk
        assert consts["CPS"] == (per_sub if tile else 4 * per_sub)
        assert geo["stage_bytes"] == geo["NCH"] * 4 * per_sub * consts["NBP"] * 64 * 2
        assert geo["stage_bytes"] >= consts["GP"] * sc.num_warps * spec.config.hd * 4
        assert geo["NS"] >= (4 if tile else 5) and geo["stage_k"] >= spec.config.hidden_size
        assert geo["ring_bytes"] >= 5 * 16 * 1024
    if model.startswith("tiny") or batch in (4, 8):
        _, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig(), batch=batch)
        # llama-8b's batch 8 stages its fp16 x in two pipelined groups: 16 B of spill, measured 2.7 % faster
        # (docs/perf-notes.md)
        spill = {("llama-8b", 8): 16}.get((model, batch), 0)
        assert res.stack <= spill, f"{model} batch {batch}: {res.stack} bytes of spill stack"
        assert res.shared <= SMEM_LIMIT


@pytest.mark.parametrize("model, batch", [("tiny-qwen3", 3), ("qwen3-0.6b", 8), ("qwen3-1.7b", 8)])
def test_v10_whole_head_qk_norm_batch_builds_fit(model: str, batch: int) -> None:
    """A QK-norm model's batch build without `qk_pairs` (QKV on whole-head tiles that it normalises, on tile slots at
    every batch) compiles for sm_90 within a CTA's shared memory, without spill (its build for qwen3-8b at batch 16
    spills 56 B; docs/perf-notes.md)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import SMEM_LIMIT, StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    _, res = compile_v10(spec.config, 4096, StreamConfig(qk_pairs=False), batch=batch)
    assert res.stack == 0, f"{model} batch {batch}: {res.stack} bytes of spill stack"
    assert res.shared <= SMEM_LIMIT


def test_v10_batch_limits_name_what_they_refuse() -> None:
    """What interpreter v10 cannot build a batch for is a ValueError naming it (Megakernel then runs v9)."""
    from megasynth.kernels.gpu.stream import StreamConfig, batch_limits, stream_geometry
    from megasynth.lowering.models import get_model

    llama = get_model("tiny").config
    assert batch_limits(llama, StreamConfig(), 1) is None and batch_limits(llama, StreamConfig(), 16) is None
    assert "outside 1..16" in batch_limits(llama, StreamConfig(), 17)
    assert "2 boxes" in batch_limits(llama, StreamConfig(boxes=4), 2)
    mha = get_model("tiny-mha").config
    assert "multiples of 64" in batch_limits(mha, StreamConfig(), 2)
    with pytest.raises(ValueError, match="cannot run this batch: a batch runs on the tensor cores"):
        stream_geometry(mha, StreamConfig(), 3)


def test_v10_qk_norm_batches_take_whole_heads_on_tiles() -> None:
    """A QK-norm model's batch built without `qk_pairs` normalises each q and k head in QKV's epilogue over one tile
    half (64 rows): it runs on tile slots at every batch, whatever `batch_tiles` says, with QKV boxes of half a head
    and no K-packing (its builds' spills: `test_v10_whole_head_qk_norm_batch_builds_fit`)."""
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    qwen = get_model("qwen3-1.7b").config
    for batch in (2, 3, 8, 16):
        for sc in (StreamConfig(qk_pairs=False), StreamConfig(qk_pairs=False, batch_tiles=16),
                   StreamConfig(qk_pairs=False, qkv_box_rows=32)):
            geo = stream_geometry(qwen, sc, batch)
            assert geo["TILE"] and geo["QKP"] == 1 and geo["X_DTYPE"] == "fp16", (batch, sc)
            assert geo["QKH"]
    assert stream_geometry(qwen, StreamConfig(qk_pairs=False), 8)["QXR"] == qwen.hd // 2
    assert not stream_geometry(get_model("llama-1b").config, StreamConfig(), 3)["TILE"]


def test_v10_qk_pairs_batches_take_any_models_qkv_geometry() -> None:
    """With `qk_pairs` a QK-norm model's batch builds as a model without the norm would: row-pair slots below
    `batch_tiles`, QKV boxes of `v10_qkv_box_rows` and K-packed on tiles, and no QKV that normalises (QKH false);
    llama's geometry is the same with it or without, and batch 1 has no QKH. Only its stage differs, at hidden 2048
    whole (`STAGE_WHOLE_QK_PAIRS_HIDDEN`)."""
    import dataclasses

    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    qwen = get_model("qwen3-1.7b").config
    plain = dataclasses.replace(qwen, qk_norm=False)
    for batch in (2, 3, 8, 16):
        geo = stream_geometry(qwen, StreamConfig(qk_pairs=True), batch)
        assert not geo["QKH"]
        whole = {"SPIPE": False, "CG": geo["NCHH"]} if batch == 8 else {}
        assert geo == {**stream_geometry(plain, StreamConfig(), batch), "QKH": False, **whole}, batch
    geo8 = stream_geometry(qwen, StreamConfig(qk_pairs=True), 8)
    assert geo8["TILE"] and geo8["QKP"] == 2 and geo8["QXR"] == 32
    assert not stream_geometry(qwen, StreamConfig(qk_pairs=True), 3)["TILE"]
    llama = get_model("llama-1b").config
    assert stream_geometry(llama, StreamConfig(qk_pairs=True), 8) == stream_geometry(llama, StreamConfig(), 8)
    assert not stream_geometry(qwen, StreamConfig(), 1)["QKH"]


def test_batch_one_loads_k_ranges_as_vectors() -> None:
    """At batch 1 o_proj's and down's K ranges start at a column known only at run time; with `k_vec` (their ranges
    on multiples of 8 columns, checked when a schedule is packed) llama-1b's build loads them in 16-byte vectors,
    and without it element by element: at least 16 more scalar fp32 loads through L2 in its PTX. Registers and
    stack are the same."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import stream_config, stream_geometry
    from megasynth.lowering.models import get_model

    cfg = get_model("llama-1b").config
    sc = stream_config(cfg)
    assert sc.k_vec and stream_geometry(cfg, sc)["KA"] == 4
    assert stream_geometry(cfg, dataclasses.replace(sc, k_vec=False))["KA"] == 1
    assert stream_geometry(cfg, sc, 8)["KA"] == 1  # a batch rounds its windows itself (`_load_window`)
    (vec, vres), (elem, eres) = (compile_v10(cfg, 4096, dataclasses.replace(sc, k_vec=on)) for on in (True, False))
    scalar = [k.asm["ptx"].count("ld.global.cg.b32") for k in (vec, elem)]
    assert scalar[1] - scalar[0] >= 16, scalar
    assert (vres.regs, vres.stack) == (eres.regs, eres.stack) and vres.stack == 0


def test_a_release_is_a_gpu_fence_then_the_add() -> None:
    """Every counter release (`ptx.ASM_SIGNAL_RELEASE`) is a GPU-scope fence right before the add in the machine code:
    the fence that waits until this SM's fills in flight have landed, which is what a release costs while the loader
    streams (`scripts/release_probe.py`, docs/perf-notes.md)."""
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.offline import compile_v10, sass
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import get_model

    spec = get_model("tiny")
    kernel, _ = compile_v10(spec.config, spec.max_seq_len, StreamConfig())
    code = [ln for ln in sass(kernel).splitlines() if ";" in ln]
    adds = [i for i, ln in enumerate(code) if "RED" in ln and ".ADD.S32" in ln and ".GPU" in ln]
    assert adds, "no counter release found in the machine code"
    for i in adds:
        assert any("MEMBAR" in ln and ".GPU" in ln for ln in code[max(0, i - 4):i]), code[max(0, i - 4):i + 1]


def test_fills_in_flight_are_counted_in_batch_1_slots() -> None:
    """`StreamConfig.inflight` is a byte budget in batch-1 slots: a tile batch's 32 KB slots keep half as many fills
    in flight (rounded up), its 16 KB slots (llama-8b at batch 16) and every row-pair batch as many, and the ring
    bounds it; the build's INFLIGHT is that count. A batch's QKV tile fills of a 64-dim head carry 16 KB (32 rows of
    each half, 8 KB in 16-row boxes) unless K-packed (the default: 32 KB), so its QKV keeps as many bytes in flight in
    as many fills as that takes (QIN; `qkv_inflight` sets it). A tile batch's gate/up keeps half the ring in flight
    where that is more (GIN: llama-1b's batch 8, 3 of 6 slots; `gate_up_inflight` sets it)."""
    from megasynth.kernels.gpu.stream import StreamConfig, stream_config, stream_constexprs, stream_geometry
    from megasynth.lowering.models import get_model

    for name, batch, kt, fills, qkv, gate_up in (
            ("llama-1b", 1, 1, 3, 3, 3), ("llama-1b", 4, 1, 3, 3, 3), ("llama-1b", 8, 2, 2, 2, 3),
            ("llama-1b", 16, 2, 2, 2, 2), ("llama-8b", 1, 1, 4, 4, 4), ("llama-8b", 8, 2, 2, 2, 2),
            ("llama-8b", 16, 1, 4, 4, 4)):
        cfg = get_model(name).config
        sc = stream_config(cfg)
        geo = stream_geometry(cfg, sc, batch)
        assert (geo["KT"], geo["INFLIGHT"], geo["QIN"], geo["GIN"]) == (kt, fills, qkv, gate_up), (name, batch)
        assert stream_constexprs(cfg, 4096, sc, False, batch)["INFLIGHT"] == fills
    llama = get_model("llama-1b").config
    assert stream_geometry(llama, StreamConfig(inflight=0), 8)["INFLIGHT"] == stream_geometry(llama, StreamConfig(),
                                                                                               8)["NS"]
    assert stream_geometry(llama, StreamConfig(inflight=99), 1)["INFLIGHT"] == stream_geometry(llama, StreamConfig(),
                                                                                                1)["NS"]
    assert stream_geometry(llama, StreamConfig(qkv_inflight=5), 8)["QIN"] == 5
    assert stream_geometry(llama, StreamConfig(qkv_kpack=False, qkv_box_rows=32), 8)["QIN"] == 3
    assert stream_geometry(llama, StreamConfig(qkv_kpack=False), 8)["QIN"] == 6  # the whole ring
    assert stream_geometry(llama, StreamConfig(gate_up_inflight=2), 8)["GIN"] == 2


def test_batch_products_one_wgmma_as_wide_as_the_operand() -> None:
    """A batch's weight products issue one wgmma per 64-row half and K step as wide as the staged operand (N = the
    padded batch, times hi/lo, times the K-packed QKV's sub-chunks), not several N-8 wgmmas that each read the weight
    tile from shared memory again. QKV tiles are K-packed (`StreamConfig.qkv_kpack`, boxes of `qkv_box_rows` rows of
    each RoPE half at 64 / rows sub-chunks a tile: 32 rows at two for llama-8b's 128-dim heads, 16 at four for
    64-dim heads; full 32 KB fills, so their fills in flight drop to as many bytes as the other ops');
    hidden sizes that the sub-chunks do not divide into whole slots and row-pair slots are not. Only llama-1b's batch
    16 build, whose four sub-chunks make QKV's operand 64 columns a sequence, spills (32 B; measured faster anyway)."""
    pytest.importorskip("triton.experimental.gluon")
    import re
    from collections import Counter

    from megasynth.kernels.gpu.offline import compile_v10
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry
    from megasynth.lowering.models import get_model

    llama, big = get_model("llama-1b").config, get_model("llama-8b").config
    for batch, packed, unpacked_fills in ((8, (4, 16, 2), 6), (16, (4, 16, 2), 5)):
        geo = stream_geometry(llama, StreamConfig(), batch)
        assert (geo["QKP"], geo["QXR"], geo["QIN"]) == packed
        assert stream_geometry(llama, StreamConfig(qkv_box_rows=32), batch)["QKP"] == 2
        off = stream_geometry(llama, StreamConfig(qkv_kpack=False), batch)  # 16 or 8 KB QKV fills: more in flight
        assert (off["QKP"], off["QIN"]) == (1, unpacked_fills)
        geo8b = stream_geometry(big, StreamConfig(), batch)
        assert (geo8b["QKP"], geo8b["QXR"]) == (2, 32)
        assert stream_geometry(big, StreamConfig(qkv_box_rows=64), batch)["QKP"] == 1
    with pytest.raises(ValueError, match="qkv_box_rows must be"):
        stream_geometry(llama, StreamConfig(qkv_box_rows=8), 8)
    # a tile build's residual stream in fp16 by default; other builds keep fp32; a bad type is refused by name
    assert stream_geometry(llama, StreamConfig(), 8)["X_DTYPE"] == "fp16"
    assert stream_geometry(llama, StreamConfig(x_dtype="fp32"), 16)["X_DTYPE"] == "fp32"
    assert stream_geometry(llama, StreamConfig(x_dtype="fp16"), 4)["X_DTYPE"] == "fp32"  # row-pair slots
    assert stream_geometry(llama, StreamConfig(), 1)["X_DTYPE"] == "fp32"
    with pytest.raises(ValueError, match="x_dtype must be fp32 or fp16 .*, got 'bf16'"):
        StreamConfig(x_dtype="bf16")
    assert stream_geometry(get_model("tiny-gqa4").config, StreamConfig(), 8)["QKP"] == 1  # hidden 256
    assert stream_geometry(get_model("qwen2.5-0.5b").config, StreamConfig(), 8)["QKP"] == 1  # hidden 896
    assert stream_geometry(llama, StreamConfig(), 4)["QKP"] == 1  # row-pair slots
    want = {8: {"m64n8k16", "m64n32k16"}, 16: {"m64n16k16", "m64n64k16"}, 4: {"m64n16k16"}}
    for batch, shapes in want.items():
        kernel, res = compile_v10(llama, 4096, StreamConfig(), batch=batch)
        assert res.stack == (32 if batch == 16 else 0), (batch, res.stack)
        got = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", kernel.asm["ptx"]))
        assert set(got) == shapes, (batch, got)
