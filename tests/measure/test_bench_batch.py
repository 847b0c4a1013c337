"""`synth bench --batch N` on the CPU: the batched bf16 step against the per-sequence fp32 reference, the floor's
bytes of a batch, the dry run's JSON and table at batch 3, and the variants that decode one sequence per step
reported as skipped with their reason."""

from __future__ import annotations

import io
import json

import pytest
import torch
from click.testing import CliRunner

from megasynth.cli import main
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model, with_batch
from megasynth.measure.bench import add_ratios
from megasynth.measure.options import BenchOptions
from megasynth.measure.timing import floor_bytes
from megasynth.measure.torch_step import (
    CHECK_TOL,
    bf16_decode_batch,
    bf16_decode_step,
    bf16_rope,
    check_ok,
    compare,
    kv_history,
    kv_write_index,
    prefill,
    step_weights,
)
from megasynth.measure.variants import BATCH_ONE, VARIANTS, bf16_step_fn, new_state


@pytest.fixture(scope="module")
def batch3(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One CLI dry run on the tiny model at batch 3, ctx 8."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--batch", "3", "--ctx", "8",
                                       "--reps", "2", "--warmup", "0", "--json", str(out), "--variants",
                                       "torch_eager,hf_eager,torch_bf16,per_op_graph,megakernel,cpu_executor"])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_floor_bytes_of_a_batch() -> None:
    """Weights once, each sequence's KV history, new K/V and logits B times; an untied embedding adds one row per
    sequence; batch 1 is the default's numbers."""
    for model in ("tiny", "tiny-mha", "llama-1b"):
        cfg = get_model(model).config
        one, three = floor_bytes(cfg, 100), floor_bytes(cfg, 100, 3)
        assert floor_bytes(cfg, 100, 1) == one
        for key in ("kv_read", "kv_write", "activations"):
            assert three[key] == 3 * one[key], (model, key)
        rows = 0 if cfg.tie_word_embeddings else 2 * cfg.hidden_size * 2
        assert three["weights"] == one["weights"] + rows, model
        assert three["total"] == sum(v for k, v in three.items() if k != "total")
    assert not get_model("tiny-mha").config.tie_word_embeddings  # the untied case is exercised


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3", "tiny-qwen2"])
def test_bf16_batch_step_matches_reference(model: str) -> None:
    """The bf16 step of 3 sequences at once (each its own history and token) computes `decode_batch`'s logits to
    the bf16 check's tolerance, sequence by sequence, and writes each sequence's new K/V into its own slot."""
    from megasynth.kernels.reference import decode_batch, new_kv_cache
    from megasynth.kernels.weights import random_weights

    spec = get_model(model)
    cfg = spec.config
    w = random_weights(cfg, seed=1, dtype=torch.bfloat16)
    fused = step_weights(cfg, w)
    k, v = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16, batch=3)
    k2, v2 = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16, batch=3)
    tokens = [5, 9, 200]
    for ctx in (1, 30, spec.max_seq_len):
        hist = kv_history(cfg, spec.max_seq_len, ctx, 0, batch=3)
        prefill(k, v, hist)
        prefill(k2, v2, hist)
        ref = decode_batch(cfg, w, k, v, tokens, [ctx - 1] * 3)
        cos, sin = bf16_rope(cfg, ctx - 1, "cpu")
        with torch.inference_mode():
            out = bf16_decode_batch(cfg, fused, k2, v2, torch.tensor(tokens), ctx - 1, cos, sin)
        assert out.dtype == torch.float32 and out.shape == ref.shape == (3, cfg.vocab_size)
        whole = compare(out, ref)
        for b in range(3):
            chk = compare(out[b], ref[b])
            assert chk["rel_l2"] < CHECK_TOL, (ctx, b, chk)
            assert chk["argmax_match"] or whole["near_ties"], (ctx, b, chk)  # a flip only at a near-tie
        assert check_ok(whole) and whole["argmax_match"] and whole["argmax_agree"] + whole["near_ties"] == 3
        assert max(compare(out[b], ref[b])["rel_l2"] for b in range(3)) == whole["rel_l2_max"]
        for new, old in ((k2, k), (v2, v)):
            assert torch.allclose(new[..., ctx - 1, :].float(), old[..., ctx - 1, :].float(), rtol=5e-2, atol=5e-2)
            assert torch.equal(new[..., :ctx - 1, :], old[..., :ctx - 1, :])  # the history is untouched
        if ctx > 1:  # the sequences' histories differ, so a step that mixed them up would show
            assert not torch.equal(k[:, 0, :, :ctx - 1], k[:, 1, :, :ctx - 1])


def test_batch_of_one_is_the_batch_1_step_bit_for_bit() -> None:
    """The batched step with one slot computes the batch-1 step's logits and K/V exactly; the bench's batch-1 bf16
    variant is still `bf16_decode_step` itself; the index_put_ K/V write of the batched step (torch.compile's) is its
    slice write exactly."""
    from megasynth.kernels.reference import new_kv_cache

    model = "tiny-qwen3"
    spec = get_model(model)
    cfg = spec.config
    st = new_state(spec, BenchOptions(model=model, device="cpu"))
    st.ctx = 11
    hist = kv_history(cfg, spec.max_seq_len, st.ctx, 2)
    cos, sin = bf16_rope(cfg, st.pos, "cpu")
    k1, v1 = new_kv_cache(cfg, spec.max_seq_len, dtype=torch.bfloat16, batch=1)
    with torch.inference_mode():
        prefill(st.k, st.v, hist)
        bench_out = bf16_step_fn(st)()
        k_bench, v_bench = st.k.clone(), st.v.clone()
        prefill(st.k, st.v, hist)
        plain = bf16_decode_step(cfg, st.step_weights, st.k, st.v, st.token, st.pos, cos, sin)
        prefill(k1, v1, (hist[0][:, None], hist[1][:, None]))
        one = bf16_decode_batch(cfg, st.step_weights, k1, v1, torch.tensor([st.token]), st.pos, cos, sin)
    assert torch.equal(bench_out, plain) and torch.equal(k_bench, st.k) and torch.equal(v_bench, st.v)
    assert one.shape == (1, cfg.vocab_size) and torch.equal(one[0], plain)
    assert torch.equal(k1[:, 0], st.k) and torch.equal(v1[:, 0], st.v)

    st3 = new_state(with_batch(spec, 3), BenchOptions(model=model, device="cpu", batch=3))
    st3.ctx = 11
    hist3 = st3.history(2)
    with torch.inference_mode():
        prefill(st3.k, st3.v, hist3)
        sliced = bf16_step_fn(st3)()
        k_s, v_s = st3.k.clone(), st3.v.clone()
        prefill(st3.k, st3.v, hist3)
        indexed = bf16_decode_batch(cfg, st3.step_weights, st3.k, st3.v, st3.token_ids, st3.pos, cos, sin,
                                    kv_write_index(cfg, st3.pos, "cpu"))
    assert torch.equal(sliced, indexed) and torch.equal(k_s, st3.k) and torch.equal(v_s, st3.v)
    assert torch.equal(hist3[0][:, 0], hist[0])  # sequence 0 has the batch-1 history


def test_compiled_batch_step_is_one_graph() -> None:
    """The torch.compile variant's batched step (dynamo, eager backend: quick on the CPU): one graph, no break, the
    plain batched step's logits, the token ids among its fixed tensors."""
    from megasynth.measure.compile import compile_step, compiled_step, dynamo_stats

    spec = with_batch(get_model("tiny"), 3)
    st = new_state(spec, BenchOptions(model="tiny", device="cpu", batch=3))
    st.ctx = 7
    hist = st.history(0)
    with torch.inference_mode():
        prefill(st.k, st.v, hist)
        plain = bf16_step_fn(st)()
        prefill(st.k, st.v, hist)
        step_fn, statics = compiled_step(st)
        out = compile_step(step_fn, None, "eager")()
    assert dynamo_stats() == {"graphs": 1, "graph_breaks": 0}
    assert out.shape == (3, spec.config.vocab_size) and torch.equal(out, plain)
    assert any(t is st.token_ids for t in statics)


def test_dry_run_at_batch_3(batch3: tuple[dict, str]) -> None:
    """The CPU variants agree with `decode_batch`; the JSON has the batch (top level and per ctx), tokens/s = 3 /
    step time and the batch's floor; the one-sequence variants are skipped with their reason; the table adds tok/s;
    the runs reader still reads the document."""
    from megasynth.runs.reader import bench_rows

    data, output = batch3
    assert data["batch"] == 3 and data["settings"]["tokens"] == [1, 2, 3]
    rec = data["results"][0]
    assert rec["batch"] == 3 and rec["ctx"] == 8 and rec["pos"] == 7
    assert rec["floor"]["bytes"] == floor_bytes(get_model("tiny").config, 8, 3)
    v = rec["variants"]
    assert list(v) == [k for k in VARIANTS if k in v]
    for name in ("torch_eager", "torch_bf16", "cpu_executor"):
        assert v[name]["status"] == "ok", v[name]
        chk = v[name]["check"]
        assert chk["rel_l2_max"] < CHECK_TOL and chk["argmax_match"], (name, chk)
        assert v[name]["tokens_per_s"] == pytest.approx(3 / (v[name]["timing"]["median_ms"] * 1e-3))
    for name in ("hf_eager", "per_op_graph"):
        assert v[name]["status"] == "skipped" and v[name]["reason"] == BATCH_ONE[name], v[name]
        assert "tokens_per_s" not in v[name]
    assert "megakernel" not in BATCH_ONE  # it runs a batch on interpreter v9: skipped here only for want of CUDA
    assert v["megakernel"]["status"] == "skipped" and v["megakernel"]["reason"] == "no CUDA (dry run)"
    assert "tiny, ctx 8, batch 3" in output and "tok/s" in output and "batch 1 only" in output
    rows, floor, _ = bench_rows(data, 8)
    assert len(rows) == 3 and floor == pytest.approx(rec["floor"]["ms"])


def test_batch_1_table_and_json_keep_their_shape(tmp_path) -> None:
    """At batch 1 the table has no tok/s column and no batch in its title; the JSON says batch 1 and tokens/s is
    1 / step time."""
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "6", "--reps", "1",
                                       "--warmup", "0", "--variants", "torch_bf16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "tok/s" not in result.output and ", batch" not in result.output and "% copy" in result.output
    data = json.loads(out.read_text())
    rec = data["results"][0]
    assert data["batch"] == rec["batch"] == 1 and rec["floor"]["bytes"] == floor_bytes(get_model("tiny").config, 6)
    bf16 = rec["variants"]["torch_bf16"]
    assert bf16["tokens_per_s"] == pytest.approx(1 / (bf16["timing"]["median_ms"] * 1e-3))


def test_batched_table_fits_80_columns() -> None:
    from rich.console import Console

    from megasynth.measure.render import render

    t = {"median_ms": 123.345, "p10_ms": 120.001, "p90_ms": 139.999, "min_ms": 11.0, "max_ms": 99.0, "reps": 100}
    variants = {name: {"label": VARIANTS[name][0], "launch": VARIANTS[name][1], "status": "ok",
                       "timing": {**t, "median_ms": 0.01 + i},
                       "check": {"rel_l2": 1.234e-2, "rel_l2_max": 4.5e-2, "argmax_match": i % 2 == 0}}
                for i, name in enumerate(VARIANTS)}
    variants["megakernel"] = {"label": "x", "launch": "y", "status": "skipped", "reason": BATCH_ONE["per_op_graph"]}
    rec = {"ctx": 131072, "pos": 131071, "batch": 16, "floor": {"bytes": {"total": 16_000_000_000}},
           "variants": variants}
    add_ratios(rec, copy_tbps=4.19)
    assert variants["torch_eager"]["tokens_per_s"] == pytest.approx(16 / 0.01e-3)
    items = render({"model": "llama-8b", "dry_run": False, "device": {"name": "NVIDIA H200"},
                    "copy_bandwidth": {"tbps": 4.19}, "results": [rec]})
    wide = Console(width=200, record=True, file=io.StringIO())
    wide.print(items[0])
    lines = wide.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert any("tok/s" in ln for ln in lines) and any("1600000" in ln for ln in lines)
    assert any("4.5e-02" in ln for ln in lines)  # the worst sequence's error is shown


def test_schedule_of_another_batch_is_refused(tmp_path) -> None:
    from megasynth.ir.schedule import dump_schedule

    path = tmp_path / "s.json"
    dump_schedule(lower(get_model("tiny"), 4), path)
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--batch", "2", "--schedule",
                                       str(path)])
    assert result.exit_code == 2 and "$.model.batch" in result.output and "--batch 1" in result.output
    bad = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--batch", "17"])
    assert bad.exit_code == 2 and "--batch" in bad.output


def test_compile_worker_at_batch_3() -> None:
    """The torch.compile child at a batch (dynamo's eager backend): the batched step against `decode_batch`."""
    from megasynth.measure.compile import run_compile

    opts = BenchOptions(model="tiny", ctxs=[6], reps=2, warmup=0, device="cpu", compile_backend="eager",
                        compile_mode=None, compile_timeout_s=120, batch=3)
    rec = run_compile(opts, lambda s: None)[6]
    assert rec["status"] == "ok", rec
    assert check_ok(rec["check"]) and rec["check"]["argmax_match"] and rec["check"]["argmax_agree"] == 3
    assert rec["dynamo"] == {"graphs": 1, "graph_breaks": 0} and "3 sequences in one step" in rec["note"]


def test_several_batches_one_json_each_and_a_tokens_per_s_table(tmp_path) -> None:
    """`--batch 1,3`: one run per batch, its JSON at the path with {batch} filled in (or _batch<N> added; a single
    batch fills in {batch} too), then the table of tokens/s by batch; a schedule path without {batch}, a batch
    outside 1..16 or a non-number exit 2."""
    out = tmp_path / "b{batch}.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "8", "--reps", "1",
                                       "--warmup", "0", "--batch", "1,3", "--variants", "torch_bf16",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    docs = {b: json.loads((tmp_path / f"b{b}.json").read_text()) for b in (1, 3)}
    assert [docs[b]["batch"] for b in (1, 3)] == [1, 3]
    assert "tokens/s by batch" in result.output
    plain = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "8", "--reps", "1",
                                       "--warmup", "0", "--batch", "2,1,2", "--variants", "torch_bf16",
                                       "--json", str(plain)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("p_batch*.json")) == ["p_batch1.json", "p_batch2.json"]
    result = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", "--ctx", "8", "--reps", "1",
                                       "--warmup", "0", "--batch", "2", "--variants", "torch_bf16",
                                       "--json", str(tmp_path / "one{batch}.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "one2.json").read_text())["batch"] == 2  # {batch} filled in for one batch too
    for args, needle in ((["--batch", "1,2", "--schedule", "s.json"], "give a path with {batch}"),
                         (["--batch", "1,17"], "17 is not in 1..16"), (["--batch", "x"], "'x' is not a whole")):
        bad = CliRunner().invoke(main, ["bench", "--model", "tiny", "--dry-run", *args])
        assert bad.exit_code == 2 and needle in bad.output, bad.output


def test_batch_rows_compare_each_batch_with_the_batch_1_step() -> None:
    from megasynth.measure.render import batch_rows

    def result(batch: int, mk_ms: float, pt_ms: float) -> dict:
        return {"results": [{"ctx": 1024, "batch": batch, "pytorch_best": {"variant": "torch_compile",
                                                                           "median_ms": pt_ms},
                             "variants": {"megakernel": {"status": "ok", "timing": {"median_ms": mk_ms},
                                                         "tokens_per_s": batch / mk_ms * 1e3,
                                                         "speedup_vs_pytorch_best": pt_ms / mk_ms}}}]}

    rows = batch_rows([result(1, 0.8, 1.1), result(8, 0.9, 1.2)])
    assert [r["batch"] for r in rows] == [1, 8]
    assert rows[0]["vs_batch1"] == pytest.approx(1.0) and rows[1]["vs_batch1"] == pytest.approx(0.9 / 0.8)
    assert rows[1]["megakernel_tokens_per_s"] == pytest.approx(8 / 0.9e-3)
    assert rows[1]["pytorch_tokens_per_s"] == pytest.approx(8 / 1.2e-3)
    assert rows[1]["vs_pytorch"] == pytest.approx(1.2 / 0.9)
