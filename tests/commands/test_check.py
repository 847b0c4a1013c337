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


def _write_scaled(folder: Path, tensor: str, edit) -> None:  # noqa: ANN001
    """Rewrite one tensor of the checkpoint in `folder` as `edit(tensor)` returns it."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    state = load_file(str(file))
    state[tensor] = edit(state[tensor].clone())
    save_file(state, str(file), metadata={"format": "pt"})


DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("batch", ["1", "2"])
def test_check_nan_weight_is_bad_input_naming_the_tensor(tmp_path: Path, batch: str) -> None:
    """One NaN in a down_proj makes both sides' logits NaN: not a disagreement (exit 1) but bad input (exit 2),
    found before anything decodes and named by the checkpoint's tensor name."""
    save_hf_checkpoint(tmp_path, "mistral")

    def one_nan(t: torch.Tensor) -> torch.Tensor:
        t[3, 5] = float("nan")
        return t

    _write_scaled(tmp_path, DOWN, one_nan)
    code, out = _check(tmp_path, "--batch", batch)
    assert code == 2, out
    assert f"{tmp_path}: the checkpoint holds non-finite weights" in out and f"{DOWN} (1 NaN of " in out, out
    assert "MISMATCH" not in out and "DISAGREE" not in out


@pytest.mark.parametrize("batch", ["1", "2"])
def test_check_logits_non_finite_on_both_sides_is_bad_input(tmp_path: Path, batch: str) -> None:
    """Finite weights whose activations overflow fp32 (a down_proj scaled to 3e38) give non-finite logits on both
    sides: exit 2 naming the step, not a disagreement."""
    save_hf_checkpoint(tmp_path, "mistral")
    _write_scaled(tmp_path, DOWN, lambda t: t / t.abs().max() * 3e38)
    code, out = _check(tmp_path, "--batch", batch)
    assert code == 2, out
    assert "non-finite logits from the reference (transformers) and the megakernel path alike at " in out, out
    assert ("step 0 (pos 3)" if batch == "1" else "pos 3 of sequence 0") in out, out
    assert "MISMATCH" not in out


def test_positions_fed_is_exact(tmp_path: Path) -> None:
    """The check feeds positions 0..P+N-2 (the last generated token is compared, never fed back): a model with
    max_position_embeddings 16 takes a 4-token prompt with --tokens 13, not 14; --max-seq-len 5 takes the default
    4-token prompt with --tokens 2, 4 does not."""
    from megasynth.commands.check import positions_fed

    assert positions_fed([[1, 2, 3, 4]], 125) == 128
    assert positions_fed([[1] * 4, [1] * 5, [1] * 6], 2) == 7
    save_hf_checkpoint(tmp_path, "mistral", max_position_embeddings=16)
    code, out = _check(tmp_path, "--prompt", "1,2,3,4", "--tokens", "13")
    assert code == 0, out
    assert [line.split()[1] for line in out.splitlines() if line[:4].strip().isdigit()][-1] == "15"  # the last pos
    code, out = _check(tmp_path, "--prompt", "1,2,3,4", "--tokens", "14")
    assert code == 2 and "the 17 positions (0..16)" in out and "max_position_embeddings = 16" in out, out
    code, out = _check(tmp_path, "--tokens", "2", "--max-seq-len", "5")
    assert code == 0, out
    code, out = _check(tmp_path, "--tokens", "2", "--max-seq-len", "4")
    assert code == 2 and "--max-seq-len 4 is below the 5 positions (0..4)" in out, out


def test_check_batch_positions_and_help(tmp_path: Path) -> None:
    """With --batch 3 (prompts of 4, 5, 6 tokens) and --tokens 2 the sequences generate 4, 3 and 2 tokens, up to
    position 6: --max-seq-len 7 is enough, 6 is not; the help of --tokens says so."""
    save_hf_checkpoint(tmp_path, "qwen3")
    code, out = _check(tmp_path, "--batch", "3", "--tokens", "2", "--max-seq-len", "7")
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit() and len(line.split()) == 6]
    assert [sum(r[1] == str(b) for r in rows) for b in range(3)] == [4, 3, 2]
    assert max(int(r[2]) for r in rows) == 6
    code, out = _check(tmp_path, "--batch", "3", "--tokens", "2", "--max-seq-len", "6")
    assert code == 2 and "below the 7 positions (0..6)" in out, out
    help_text = " ".join(CliRunner().invoke(main, ["check", "--help"]).output.split())
    assert "Greedy decode steps to compare" not in help_text
    assert "after the longest prompt" in help_text and "4, 3 and 2 tokens" in help_text
