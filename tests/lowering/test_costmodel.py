"""The cost model (simulation over queues and counters, trace in the shared format) and its calibration, fitted on
synthetic traces with known parameters (no GPU here)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.ir.schedule import parse_schedule
from megasynth.lowering.costmodel import CostParams, OpParams, estimate, load_params
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.search.calibrate import fit, measured_ms

TINY = get_model("tiny")


def _declared(queues: list[list[int]], waits: dict[int, list[tuple[int, int]]],
              signals: dict[int, list[tuple[int, int]]], counters: int = 4) -> dict:
    n = sum(len(q) for q in queues)
    ins = [{"id": i, "op": "work", "writes": [{"buffer": "b", "range": [i, i + 1]}],
            "waits": [{"counter": c, "value": v} for c, v in waits.get(i, [])],
            "signals": [{"counter": c, "add": a} for c, a in signals.get(i, [])]} for i in range(n)]
    return {"format": "megakernel-schedule/1", "target": {"workers": len(queues)}, "buffers": {"b": n},
            "counters": counters, "instructions": ins, "queues": queues}


def test_counters_and_hops_order_the_simulation() -> None:
    params = CostParams(ops={"work": OpParams(eff=1.0, overhead_us=2.0)}, hop_us=0.5, wait_us=0.0)
    # 0 on worker 0 signals counter 0; 1 on worker 1 waits for it; 2 runs after 0 on worker 0.
    sched = parse_schedule(_declared([[0, 2], [1]], {1: [(0, 1)]}, {0: [(0, 1)]}))
    est = estimate(sched, 64, params)
    assert est.start_us[0] == 0 and est.end_us[0] == pytest.approx(2.0)
    assert est.start_us[1] == pytest.approx(2.5)  # one hop after its signaller ended
    assert est.start_us[2] == pytest.approx(2.0)  # program order on worker 0: no hop
    assert est.makespan_ms == pytest.approx(4.5 / 1000)
    assert est.critical_path == [0, 1]
    assert est.per_sm_idle_ms[1] == pytest.approx(2.5 / 1000)


def test_a_deadlock_is_an_error_not_a_hang() -> None:
    sched = parse_schedule(_declared([[0], [1]], {0: [(1, 1)], 1: [(0, 1)]}, {0: [(0, 1)], 1: [(1, 1)]}))
    with pytest.raises(ValueError, match="deadlocks"):
        estimate(sched, 64, CostParams())


def test_estimate_of_a_lowered_schedule_is_consistent_and_labelled() -> None:
    from megasynth.trace import check_trace

    sched = lower(TINY, 8)
    est = estimate(sched, 64)
    check_trace(est.trace)
    assert est.trace["metadata"]["estimated"] is True and est.estimated
    assert est.makespan_ms > 0 and all(i >= -1e-9 for i in est.per_sm_idle_ms)
    assert set(est.per_op_ms) == {i.op for i in sched.instructions}
    # Every wait is honoured: an instruction starts after the last signaller that its wait needs.
    ends = dict(enumerate(est.end_us))
    sig: dict[int, list[int]] = {}
    for ins in sched.instructions:
        for s in ins.signals:
            sig.setdefault(s.counter, []).append(ins.id)
    for ins in sched.instructions:
        for w in ins.waits:
            need = sorted(ends[j] for j in sig[w.counter])[w.value - 1]
            assert est.start_us[ins.id] >= need - 1e-9
    # Longer contexts read more KV cache: never faster.
    assert estimate(sched, 64).makespan_ms >= estimate(sched, 8).makespan_ms
    assert est.critical_path[-1] == max(range(len(est.end_us)), key=lambda i: est.end_us[i])


def test_attention_flops_lengthen_long_splits_only() -> None:
    """Interpreter v9 (no ring): each attn_partial takes its flops / `attn_flop_rate` longer, so a split over the
    whole context (one split) pays it in full on one SM, many short splits pay a fraction each, and no other op
    changes."""
    from dataclasses import replace

    base = replace(load_params(), attn_flop_rate=0.0, ring_bytes=0.0)
    slow = replace(base, attn_flop_rate=2e3)
    one, many = lower(TINY, 8, Strategy(attn_splits=1)), lower(TINY, 8, Strategy(attn_splits=8))
    d_one = estimate(one, 64, slow).per_op_ms["attn_partial"] - estimate(one, 64, base).per_op_ms["attn_partial"]
    d_many = estimate(many, 64, slow).per_op_ms["attn_partial"] - estimate(many, 64, base).per_op_ms["attn_partial"]
    c = TINY.config
    flops = c.num_hidden_layers * c.num_key_value_heads * 4 * 64 * c.hd * c.group_size  # every split, all layers
    assert d_one == pytest.approx(flops / 2e3 / 1e3, rel=1e-6) and d_many == pytest.approx(d_one, rel=1e-6)
    assert estimate(one, 64, slow).per_op_ms["mlp_norm_gate_up"] == pytest.approx(
        estimate(one, 64, base).per_op_ms["mlp_norm_gate_up"], rel=1e-9)
    assert estimate(one, 64, slow).makespan_ms - estimate(one, 64, base).makespan_ms > \
        estimate(many, 64, slow).makespan_ms - estimate(many, 64, base).makespan_ms


def test_attention_flops_overlap_the_kv_stream_on_v10() -> None:
    """Interpreter v10 computes each K/V block as its ring slot lands: a split's arithmetic bounds how fast its
    stream is consumed instead of adding to it. Arithmetic faster than the stream changes nothing; slower, the split
    lasts at least flops / rate but less than that plus its time without arithmetic."""
    from dataclasses import replace

    from megasynth.ir.catalogue import Geometry
    from megasynth.lowering.costmodel import instruction_cost

    base = replace(load_params(), attn_flop_rate=0.0)
    assert base.ring_bytes > 0
    sched = lower(TINY, 8, Strategy(attn_splits=1))
    ctx, rate = 64, 2e3
    fast = estimate(sched, ctx, replace(base, attn_flop_rate=1e12))
    ref = estimate(sched, ctx, base)
    assert fast.makespan_ms == pytest.approx(ref.makespan_ms, rel=1e-9)
    slow = estimate(sched, ctx, replace(base, attn_flop_rate=rate))
    geo = Geometry(TINY.config, TINY.max_seq_len, 1)
    parts = [k for k, ins in enumerate(sched.instructions) if ins.op == "attn_partial"]
    assert parts
    for k in parts:
        ins = sched.instructions[k]
        flops = instruction_cost(geo, ins.op, ins.layer, ins.args, ctx)[1]
        took, alone = slow.end_us[k] - slow.start_us[k], ref.end_us[k] - ref.start_us[k]
        assert flops / rate <= took < flops / rate + alone, (k, took, alone, flops / rate)


def test_committed_parameters_load_and_say_where_they_come_from() -> None:
    p = load_params()
    assert p.source.startswith(("prior", "fitted")) and p.notes
    assert p.total_bw == pytest.approx(4.19e6) and 0 < p.hop_us < 10
    assert all(0 < op.eff <= 1 and op.overhead_us >= 0 for op in p.ops.values())
    # (its error on measured H200 steps it was not fitted to: tests/test_synthesis.py)


def _synthetic(n: int, secret: CostParams, noise: float, seed: int = 0) -> list[tuple[dict, object]]:
    """n schedules of a small model timed by the cost model with secret parameters, plus multiplicative noise."""
    rng = random.Random(seed)
    spec = get_model("tiny-gqa4")
    pairs = []
    for _ in range(n):
        st = Strategy(attn_splits=rng.choice([1, 2, 4]), assignment=rng.choice(["round_robin", "critical_path",
                                                                                "cost_balanced", "zigzag"]),
                      tiles={**Strategy().tiles, "mlp_norm_gate_up": rng.choice([8, 16, 32]),
                             "down_proj_residual": rng.choice([8, 16, 32])})
        sched = lower(spec, rng.choice([6, 12, 24]), st)
        trace = estimate(sched, 128, secret).trace
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                e["dur"] *= 1 + rng.uniform(-noise, noise)
        trace["metadata"]["estimated"] = False
        pairs.append((trace, sched))
    return pairs


def test_calibration_recovers_known_parameters() -> None:
    secret = CostParams(ops={op: OpParams(eff=e, overhead_us=o) for op, e, o in [
        ("embed", 0.5, 0.5), ("attn_norm_qkv_rope", 0.8, 2.0), ("attn_partial", 0.4, 3.0),
        ("attn_reduce", 0.6, 1.5), ("o_proj_residual", 0.7, 1.2), ("mlp_norm_gate_up", 0.75, 2.5),
        ("down_proj_residual", 0.55, 1.8), ("final_norm_lm_head", 0.9, 1.0)]}, sm_peak=2e3, total_bw=2e4)
    pairs = _synthetic(20, secret, noise=0.03)
    prior = CostParams(ops={op: OpParams(eff=0.3, overhead_us=0.2) for op in secret.ops}, sm_peak=2e3, total_bw=2e4)
    before = [abs(estimate(s, 128, prior).makespan_ms - measured_ms(t)) / measured_ms(t) for t, s in pairs]
    result = fit(pairs, prior)
    assert result.median_abs_pct_error is not None and result.median_abs_pct_error <= 10.0
    assert result.median_abs_pct_error < 100 * sorted(before)[len(before) // 2]
    for op in ("mlp_norm_gate_up", "down_proj_residual"):  # tiles vary, so bytes vary: both parameters are known
        assert result.params.op(op).eff == pytest.approx(secret.op(op).eff, rel=0.2)
        assert result.params.op(op).overhead_us == pytest.approx(secret.op(op).overhead_us, rel=0.3, abs=0.3)
    assert result.params.source.startswith("fitted from 20 traces")


def test_calibrate_cli_writes_parameters(tmp_path: Path) -> None:
    from megasynth.commands.calibrate import calibrate

    pairs = _synthetic(3, CostParams(), noise=0.0, seed=3)
    traces = []
    for k, (trace, sched) in enumerate(pairs):
        d = tmp_path / f"t{k}"
        d.mkdir()
        (d / "trace.json").write_text(json.dumps(trace))
        (d / "schedule.json").write_text(json.dumps(sched.to_json()))
        traces.append(str(d / "trace.json"))
    out = tmp_path / "fit.json"
    v9 = tmp_path / "v9.json"
    CostParams().save(v9)  # ring_bytes 0: the per-instruction fit of interpreter v9
    res = CliRunner().invoke(calibrate, [*traces, "--prior", str(v9), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "median absolute error" in res.output
    p = load_params(out)
    assert p.source.startswith("fitted from 3 traces")
    # An estimated trace is refused (it is not a measurement), with the JSON path.
    est = json.loads(Path(traces[0]).read_text())
    est["metadata"]["estimated"] = True
    Path(traces[0]).write_text(json.dumps(est))
    res = CliRunner().invoke(calibrate, [traces[0], "--prior", str(v9)])
    assert res.exit_code == 2 and "$.metadata.estimated" in res.output


def test_held_out_check_on_a_measured_run(tmp_path: Path) -> None:
    from megasynth.ir.schedule import dump_schedule
    from megasynth.search.calibrate import check_runs

    (trace, sched), = _synthetic(1, CostParams(), noise=0.0, seed=5)
    cand = tmp_path / "run" / "candidates" / "c0000"
    cand.mkdir(parents=True)
    dump_schedule(sched, cand / "schedule.json")
    ms = measured_ms(trace)
    (cand / "timing.json").write_text(json.dumps({"ms": ms, "estimated": False, "ctx": 128}))
    est = tmp_path / "run" / "candidates" / "c0001"
    est.mkdir()
    (est / "timing.json").write_text(json.dumps({"ms": 1.0, "estimated": True}))  # estimates are not checked
    rows = check_runs([str(tmp_path / "run")], CostParams())
    assert len(rows) == 1 and abs(rows[0]["error_pct"]) < 1e-3


def test_measured_steps_pick_the_sm_peak_from_a_grid() -> None:
    from dataclasses import replace

    secret = CostParams(ops={op: OpParams(eff=0.7, overhead_us=1.5) for op in CostParams().ops}, sm_peak=3e3,
                        total_bw=2e4, hop_us=0.8)
    pairs = _synthetic(2, secret, noise=0.0, seed=7)
    spec = get_model("tiny-gqa4")
    measured = []
    for workers in (2, 4, 24):  # few workers: one SM's peak bandwidth decides
        sched = lower(spec, workers, Strategy(attn_splits=2))
        measured.append((sched, 128, estimate(sched, 128, secret).makespan_ms))
    prior = replace(secret, sm_peak=9e3, hop_us=0.1)
    result = fit(pairs, prior, measured=measured, peaks=[1.5e3, 3e3, 9e3])
    assert result.params.sm_peak == pytest.approx(3e3)
    assert result.params.hop_us == pytest.approx(0.8, abs=0.3)
    assert "measured steps" in result.params.source


def test_qkv_cost_counts_the_bias_and_the_qk_norm_weights() -> None:
    """A QKV tile reads a bias element per row (Qwen2) and the q_norm / k_norm weights it uses, head_dim each (Qwen3:
    a tile of q heads reads q_norm, one spanning q and k heads both, one of v rows neither); the flops and the rest
    of the bytes are the Llama matvec's."""
    from dataclasses import replace

    from megasynth.ir.catalogue import OPS, Geometry

    cost = OPS["attn_norm_qkv_rope"].cost
    # tiny-qwen3: head_dim 128, q rows [0, 512), k rows [512, 768), v rows [768, 1024); bf16 weights
    # tiny-qwen2: q rows [0, 192), k [192, 256), v [256, 320)
    cases = {"tiny-qwen3": [((0, 128), 256), ((384, 640), 512), ((512, 768), 256), ((768, 1024), 0),
                            ((0, 1024), 512)],
             "tiny-qwen2": [((0, 32), 64), ((10, 20), 20), ((250, 262), 24), ((0, 320), 640)]}
    for name, tiles in cases.items():
        cfg = get_model(name).config
        geo, llama = Geometry(cfg, 64), Geometry(replace(cfg, qkv_bias=False, qk_norm=False), 64)
        for (start, end), extra in tiles:
            a = {"start": start, "end": end}
            got, want = cost(geo, 0, a, 8), cost(llama, 0, a, 8)
            assert got == (want[0] + extra, want[1]), (name, start, end)


def test_step_fit_starts_a_borrowing_op_from_the_parameters_it_borrows() -> None:
    """An op without parameters of its own (PARAMS_LIKE) whose overhead the step fit frees keeps the efficiency it
    borrowed, not the default's."""
    from megasynth.lowering.costmodel import PARAMS_LIKE
    from megasynth.search.calibrate import _get, _set

    for op, like in PARAMS_LIKE.items():
        p = CostParams(ops={like: OpParams(eff=0.9, overhead_us=3.0)})
        assert _get(p, f"overhead_us:{op}") == 3.0
        assert _set(p, {f"overhead_us:{op}": 2.0}).op(op) == OpParams(eff=0.9, overhead_us=2.0)
        assert p.op(like) == OpParams(eff=0.9, overhead_us=3.0)


def test_measured_steps_file_lowers_at_its_max_seq_len_and_keeps_always_fit_steps(tmp_path: Path) -> None:
    """A `megasynth-measured-steps/1` step is lowered for its `max_seq_len` (a long-context step is costed over its
    whole ctx, not clamped at the model's default), and one marked `always_fit` is never held out nor subsampled
    away."""
    from megasynth.search.calibrate import Step, file_steps, split_held_out, subsample

    seq = TINY.max_seq_len * 4
    st = Strategy(attn_splits=2).model_dump(mode="json")
    steps = [{"name": f"s{k}", "model": "tiny", "workers": 8, "ctx": seq, "max_seq_len": seq, "ms": 0.1 + k,
              "strategy": st, "always_fit": k < 3} for k in range(6)]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": steps}))
    got = file_steps([str(path)])
    assert all(s.prog.geometry.max_seq_len == seq for s in got)
    assert [s.always for s in got] == [True] * 3 + [False] * 3
    p = load_params()
    short = estimate(lower(TINY, 8, Strategy(attn_splits=2)), seq, p).makespan_ms  # clamped at the default
    assert estimate(got[0].prog, seq, p).makespan_ms > short
    others = [Step(f"r{k}", got[3].prog, seq, 0.5 + k) for k in range(40)]
    fit_set, held = split_held_out(got + others, 0.9)
    assert all(any(f is s for f in fit_set) for s in got[:3]) and len(held) > 20
    used = subsample(got + others, 8)
    assert len(used) <= 8 and all(any(u is s for u in used) for s in got[:3])


def test_measured_steps_at_a_batch_are_checked_step_by_step(tmp_path: Path) -> None:
    """A measured step's `batch` lowers it for that many sequences; `synth calibrate --check-measured FILE` reports
    the committed model's estimate against each step's time and writes nothing; a malformed step is exit 2 naming
    the file and the JSON path, without a traceback."""
    from megasynth.commands.calibrate import calibrate
    from megasynth.search.calibrate import file_steps

    st = Strategy(attn_splits=1).model_dump(mode="json")
    steps = [{"name": f"b{b}", "model": "tiny", "batch": b, "workers": 8, "ctx": 64, "ms": 0.05 * b, "strategy": st}
             for b in (1, 3)]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": steps}))
    got = file_steps([str(path)])
    assert [s.prog.geometry.batch for s in got] == [1, 3]
    p = load_params()
    assert estimate(got[1].prog, 64, p).makespan_ms > estimate(got[0].prog, 64, p).makespan_ms
    res = CliRunner().invoke(calibrate, ["--check-measured", str(path)])
    assert res.exit_code == 0, res.output
    assert "steps.json:b1@64: estimated" in res.output and "steps.json:b3@64: estimated" in res.output
    assert "over 2 measured steps" in res.output and sorted(p.name for p in tmp_path.iterdir()) == ["steps.json"]
    for bad, where in (({**steps[1], "batch": 99}, "$.steps[1]"), ({k: v for k, v in steps[1].items() if k != "ms"},
                                                                     "$.steps[1]: missing ms"),
                       ({**steps[1], "model": "no-such-model"}, "$.steps[1]")):
        path.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": [steps[0], bad]}))
        res = CliRunner().invoke(calibrate, ["--check-measured", str(path)])
        assert res.exit_code == 2 and f"{path}: {where}" in res.output and "Traceback" not in res.output, res.output


def test_committed_batch_steps_lower_to_the_timed_schedules(tmp_path: Path) -> None:
    """bench/results/batch/measured_steps.json records the strategies of the published batch rows: each lowers
    (as `synth lower` writes it) to exactly the schedule file the benchmark timed (its sha256)."""
    import hashlib

    from megasynth.ir.schedule import dump_schedule
    from megasynth.lowering.models import with_batch

    root = Path(__file__).resolve().parents[2]
    doc = json.loads((root / "bench/results/batch/measured_steps.json").read_text())
    assert doc["steps"]
    for e in doc["steps"]:
        bench = json.loads((root / f"bench/results/batch/{e['model']}_batch{e['batch']}.json").read_text())
        assert e["ms"] == bench["results"][0]["variants"]["megakernel"]["timing"]["median_ms"]
        spec = with_batch(get_model(e["model"]), e["batch"])
        sched = lower(spec, e["workers"], Strategy.model_validate(e["strategy"]), proposer="manual")
        out = tmp_path / f"{e['name']}.json"
        dump_schedule(sched, str(out))
        sha = hashlib.sha256(out.read_text().encode()).hexdigest()
        assert sha == e["schedule_sha256"] == bench["schedule"]["sha256"], e["name"]


def test_batch_attention_on_the_tensor_cores_has_its_own_flop_rate() -> None:
    """From `attn_mma_batch` sequences per step (v10's tile batches, whose attention runs on the tensor cores)
    attention's arithmetic is priced at `attn_mma_flop_rate`; below it, and where that rate is unset, at the CUDA
    cores' `attn_flop_rate`."""
    from dataclasses import replace

    from megasynth.lowering.models import with_batch

    p = replace(load_params(), attn_flop_rate=5e4, attn_mma_flop_rate=0.0)
    assert p.attn_rate(8) == p.attn_rate(1) == 5e4
    fast = replace(p, attn_mma_flop_rate=5e5)
    assert fast.attn_rate(8) == fast.attn_rate(16) == 5e5 and fast.attn_rate(4) == 5e4
    for batch, changes in ((8, True), (3, False)):
        s = lower(with_batch(TINY, batch), 8, Strategy(attn_splits=1))
        slow_ms, fast_ms = (estimate(s, TINY.max_seq_len, q).makespan_ms for q in (p, fast))
        assert (fast_ms < slow_ms) == changes, (batch, slow_ms, fast_ms)


def test_calibrate_fits_only_the_parameters_named_by_free(tmp_path: Path) -> None:
    """`synth calibrate --free NAME` fits that parameter alone: every other one stays the prior's, the prior's record
    of its own fit stays beside this fit's (`refits`), and an unknown name is a usage error that lists the known."""
    from megasynth.commands.calibrate import calibrate
    from megasynth.lowering.costmodel import DATA

    prior = tmp_path / "prior.json"
    prior.write_text(DATA.read_text())
    st = Strategy(attn_splits=1).model_dump(mode="json")
    steps = [{"name": f"b{b}", "model": "tiny", "batch": b, "workers": 8, "ctx": 64, "ms": 0.03 * b ** 0.5,
              "strategy": st} for b in (1, 8, 16)]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": steps}))
    out = tmp_path / "fitted.json"
    res = CliRunner().invoke(calibrate, ["--measured", str(path), "--free", "attn_mma_flop_rate", "--holdout", "0",
                                         "--iterations", "2", "--jobs", "1", "--prior", str(prior), "-o", str(out)])
    assert res.exit_code == 0, res.output
    before, after = json.loads(prior.read_text()), json.loads(out.read_text())
    assert after["fit"] == before["fit"] and after["refits"][-1]["free"] == ["attn_mma_flop_rate"]
    for key in ("hop_us", "sm_peak", "consume_bw", "launch_us", "attn_flop_rate", "ops", "ring_bytes"):
        assert after[key] == before[key], key
    assert after["attn_mma_flop_rate"] > 0 and after["source"].startswith(before["source"] + "; then ")
    res = CliRunner().invoke(calibrate, ["--measured", str(path), "--free", "no_such_param", "-o", str(out)])
    assert res.exit_code == 2 and "no_such_param" in res.output and "attn_mma_flop_rate" in res.output
