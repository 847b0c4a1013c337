"""`synth bench` / `synth generate`: the command structure and the arithmetic on the CPU (dry run on the tiny model);
the GPU variants run only where CUDA is present (marked `gpu`)."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.measure.bench import add_ratios, pytorch_best, run_bench, split_by_ctx
from megasynth.measure.compile import run_compile
from megasynth.measure.options import BenchOptions
from megasynth.measure.timing import floor_bytes, summarize
from megasynth.measure.torch_step import CHECK_TOL
from megasynth.measure.variants import DEFAULT_CPU, PYTORCH, VARIANTS, stage_schedules

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One CLI dry run on the tiny model at two ctx values, shared by the structure tests."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "3", "--warmup", "1",
                                       "--ctx", "8", "24", "--json", str(out), "--variants",
                                       "torch_eager,torch_graph,hf_eager,torch_bf16,megakernel,cpu_executor"])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_summarize_quantiles() -> None:
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["mean_ms"], s["reps"]) == (3.0, 1.0, 5.0, 3.0, 5)
    assert s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(4.6)
    assert summarize([2.5])["p90_ms"] == 2.5


def test_floor_bytes_llama_1b() -> None:
    """llama-1b at ctx 1024: 2.47 GB of weights + 34 MB of KV history, 0.60 ms at the H200's 4.19 TB/s copy."""
    f = floor_bytes(get_model("llama-1b").config, 1024)
    assert f["weights"] == pytest.approx(2.47e9, rel=0.01)
    assert f["kv_read"] + f["kv_write"] == pytest.approx(33.5e6, rel=0.01)
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    assert f["total"] / 4.19e12 * 1e3 == pytest.approx(0.60, abs=0.005)
    untied = floor_bytes(get_model("tiny-mha").config, 8)
    c = get_model("tiny-mha").config
    assert untied["weights"] == c.weight_bytes(2) - (c.vocab_size - 1) * c.hidden_size * 2  # one embedding row


def test_ratios_come_from_measured_medians() -> None:
    ok = {"rel_l2": 1e-3, "argmax_match": True}
    rec = {"floor": {"bytes": {"total": 3_000_000_000}}, "schedule_bytes": 4_500_000_000,
           "variants": {"torch_graph": {"status": "ok", "timing": {"median_ms": 3.0}, "check": ok},
                        "megakernel": {"status": "ok", "timing": {"median_ms": 1.5}, "check": ok},
                        "hf_eager": {"status": "skipped", "reason": "x"}}}
    add_ratios(rec, copy_tbps=4.0)
    assert rec["floor"]["ms"] == pytest.approx(0.75)
    assert rec["pytorch_best"]["variant"] == "torch_graph"  # the only PyTorch variant measured
    mk = rec["variants"]["megakernel"]
    assert mk["speedup_vs_graph"] == pytest.approx(2.0)
    assert mk["speedup_vs_pytorch_best"] == pytest.approx(2.0)
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
        assert "torch_compile" not in v and "per_op_graph" not in v  # not asked for
        for name in ("torch_eager", "hf_eager", "torch_bf16", "cpu_executor"):
            assert v[name]["status"] == "ok", v[name]
            assert v[name]["timing"]["reps"] == 3
            assert v[name]["check"]["rel_l2"] < CHECK_TOL  # every timed variant computes the reference's logits
        best = rec["pytorch_best"]
        assert best["variant"] in PYTORCH and best["variant"] in v
        assert best["median_ms"] == min(v[n]["timing"]["median_ms"] for n in PYTORCH if v.get(n, {}).get("status")
                                        == "ok")
        assert v[best["variant"]]["speedup_vs_pytorch_best"] == pytest.approx(1.0)
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
            assert v["speedup_vs_pytorch_best"] == pytest.approx(rec["pytorch_best"]["median_ms"] / ms)
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
    """The child protocol (compiling the bf16 step with dynamo's eager backend: quick on the CPU) at two positions;
    then a limit that kills it."""
    opts = BenchOptions(model="tiny", ctxs=[6, 20], reps=2, warmup=0, device="cpu", compile_backend="eager",
                        compile_mode=None, compile_timeout_s=120)
    recs = run_compile(opts, lambda s: None)
    for ctx in (6, 20):
        rec = recs[ctx]
        assert rec["status"] == "ok", rec
        assert rec["check"]["rel_l2"] < CHECK_TOL and rec["timing"]["reps"] == 2 and rec["compile_s"] > 0
        assert rec["label"] == VARIANTS["torch_compile"][0]
        assert rec["dynamo"] == {"graphs": 1, "graph_breaks": 0}  # one graph per ctx, none made while timing
    opts.compile_timeout_s = 0.5
    rec = run_compile(opts, lambda s: None)[6]
    assert rec["status"] == "timed_out" and "0 s limit (child killed)" in rec["reason"]


def test_static_tensors_are_every_tensor_the_compiled_step_reads() -> None:
    """Under inductor's own CUDA graphs, a tensor not marked static is copied at every replay: all must be listed."""
    import dataclasses

    from megasynth.measure.compile import static_tensors
    from megasynth.measure.variants import bf16_step_fn, new_state

    spec = get_model("tiny")
    st = new_state(spec, BenchOptions(model="tiny", ctxs=[4], device="cpu"))
    st.ctx = 4
    bf16_step_fn(st)
    listed = {id(t) for t in static_tensors(st)}
    w = st.step_weights
    every = [st.k, st.v] + [getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "layers"]
    every += [getattr(lw, f.name) for lw in w.layers for f in dataclasses.fields(lw)]
    every = [t for t in every if t is not None]  # a Llama has no QKV bias and no QK-norm
    assert all(isinstance(t, torch.Tensor) for t in every) and {id(t) for t in every} == listed
    assert {id(t) for t in w.tensors()} == listed - {id(st.k), id(st.v)}


def test_step_weights_of_qwen_families() -> None:
    """The bias (Qwen2) and the QK-norm weights stacked per head (Qwen3, q heads first) are laid out in bf16, and the
    step's tensor list holds them."""
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.torch_step import step_weights

    cfg = get_model("tiny-qwen2").config
    w = random_weights(cfg, seed=2)
    lw = step_weights(cfg, w).layers[1]
    assert lw.qk_norm is None and lw.bqkv.dtype == torch.bfloat16
    assert torch.equal(lw.bqkv, w["layers.1.bqkv"].to(torch.bfloat16))
    cfg = get_model("tiny-qwen3").config
    w = random_weights(cfg, seed=2)
    fused = step_weights(cfg, w)
    lw = fused.layers[1]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    assert lw.bqkv is None and lw.qk_norm.shape == (nh + nkv, cfg.hd)
    assert torch.equal(lw.qk_norm[nh - 1], w["layers.1.q_norm"].to(torch.bfloat16))
    assert torch.equal(lw.qk_norm[nh], w["layers.1.k_norm"].to(torch.bfloat16))
    assert any(t is lw.qk_norm for t in fused.tensors()) and fused.lm_head.data_ptr() != fused.embed.data_ptr()


def test_dry_run_skips_inductor_compile() -> None:
    opts = BenchOptions(model="tiny", ctxs=[4], device="cpu")
    assert opts.compile_mode == "max-autotune-no-cudagraphs"
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


def test_bench_with_a_schedule_set_runs_each_ctx_on_its_ranges_member(tmp_path) -> None:
    """`--schedule SET`: ctx 8 (pos 7) runs the member for positions 0-15, ctx 40 the one for 16-63 (another attention
    split, so its bytes differ); the CPU executor's logits match the reference at both; a bad set is exit 2 with
    the set file and JSON path."""
    from megasynth.atomic import write_json_atomic
    from megasynth.ir.schedule import dump_schedule
    from megasynth.ir.schedule_set import set_document

    spec = get_model("tiny")
    files = [tmp_path / "short.json", tmp_path / "long.json"]
    dump_schedule(lower(spec, 4, Strategy(attn_splits=1)), files[0])
    dump_schedule(lower(spec, 4, Strategy(attn_splits=4)), files[1])
    sset = tmp_path / "set.json"
    write_json_atomic(sset, set_document([16, 64], [str(f) for f in files], sset))
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "1", "--warmup", "0",
                                       "--ctx", "8", "40", "--schedule", str(sset), "--json", str(out),
                                       "--variants", "torch_bf16,cpu_executor"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [m["positions"] for m in data["schedule"]["members"]] == [[0, 16], [16, 64]]
    assert [r["schedule_member"] for r in data["results"]] == [0, 1]
    for r in data["results"]:
        assert r["variants"]["cpu_executor"]["check"]["rel_l2"] < 1e-4
    write_json_atomic(sset, {**json.loads(sset.read_text()), "ranges": [{"up_to": 64, "schedule": "nope.json"}]})
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--schedule", str(sset)])
    assert result.exit_code == 2 and f"{sset}: $.ranges[0].schedule" in result.output


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


def test_generate_batch_on_cpu(tmp_path) -> None:
    """`--batch N` decodes N sequences in lockstep on the reference: each is what batch 1 gives for its first
    token; one first token counts up per sequence; a list of the wrong length is refused, and so is the megakernel
    without CUDA."""
    def run(*args: str) -> tuple[list[str], list[str]]:
        result = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "4", *args])
        assert result.exit_code == 0, result.output
        return result.stdout.splitlines(), result.stderr.splitlines()

    alone = {t: run("--prompt-token", str(t), "--backend", "reference")[0] for t in (1, 2, 3)}
    assert all(len(lines) == 1 for lines in alone.values())
    out = tmp_path / "gen.json"
    lines, err = run("--batch", "3", "--prompt-token", "1,2,3", "--json", str(out))
    assert lines == [f"seq {b}: {alone[t][0]}" for b, t in enumerate((1, 2, 3))]
    assert any("notice: no CUDA" in line for line in err) or CUDA
    assert any(line.startswith("12 tokens in") and "batch 3" in line for line in err)
    data = json.loads(out.read_text())
    assert data["prompt_token"] == [1, 2, 3] and data["batch"] == 3 and data["check"] is None
    assert data["tokens"] == [[int(x) for x in alone[t][0].split()] for t in (1, 2, 3)]
    assert run("--batch", "2", "--prompt-token", "1")[0] == [f"seq {b}: {alone[t][0]}" for b, t in enumerate((1, 2))]
    if not CUDA:
        mk = CliRunner().invoke(main, ["generate", "--model", "tiny", "--batch", "2", "--backend", "megakernel"])
        assert mk.exit_code == 2 and "needs CUDA" in mk.output
    bad = CliRunner().invoke(main, ["generate", "--model", "tiny", "--batch", "3", "--prompt-token", "1,2"])
    assert bad.exit_code == 2 and "2 first tokens for --batch 3" in bad.output


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA notice")
def test_generate_auto_without_cuda_says_so() -> None:
    result = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "2"])
    assert result.exit_code == 0 and "notice: no CUDA" in result.output
    bad = CliRunner().invoke(main, ["generate", "--model", "tiny", "--tokens", "2", "--backend", "megakernel"])
    assert bad.exit_code == 2 and "needs CUDA" in bad.output


def test_greedy_agreement_finds_clear_mismatches() -> None:
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.torch_step import greedy_agreement

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
                        variants=["torch_eager", "torch_graph", "torch_bf16", "hf_eager", "torch_compile",
                                  "per_op_graph", "megakernel"], compile_mode="default", compile_timeout_s=300)
    data = run_bench(opts)
    v = data["results"][0]["variants"]
    for name in ("torch_eager", "torch_graph", "torch_bf16", "torch_compile", "megakernel", "per_op_graph"):
        assert v[name]["status"] == "ok", (name, v[name])
        assert v[name]["check"]["rel_l2"] < 2e-2, (name, v[name]["check"])
        assert v[name]["speedup_vs_graph"] > 0
    assert data["results"][0]["pytorch_best"]["variant"] in PYTORCH


@dataclass(frozen=True)
class FakeSettings:
    """The interpreter settings a Megakernel carries (`kcfg`), recorded in the bench JSON."""

    num_warps: int = 4


class FakeMegakernel:
    """The interface of megasynth.kernels.gpu.Megakernel on the CPU: instructions run in ascending id order with the
    catalogue's compute; each packed table has its own attention scratch, as on the GPU."""

    def __init__(self, schedule, weights, *, max_seq_len, config=None):
        from megasynth.ir.program import resolve
        from megasynth.kernels.reference import new_kv_cache

        self.weights = weights
        self.k_cache, self.v_cache = new_kv_cache(get_model("tiny").config, max_seq_len, dtype=torch.bfloat16)
        prog = resolve(schedule)
        self.ws = {n: torch.full((size,), float("nan")) for n, size in prog.buffers.items()
                   if n not in ("k_cache", "v_cache", "attn_o_part", "attn_lse")}
        self.occupancy: dict = {}
        self.kcfg = FakeSettings()
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

    import megasynth.measure.variants as variants
    from megasynth.kernels.reference import decode_step
    from megasynth.lowering.strategy import Strategy
    from megasynth.measure.torch_step import compare, kv_history, prefill

    monkeypatch.setattr(variants, "_megakernel_api", lambda: SimpleNamespace(Megakernel=FakeMegakernel))
    monkeypatch.setattr(variants, "capture_graph", lambda fn: fn)
    spec = get_model("tiny")
    opts = BenchOptions(model="tiny", ctxs=[10], reps=2, warmup=0, device="cpu")
    st = variants.new_state(spec, opts)
    st.schedule = lower(spec, 8, Strategy(attn_splits=3))
    st.ctx = 10
    hist = kv_history(spec.config, spec.max_seq_len, 10, 0)
    prefill(st.k, st.v, hist)
    ref = decode_step(spec.config, st.weights, st.k, st.v, st.token, st.pos)
    for name in ("megakernel", "per_op_graph"):
        step, notes = variants.RUNNERS[name](st)
        chk = compare(step(), ref)
        assert chk["rel_l2"] < 1e-4, (name, chk)
        rec: dict = {}
        notes["_after"](rec, opts)
        if name == "megakernel":
            assert rec["step_call"]["reps"] == 2 and rec["kernel"]["instructions"] == len(st.schedule.instructions)
            assert rec["kernel"]["settings"] == {"num_warps": 4}
        else:
            assert notes["stages"] == 2 + 6 * spec.config.num_hidden_layers


@pytest.mark.parametrize(("model", "arch"), [("tiny-gqa4", "LlamaForCausalLM"), ("tiny-qwen3", "Qwen3ForCausalLM"),
                                             ("tiny-qwen2", "Qwen2ForCausalLM")])
def test_hf_baseline_is_the_same_model(model: str, arch: str) -> None:
    """The transformers baseline built from our config and weights (Llama-3 RoPE scaling, GQA; Qwen3's QK-norm with
    head_dim 128 on hidden 256; Qwen2's QKV bias) is the family's class and computes the reference's logits over a
    pre-filled cache, in fp32."""
    pytest.importorskip("transformers")
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.torch_step import compare, kv_history, prefill
    from megasynth.measure.variants import State, _v_hf_eager

    spec = get_model(model)
    cfg = spec.config
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    st = State(spec, "cpu", random_weights(cfg, seed=1), k, v, token=5, ctx=40)
    prefill(k, v, kv_history(cfg, spec.max_seq_len, st.ctx, 0))
    ref = decode_step(cfg, st.weights, k, v, st.token, st.pos)
    step, notes = _v_hf_eager(st)
    assert type(st.hf).__name__ == arch
    assert compare(step(), ref)["rel_l2"] < 1e-5
    assert "attn_implementation" in notes["note"]


@pytest.mark.parametrize("model", ["tiny", "tiny-gqa4", "tiny-mha", "tiny-qwen3", "tiny-qwen2"])
def test_bf16_step_matches_reference(model: str) -> None:
    """The plain bf16 PyTorch step (the PyTorch baseline) computes the fp32 reference's logits to bf16 precision and
    writes the same new K/V into the caches, at the first position, in the middle and at the last; also with QK-norm,
    head_dim 128 != hidden / heads and an untied head (tiny-qwen3) and with the QKV bias (tiny-qwen2)."""
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.torch_step import bf16_decode_step, bf16_rope, compare, kv_history, prefill, step_weights

    spec = get_model(model)
    cfg = spec.config
    w = random_weights(cfg, seed=1, dtype=torch.bfloat16)
    fused = step_weights(cfg, w)
    k, v = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16)
    k2, v2 = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16)
    for ctx in (1, 30, spec.max_seq_len):
        hist = kv_history(cfg, spec.max_seq_len, ctx, 0)
        prefill(k, v, hist)
        prefill(k2, v2, hist)
        ref = decode_step(cfg, w, k, v, 5, ctx - 1)
        cos, sin = bf16_rope(cfg, ctx - 1, "cpu")
        with torch.inference_mode():
            out = bf16_decode_step(cfg, fused, k2, v2, 5, ctx - 1, cos, sin)
        chk = compare(out, ref)
        assert out.dtype == torch.float32 and chk["rel_l2"] < CHECK_TOL and chk["argmax_match"], (ctx, chk)
        for new, old in ((k2, k), (v2, v)):  # the new K/V at pos, rounded to bf16 on both sides
            assert torch.allclose(new[:, :, ctx - 1].float(), old[:, :, ctx - 1].float(), rtol=5e-2, atol=5e-2)
            assert torch.equal(new[:, :, :ctx - 1], old[:, :, :ctx - 1])  # the history is untouched


def test_step_weights_fuse_gate_up_once() -> None:
    """QKV is already one matrix; gate and up become one [2I, H] matrix; bf16 weights are shared, not copied."""
    from megasynth.kernels.weights import random_weights
    from megasynth.measure.torch_step import step_weights

    cfg = get_model("tiny-gqa4").config
    w = random_weights(cfg, seed=2, dtype=torch.bfloat16)
    fused = step_weights(cfg, w)
    assert len(fused.layers) == cfg.num_hidden_layers
    lw = fused.layers[1]
    assert lw.w_gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert torch.equal(lw.w_gate_up[:cfg.intermediate_size], w["layers.1.w_gate"])
    assert torch.equal(lw.w_gate_up[cfg.intermediate_size:], w["layers.1.w_up"])
    assert lw.wqkv.data_ptr() == w["layers.1.wqkv"].data_ptr() and lw.wqkv.dtype == torch.bfloat16
    fp32 = step_weights(cfg, random_weights(cfg, seed=2))
    assert fp32.lm_head.dtype == torch.bfloat16 and fp32.layers[0].w_down.dtype == torch.bfloat16


def test_pytorch_best_is_the_fastest_that_passes_the_check() -> None:
    def rec(ms: float, rel: float, status: str = "ok") -> dict:
        return {"status": status, "timing": {"median_ms": ms}, "check": {"rel_l2": rel, "argmax_match": True}}

    variants = {"torch_graph": rec(3.0, 1e-4), "torch_bf16": rec(2.0, 3e-2), "torch_compile": rec(1.0, 0.5),
                "megakernel": rec(0.5, 1e-3), "hf_eager": rec(0.1, 1e-3, status="failed")}
    best = pytorch_best(variants)
    assert best is not None and (best["variant"], best["median_ms"]) == ("torch_bf16", 2.0)  # compile's logits wrong
    assert pytorch_best({"megakernel": rec(0.5, 1e-3)}) is None
    ctx_rec = {"floor": {"bytes": {"total": 10**9}}, "variants": variants}
    add_ratios(ctx_rec, copy_tbps=1.0)
    assert ctx_rec["variants"]["megakernel"]["speedup_vs_pytorch_best"] == pytest.approx(4.0)
    assert ctx_rec["variants"]["megakernel"]["pct_copy_bw"] == pytest.approx(200.0)
    assert 3e-2 > CHECK_TOL  # bf16 rounding beyond the megakernel's tolerance still makes the PyTorch line
    variants["torch_bf16"]["check"]["argmax_match"] = False
    assert pytorch_best(variants)["variant"] == "torch_graph"  # a different greedy token is not bf16 rounding


def test_dry_run_defaults_and_one_file_per_ctx(tmp_path) -> None:
    """No --variants: the CPU default set; a --json path with {ctx} writes one document per ctx, each with its row."""
    pattern = tmp_path / "row_ctx{ctx}.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "2", "--warmup", "0",
                                       "--ctx", "5,12", "--json", str(pattern)])
    assert result.exit_code == 0, result.output
    for ctx in (5, 12):
        doc = json.loads((tmp_path / f"row_ctx{ctx}.json").read_text())
        assert doc["format"] == "megasynth-bench/1" and [r["ctx"] for r in doc["results"]] == [ctx]
        assert doc["settings"]["variants"] == list(DEFAULT_CPU)
        v = doc["results"][0]["variants"]
        assert list(v) == list(DEFAULT_CPU)
        assert v["torch_bf16"]["status"] == "ok" and v["torch_bf16"]["check"]["rel_l2"] < CHECK_TOL
        assert v["torch_compile"]["status"] == "skipped"
        assert doc["results"][0]["pytorch_best"]["variant"] in ("torch_eager", "torch_bf16")
    assert not (tmp_path / "row_ctx{ctx}.json").exists()


def test_split_by_ctx_keeps_everything_but_the_other_rows() -> None:
    doc = {"format": "megasynth-bench/1", "model": "m", "results": [{"ctx": 1, "a": 1}, {"ctx": 9, "a": 2}]}
    parts = split_by_ctx(doc)
    assert list(parts) == [1, 9]
    assert parts[9] == {"format": "megasynth-bench/1", "model": "m", "results": [{"ctx": 9, "a": 2}]}
    assert len(doc["results"]) == 2  # the input is not modified


def test_the_naive_schedule_of_a_qk_norm_batch_normalises_inside_attention() -> None:
    """Without a schedule file the megakernel runs the naive lowering: a QK-norm model's batch on interpreter v10
    (whose default build, `StreamConfig.qk_pairs`, runs no QKV that normalises) applies the norm inside attention on
    RoPE-pair QKV tiles; its batch 1 inside QKV, as the naive strategy says."""
    from megasynth.lowering.models import with_batch
    from megasynth.measure.bench import load_bench_schedule

    batch, _ = load_bench_schedule(with_batch(get_model("tiny-qwen3"), 3), None, verify=False)
    one, info = load_bench_schedule(get_model("tiny-qwen3"), None, verify=False)
    assert {"attn_norm_qkv_rope_sq", "qk_norm_apply"} <= {i.op for i in batch.instructions}
    assert "attn_norm_qkv_rope" not in {i.op for i in batch.instructions}
    assert all(i.args.get("qk_norm") == 1 for i in batch.instructions if i.op == "attn_partial")
    assert "attn_norm_qkv_rope" in {i.op for i in one.instructions} and "qk_norm_apply" not in {
        i.op for i in one.instructions}
    assert info["source"].startswith("naive lowering")


def test_gzipped_schedule_loads_like_the_plain_one(tmp_path) -> None:
    import gzip
    import hashlib

    from megasynth.ir.schedule import dump_schedule
    from megasynth.measure.bench import load_bench_schedule

    spec = get_model("tiny")
    plain = tmp_path / "schedule.json"
    dump_schedule(lower(spec, 6), plain)
    packed = tmp_path / "schedule.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, info_a = load_bench_schedule(spec, str(plain), verify=True)
    b, info_b = load_bench_schedule(spec, str(packed), verify=True)
    assert a.to_json() == b.to_json() and info_b["validation"]["verdict"] == "accepted"
    assert info_a["sha256"] == info_b["sha256"] == hashlib.sha256(plain.read_bytes()).hexdigest()
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--reps", "1", "--warmup", "0",
                                       "--ctx", "4", "--variants", "cpu_executor", "--schedule", str(packed),
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["results"][0]["variants"]["cpu_executor"]["status"] == "ok"
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(b"{}")[:12])  # a truncated gzip file
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--schedule", str(broken)])
    assert result.exit_code == 2 and "cannot read file" in result.output and "Traceback" not in result.output


def _fake_result() -> dict:
    """A GPU-like result with every variant, long names and numbers, for the table's width."""
    t = {"median_ms": 12.345, "p10_ms": 12.001, "p90_ms": 13.999, "min_ms": 11.0, "max_ms": 99.0, "reps": 100}
    variants = {}
    for i, name in enumerate(VARIANTS):
        variants[name] = {"label": VARIANTS[name][0], "launch": VARIANTS[name][1], "status": "ok",
                          "timing": {**t, "median_ms": 10.0 + i},
                          "check": {"rel_l2": 1.234e-2, "argmax_match": i % 2 == 0}, "note": "n" * 200}
    variants["hf_eager"] = {"label": "x", "launch": "y", "status": "timed_out", "reason": "r" * 300}
    rec = {"ctx": 131072, "pos": 131071, "floor": {"bytes": {"total": 16_000_000_000}}, "schedule_bytes": 10**10,
           "variants": variants}
    add_ratios(rec, copy_tbps=4.19)
    return {"model": "llama-8b", "dry_run": False, "device": {"name": "NVIDIA H200"},
            "copy_bandwidth": {"tbps": 4.19}, "results": [rec]}


def test_table_fits_80_columns() -> None:
    """At its natural width (a 200-column console) every table line fits 80 columns, so an 80-column console shows
    it whole: no cell is cut short."""
    from rich.console import Console

    from megasynth.measure.render import render

    items = render(_fake_result())
    wide = Console(width=200, record=True, file=io.StringIO())
    wide.print(items[0])
    lines = wide.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert any("torch.compile" in ln and "12.0" in ln for ln in lines)  # the rows are there
    narrow = Console(width=80, record=True, file=io.StringIO())
    for item in items:
        narrow.print(item)
    text = narrow.export_text()
    assert "…" not in text and max(len(ln) for ln in text.splitlines()) <= 80
    assert "megakernel" in text and "timed_out" in text and "1.2e-02 argmax" in text and "vs PT" in text


def test_weights_dir_is_used_by_bench_and_generate(tmp_path) -> None:
    import importlib.util
    from pathlib import Path

    # one checkpoint writer for the tests: tests/kernels/test_reference.py's (tests/ has no packages to import from)
    where = importlib.util.spec_from_file_location("_reference_tests",
                                                   Path(__file__).parents[1] / "kernels" / "test_reference.py")
    assert where is not None and where.loader is not None
    module = importlib.util.module_from_spec(where)
    where.loader.exec_module(module)
    write_checkpoint = module.write_checkpoint
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


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen2"])
def test_dry_run_on_qwen_families(tmp_path, model: str) -> None:
    """`synth bench --dry-run` on the families beyond Llama: every CPU variant (the reference, HF, the bf16 step, the
    megakernel's schedule on the CPU executor) computes the reference's logits."""
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--model", model, "--dry-run", "--reps", "1", "--warmup", "0",
                                       "--ctx", "9", "--json", str(out), "--variants",
                                       "torch_eager,hf_eager,torch_bf16,cpu_executor"])
    assert result.exit_code == 0, result.output
    v = json.loads(out.read_text())["results"][0]["variants"]
    for name in ("torch_eager", "hf_eager", "torch_bf16", "cpu_executor"):
        assert v[name]["status"] == "ok", v[name]
        assert v[name]["check"]["rel_l2"] < CHECK_TOL and v[name]["check"]["argmax_match"], (name, v[name]["check"])


def test_model_dir_runs_on_its_own_weights(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model DIR` without --weights: bench and generate read the checkpoint's weights (generate's greedy tokens
    are transformers' on the saved model; bench records the folder and cannot run once its weights are gone), from
    any working directory."""
    from conftest import save_hf_checkpoint

    ckpt = tmp_path / "ckpt"
    model = save_hf_checkpoint(ckpt, "qwen3", seed=4)
    monkeypatch.chdir(tmp_path)  # a relative folder name
    gen = CliRunner().invoke(main, ["generate", "--model", "ckpt", "--tokens", "4", "--prompt-token", "3",
                                    "--backend", "reference", "--no-check"])
    assert gen.exit_code == 0, gen.output
    tokens = [3]
    with torch.no_grad():
        for _ in range(4):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert " ".join(map(str, tokens[1:])) in gen.output and f"checkpoint {ckpt.resolve()}" in gen.output
    out = tmp_path / "b.json"
    args = ["bench", "--model", "ckpt", "--dry-run", "--reps", "1", "--warmup", "0", "--ctx", "5", "--variants",
            "torch_eager,hf_eager,torch_bf16,cpu_executor", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["model"] == data["settings"]["weights"] == str(ckpt.resolve())
    assert all(v["status"] == "ok" for v in data["results"][0]["variants"].values()), data["results"][0]
    (ckpt / "model.safetensors").unlink()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "neither model.safetensors" in result.output


class _StuckEvent:
    """A CUDA event stand-in that the GPU reaches after `polls` queries (never with None)."""

    polls: int | None = None

    def __init__(self) -> None:
        self.left = self.polls

    def record(self) -> None:
        pass

    def query(self) -> bool:
        if self.left is None:
            return False
        self.left -= 1
        return self.left < 0


def test_waiting_for_the_gpu_is_bounded_and_a_hang_stops_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wait_for_gpu` returns once the work is done and raises GpuHangError, naming what it waited for, past its
    limit (a ring slot's wait has no watchdog on the device); a variant that hangs stops the bench (nothing more can
    run on that GPU) instead of being recorded as one failure among others, and `synth bench` exits 1 with it."""
    from contextlib import nullcontext

    import megasynth.measure.bench as bench_mod
    import megasynth.measure.variants as variants
    from megasynth.kernels.gpu.timing import GpuHangError, WatchdogError, wait_for_gpu

    monkeypatch.setattr(torch.cuda, "Event", _StuckEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda device: nullcontext())
    _StuckEvent.polls = 3
    wait_for_gpu("three polls", limit_s=5)
    _StuckEvent.polls = None
    with pytest.raises(GpuHangError, match=r"the step has not finished after 0.05 s.*restart the process") as hang:
        wait_for_gpu("the step", limit_s=0.05)
    assert isinstance(hang.value, WatchdogError)

    def stuck(st):
        def step():
            raise GpuHangError("the megakernel's step has not finished after 60 s")
        return step, {}

    monkeypatch.setitem(variants.RUNNERS, "torch_bf16", stuck)
    opts = BenchOptions(model="tiny", ctxs=[10], reps=1, warmup=0, device="cpu", variants=["torch_bf16"])
    with pytest.raises(GpuHangError):
        bench_mod.run_bench(opts, log=lambda s: None)
    monkeypatch.setattr(bench_mod, "run_bench", lambda *a, **k: stuck(None)[0]())
    res = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "8"])
    assert res.exit_code == 1 and "has not finished after 60 s" in res.output, res.output
