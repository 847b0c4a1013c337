"""`--max-seq-len` on every command that lowers or runs a model: accepted up to the model's max_position_embeddings,
refused above it (and below 1) with exit 2 naming both numbers and the option, recorded in the schedule's
`model.max_seq_len`; `--ctx` and `--tokens` above it are refused. The memory check of the GPU runtime and of the
bench's own KV cache is driven on the CPU with `torch.cuda.mem_get_info` patched."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import save_hf_checkpoint

from megasynth.cli import main
from megasynth.ir.model import DoesNotFit
from megasynth.ir.schedule import load_schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS, MaxSeqLenError, get_model, with_max_seq_len
from megasynth.runs.rundir import RunDir


def _invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def test_spec_takes_lengths_up_to_max_position_embeddings() -> None:
    spec = get_model("llama-1b", 131072)
    assert spec.max_seq_len == 131072 and spec.config == MODELS["llama-1b"].config
    assert get_model("llama-1b").max_seq_len == 4096 and get_model("llama-1b", None) is MODELS["llama-1b"]
    for bad in (131073, 0, -5):
        with pytest.raises(MaxSeqLenError) as err:
            get_model("llama-1b", bad)
        assert f"--max-seq-len {bad} " in str(err.value) and "131072" in str(err.value)
    with pytest.raises(MaxSeqLenError, match="40960"):
        with_max_seq_len(MODELS["qwen3-0.6b"], 40961)
    assert get_model("tiny", 8192).max_seq_len == 8192  # a test config has no published limit


@pytest.mark.parametrize("value", ["131073", "0"])
def test_lower_refuses_a_length_outside_the_limit(tmp_path: Path, value: str) -> None:
    code, out = _invoke("lower", "--model", "llama-1b", "--max-seq-len", value, "-o", str(tmp_path / "s.json"))
    assert code == 2 and f"--max-seq-len {value}" in out and "131072" in out
    assert not (tmp_path / "s.json").exists()


def test_lower_records_max_seq_len(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    code, text = _invoke("lower", "--model", "tiny", "--workers", "4", "--max-seq-len", "8192", "-o", str(out))
    assert code == 0, text
    assert json.loads(out.read_text())["model"]["max_seq_len"] == 8192
    code, text = _invoke("lower", "--model", "tiny", "--workers", "4", "-o", str(out))
    assert code == 0 and json.loads(out.read_text())["model"]["max_seq_len"] == 64


#: `validate` on llama-1b lowered at 131072: ~1.4 s in the CLI on 2 shared cores (the same as at 4096; the
#: footprints are element intervals, never per position). The bound leaves room for a loaded CI machine.
VALIDATE_131072_S = 30.0


def test_validate_accepts_llama_1b_at_131072_quickly(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    code, text = _invoke("lower", "--model", "llama-1b", "--max-seq-len", "131072", "-o", str(out))
    assert code == 0, text
    from megasynth.validator.verify import Options, verify

    schedule = load_schedule(str(out))
    assert schedule.model is not None and schedule.model.max_seq_len == 131072
    assert schedule.buffers is not None and schedule.buffers["k_cache"] == 16 * 8 * 131072 * 64
    t = time.perf_counter()
    report = verify(schedule, str(out), Options(interleavings=200))
    assert report.accepted, report.findings[:3]
    assert time.perf_counter() - t < VALIDATE_131072_S


def test_a_kv_cache_past_2_31_elements_lowers() -> None:
    """llama-8b's K cache at 131072 has 2**32 elements; the schedule format takes such sizes (they are not int32
    fields of the interpreters' tables). The tiny config at 2**26 positions has 2**33, and lowers in milliseconds."""
    schedule = lower(get_model("tiny", 2**26), 4)
    assert schedule.buffers is not None and schedule.buffers["k_cache"] == 2**33


def test_search_refuses_ctx_and_length_and_records_max_seq_len(tmp_path: Path) -> None:
    base = ["search", "--model", "tiny", "--workers", "6", "--runs-dir", str(tmp_path), "--cpu", "--no-progress",
            "--interleavings", "5", "--final-interleavings", "5", "--proposer", "heuristic"]
    code, out = _invoke(*base, "--ctx", "100")
    assert code == 2 and "100" in out and "max_seq_len 64" in out and "--max-seq-len" in out
    code, out = _invoke("search", "--model", "llama-1b", "--max-seq-len", "200000", "--cpu")
    assert code == 2 and "200000" in out and "131072" in out and "--max-seq-len" in out
    code, out = _invoke(*base, "--max-seq-len", "128", "--ctx", "100", "--budget", "2", "--jobs", "2", "--run", "r")
    assert code == 0, out
    run = RunDir(tmp_path / "r")
    assert run.info["max_seq_len"] == 128 and run.info["ctx"] == 100
    assert run.accepted()
    for cid in run.accepted():  # built by the worker processes, and rebuilt from the run's strategy
        schedule = run.load_candidate(cid)
        assert schedule.model is not None and schedule.model.max_seq_len == 128
    code, out = _invoke(*base, "--max-seq-len", "96", "--ctx", "32", "--resume", "r")
    assert code == 2 and "run r was searched with --max-seq-len 128" in out


def test_bench_dry_run_beyond_the_row_length(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    code, text = _invoke("bench", "--model", "tiny", "--dry-run", "--reps", "1", "--warmup", "0", "--ctx", "100",
                         "--variants", "torch_eager,cpu_executor", "--json", str(out))
    assert code == 2 and "--ctx 100 must be in [1, 64]" in text and "--max-seq-len" in text
    code, text = _invoke("bench", "--model", "tiny", "--dry-run", "--reps", "1", "--warmup", "0", "--ctx", "100",
                         "--max-seq-len", "128", "--variants", "torch_eager,cpu_executor", "--json", str(out))
    assert code == 0, text
    doc = json.loads(out.read_text())
    assert doc["max_seq_len"] == 128
    (rec,) = doc["results"]
    assert rec["ctx"] == 100 and rec["variants"]["cpu_executor"]["status"] == "ok", rec["variants"]
    code, text = _invoke("bench", "--model", "llama-1b", "--dry-run", "--max-seq-len", "131073")
    assert code == 2 and "131073" in text and "131072" in text


def test_bench_schedule_of_another_length_names_the_option(tmp_path: Path) -> None:
    sched = tmp_path / "s.json"
    assert _invoke("lower", "--model", "tiny", "--workers", "4", "--max-seq-len", "128", "-o", str(sched))[0] == 0
    code, text = _invoke("bench", "--model", "tiny", "--dry-run", "--reps", "1", "--schedule", str(sched))
    assert code == 2 and "--max-seq-len 128" in text


def test_generate_beyond_the_row_length() -> None:
    code, out = _invoke("generate", "--model", "tiny", "--tokens", "70")
    assert code == 2 and "max_seq_len 64" in out and "--max-seq-len" in out
    code, out = _invoke("generate", "--model", "tiny", "--tokens", "70", "--max-seq-len", "80", "--backend",
                        "reference")
    assert code == 0, out
    assert len(out.splitlines()[0].split()) == 70
    code, out = _invoke("generate", "--model", "llama-1b", "--max-seq-len", "131073")
    assert code == 2 and "131073" in out and "131072" in out


@pytest.mark.usefixtures("single_thread")
def test_check_takes_max_seq_len_up_to_the_checkpoint_limit(tmp_path: Path) -> None:
    save_hf_checkpoint(tmp_path, "mistral")  # max_position_embeddings 64
    base = ["check", "--weights", str(tmp_path), "--tokens", "2", "--device", "cpu"]
    code, out = _invoke(*base, "--max-seq-len", "65")
    assert code == 2 and "65" in out and "64" in out and "--max-seq-len" in out
    code, out = _invoke(*base, "--max-seq-len", "3")
    assert code == 2 and "--max-seq-len 3" in out and "5 positions (0..4)" in out
    code, out = _invoke(*base, "--max-seq-len", "64")
    assert code == 0, out


def _patch_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 2 * free))


def test_megakernel_refuses_a_kv_cache_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs before any CUDA call, so it is exercised here with the free memory patched."""
    from megasynth.kernels.gpu import Megakernel

    _patch_free(monkeypatch, int(5.1e9))
    schedule = lower(get_model("llama-1b", 131072), 132)
    with pytest.raises(DoesNotFit) as err:
        Megakernel(schedule, {}, device="cuda")
    msg = str(err.value)
    assert msg.startswith("KV cache for max_seq_len 131072 (16 layers x 8 KV heads x 64 x 2 x bf16 = 4.29 GB)")
    assert "weights 2.47 GB" in msg and msg.endswith("does not fit in 5.10 GB of free GPU memory")


def test_bench_state_refuses_a_kv_cache_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from megasynth.measure.options import BenchError, BenchOptions
    from megasynth.measure.variants import new_state

    _patch_free(monkeypatch, int(1e9))
    with pytest.raises(BenchError, match=r"KV cache for max_seq_len 131072 .* does not fit in 1.00 GB"):
        new_state(get_model("llama-1b", 131072), BenchOptions(model="llama-1b", device="cuda"))


def test_lower_and_search_take_a_batch(tmp_path: Path) -> None:
    """`--batch N`: the schedule decodes N sequences (validated), a CPU search records and keeps it (resume
    included; its rebuilt candidates are batched too), and a GPU search takes a batch too (timed on interpreter
    v10; tests/search/test_synthesis.py runs one on a fake GPU)."""
    out = tmp_path / "s.json"
    code, text = _invoke("lower", "--model", "tiny", "--workers", "6", "--batch", "3", "-o", str(out))
    assert code == 0, text
    schedule = load_schedule(str(out))
    assert schedule.model is not None and schedule.model.batch == 3
    from megasynth.validator.verify import verify

    assert verify(schedule).accepted
    base = ["search", "--model", "tiny", "--workers", "6", "--runs-dir", str(tmp_path), "--cpu", "--no-progress",
            "--interleavings", "5", "--final-interleavings", "5", "--jobs", "1", "--run", "b"]
    code, text = _invoke(*base, "--batch", "2", "--budget", "3", "--proposer", "heuristic")
    assert "note: the cost model is fitted at batch 1" in text and "synth bench --batch 2 --schedule" in text
    assert code == 0, text
    run = RunDir(tmp_path / "b")
    assert run.info["batch"] == 2 and run.accepted()
    for cid in run.accepted():
        sched = run.load_candidate(cid)
        assert sched.model is not None and sched.model.batch == 2
    code, text = _invoke(*base[:-2], "--resume", "b", "--budget", "4", "--proposer", "heuristic")
    assert code == 0, text
    code, text = _invoke(*base[:-2], "--resume", "b", "--batch", "3", "--budget", "5")
    assert code == 2 and "run b was searched with --batch 2" in text

    from megasynth.search.config import SearchConfig
    from megasynth.search.loop import Search

    search = Search(SearchConfig(model="tiny", runs_dir=tmp_path, run="g", sequences=2, gpu=True))
    assert search.gpu and search.spec.batch == 2
