"""Interpreter settings from the command line (`synth bench --kernel-option KEY=VALUE`): parsed against the config
dataclass, checked before anything runs, recorded in the bench JSON. CPU only."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.kernels.gpu.runtime import config_with, kernel_config
from megasynth.kernels.gpu.v9 import KernelConfig
from megasynth.lowering.models import get_model


def test_config_with_reads_each_value_as_its_fields_type() -> None:
    cfg = config_with(KernelConfig(), ["num_stages=2", "attn_mma=false", " batch_mma = ON "])
    assert (cfg.num_stages, cfg.attn_mma, cfg.batch_mma) == (2, False, True)
    assert config_with(KernelConfig(), []) == KernelConfig()
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.stream import StreamConfig

    assert config_with(StreamConfig(), ["x_dtype=fp32"]).x_dtype == "fp32"  # a name, quoted or not
    assert config_with(StreamConfig(), ["x_dtype='fp16'"]).x_dtype == "fp16"


@pytest.mark.parametrize("item, needle", [
    ("nope=1", "has no field 'nope'"),
    ("num_stages=two", "num_stages takes int values, not 'two'"),
    ("num_stages=2.5", "num_stages takes int values"),
    ("attn_mma=maybe", "attn_mma takes bool values"),
    ("num_stages", "expected KEY=VALUE"),
])
def test_config_with_names_the_bad_item(item: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        config_with(KernelConfig(), [item])
    assert repr(item) in str(info.value)


def test_kernel_config_picks_the_interpreter_megakernel_would() -> None:
    assert isinstance(kernel_config([], batch=4, device="cpu"), KernelConfig)  # no Hopper: v9, batch or not
    assert isinstance(kernel_config([], batch=1, device="cpu"), KernelConfig)
    assert kernel_config(["interpreter=v9", "num_warps=4"], batch=1).num_warps == 4
    with pytest.raises(ValueError, match="expected v9 or v10"):
        kernel_config(["interpreter=v8"])
    pytest.importorskip("triton.experimental.gluon")
    from megasynth.kernels.gpu.pack import default_batch_interpreter
    from megasynth.kernels.gpu.stream import StreamConfig

    # a batch runs on v10 unless its sizes are no multiples of 64 (tiny-mha): then naming v10 fails; a QK-norm
    # model's batch too, on RoPE-pair QKV tiles (qk_pairs, its default) or, named off, on whole heads
    assert isinstance(kernel_config(["interpreter=v10"], batch=2, cfg=get_model("tiny").config), StreamConfig)
    qwen = get_model("tiny-qwen3").config
    assert kernel_config(["interpreter=v10"], batch=2, cfg=qwen).qk_pairs
    assert not kernel_config(["interpreter=v10", "qk_pairs=false"], batch=2, cfg=qwen).qk_pairs
    assert [default_batch_interpreter(get_model(m).config, b) for m, b in (("tiny-qwen3", 2), ("tiny-qwen3", 1),
                                                                           ("tiny", 2), ("tiny-mha", 2))] == [
        "v10", "v10", "v10", "v9"]
    with pytest.raises(ValueError, match="cannot run a batch of 2 of this model: a batch runs on the tensor cores"):
        kernel_config(["interpreter=v10"], batch=2, cfg=get_model("tiny-mha").config)
    with pytest.raises(ValueError, match="outside 1..16"):
        kernel_config(["interpreter=v10"], batch=17, cfg=get_model("tiny").config)

    cfg = kernel_config(["interpreter=v10", "inflight=4", "mma=true"], batch=1, device="cpu")
    assert isinstance(cfg, StreamConfig) and (cfg.inflight, cfg.mma) == (4, True)


def test_bench_checks_kernel_options_first_and_records_them(tmp_path) -> None:
    bad = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--kernel-option", "nope=1"])
    assert bad.exit_code == 2 and "--kernel-option" in bad.output and "nope" in bad.output, bad.output
    assert "Traceback" not in bad.output
    out = tmp_path / "b.json"
    ok = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "6", "--reps", "1", "--warmup",
                                   "0", "--variants", "torch_bf16", "--kernel-option", "num_stages=2",
                                   "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(out.read_text())["settings"]["kernel_options"] == ["num_stages=2"]


def test_kernel_options_config_names_the_bad_item() -> None:
    """`synth bench` and `synth generate` check --kernel-option before anything runs: an unknown field or a value
    its field refuses (a residual stream in bf16) is click's bad-parameter error on --kernel-option."""
    import click

    from megasynth.commands import kernel_options_config

    assert kernel_options_config((), "llama-1b", None, 8, "cpu") is None  # the Megakernel's own choice
    with pytest.raises(click.BadParameter, match="has no field 'nope'") as info:
        kernel_options_config(("nope=1",), "llama-1b", None, 8, "cpu")
    assert info.value.param_hint == "--kernel-option"
    pytest.importorskip("triton.experimental.gluon")
    cfg = kernel_options_config(("interpreter=v10", "x_dtype=fp32"), "llama-1b", None, 8, "cpu")
    assert cfg.x_dtype == "fp32"
    with pytest.raises(click.BadParameter, match="x_dtype must be fp32 or fp16 .*got 'bf16'"):
        kernel_options_config(("interpreter=v10", "x_dtype=bf16"), "llama-1b", None, 8, "cpu")
    assert "--kernel-option" in CliRunner().invoke(main, ["generate", "--help"]).output
