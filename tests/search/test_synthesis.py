"""Synthesis without hand seeds: the search space, the cost model of the v10 interpreter (its weight stream running
ahead of the waits) and its step fit (synthetic data), the few-layer surrogate, the descent proposer, screened
candidates shown as such, and a search that survives a dead worker and a kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from megasynth.ir.program import resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.lowering.costmodel import CostParams, OpParams, estimate, load_params
from megasynth.lowering.lower import lower
from megasynth.lowering.models import ModelSpec, get_model
from megasynth.lowering.strategy import BOX_ROWS, SearchSpace, Strategy, wave_tiles
from megasynth.runs.rundir import RunDir
from megasynth.search.config import SearchConfig
from megasynth.search.loop import Search, run_search
from megasynth.search.pool import Pool, prepare
from megasynth.search.proposers.base import Proposal, Result, SearchContext, strategy_key
from megasynth.validator.verify import Options, verify

TINY = get_model("tiny")
#: The tiny config with 6 layers: long enough for the surrogate to extrapolate, small enough to lower in ms.
TINY6 = ModelSpec("tiny6", "tiny with 6 layers", replace(TINY.config, num_hidden_layers=6), TINY.max_seq_len)
V10 = CostParams(ops={op: OpParams(eff=1.0, overhead_us=1.0) for op in CostParams().ops}, total_bw=2e4, sm_peak=3e3,
                 hop_us=0.6, wait_us=0.0, ring_bytes=4096.0, consume_bw=8e3, box_rows=16, launch_us=3.0)


def _cfg(tmp_path: Path, **kw) -> SearchConfig:
    base = dict(model="tiny", workers=8, budget=6, runs_dir=tmp_path, run="r", interleavings=20,
                final_interleavings=50, ctx=64, gpu=False, progress=False, proposer="seeds", notice=lambda m: None,
                jobs=1)
    base.update(kw)
    return SearchConfig(**base)


# -- the search space ---------------------------------------------------------------------------------------------


def test_space_holds_one_wave_tiles_pair_tiles_k_splits_and_every_knob() -> None:
    space = SearchSpace(get_model("llama-1b"), 132)
    names = {k.name for k in space.knobs}
    assert {"attn_splits", "assignment", "order", "k_splits.o_proj_residual", "k_splits.down_proj_residual"} <= names
    assert {f"edges.{e}" for e in ("attn_partial->attn_reduce", "mlp_norm_gate_up->down_proj_residual")} <= names
    lm = space.by_name["tiles.final_norm_lm_head"].choices
    assert 972 in lm and 976 in lm  # ceil(128256 / 132), as is and in whole 16-row boxes: one wave
    qkv = space.by_name["tiles.attn_norm_qkv_rope"].choices
    assert {24, 32, 64} <= set(qkv) and all(t % 2 == 0 for t in qkv)  # RoPE pairs
    assert 32 in space.by_name["tiles.down_proj_residual"].choices  # one wave of down with a K-split of 2
    assert 16 in space.by_name["attn_splits"].choices  # one wave of attn_partial: 132 // 8 KV heads
    assert wave_tiles(8192, 132) == [63, 64, 32] or wave_tiles(8192, 132) == sorted({63, 64, 32})
    # the best known schedule is a point of the space
    best = Strategy(attn_splits=16, tiles={**Strategy().tiles, "attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 64,
                                           "down_proj_residual": 32, "final_norm_lm_head": 1024},
                    k_splits={"o_proj_residual": 1, "down_proj_residual": 2})
    point = space.point(best)
    assert all(v in space.by_name[k].choices for k, v in point.items())
    assert strategy_key(space.from_point(point)) == strategy_key(best)


def test_strategy_schema_prints_the_space() -> None:
    from megasynth.cli import main

    res = CliRunner().invoke(main, ["strategy-schema", "--space", "llama-1b", "--workers", "132"])
    assert res.exit_code == 0 and "tiles.final_norm_lm_head: [256, 486, 496, 512, 972, 976," in res.output
    assert len(res.output.strip().splitlines()) == len(SearchSpace(get_model("llama-1b"), 132).knobs)
    # at a batch the space is the batch's: from batch 8 o_proj's tiles are whole tile slots
    res = CliRunner().invoke(main, ["strategy-schema", "--space", "llama-1b", "--batch", "8"])
    assert res.exit_code == 0 and "tiles.o_proj_residual: [128, 256]" in res.output
    one = CliRunner().invoke(main, ["strategy-schema", "--space", "llama-1b"]).output
    assert "tiles.o_proj_residual: [8, 16," in one


def test_box_rows_is_the_interpreters() -> None:
    stream = pytest.importorskip("megasynth.kernels.gpu.stream")  # needs triton (present where the kernel is built)
    assert int(stream.BR.value) == BOX_ROWS


def test_moves_stay_in_the_space_and_every_knob_lowers_to_a_proven_schedule() -> None:
    space = SearchSpace(TINY, 8)
    rng = random.Random(3)
    st = Strategy()
    for _ in range(30):
        st = space.mutate(st, rng)
        assert all(v in space.by_name[k].choices or k.startswith("tiles.") for k, v in space.point(st).items())
    for k in space.knobs:  # the extreme choices of every knob, one at a time, prove safe
        for v in {k.choices[0], k.choices[-1]}:
            sched = lower(TINY, 8, space.with_value(Strategy(), k.name, v))
            report = verify(sched, options=Options(interleavings=5))
            assert report.accepted, (k.name, v, [f.message[:200] for f in report.findings][:1])
    ordered = space.neighbours(Strategy(), "tiles.mlp_norm_gate_up", reach=1)
    assert len(ordered) == 2 and min(ordered) < 16 < max(ordered)  # the nearest choice on each side


# -- the v10 cost model ----------------------------------------------------------------------------------------------


def _two_gate_up_tiles() -> object:
    """Two gate/up tiles of tiny on two workers; the second waits for the first."""
    doc = lower(TINY, 2).to_json()
    ins = [i for i in doc["instructions"] if i["op"] == "mlp_norm_gate_up" and i.get("layer") == 0][:2]
    doc.update(instructions=[{**ins[0], "id": 0, "waits": [], "signals": [{"counter": 0, "add": 1}]},
                             {**ins[1], "id": 1, "waits": [{"counter": 0, "value": 1}], "signals": []}],
               queues=[[0], [1]], counters=1)
    return parse_schedule(doc)


def test_v10_loader_streams_while_the_compute_warps_wait() -> None:
    sched = _two_gate_up_tiles()
    v9 = CostParams(ops={op: OpParams(eff=1.0, overhead_us=2.0) for op in CostParams().ops}, total_bw=1e3,
                    sm_peak=1e3, hop_us=0.5, wait_us=0.0)
    nbytes = 8768  # one 16-row gate/up tile of tiny: 2 x 16 x 128 bf16 weights + its x and norm weight
    e9 = estimate(sched, 64, v9)
    assert e9.end_us[0] == pytest.approx(2 + nbytes / 1e3)
    assert e9.end_us[1] == pytest.approx(e9.end_us[0] + 0.5 + 2 + nbytes / 1e3)  # streams after its wait
    e10 = estimate(sched, 64, replace(v9, ring_bytes=1e9, consume_bw=1e4))
    both = 2 * nbytes / 1e3  # both loaders stream from t = 0, sharing the bandwidth
    assert e10.end_us[0] == pytest.approx(both)
    assert e10.start_us[1] == pytest.approx(both + 0.5)
    assert e10.end_us[1] == pytest.approx(both + 0.5 + 2 + nbytes / 1e4)  # its bytes were there: overhead, consume
    # A ring smaller than the tile: the rest of the tile streams once the compute warps consume (after the wait)
    small = estimate(sched, 64, replace(v9, ring_bytes=1024.0, consume_bw=1e4))
    assert small.end_us[1] == pytest.approx(small.start_us[1] + 2 + (nbytes - 1024) / 1e3)


def test_v10_boxes_charge_what_is_loaded() -> None:
    spec = get_model("llama-1b")
    from megasynth.ir.catalogue import Geometry
    from megasynth.lowering.costmodel import moved_bytes

    geo = Geometry(spec.config, spec.max_seq_len, 1)
    assert moved_bytes(geo, "final_norm_lm_head", {"start": 0, "end": 972}, 972_000, 16) == 976_000
    assert moved_bytes(geo, "final_norm_lm_head", {"start": 0, "end": 976}, 976_000, 16) == 976_000
    # QKV pair tiles: 24 rows = 12 pairs fill 12 of a box pair's 16; 32 rows fill it
    assert moved_bytes(geo, "attn_norm_qkv_rope", {"start": 0, "end": 24}, 24_000, 16) == 32_000
    assert moved_bytes(geo, "attn_norm_qkv_rope", {"start": 0, "end": 32}, 32_000, 16) == 32_000
    assert moved_bytes(geo, "final_norm_lm_head", {"start": 0, "end": 972}, 972_000, 0) == 972_000


def test_committed_parameters_are_the_v10_step_fit_and_say_how_they_did() -> None:
    p = load_params()
    assert p.ring_bytes > 0 and p.box_rows == BOX_ROWS and p.source.startswith("fitted")
    doc = json.loads((Path(__file__).resolve().parents[2] / "megasynth" / "data" / "h200_costmodel.json").read_text())
    held = doc["fit"]["held_out"]
    # the goal is a median <= 3 % and a max <= 10 % on steps left out; the median holds, the max does not yet (the
    # naive lowering of qwen3-0.6b, read 12 % slow: docs/search.md, "What it still gets wrong"), so it is pinned
    # where it stands and may only fall
    assert held["n"] >= 3 and held["median_abs_pct_error"] <= 3 and held["max_abs_pct_error"] <= 12.5
    assert "bench/results/long/measured_steps.json" in doc["fit"]["measured"]
    stream = pytest.importorskip("megasynth.kernels.gpu.stream")
    from megasynth.kernels.gpu.stream import StreamConfig, stream_geometry

    assert p.ring_bytes == stream_geometry(get_model("llama-1b").config, StreamConfig())["ring_bytes"]
    assert stream is not None


def test_committed_parameters_read_long_contexts_and_rank_their_split_counts() -> None:
    """The six llama-1b steps the H200 ran at 32768 and 131072 positions (16-128 attention splits): each within 15 %,
    and the model orders the split counts at each length as the GPU did (fewer splits faster). Before attention's
    arithmetic overlapped its K/V stream in the model, 16 splits at 131072 read 97 % slow."""
    from megasynth.search.calibrate import file_steps, step_errors

    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "long" / "measured_steps.json"
    steps = file_steps([str(path)])
    params = load_params()
    errs = step_errors(steps, params)
    assert len(steps) == 6 and all(e is not None and abs(e) <= 15 for e in errs), errs
    by_ctx: dict[int, list[tuple[float, float]]] = {}
    for st, e in zip(steps, errs, strict=True):
        by_ctx.setdefault(st.ctx, []).append((st.ms, st.ms * (1 + e / 100)))
    for ctx, pairs in by_ctx.items():
        measured = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
        estimated = sorted(range(len(pairs)), key=lambda i: pairs[i][1])
        assert measured == estimated, (ctx, pairs)


# -- the step fit on synthetic data ------------------------------------------------------------------------------


def _synthetic_steps(n: int, secret: CostParams, noise: float, seed: int) -> list:
    from megasynth.search.calibrate import Step

    rng = random.Random(seed)
    space = SearchSpace(get_model("tiny-gqa4"), 12)
    out = []
    for k in range(n):
        st = space.random(rng) if k else Strategy()
        prog = resolve(lower(get_model("tiny-gqa4"), rng.choice([6, 12, 24]), st))
        ms = estimate(prog, 128, secret).makespan_ms * (1 + rng.uniform(-noise, noise))
        out.append(Step(f"s{k}", prog, 128, ms))
    return out


def test_step_fit_recovers_a_v10_model_on_steps_it_never_saw() -> None:
    from megasynth.search.calibrate import error_summary, fit_steps

    llama_ops = ("embed", "attn_norm_qkv_rope", "attn_partial", "attn_reduce", "o_proj_residual", "attn_reduce_o_proj",
                 "mlp_norm_gate_up", "down_proj_residual", "final_norm_lm_head")
    secret = replace(V10, ops={op: OpParams(eff=1.0, overhead_us=o) for op, o in zip(
        llama_ops, [0.5, 2.0, 3.0, 1.5, 1.2, 2.4, 2.5, 1.8, 1.0], strict=True)}, hop_us=0.9, launch_us=6.0)
    steps = _synthetic_steps(24, secret, noise=0.005, seed=1)
    fit_set, held = steps[:17], steps[17:]  # 17 to fit: one more op (the fused merge + o_proj) than before
    prior = replace(secret, ops={op: OpParams(1.0, 0.4) for op in secret.ops}, hop_us=0.2, launch_us=1.0,
                    sm_peak=6e3, consume_bw=2e4)
    before = error_summary(held, prior)
    result = fit_steps(fit_set, prior, iterations=15)
    after = error_summary(held, result.params)
    assert before["median_abs_pct_error"] > 10
    assert after["median_abs_pct_error"] <= 3 and after["max_abs_pct_error"] <= 10, after
    assert result.median_abs_pct_error is not None and result.median_abs_pct_error <= 3  # on the steps it fitted


def test_calibrate_cli_fits_measured_steps_and_reports_the_held_out(tmp_path: Path) -> None:
    from megasynth.commands.calibrate import calibrate

    secret = replace(V10, hop_us=0.9, launch_us=6.0)
    rng = random.Random(4)
    space = SearchSpace(get_model("tiny-gqa4"), 12)
    steps = []
    for k in range(9):
        st = space.random(rng) if k else Strategy()
        ms = estimate(lower(get_model("tiny-gqa4"), 12, st), 128, secret).makespan_ms
        steps.append({"name": f"s{k}", "model": "tiny-gqa4", "workers": 12, "ctx": 128, "ms": ms,
                      "strategy": st.model_dump(mode="json")})
    measured = tmp_path / "steps.json"
    measured.write_text(json.dumps({"format": "megasynth-measured-steps/1", "steps": steps}))
    prior = tmp_path / "prior.json"
    replace(secret, hop_us=0.3, launch_us=1.0).save(prior)
    out = tmp_path / "fit.json"
    res = CliRunner().invoke(calibrate, ["--prior", str(prior), "--measured", str(measured), "--holdout", "0.4",
                                         "--jobs", "1", "--iterations", "6", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "held out (not fitted): median |error|" in res.output
    doc = json.loads(out.read_text())
    assert doc["fit"]["mode"] == "steps" and doc["fit"]["held_out"]["n"] >= 1
    assert doc["fit"]["held_out"]["n"] + doc["fit"]["fitted"]["n"] == 9
    assert load_params(out).source.startswith("fitted to")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    res = CliRunner().invoke(calibrate, ["--prior", str(prior), "--measured", str(bad)])
    assert res.exit_code == 2 and "$.format" in res.output


# -- the surrogate and the descent ------------------------------------------------------------------------------------


def test_surrogate_extrapolates_the_layers_it_leaves_out() -> None:
    from megasynth.search.surrogate import extrapolated_ms

    for st in (Strategy(), Strategy(attn_splits=2, tiles={**Strategy().tiles, "mlp_norm_gate_up": 32})):
        full = estimate(lower(TINY6, 8, st), 64, V10).makespan_ms
        assert extrapolated_ms(TINY6, 8, st, V10, 64) == pytest.approx(full, rel=0.02)


def test_surrogate_workers_estimate_the_spec_they_were_given() -> None:
    """With `jobs` > 1 the estimates come from spawned processes: they must price the spec the surrogate holds (its
    batch and context length), not the named model's defaults. A batch of 4 prices higher than one sequence, so a
    worker that dropped the batch would give the batch-1 numbers."""
    from megasynth.lowering.models import with_batch
    from megasynth.search.surrogate import Surrogate, extrapolated_ms

    spec = with_batch(replace(TINY6, name="llama-1b"), 4)  # a name the registry knows, with other fields
    sts = [Strategy(), Strategy(attn_splits=2)]
    here = [extrapolated_ms(spec, 8, st, V10, 64) for st in sts]
    one = [extrapolated_ms(replace(spec, batch=1), 8, st, V10, 64) for st in sts]
    assert all(b > a for a, b in zip(one, here, strict=True))
    sur = Surrogate(spec, 8, V10, 64, jobs=2)
    try:
        assert sur.many(sts) == pytest.approx(here, rel=1e-9)
    finally:
        sur.close()


def _descent(spec: ModelSpec = TINY6, workers: int = 8, **kw):
    from megasynth.search.proposers.descent import DescentProposer

    return DescentProposer(SearchSpace(spec, workers), spec, workers, V10, 64, **kw)


def test_descent_starts_from_naive_and_stops_at_a_local_optimum_of_the_model() -> None:
    from megasynth.search.proposers.descent import FULL, MIN_GAIN

    d = _descent(first_batch=3)
    ctx = SearchContext("tiny6", 8, "cpu", None, [], None, True)
    props = d.propose(ctx, 5)
    assert len(props) == 3 and all(p.proposer == "descent" for p in props)  # stage 2 waits for its batch
    ests = [d.model(p.strategy) for p in props]
    assert ests[0] < d.model(Strategy()) and ests[1:] == sorted(ests[1:])
    opt = props[0].strategy  # the optimum first: no move improves it by MIN_GAIN
    assert "its optimum" in props[0].rationale
    assert all(d.model(s) >= d.model(opt) * (1 - MIN_GAIN) for _, s in d.moves(opt, FULL))
    centre = d.space.point(opt)
    for p in props[1:]:  # then the best other value of one knob each (a K-split moves its tile along)
        diff = [k for k, v in d.space.point(p.strategy).items() if centre[k] != v]
        assert 1 <= len(diff) <= 2 and (len(diff) == 1 or diff[0].split(".")[1] == diff[1].split(".")[1]), diff
    assert d.propose(ctx, 2) == []  # nothing measured yet: stage 3 has no centre
    assert not d.exhausted


def test_descent_reports_each_step_of_its_first_stage() -> None:
    """The first stage estimates hundreds of strategies (about a minute for llama-1b on 2 cores): the search log shows
    each descent step, so it is never silent that long."""
    lines: list[str] = []
    d = _descent(first_batch=3, progress=lines.append)
    d.propose(SearchContext("tiny6", 8, "cpu", None, [], None, True), 3)
    assert lines and all(line.startswith(f"cost-model descent: step {i + 1}, ") for i, line in enumerate(lines))
    counts = [int(line.split(", ")[1].split()[0]) for line in lines]
    assert counts == sorted(counts) and counts[-1] == len(d.model.cache)


def test_descent_climbs_from_the_best_measurement_not_the_model() -> None:
    d = _descent(first_batch=2, tolerance=0.5)
    ctx = SearchContext("tiny6", 8, "cpu", None, [], None, True)
    first = d.propose(ctx, 2)
    # The GPU disagrees with the model: the second proposal measures faster than the first.
    results = [Result(f"c000{k + 1}", p, True, 1.0 - 0.1 * k, False) for k, p in enumerate(first)]
    for r in results:
        d.observe(r)
    ctx = SearchContext("tiny6", 8, "H200", results[1], results, 2.0, False)
    nxt = d.propose(ctx, 4)
    assert nxt and all(p.parent == "c0002" and "c0002" in p.rationale for p in nxt)
    centre = d.space.point(first[1].strategy)
    for p in nxt:  # neighbours of the measured best: one knob apart (or a K-split with its tile)
        diff = {k for k, v in d.space.point(p.strategy).items() if centre[k] != v}
        assert 1 <= len(diff) <= 2
    assert len({strategy_key(p.strategy) for p in nxt}) == len(nxt)


def test_climbing_takes_each_knobs_best_move_before_any_knobs_second() -> None:
    from megasynth.search.proposers.descent import _knob_by_knob

    st = Strategy()
    ranked = [(0.90, "tiles.x=1", st), (0.91, "tiles.x=2", st), (0.92, "k_splits.y=2+tiles.y=32", st),
              (0.93, "tiles.x=3", st), (0.94, "order=critical_path", st), (0.95, "k_splits.y=4+tiles.y=64", st)]
    assert [w for _, w, _ in _knob_by_knob(ranked)] == [
        "tiles.x=1", "k_splits.y=2+tiles.y=32", "order=critical_path", "tiles.x=2", "k_splits.y=4+tiles.y=64",
        "tiles.x=3"]


def test_no_seed_search_reaches_the_model_optimum(tmp_path: Path) -> None:
    summary = run_search(_cfg(tmp_path, proposer="descent", budget=8, cost_params=V10, model="tiny", workers=8))
    run = RunDir(summary.run_dir)
    acc = run.accepted()
    assert {t["proposer"] for cid, t in acc.items() if cid != "c0000"} == {"descent"}
    assert summary.best_ms is not None and summary.best_ms < acc["c0000"]["ms"]
    # the hand-written seeds were never proposed
    assert not any(t.get("rationale", "").startswith("hand-tuned") for t in acc.values())


# -- screened candidates ----------------------------------------------------------------------------------------------


class _FakeTimer:
    device = "fake GPU"
    tolerance = 2e-2

    def check(self, schedule) -> float:
        return 0.0

    def time(self, schedule) -> dict:
        return {"ms": 0.5, "median_ms": 0.5, "estimated": False, "source": "GPU (fake GPU)"}

    def trace(self, schedule) -> None:
        return None


def test_a_screened_candidate_is_shown_as_screened_everywhere(tmp_path: Path) -> None:
    from megasynth.cli import main
    from megasynth.runs.report import load_run, render_index, render_report

    search = Search(_cfg(tmp_path, gpu=True))
    search.run.init({"model": "tiny", "gpu": "fake GPU"})
    search.evaluator.timer = _FakeTimer()
    assert search.evaluator.evaluate("c0001", Proposal(Strategy(attn_splits=2), proposer="seeds")).accepted
    search.standing.best_est = 1e-6  # every later estimate is far behind: screened
    res = search.evaluator.evaluate("c0002", Proposal(Strategy(attn_splits=4), proposer="descent"))
    assert not res.accepted and res.screened is not None
    lb = search.run.write_leaderboard()
    row = next(e for e in lb["entries"] if e["candidate"] == "c0002")
    assert row["status"] == "screened" and row["reason"] == f"screened (estimated {res.screened:.4f} ms)"
    shown = CliRunner().invoke(main, ["runs", "show", "r", "--runs-dir", str(tmp_path)])
    assert shown.exit_code == 0 and "screened (estimated" in shown.output and "rejected 0" in shown.output, \
        shown.output
    run = load_run(tmp_path / "r")
    assert (run.accepted, run.screened, run.rejected) == (1, 1, 0)
    html = render_report(run)
    assert f"screened (estimated {res.screened:.4f} ms)" in html and "1 screened / 0 rejected" in html
    assert "Rejected candidates (" not in html and "Screened candidates (1)" in html
    assert ">screened<" in render_index([run]) or "screened" in render_index([run])


# -- reliability ------------------------------------------------------------------------------------------------------


def crash_on_marker(model, workers, proposal, interleavings, seed, claim_schedule=None):
    """A worker that is killed (SIGKILL, as the OOM killer does) on the proposal whose rationale says so."""
    if "KILL ME" in proposal.rationale:
        os.kill(os.getpid(), signal.SIGKILL)
    return prepare(model, workers, proposal, interleavings, seed, claim_schedule)


def test_a_dead_worker_fails_only_its_own_proposal() -> None:
    props = [Proposal(Strategy(attn_splits=k), [], "KILL ME" if k == 2 else "fine", "test") for k in (1, 2, 3)]
    got = {}
    with Pool(2, "tiny", 4, 5, 0, target=crash_on_marker) as pool:
        for p in props:
            pool.submit(p)
        while len(pool):
            for prep in pool.finished():
                got[prep.proposal.rationale + str(prep.proposal.strategy.attn_splits)] = prep
        pool.submit(Proposal(Strategy(attn_splits=4), [], "after", "test"))  # the pool still works
        after = [prep for _ in range(3) if len(pool) for prep in pool.finished()]
        assert pool.deaths == 1
    dead = got["KILL ME2"]
    assert dead.schedule is None and "SIGKILL" in (dead.failure or "") and "fresh worker" in dead.failure
    assert all(got[k].failure is None and got[k].verdict.accepted for k in ("fine1", "fine3"))
    assert len(after) == 1 and after[0].failure is None and after[0].verdict.accepted


def test_a_search_goes_on_after_a_worker_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import megasynth.search.loop as loop

    class Crashy(Pool):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, target=crash_on_marker, **kw)

    from megasynth.search.proposers import heuristic

    seeds = list(heuristic.SEEDS)
    seeds[1] = ("KILL ME: " + seeds[1][0], seeds[1][1])
    monkeypatch.setattr(heuristic, "SEEDS", seeds)
    monkeypatch.setattr(loop, "Pool", Crashy)
    notes: list[str] = []
    summary = run_search(_cfg(tmp_path, jobs=2, budget=6, notice=notes.append))
    run = RunDir(summary.run_dir)
    dead = [r for r in run.rejected().values() if r.get("reason") == "worker_died"]
    assert len(dead) == 1 and dead[0]["rationale"].startswith("KILL ME") and "SIGKILL" in dead[0]["error"]
    assert len(run.accepted()) + len(run.rejected()) == 6 and len(run.accepted()) >= 4
    assert any("died" in n for n in notes)
    lb = run.write_leaderboard()
    assert [e["status"] for e in lb["entries"] if not e["accepted"]] == ["failed"]


def test_resume_rewrites_a_best_that_a_kill_left_behind(tmp_path: Path) -> None:
    import shutil

    first = run_search(_cfg(tmp_path, budget=5))
    run = RunDir(first.run_dir)
    fastest = min(run.accepted().items(), key=lambda kv: kv[1]["ms"])
    shutil.rmtree(first.run_dir / "best")  # killed after recording the candidate, before writing best/
    run_search(_cfg(tmp_path, budget=5, resume=True))
    timing = json.loads((first.run_dir / "best" / "timing.json").read_text())
    assert timing["candidate"] == fastest[0] and timing["ms"] == fastest[1]["ms"]
    assert json.loads((first.run_dir / "best" / "validation.json").read_text())["interleavings"] == 50


def test_a_best_recorded_by_a_process_that_died_before_writing_best_is_written_at_the_end(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """One of several processes sharing a run records a new best, then dies before it writes best/ (CI caught this in
    the SIGKILL test of tests/search/test_distributed.py): whoever ends the search last writes best/ for it."""
    from megasynth.search import evaluate, loop
    from megasynth.search.evaluate import Evaluator

    original_promote, original_catch_up = Evaluator._promote, loop.Search._catch_up_best
    state = {"dying": True, "promoted": 0, "estimates": 0}
    real_estimate = evaluate.estimate

    def falling(*args, **kwargs):  # every candidate estimated faster than the last, whatever the committed model
        state["estimates"] += 1
        return replace(real_estimate(*args, **kwargs), makespan_ms=1.0 - 0.01 * state["estimates"])

    def promote(self, cid, *args, **kwargs):  # every new best after the first is "lost" with its process
        if state["dying"] and state["promoted"] >= 1:
            return None
        state["promoted"] += 1
        return original_promote(self, cid, *args, **kwargs)

    def catch_up(self) -> None:
        if self.evaluated:  # the end of the loop (the start, before any candidate, still loses them)
            state["dying"] = False
        original_catch_up(self)

    monkeypatch.setattr(Evaluator, "_promote", promote)
    monkeypatch.setattr(loop.Search, "_catch_up_best", catch_up)
    monkeypatch.setattr(evaluate, "estimate", falling)
    summary = run_search(_cfg(tmp_path, budget=5))
    run = RunDir(summary.run_dir)
    fastest = min(run.accepted().items(), key=lambda kv: kv[1]["ms"])
    timing = json.loads((summary.run_dir / "best" / "timing.json").read_text())
    assert timing["candidate"] == fastest[0] and timing["ms"] == fastest[1]["ms"]
    assert state["promoted"] >= 2  # the first best, then the catch-up at the end


_PARALLEL = """
import sys
from pathlib import Path
from megasynth.search.config import SearchConfig
from megasynth.search.loop import run_search
run_search(SearchConfig(model="tiny", workers=8, budget=1000, runs_dir=Path(sys.argv[1]), run="killed", jobs=2,
                        interleavings=10, final_interleavings=20, ctx=64, gpu=False, progress=False,
                        proposer="evolve", notice=lambda m: None))
"""


def test_kill_9_of_a_parallel_search_then_resume_loses_no_accepted_candidate(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    import optuna

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _PARALLEL, str(tmp_path)], env=env, stderr=subprocess.DEVNULL)
    run = RunDir(tmp_path / "killed")
    deadline = time.monotonic() + 120
    while len(run.accepted()) < 5 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)  # mid-run: workers hold proposals, the main process may be writing
    proc.wait()
    before = run.accepted()
    assert len(before) >= 5, "the search did not get going"
    storage = f"sqlite:///{tmp_path / 'killed' / 'study.db'}"
    n_before = len(optuna.load_study(study_name="megasynth-killed", storage=storage).trials)
    summary = run_search(_cfg(tmp_path, run="killed", resume=True, budget=n_before + 4, jobs=2, proposer="evolve",
                              interleavings=10, final_interleavings=20))
    after = RunDir(summary.run_dir).accepted()
    assert set(before) <= set(after) and all(after[c]["ms"] == before[c]["ms"] for c in before)
    best = json.loads((summary.run_dir / "best" / "timing.json").read_text())
    assert best["ms"] == min(t["ms"] for t in after.values())
    lb = json.loads((summary.run_dir / "leaderboard.json").read_text())
    assert {e["candidate"] for e in lb["entries"] if e["accepted"]} == set(after)


def test_the_curve_keeps_the_searched_candidates_readable_under_a_slow_baseline() -> None:
    import re

    from megasynth.runs.report import Entry, curve_svg

    entries = [Entry("c0000", 1.34, False, True, "naive"), Entry("c0001", 0.892, False, True, "seeds"),
               Entry("c0002", 0.905, False, True, "descent"), Entry("c0003", 0.887, False, True, "descent")]
    svg, estimated, mixed, clipped = curve_svg(entries)
    assert clipped and not estimated and not mixed
    assert "naive 1.340 ms ↑" in svg and "descent 0.887 ms" in svg and "↑" not in svg.split("descent")[1]
    ys = {c: float(y) for y, c in re.findall(r'cy="([\d.]+)"[^>]*data-candidate="(c\d+)"', svg)}
    assert ys["c0000"] == min(ys.values())  # the baseline on the top edge
    # the searched candidates spread over the axis: a 2 % spread, not a sliver under a 50 % slower baseline
    assert ys["c0003"] - ys["c0002"] > 0.5 * (ys["c0003"] - ys["c0000"])
    full = curve_svg(entries[1:])
    assert full is not None and not full[3]  # no baseline far above: nothing on the edge


class _ModelTimer:
    """Stands in for the GPU (no CUDA here): the cost model's estimate, off by a few % per schedule, as the GPU is."""

    device = "fake GPU"
    tolerance = 2e-2

    def __init__(self, schedule, ctx: int, *args, **kwargs) -> None:
        self.ctx = ctx

    def check(self, schedule) -> float:
        return 0.0

    def time(self, schedule) -> dict:
        import hashlib

        from megasynth.runs.rundir import schedule_key

        off = int(hashlib.sha256(schedule_key(schedule).encode()).hexdigest()[:6], 16) / 0xFFFFFF - 0.5
        ms = estimate(schedule, self.ctx, V10).makespan_ms * (1 + 0.06 * off)
        return {"ms": ms, "median_ms": ms, "estimated": False, "source": "GPU (fake GPU)"}

    def trace(self, schedule) -> None:
        return None


def test_default_search_on_a_fake_gpu_times_seeds_and_descent_side_by_side(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import megasynth.search.evaluate as evaluate
    import megasynth.search.loop as loop

    monkeypatch.setattr(evaluate, "GpuTimer", _ModelTimer)
    monkeypatch.setattr(loop, "gpu_name", lambda: "fake GPU")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    summary = run_search(_cfg(tmp_path, gpu=True, jobs=2, budget=16, proposer="auto", cost_params=V10))
    run = RunDir(summary.run_dir)
    acc = run.accepted()
    assert not summary.estimated and all(not t["estimated"] for t in acc.values())
    assert len(acc) + len(run.rejected()) == 16
    who = {t["proposer"] for t in acc.values()}
    assert {"naive", "seeds", "descent"} <= who
    assert any(t["rationale"].startswith("hill climbing on the measurements") for t in acc.values())
    assert set(summary.best_by_proposer) >= {"seeds", "descent"}
    best = json.loads((summary.run_dir / "best" / "timing.json").read_text())
    assert best["ms"] == min(t["ms"] for t in acc.values()) and best["estimated"] is False


def test_a_batch_is_searched_on_the_gpu_within_what_its_interpreter_runs(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`synth search --batch 3` on a (fake) GPU: every candidate is timed, none estimated; the run and its best are
    for the batch and folds the merge into o_proj only with one attention split; a proposal that folds two splits'
    merge (which no interpreter runs at a batch) is refused when it is built, naming the instruction; a batch v10
    cannot build is held to what interpreter v9 runs, and a QK-norm model's to the forms of v10's default build."""
    import megasynth.search.evaluate as evaluate
    import megasynth.search.loop as loop
    from megasynth.ir.errors import ScheduleError
    from megasynth.ir.schedule import load_schedule
    from megasynth.lowering.models import with_batch

    monkeypatch.setattr(evaluate, "GpuTimer", _ModelTimer)
    monkeypatch.setattr(loop, "gpu_name", lambda: "fake GPU")
    summary = run_search(_cfg(tmp_path, gpu=True, budget=6, proposer="auto", cost_params=V10, sequences=3))
    run = RunDir(summary.run_dir)
    acc = run.accepted()
    assert not summary.estimated and len(acc) >= 2 and all(not t["estimated"] for t in acc.values())
    assert run.info["batch"] == 3
    best = load_schedule(summary.run_dir / "best" / "schedule.json.gz")
    assert best.model.batch == 3
    assert all(i.args["splits"] == 1 for i in best.instructions if i.op == "attn_reduce_o_proj")
    fused = Proposal(Strategy(attn_splits=2, fuse_attn_reduce=True), [], "fold the merge", "seeds")
    with pytest.raises(ScheduleError, match="only with 1 attention split"):
        evaluate.build(with_batch(get_model("tiny"), 3), 8, fused)
    with pytest.raises(ScheduleError, match="this model's batch runs on interpreter v9"):  # sizes v10 cannot take
        evaluate.build(with_batch(get_model("tiny-mha"), 3), 8, fused)
    qk = with_batch(get_model("tiny-qwen3"), 3)  # v10, the norm inside attention (its default build's form)
    assert "attn_norm_qkv_rope_sq" in {i.op for i in evaluate.build(qk, 8, evaluate.baseline_proposal()).instructions}
    with pytest.raises(ScheduleError, match="not inside QKV"):  # asked for by name: the whole-head form
        evaluate.build(qk, 8, Proposal(Strategy(qk_norm="in_qkv"), [], "norm in QKV", "seeds"))


class _HungTimer(_ModelTimer):
    """A GPU whose second timed schedule never finishes."""

    runs = 0

    def time(self, schedule) -> dict:
        from megasynth.kernels.gpu.timing import GpuHangError

        _HungTimer.runs += 1
        if _HungTimer.runs >= 2:
            raise GpuHangError("2 replays of the step has not finished after 60 s")
        return super().time(schedule)


def test_a_gpu_hang_stops_the_search_and_keeps_the_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that never finishes (the host's bounded wait gives up) ends the search with that error, since nothing
    more can run on the GPU; the candidate is kept in the run as a GPU error, and `synth search` exits 1."""
    import megasynth.search.evaluate as evaluate
    import megasynth.search.loop as loop
    from megasynth.kernels.gpu.timing import GpuHangError

    monkeypatch.setattr(evaluate, "GpuTimer", _HungTimer)
    monkeypatch.setattr(loop, "gpu_name", lambda: "fake GPU")
    _HungTimer.runs = 0
    with pytest.raises(GpuHangError):
        run_search(_cfg(tmp_path, gpu=True, budget=4, proposer="seeds", cost_params=V10))
    rejected = RunDir(tmp_path / "r").rejected()
    assert [r["reason"] for r in rejected.values()] == ["gpu_error"]
    assert "has not finished" in next(iter(rejected.values()))["error"]
    _HungTimer.runs = 0
    monkeypatch.setattr(loop, "cuda_available", lambda: True)
    from megasynth.cli import main as main_cli

    res = CliRunner().invoke(main_cli, ["search", "--model", "tiny", "--workers", "8", "--ctx", "64", "--budget", "4",
                                        "--runs-dir", str(tmp_path), "--run", "again", "--no-progress",
                                        "--interleavings", "5", "--final-interleavings", "5", "--jobs", "1",
                                        "--proposer", "seeds"])
    assert res.exit_code == 1 and "has not finished after 60 s" in res.output, res.output


def test_calibrate_check_run_alone_checks_the_model_without_fitting(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`synth calibrate --check-run RUN` with nothing to fit reports the committed model's error on the run's
    GPU-measured candidates (here a fake GPU that is the model off by up to 3 %) and writes nothing."""
    import megasynth.search.evaluate as evaluate
    import megasynth.search.loop as loop
    from megasynth.commands.calibrate import calibrate

    monkeypatch.setattr(evaluate, "GpuTimer", _ModelTimer)
    monkeypatch.setattr(loop, "gpu_name", lambda: "fake GPU")
    summary = run_search(_cfg(tmp_path, gpu=True, budget=5, proposer="seeds", cost_params=V10))
    prior = tmp_path / "prior" / "v10.json"
    prior.parent.mkdir()
    prior.write_text(json.dumps(V10.to_json()))
    res = CliRunner().invoke(calibrate, ["--check-run", str(summary.run_dir), "--prior", str(prior)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "(not fitted)" in ln)
    med = float(line.split("median |error| ")[1].split("%")[0])
    worst = float(line.split("max ")[1].split("%")[0])
    assert "over 5 measured steps" in line and 0 < med <= worst <= 3.1, line
    assert [p.name for p in prior.parent.iterdir()] == ["v10.json"] and not list(tmp_path.glob("*.json")), \
        "a check writes no parameters"
