"""`synth check`: the megakernel path (CPU executor) against transformers on tiny checkpoints written by
`save_pretrained`, one per family, and its refusals (exit 2, the file and the key named, no traceback); the choice of
device, and the GPU path's comparison (bf16 matrices and KV cache on both sides) driven on the CPU with the CPU
executor standing in for the GPU interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import HF_TINY, save_hf_checkpoint

from megasynth.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _check(folder: Path, *extra: str) -> tuple[int, str]:
    if "--device" not in extra:  # the CPU executor, also where CUDA is present
        extra = (*extra, "--device", "cpu")
    res = CliRunner().invoke(main, ["check", "--weights", str(folder), "--tokens", "3", *extra])
    assert "Traceback" not in res.output
    return res.exit_code, res.output


@pytest.mark.parametrize("family", list(HF_TINY))
def test_check_agrees_with_transformers(tmp_path: Path, family: str) -> None:
    save_hf_checkpoint(tmp_path, family)
    code, out = _check(tmp_path)
    assert code == 0, out
    assert out.rstrip().endswith("agree")
    steps = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(steps) == 3
    for _, _, err, ours, theirs in steps:
        assert float(err) <= 1e-4 and ours == theirs


def test_check_fails_on_disagreement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers side that differs (here: its logits shifted on one token) makes the check exit 1."""
    import megasynth.commands.check as check_mod

    save_hf_checkpoint(tmp_path, "mistral")
    real = check_mod._hf_runner

    def skewed(folder: Path, *args: object):  # noqa: ANN202
        run = real(folder, *args)

        def logits(tokens: list[int]):  # noqa: ANN202
            out = run(tokens).clone()
            out[7] += 0.01 * out.norm()
            return out
        return logits

    monkeypatch.setattr(check_mod, "_hf_runner", skewed)
    code, out = _check(tmp_path)
    assert code == 1, out
    assert "MISMATCH" in out and "DISAGREE" in out


def test_check_bad_input_exits_2(tmp_path: Path) -> None:
    code, out = _check(tmp_path / "missing")
    assert code == 2 and "missing" in out
    (tmp_path / "empty").mkdir()
    code, out = _check(tmp_path / "empty")
    assert code == 2 and "no config.json" in out
    ckpt = tmp_path / "ckpt"
    save_hf_checkpoint(ckpt, "qwen2")
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in [("use_sliding_window", True), ("num_experts", 4), ("model_type", "gpt2"),
                       ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
                       ("rms_norm_eps", -1.0)]:
        (ckpt / "config.json").write_text(json.dumps({**config, key: value}))
        code, out = _check(ckpt)
        assert code == 2, (key, out)
        assert f"{ckpt / 'config.json'}: $.{key}" in out, out
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "model.safetensors").unlink()
    code, out = _check(ckpt)
    assert code == 2 and "neither model.safetensors" in out
    code, out = _check(ckpt, "--prompt", "1,x")
    assert code == 2 and "--prompt" in out


def test_device_choice() -> None:
    from megasynth.commands.check import pick_device

    assert pick_device("auto", cuda=True) == "cuda" and pick_device("auto", cuda=False) == "cpu"
    assert pick_device("cpu", cuda=True) == "cpu" and pick_device("cuda", cuda=True) == "cuda"
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device("cuda", cuda=False)


def test_cuda_without_cuda_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import megasynth.commands.check as check_mod

    monkeypatch.setattr(check_mod, "_cuda_available", lambda: False)
    save_hf_checkpoint(tmp_path, "qwen2")
    code, out = _check(tmp_path, "--device", "cuda")
    assert code == 2 and "CUDA is not available" in out


class _KernelOnTheCpu:
    """The GPU interpreter's numbers on the CPU: the CPU executor over bf16-rounded matrices (norms and biases fp32,
    as `kernels.gpu.runtime.stack_weights` keeps them) with a bf16 KV cache; `step` as `Megakernel.step`."""

    def __init__(self, schedule, weights, max_seq_len: int) -> None:  # noqa: ANN001
        import torch

        from megasynth.ir.program import resolve
        from megasynth.kernels.reference import new_kv_cache

        self.prog = resolve(schedule)
        self.w = {k: v.to(torch.bfloat16).float() if v.dim() == 2 else v for k, v in weights.items()}
        self.k, self.v = new_kv_cache(self.prog.geometry.cfg, max_seq_len, dtype=torch.bfloat16)

    def step(self, token: int, pos: int):  # noqa: ANN201
        from megasynth.kernels.cpu_executor import run_program

        return run_program(self.prog, self.w, self.k, self.v, token, pos)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_gpu_path_compares_the_kernels_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """With --device cuda the megakernel path is the GPU interpreter (a CPU stand-in here) and transformers gets the
    same bf16 roundings: they agree within 1e-4 (~1e-6). Without the roundings on the transformers side the bf16
    rounding alone breaks the bound (~2e-3), so the roundings are what keeps the bound able to tell a kernel bug."""
    import megasynth.commands.check as check_mod

    save_hf_checkpoint(tmp_path, family)
    real = check_mod._hf_runner
    monkeypatch.setattr(check_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(check_mod, "_gpu_megakernel", _KernelOnTheCpu)
    monkeypatch.setattr(check_mod, "_hf_runner", lambda folder, numerics, device: real(folder, numerics, "cpu"))
    code, out = _check(tmp_path, "--device", "auto")
    assert code == 0, out
    assert "GPU interpreter, bf16 matrices and KV cache" in out and "the same bf16 roundings" in out
    errs = [float(line.split()[2]) for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(errs) == 3 and max(errs) <= 1e-5, errs
    monkeypatch.setattr(check_mod, "_hf_runner", lambda folder, numerics, device: real(folder, False, "cpu"))
    code, out = _check(tmp_path, "--device", "cuda")
    assert code == 1 and "MISMATCH" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "llama-hd"])
def test_check_on_the_gpu(tmp_path: Path, family: str) -> None:
    """The GPU interpreter against transformers with the kernel's bf16 roundings (head_dim 32 configs)."""
    pytest.importorskip("triton")
    save_hf_checkpoint(tmp_path, family)
    code, out = _check(tmp_path, "--device", "cuda")
    assert code == 0, out
    assert "GPU interpreter" in out and out.rstrip().endswith("agree")


@pytest.mark.parametrize("family", ["qwen3", "llama-hd"])
def test_check_batch_3_agrees_with_transformers_one_sequence_at_a_time(tmp_path: Path, family: str) -> None:
    """Three sequences with prompts of 4, 5 and 6 tokens step together through one batched schedule; transformers
    decodes each alone. In the first compared steps the shorter prompts already generate while the longest is still
    read, so every sequence's tokens and logits are its own."""
    save_hf_checkpoint(tmp_path, family)
    code, out = _check(tmp_path, "--batch", "3")
    assert code == 0, out
    assert out.rstrip().endswith("agree")
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit() and len(line.split()) == 6]
    assert sorted({int(r[1]) for r in rows}) == [0, 1, 2]
    assert [sum(int(r[1]) == b for r in rows) for b in range(3)] == [5, 4, 3]  # 3 tokens after the longest prompt
    assert all(float(r[3]) <= 1e-4 and r[4] == r[5] for r in rows)
    outs = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("seq ")}
    assert len(set(v.split(":", 1)[1] for v in outs.values())) == 3  # the sequences decode different tokens


def test_check_batch_bad_input(tmp_path: Path) -> None:
    save_hf_checkpoint(tmp_path, "mistral")
    code, out = _check(tmp_path, "--batch", "3", "--prompt", "1,2;3,4")
    assert code == 2 and "--prompt holds 2 prompts; --batch 3 needs 1 or 3" in out
    code, out = _check(tmp_path, "--batch", "2", "--device", "cuda")
    assert code == 2 and "checked on the CPU executor only so far" in out
