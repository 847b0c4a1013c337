"""Interpreter v10 compiles for sm_90 without a GPU (Triton's bundled ptxas), with no spill stack and within the
227 KB of shared memory one CTA may use, for the model shapes it runs; so does v9. The register and shared-memory
budget is what a kernel change most often breaks (perf-notes v7), and this catches it before any device time."""

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
    from kernels.gpu.offline import compile_v10
    from kernels.gpu.stream import SMEM_LIMIT, StreamConfig, stream_geometry
    from synth.lowering.models import get_model

    spec = get_model(model)
    _, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig())
    assert res.stack == 0, f"{model}: {res.stack} bytes of spill stack"
    assert res.shared <= SMEM_LIMIT, f"{model}: {res.shared} B of shared memory > {SMEM_LIMIT}"
    assert stream_geometry(spec.config, StreamConfig())["NS"] >= 4, "the ring should hold at least 4 slots"


def test_v10_without_row_paired_slots_compiles() -> None:
    """StreamConfig(kpair=False), the K-split ops' previous slot order, stays selectable for side-by-side runs."""
    pytest.importorskip("triton.experimental.gluon")
    from kernels.gpu.offline import compile_v10
    from kernels.gpu.stream import StreamConfig
    from synth.lowering.models import get_model

    spec = get_model("tiny")
    _, res = compile_v10(spec.config, spec.max_seq_len, StreamConfig(kpair=False))
    assert res.stack == 0


def test_v9_still_compiles() -> None:
    from kernels.gpu.interpreter import KernelConfig
    from kernels.gpu.offline import compile_v9
    from synth.lowering.models import get_model

    spec = get_model("tiny")
    _, res = compile_v9(spec.config, spec.max_seq_len, KernelConfig())
    assert res.stack == 0


def test_too_many_slots_is_a_clear_error() -> None:
    from kernels.gpu.stream import StreamConfig, stream_geometry
    from synth.lowering.models import get_model

    with pytest.raises(ValueError, match="ring slots"):
        stream_geometry(get_model("llama-1b").config, StreamConfig(slots=64))
