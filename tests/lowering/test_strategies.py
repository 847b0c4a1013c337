"""Every strategy knob lowers to a schedule the validator accepts (tiny configs), randomized strategies via
hypothesis, the strategy schema and errors, and the CPU executor reproducing the reference for a few of them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megasynth.ir.errors import ScheduleError
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import ASSIGNMENTS, GRANULARITIES, ORDERS, Strategy, parse_strategy, strategy_schema
from megasynth.validator.verify import Options, verify

FINE = {"attn_splits": 3, "k_splits": {"o_proj_residual": 2, "down_proj_residual": 4}}


def _accepted(model: str, workers: int, strategy: Strategy, interleavings: int = 20) -> None:
    sched = lower(get_model(model), workers, strategy)
    report = verify(sched, options=Options(interleavings=interleavings))
    assert report.accepted, [f.message[:300] for f in report.findings][:2]
    assert [i.id for i in sched.instructions] == list(range(len(sched.instructions)))
    assert sorted(i for q in sched.queues for i in q) == list(range(len(sched.instructions)))


def test_default_strategy_is_the_naive_baseline() -> None:
    sched = lower(get_model("tiny"), 5)
    assert sched.queues == [list(range(w, len(sched.instructions), 5)) for w in range(5)]
    # one all-join counter per stage: every instruction signals its stage's counter and waits on the previous one
    for ins in sched.instructions:
        assert len(ins.signals) <= 1 and len(ins.waits) <= 1
    _accepted("tiny", 5, Strategy())


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize("order", ORDERS)
def test_every_assignment_and_order(assignment: str, order: str) -> None:
    _accepted("tiny-gqa4", 7, Strategy(assignment=assignment, order=order, **FINE))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("model", ["tiny", "tiny-mha"])
def test_every_granularity(granularity: str, model: str) -> None:
    _accepted(model, 6, Strategy(default_granularity=granularity, assignment="critical_path", **FINE))


def test_per_edge_granularity_makes_finer_waits() -> None:
    spec = get_model("tiny-gqa4")
    coarse = lower(spec, 8, Strategy(attn_splits=2))
    fine = lower(spec, 8, Strategy(attn_splits=2, edges={"attn_norm_qkv_rope->attn_partial": "head",
                                                         "attn_partial->attn_reduce": "head"}))
    first = next(i for i in fine.instructions if i.op == "attn_partial")
    coarse_first = next(i for i in coarse.instructions if i.op == "attn_partial")
    # per KV head: the first partial waits for fewer producers than the whole QKV stage
    assert sum(w.value for w in first.waits) < sum(w.value for w in coarse_first.waits)
    assert fine.counters > coarse.counters
    _accepted("tiny-gqa4", 8, fine.meta["strategy"] and Strategy.model_validate(fine.meta["strategy"]))


def test_counter_sharing_across_layers_is_proven() -> None:
    _accepted("tiny", 7, Strategy(counter_sharing="across_layers"))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(assignment=st.sampled_from(ASSIGNMENTS), order=st.sampled_from(ORDERS),
       granularity=st.sampled_from(GRANULARITIES), splits=st.integers(1, 5), ko=st.integers(1, 4),
       kd=st.integers(1, 5), tile=st.sampled_from([8, 16, 24, 64]), qkv=st.sampled_from([32, 64, 96]),
       workers=st.integers(1, 12), edge=st.sampled_from(["head", "chunk", "tile"]), chunks=st.integers(1, 9))
def test_random_strategies_are_accepted(assignment: str, order: str, granularity: str, splits: int, ko: int, kd: int,
                                        tile: int, qkv: int, workers: int, edge: str, chunks: int) -> None:
    e = "mlp_norm_gate_up->down_proj_residual"
    strategy = Strategy(assignment=assignment, order=order, default_granularity=granularity, attn_splits=splits,
                        k_splits={"o_proj_residual": ko, "down_proj_residual": kd},
                        tiles={**Strategy().tiles, "mlp_norm_gate_up": tile, "down_proj_residual": tile,
                               "attn_norm_qkv_rope": qkv},
                        edges={e: edge}, chunks={e: chunks})
    _accepted("tiny-gqa4", workers, strategy, interleavings=10)


def test_strategy_errors_name_the_json_path(tmp_path) -> None:
    with pytest.raises(ScheduleError) as exc:
        parse_strategy({"edges": {"attn_partial->nope": "head"}})
    assert exc.value.path == "$.edges"
    with pytest.raises(ScheduleError) as exc:
        parse_strategy({"tiles": {"mlp_norm_gate_up": 0}})
    assert exc.value.path == "$.tiles.mlp_norm_gate_up"
    with pytest.raises(ScheduleError) as exc:
        parse_strategy({"assignment": "random"})
    assert exc.value.path == "$.assignment"
    from megasynth.cli import main

    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"order": 3}))
    res = CliRunner().invoke(main, ["lower", "--model", "tiny", "--strategy", str(bad), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "$.order" in res.output


def test_schema_is_published() -> None:
    from megasynth.cli import main

    schema = strategy_schema()
    assert set(schema["properties"]) >= {"tiles", "edges", "assignment", "order", "counter_sharing", "attn_splits"}
    res = CliRunner().invoke(main, ["strategy-schema"])
    assert res.exit_code == 0 and json.loads(res.output)["title"] == "megasynth strategy"
    res = CliRunner().invoke(main, ["strategy-schema", "--patches"])
    assert res.exit_code == 0 and "move" in res.output


CPU_CASES = [
    ("tiny", 5, Strategy(assignment="critical_path", order="critical_path", default_granularity="head", **FINE)),
    ("tiny-gqa4", 7, Strategy(assignment="spatial", default_granularity="chunk", **FINE)),
    ("tiny-mha", 3, Strategy(assignment="cost_balanced", default_granularity="tile", attn_splits=2)),
]


@pytest.mark.parametrize(("model", "workers", "strategy"), CPU_CASES)
def test_cpu_executor_reproduces_the_reference(model: str, workers: int, strategy: Strategy) -> None:
    torch = pytest.importorskip("torch")
    cpu = pytest.importorskip("megasynth.kernels.cpu_executor")
    from megasynth.kernels.reference import decode_step, new_kv_cache
    from megasynth.kernels.weights import random_weights

    spec = get_model(model)
    cfg = spec.config
    sched = lower(spec, workers, strategy)
    weights = random_weights(cfg, seed=5)
    ref_k, ref_v = new_kv_cache(cfg, spec.max_seq_len)
    caches = {seed: new_kv_cache(cfg, spec.max_seq_len) for seed in (0, 1, 2)}
    for pos, token in enumerate([3, 17, 5]):
        want = decode_step(cfg, weights, ref_k, ref_v, token, pos)
        for seed, (k, v) in caches.items():
            got = cpu.run_schedule(sched, weights, k, v, token, pos, seed=seed + 10 * pos)
            assert float((got - want).norm() / want.norm()) <= 1e-5
    del torch


def test_qk_norm_search_space_offers_every_placement_and_every_tile_lowers_legally() -> None:
    """On qwen3-0.6b (QK-norm, head_dim 128) the search space offers the norm inside QKV, apart and in attention, and
    QKV pair tiles. Every offered tile lowers, inside QKV, to whole q and k heads (the lowering rounds it down) and,
    apart or in attention, to the sq op with the tile as offered plus one qk_norm_apply per KV head (k_only in
    attention's case); the hand seeds and a random point of the space lower too. The validator accepts the smallest
    and largest tile each way, the seeds and the random point. The lowerings and proofs run on two of its layers
    (every layer lowers alike; the space is the whole model's): 28 layers made this test two minutes long."""
    import dataclasses
    import random

    from megasynth.ir.program import resolve
    from megasynth.lowering.strategy import SearchSpace, qk_norm_mode
    from megasynth.search.proposers.heuristic import seed_strategies

    full = get_model("qwen3-0.6b")
    space = SearchSpace(full, 132)
    spec = dataclasses.replace(full, config=dataclasses.replace(full.config, num_hidden_layers=2))
    c = spec.config
    assert SearchSpace(spec, 132).by_name["tiles.attn_norm_qkv_rope"].choices == \
        space.by_name["tiles.attn_norm_qkv_rope"].choices
    assert space.by_name["qk_norm"].choices == ("in_qkv", "apart", "in_attention")
    assert "qk_norm" not in SearchSpace(get_model("llama-1b"), 132).by_name
    choices = space.by_name["tiles.attn_norm_qkv_rope"].choices
    assert any(t % c.hd for t in choices) and c.hd in choices
    rng = random.Random(3)
    wheres = ("in_qkv", "apart", "in_attention")
    strategies = [Strategy(tiles={"attn_norm_qkv_rope": t}, qk_norm=where) for t in choices for where in wheres]
    strategies += [st for _, st in seed_strategies()[:2]]
    strategies.append(space.with_value(space.random(rng), "order", "id"))  # list scheduling of 10k: slow
    n = len(wheres)
    proven = {*range(n), *range(n * len(choices) - n, len(strategies))}
    for n, strategy in enumerate(strategies):
        sched = lower(spec, 132, strategy)
        resolve(sched)  # the catalogue's argument checks, the whole-head rule among them
        ops = {i.op for i in sched.instructions}
        if qk_norm_mode(spec, strategy.qk_norm) != "in_qkv":  # 'auto' at batch 1: inside QKV
            tile = strategy.tiles["attn_norm_qkv_rope"]
            qkv = [i.args for i in sched.instructions if i.op == "attn_norm_qkv_rope_sq"]
            assert "attn_norm_qkv_rope" not in ops and qkv[0] == {"start": 0, "end": min(tile, c.qkv_size)}
            applies = [i.args for i in sched.instructions if i.op == "qk_norm_apply"]
            assert len(applies) == c.num_hidden_layers * c.num_key_value_heads
            assert all(a.get("k_only", 0) == (strategy.qk_norm == "in_attention") for a in applies)
        else:
            qkv = [i.args for i in sched.instructions if i.op == "attn_norm_qkv_rope"]
            assert "qk_norm_apply" not in ops
            assert all(a["start"] % c.hd == 0 and a["end"] % c.hd == 0 for a in qkv), strategy
        if n in proven:
            report = verify(sched, options=Options(interleavings=2))
            assert report.accepted, (strategy, [f.message[:300] for f in report.findings][:2])


def test_long_contexts_offer_more_attention_splits() -> None:
    """From max_seq_len 16384 the search space offers 64 and 128 attention splits (attention's bytes rival the
    weights' there); at the rows' default 4096 it stops at 32, and never offers more splits than positions."""
    from megasynth.lowering.strategy import LONG_CONTEXT, SearchSpace, attn_split_choices

    assert attn_split_choices(get_model("llama-1b"), 132) == (1, 2, 4, 8, 16, 32)
    long = get_model("llama-1b", LONG_CONTEXT)
    assert attn_split_choices(long, 132)[-2:] == (64, 128)
    assert SearchSpace(long, 132).by_name["attn_splits"].choices[-1] == 128
    assert max(attn_split_choices(get_model("tiny-mha"), 132)) <= get_model("tiny-mha").max_seq_len
