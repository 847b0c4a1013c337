"""`synth bench` / `synth generate`: the command structure and the arithmetic on the CPU (dry run on the tiny model);
the GPU variants run only where CUDA is present (marked `gpu`)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.measure.bench import (
    VARIANTS,
    BenchOptions,
    add_ratios,
    floor_bytes,
    run_bench,
    run_compile,
    stage_schedules,
    summarize,
)

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One CLI dry run on the tiny model at two ctx values, shared by the structure tests."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "3", "--warmup", "1",
                                       "--ctx", "8", "24", "--json", str(out), "--variants",
                                       "torch_eager,torch_graph,hf_eager,megakernel,cpu_executor"])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_summarize_quantiles() -> None:
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["mean_ms"], s["reps"]) == (3.0, 1.0, 5.0, 3.0, 5)
    assert s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(4.6)
    assert summarize([2.5])["p90_ms"] == 2.5


def test_floor_bytes_llama_1b_matches_design() -> None:
    """DESIGN.md §7: 2.47 GB weights + 34 MB KV at ctx 1024, floor 0.60 ms at 4.19 TB/s."""
    f = floor_bytes(get_model("llama-1b").config, 1024)
    assert f["weights"] == pytest.approx(2.47e9, rel=0.01)
    assert f["kv_read"] + f["kv_write"] == pytest.approx(33.5e6, rel=0.01)
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    assert f["total"] / 4.19e12 * 1e3 == pytest.approx(0.60, abs=0.005)
    untied = floor_bytes(get_model("tiny-mha").config, 8)
    c = get_model("tiny-mha").config
    assert untied["weights"] == c.weight_bytes(2) - (c.vocab_size - 1) * c.hidden_size * 2  # one embedding row


def test_ratios_come_from_measured_medians() -> None:
    rec = {"floor": {"bytes": {"total": 3_000_000_000}}, "schedule_bytes": 4_500_000_000,
           "variants": {"torch_graph": {"status": "ok", "timing": {"median_ms": 3.0}},
                        "megakernel": {"status": "ok", "timing": {"median_ms": 1.5}},
                        "hf_eager": {"status": "skipped", "reason": "x"}}}
    add_ratios(rec, copy_tbps=4.0)
    assert rec["floor"]["ms"] == pytest.approx(0.75)
    mk = rec["variants"]["megakernel"]
    assert mk["speedup_vs_graph"] == pytest.approx(2.0)
    assert mk["speedup_vs_bf16_graph"] is None  # not measured here
    assert mk["x_floor"] == pytest.approx(2.0)
    assert mk["achieved_tbps"] == pytest.approx(2.0)
    assert mk["pct_copy_bw"] == pytest.approx(50.0)
    assert mk["schedule_tbps"] == pytest.approx(3.0)  # 4.5 GB by the catalogue's accounting in 1.5 ms
    assert "x_floor" not in rec["variants"]["hf_eager"]
    assert "schedule_tbps" not in rec["variants"]["torch_graph"]


def test_dry_run_json_structure(dry_run: tuple[dict, str]) -> None:
    data, output = dry_run
    assert data["format"] == "megasynth-bench/1" and data["dry_run"] is True and data["model"] == "tiny"
    assert data["settings"]["reps"] == 3 and data["device"]["kind"] == "cpu"
    assert {"python", "torch", "triton", "transformers"} <= set(data["versions"])
    assert data["schedule"]["validation"]["verdict"] == "accepted"
    assert data["copy_bandwidth"]["tbps"] > 0 and data["copy_bandwidth"]["timing"]["reps"] >= 1
    assert [r["ctx"] for r in data["results"]] == [8, 24]
    for rec in data["results"]:
        assert rec["pos"] == rec["ctx"] - 1
        assert rec["floor"]["bytes"]["total"] == sum(floor_bytes(get_model("tiny").config, rec["ctx"]).values()) // 2
        assert rec["schedule_bytes"] > 0
        v = rec["variants"]
        assert list(v) == [k for k in VARIANTS if k in v]  # table order
        assert v["torch_graph"]["status"] == "skipped" and "CUDA" in v["torch_graph"]["reason"]
        assert v["megakernel"]["status"] == "skipped"
        assert "torch_compile" not in v and "torch_bf16" not in v  # not asked for
        for name in ("torch_eager", "hf_eager", "cpu_executor"):
            assert v[name]["status"] == "ok", v[name]
            assert v[name]["timing"]["reps"] == 3
            assert v[name]["check"]["rel_l2"] < 2e-2  # every timed variant computes the reference's logits
    assert "tiny, ctx 8" in output and "DRY RUN" in output and "skipped" in output


def test_dry_run_ratios_are_computed_from_measured_numbers(dry_run: tuple[dict, str]) -> None:
    data, _ = dry_run
    copy = data["copy_bandwidth"]["tbps"]
    for rec in data["results"]:
        floor_ms = rec["floor"]["bytes"]["total"] / (copy * 1e12) * 1e3
        assert rec["floor"]["ms"] == pytest.approx(floor_ms)
        for v in rec["variants"].values():
            if v["status"] != "ok":
                continue
            ms = v["timing"]["median_ms"]
            assert v["x_floor"] == pytest.approx(ms / floor_ms)
            assert v["achieved_tbps"] == pytest.approx(rec["floor"]["bytes"]["total"] / (ms * 1e-3) / 1e12)
            assert v["speedup_vs_graph"] is None  # no CUDA graph baseline was measured on the CPU
            assert math.isfinite(v["pct_copy_bw"])


def test_stage_schedules_split_by_op_and_layer() -> None:
    spec = get_model("tiny")
    schedule = lower(spec, 8)
    stages = stage_schedules(schedule)
    c = spec.config
    assert len(stages) == 2 + 6 * c.num_hidden_layers  # embed, 6 ops per layer, lm head
    ids = [i.id for s in stages for i in s.instructions]
    assert ids == sorted(i.id for i in schedule.instructions)
    for s in stages:
        assert s.counters == 0 and len({(i.op, i.layer) for i in s.instructions}) == 1
        assert all(not i.waits and not i.signals for i in s.instructions)
        assert sorted(x for q in s.queues for x in q) == sorted(i.id for i in s.instructions)
        assert len(s.queues) <= 8


def test_compile_worker_runs_in_a_bounded_child() -> None:
    """The child protocol with dynamo's eager backend (quick on the CPU); then a limit that kills it."""
    opts = BenchOptions(model="tiny", ctxs=[6], reps=2, warmup=0, device="cpu", compile_backend="eager",
                        compile_mode=None, compile_timeout_s=120)
    rec = run_compile(opts, lambda s: None)[6]
    assert rec["status"] == "ok", rec
    assert rec["check"]["rel_l2"] < 1e-5 and rec["timing"]["reps"] == 2 and rec["compile_s"] > 0
    opts.compile_timeout_s = 0.5
    rec = run_compile(opts, lambda s: None)[6]
    assert rec["status"] == "skipped" and "limit" in rec["reason"]


def test_dry_run_skips_reduce_overhead_compile() -> None:
    opts = BenchOptions(model="tiny", ctxs=[4], device="cpu")
    assert run_compile(opts, lambda s: None)[4]["reason"] == "no CUDA (dry run)"


@pytest.mark.parametrize("args, needle", [
    (["--ctx", "65"], "--ctx 65 must be in [1, 64]"),
    (["--ctx", "x"], "'x' is not an integer"),
    (["--variants", "nope"], "unknown variant 'nope'"),
    (["--token", "256"], "--token 256 is outside the vocabulary"),
])
def test_bad_input_is_one_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "1", *args])
    assert result.exit_code == 2
    assert needle in result.output
    assert "Traceback" not in result.output


def test_bad_schedule_names_file_and_path(tmp_path) -> None:
    bad = tmp_path / "s.json"
    bad.write_text('{"format": "megakernel-schedule/1", "instructions": [')
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--schedule", str(bad)])
    assert result.exit_code == 2 and f"{bad}: $: invalid JSON" in result.output
    other = tmp_path / "o.json"
    from megasynth.ir.schedule import dump_schedule

    dump_schedule(lower(get_model("tiny-mha"), 4), other)
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--schedule", str(other)])
    assert result.exit_code == 2 and "$.model.config" in result.output


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA message")
def test_bench_without_cuda_asks_for_dry_run() -> None:
    result = CliRunner().invoke(main, ["bench", "--model", "tiny"])
    assert result.exit_code == 2 and "--dry-run" in result.output


def test_generate_on_cpu(tmp_path) -> None:
    out = tmp_path / "gen.json"
    result = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "5", "--prompt-token", "3",
                                       "--backend", "reference", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["tokens"]) == 5 and data["tokens_per_s"] > 0
    assert " ".join(map(str, data["tokens"])) in result.output
    # greedy tokens are the reference's argmax chain
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights

    cfg = get_model("tiny").config
    w = random_weights(cfg, seed=0)
    k, v = new_kv_cache(cfg, 64)
    tok, expect = 3, []
    for pos in range(5):
        tok = int(decode_step(cfg, w, k, v, tok, pos).argmax())
        expect.append(tok)
    assert data["tokens"] == expect


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA notice")
def test_generate_auto_without_cuda_says_so() -> None:
    result = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "2"])
    assert result.exit_code == 0 and "notice: no CUDA" in result.output
    bad = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "2", "--backend", "megakernel"])
    assert bad.exit_code == 2 and "needs CUDA" in bad.output


def test_greedy_agreement_finds_clear_mismatches() -> None:
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.bench import greedy_agreement

    spec = get_model("tiny")
    cfg = spec.config
    w = random_weights(cfg, seed=0)
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    toks = [3]
    for pos in range(6):
        toks.append(int(decode_step(cfg, w, k, v, toks[-1], pos).argmax()))
    good = greedy_agreement(cfg, w, toks, spec.max_seq_len, "cpu")
    assert good["agree"] == good["steps"] == 6 and not good["clear_mismatches"]
    bad = greedy_agreement(cfg, w, toks[:3] + [(toks[3] + 1) % cfg.vocab_size] + toks[4:], spec.max_seq_len, "cpu",
                           margin=0.0)
    assert bad["agree"] < 6 and 2 in bad["clear_mismatches"]


def test_generate_rejects_too_many_tokens() -> None:
    result = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "65"])
    assert result.exit_code == 2 and "exceeds max_seq_len 64" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_variants_tiny() -> None:
    """On a GPU: every in-process variant runs on the tiny model, matches the reference and gets ratios."""
    pytest.importorskip("triton")
    opts = BenchOptions(model="tiny", ctxs=[32], reps=5, warmup=2, device="cuda", copy_bytes=1 << 26,
                        variants=["torch_eager", "torch_graph", "torch_bf16", "hf_eager", "per_op_graph",
                                  "megakernel"])
    data = run_bench(opts)
    v = data["results"][0]["variants"]
    for name in ("torch_eager", "torch_graph", "torch_bf16", "megakernel", "per_op_graph"):
        assert v[name]["status"] == "ok", (name, v[name])
        assert v[name]["check"]["rel_l2"] < 2e-2, (name, v[name]["check"])
        assert v[name]["speedup_vs_graph"] > 0


class FakeMegakernel:
    """The interface of megasynth.kernels.gpu.Megakernel on the CPU: instructions run in ascending id order with the
    catalogue's compute; each packed table has its own attention scratch, as on the GPU."""

    def __init__(self, schedule, weights, *, max_seq_len):
        from megasynth.ir.program import resolve
        from megasynth.kernels.reference import new_kv_cache

        self.weights = weights
        self.k_cache, self.v_cache = new_kv_cache(get_model("tiny").config, max_seq_len, dtype=torch.bfloat16)
        prog = resolve(schedule)
        self.ws = {n: torch.full((size,), float("nan")) for n, size in prog.buffers.items()
                   if n not in ("k_cache", "v_cache", "attn_o_part", "attn_lse")}
        self.occupancy: dict = {}
        self.launches = 0
        self.packed = self.pack(schedule)

    @property
    def logits(self):
        return self.ws["logits"]

    def pack(self, schedule):
        from types import SimpleNamespace

        from megasynth.ir.program import resolve

        prog = resolve(schedule)
        scratch = {"opart": torch.full((prog.buffers["attn_o_part"],), float("nan")),
                   "lse": torch.full((prog.buffers["attn_lse"],), float("nan"))}
        return SimpleNamespace(prog=prog, workers=len(prog.queues), n=prog.n, device=scratch)

    def set_position(self, token, pos):
        self.token, self.pos = token, pos

    def launch(self, p=None):
        from megasynth.ir.catalogue import OPS
        from megasynth.kernels.reference import rope_cos_sin

        p = p or self.packed
        prog = p.prog
        cos, sin = rope_cos_sin(prog.geometry.cfg, self.pos)
        rt = {"pos": self.pos, "token": self.token, "cos": cos, "sin": sin}
        ws = {**self.ws, "attn_o_part": p.device["opart"], "attn_lse": p.device["lse"], "k_cache": self.k_cache,
              "v_cache": self.v_cache}
        for i in range(prog.n):
            layer = prog.layer[i]
            OPS[prog.op[i]].compute(ws, self.weights, rt, prog.geometry, -1 if layer is None else layer, prog.args[i])
        self.launches += 1

    def graph(self, p=None):
        from types import SimpleNamespace

        return SimpleNamespace(replay=lambda: self.launch(p))

    def check(self, p=None):
        pass

    def step(self, token, pos):
        self.set_position(token, pos)
        self.launch()
        return self.logits.clone()


def test_megakernel_and_per_op_plumbing_on_a_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The megakernel and per-op runners against a CPU stand-in of the Megakernel interface: same logits as the
    reference, stage launches share the attention scratch (attn_splits=3), step_call is timed."""
    from types import SimpleNamespace

    import megasynth.measure.bench as bench
    from megasynth.kernels.reference import decode_step
    from megasynth.lowering.strategy import Strategy

    monkeypatch.setattr(bench, "_megakernel_api", lambda: SimpleNamespace(Megakernel=FakeMegakernel))
    monkeypatch.setattr(bench, "capture_graph", lambda fn: fn)
    spec = get_model("tiny")
    opts = BenchOptions(model="tiny", ctxs=[10], reps=2, warmup=0, device="cpu")
    st = bench._new_state(spec, opts)
    st.schedule = lower(spec, 8, Strategy(attn_splits=3))
    st.ctx = 10
    hist = bench.kv_history(spec.config, spec.max_seq_len, 10, 0)
    bench.prefill(st.k, st.v, hist)
    ref = decode_step(spec.config, st.weights, st.k, st.v, st.token, st.pos)
    for name in ("megakernel", "per_op_graph"):
        step, notes = bench.RUNNERS[name](st)
        chk = bench.compare(step(), ref)
        assert chk["rel_l2"] < 1e-4, (name, chk)
        rec: dict = {}
        notes["_after"](rec, opts)
        if name == "megakernel":
            assert rec["step_call"]["reps"] == 2 and rec["kernel"]["instructions"] == len(st.schedule.instructions)
        else:
            assert notes["stages"] == 2 + 6 * spec.config.num_hidden_layers


def test_hf_baseline_is_the_same_model() -> None:
    """The transformers baseline built from our config and weights (Llama-3 RoPE scaling, GQA) computes the
    reference's logits over a pre-filled cache, in fp32."""
    pytest.importorskip("transformers")
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.bench import State, _v_hf_eager, compare, kv_history, prefill

    spec = get_model("tiny-gqa4")
    cfg = spec.config
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    st = State(spec, "cpu", random_weights(cfg, seed=1), k, v, token=5, ctx=40)
    prefill(k, v, kv_history(cfg, spec.max_seq_len, st.ctx, 0))
    ref = decode_step(cfg, st.weights, k, v, st.token, st.pos)
    step, notes = _v_hf_eager(st)
    assert compare(step(), ref)["rel_l2"] < 1e-5
    assert "attn_implementation" in notes["note"]


def test_bf16_baseline_matches_reference() -> None:
    """The bf16-native PyTorch step (the fair PyTorch line) computes the reference's logits to bf16 precision."""
    from megasynth.kernels.reference import decode_step, new_kv_cache, rope_cos_sin
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.bench import bf16_decode_step, compare, kv_history, prefill

    spec = get_model("tiny-gqa4")
    cfg = spec.config
    w = random_weights(cfg, seed=1, dtype=torch.bfloat16)
    k, v = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16)
    prefill(k, v, kv_history(cfg, spec.max_seq_len, 30, 0))
    ref = decode_step(cfg, w, k, v, 5, 29)
    cos, sin = rope_cos_sin(cfg, 29)
    assert compare(bf16_decode_step(cfg, w, k, v, 5, 29, cos, sin), ref)["rel_l2"] < 2e-2


def test_weights_dir_is_used_by_bench_and_generate(tmp_path) -> None:
    from test_reference import write_checkpoint  # tests/ is on sys.path (no package): one checkpoint writer

    from megasynth.kernels.weights import random_weights

    cfg = get_model("tiny").config
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, cfg, random_weights(cfg, seed=11))
    out = tmp_path / "b.json"
    args = ["bench", "--model", "tiny", "--dry-run", "--reps", "1", "--warmup", "0", "--variants", "torch_eager"]
    result = CliRunner().invoke(main, [*args, "--weights", str(ckpt), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["settings"]["weights"] == str(ckpt)
    gen_ckpt = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "3", "--backend", "reference",
                                         "--weights", str(ckpt), "--no-check"])
    gen_seed = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "3", "--backend", "reference",
                                         "--seed", "11", "--no-check"])
    assert gen_ckpt.exit_code == 0 and gen_seed.exit_code == 0
    first_line = [ln for ln in gen_ckpt.output.splitlines() if ln and ln[0].isdigit()][0]
    assert first_line in gen_seed.output  # the checkpoint holds exactly the seed-11 weights: same greedy tokens
    other = tmp_path / "other"
    write_checkpoint(other, get_model("tiny-mha").config, random_weights(get_model("tiny-mha").config))
    bad = CliRunner().invoke(main, [*args, "--weights", str(other), "--json", str(tmp_path / "x.json")])
    assert bad.exit_code != 0 and "does not match the model spec" in bad.output and "Traceback" not in bad.output
