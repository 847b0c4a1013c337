"""Interpreter v10 compiles for sm_90 without a GPU (Triton's bundled ptxas), with no spill stack and within the
227 KB of shared memory one CTA may use, for the model shapes it runs; so does v9. The register and shared-memory
budget is what a kernel change most often breaks (docs/perf-notes.md), and this catches it before any device time."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)"),
    pytest.mark.usefixtures("single_thread"),
]


@pytest.mark.parametrize("model", ["tiny", "tiny-mha", "llama-1b", "llama-8b"])
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
    assert tiny["MMA"] and tiny["BK"] == 256 and tiny["NCH"] == 2
    assert not stream_geometry(get_model("tiny-mha").config, StreamConfig(mma=True))["MMA"]  # intermediate 160
    assert not stream_geometry(get_model("llama-1b").config, StreamConfig(mma=True, boxes=4))["MMA"]
    assert not stream_geometry(get_model("llama-1b").config, StreamConfig())["MMA"]  # off by default
    assert weight_box(stream_geometry(get_model("llama-1b").config, StreamConfig()))[0] == [16, 256]


@pytest.mark.parametrize("model", ["tiny", "tiny-mha", "tiny-gqa4", "llama-1b", "llama-3b", "llama-8b"])
def test_staging_buffer_holds_attentions_lane_partials(model: str) -> None:
    """Attention merges its position lanes through the staging buffer ([GP, num_warps, hd] fp32 per instruction), so
    the buffer must hold them even where the activation vectors are short (tiny configs, 4 warps)."""
    from megasynth.kernels.gpu.stream import StreamConfig, stream_constexprs, stream_geometry
    from megasynth.lowering.models import get_model

    spec = get_model(model)
    for sc in (StreamConfig(), StreamConfig(num_warps=4), StreamConfig(mma=True)):
        geo = stream_geometry(spec.config, sc)
        gp = stream_constexprs(spec.config, spec.max_seq_len, sc, False)["GP"]
        assert geo["stage_bytes"] >= gp * sc.num_warps * spec.config.hd * 4


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
