"""The CPU executor against the reference decode step under many legal interleavings, and its deadlock reports."""

from __future__ import annotations

import pytest
import torch

from megasynth.ir.program import resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.kernels.cpu_executor import DeadlockError, ExecutorError, run_program, run_schedule
from megasynth.kernels.reference import decode_step, new_kv_cache
from megasynth.kernels.weights import random_weights
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS, get_model
from megasynth.lowering.strategy import Strategy

SEEDS = range(20)
pytestmark = pytest.mark.usefixtures("single_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = [
    ("tiny", 1, {}),
    ("tiny", 5, {"attn_splits": 3, "k_splits": {"o_proj_residual": 2, "down_proj_residual": 2}}),
    ("tiny-mha", 3, {"attn_splits": 2, "tiles": {"mlp_norm_gate_up": 32, "final_norm_lm_head": 40}}),
    ("tiny-gqa4", 7, {"attn_splits": 3, "k_splits": {"down_proj_residual": 3}}),
    ("tiny-gqa4", 16, {"tiles": {"attn_norm_qkv_rope": 96, "o_proj_residual": 64}}),
]


@pytest.mark.parametrize(("model", "workers", "knobs"), CASES)
def test_matches_reference_under_many_interleavings(model: str, workers: int, knobs: dict) -> None:
    """A few decode steps so the cache has history; at each step every seed's interleaving matches the reference."""
    spec = MODELS[model]
    cfg = spec.config
    prog = resolve(lower(spec, workers, Strategy(**knobs)))
    weights = random_weights(cfg, seed=11)
    ref_k, ref_v = new_kv_cache(cfg, spec.max_seq_len)
    tokens = torch.randint(0, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    traces: set[tuple[int, ...]] = set()
    caches = {seed: new_kv_cache(cfg, spec.max_seq_len) for seed in SEEDS}
    for pos, token in enumerate(tokens):
        want = decode_step(cfg, weights, ref_k, ref_v, token, pos)
        for seed in SEEDS:
            trace: list[int] = []
            got = run_program(prog, weights, *caches[seed], token, pos, seed=seed + 100 * pos, trace=trace)
            assert_legal(prog, trace)
            traces.add(tuple(trace))
            assert rel_err(got, want) <= 1e-5, f"pos {pos} seed {seed}: {rel_err(got, want)}"
            assert rel_err(caches[seed][0][:, :, :pos + 1], ref_k[:, :, :pos + 1]) <= 1e-6
    if workers > 1:
        assert len(traces) >= 20 * len(tokens) - 1, "seeds should give different interleavings"


def test_run_schedule_and_seeds_differ() -> None:
    spec = MODELS["tiny"]
    sched = lower(spec, 4)
    weights = random_weights(spec.config)
    orders = []
    for seed in (0, 1):
        trace: list[int] = []
        k, v = new_kv_cache(spec.config, spec.max_seq_len)
        run_schedule(sched, weights, k, v, 3, 0, seed=seed, trace=trace)
        orders.append(trace)
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1])


def _doc(spec, workers: int = 2) -> dict:
    return lower(spec, workers).to_json()


def test_deadlock_wait_above_total() -> None:
    """Raise one wait target above what its counter can ever reach."""
    spec = MODELS["tiny"]
    doc = _doc(spec)
    ins = next(i for i in doc["instructions"] if i["op"] == "attn_reduce" and i["layer"] == 1)
    counter = ins["waits"][0]["counter"]
    total = ins["waits"][0]["value"]
    ins["waits"] = [{"counter": counter, "value": total + 1}]
    k, v = new_kv_cache(spec.config, spec.max_seq_len)
    with pytest.raises(DeadlockError) as exc:
        run_schedule(parse_schedule(doc), random_weights(spec.config), k, v, 1, 0, seed=3)
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"#{ins['id']} attn_reduce L1 waits on counter {counter} (now {total}, needs {total + 1})" in msg
    stuck = {s.id for s in exc.value.stuck}
    assert ins["id"] in stuck
    assert len(exc.value.order) < len(doc["instructions"])


def test_deadlock_two_workers_wait_on_each_other() -> None:
    """Worker 0 runs a consumer of stage B before its producer of stage A; worker 1 the other way round."""
    spec = MODELS["tiny"]
    cfg = spec.config
    h = cfg.hidden_size
    doc = lower(spec, 1).to_json()
    doc["target"]["workers"] = 2
    # Keep only embed (counter 0): two instructions, each waiting on the other's signal on counters 1 and 2.
    doc["counters"] = 3
    doc["instructions"] = [
        {"id": 0, "op": "embed", "args": {"start": 0, "end": h // 2}, "waits": [{"counter": 2, "value": 1}],
         "signals": [{"counter": 1, "add": 1}]},
        {"id": 1, "op": "embed", "args": {"start": h // 2, "end": h}, "waits": [{"counter": 1, "value": 1}],
         "signals": [{"counter": 2, "add": 1}]},
    ]
    doc["queues"] = [[0], [1]]
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    with pytest.raises(DeadlockError) as exc:
        run_schedule(parse_schedule(doc), random_weights(cfg), k, v, 1, 0)
    msg = str(exc.value)
    assert msg.startswith("deadlock after 0 of 2 instructions: ")
    assert "worker 0: #0 embed waits on counter 2 (now 0, needs 1)" in msg
    assert "worker 1: #1 embed waits on counter 1 (now 0, needs 1)" in msg


def test_deadlock_queue_order_inverted() -> None:
    """One worker holding a consumer ahead of its own producer stalls after the others finish what they can."""
    spec = MODELS["tiny"]
    doc = _doc(spec, workers=1)
    doc["queues"] = [list(reversed(doc["queues"][0]))]
    k, v = new_kv_cache(spec.config, spec.max_seq_len)
    with pytest.raises(DeadlockError, match=r"deadlock after 0 of \d+ instructions: worker 0: #\d+ "
                                            r"final_norm_lm_head waits on counter"):
        run_schedule(parse_schedule(doc), random_weights(spec.config), k, v, 1, 0)


def test_bad_inputs() -> None:
    spec = MODELS["tiny"]
    sched = lower(spec, 2)
    w = random_weights(spec.config)
    k, v = new_kv_cache(spec.config, spec.max_seq_len)
    with pytest.raises(ExecutorError, match="pos 64 outside"):
        run_schedule(sched, w, k, v, 1, spec.max_seq_len)
    with pytest.raises(ExecutorError, match="token 999 outside"):
        run_schedule(sched, w, k, v, 999, 0)
    k2, v2 = new_kv_cache(spec.config, spec.max_seq_len + 1)
    with pytest.raises(ExecutorError, match="k_cache has shape"):
        run_schedule(sched, w, k2, v2, 1, 0)
    with pytest.raises(ExecutorError, match="stopped after max_steps=5"):
        run_schedule(sched, w, k, v, 1, 0, max_steps=5)


def test_unwritten_reads_poison_the_logits() -> None:
    """Dropping a producer (a coverage hole) leaves NaN in the workspace, which reaches the logits."""
    spec = MODELS["tiny"]
    doc = _doc(spec, workers=1)
    victim = next(i for i in doc["instructions"] if i["op"] == "attn_reduce" and i["layer"] == 0)
    doc["instructions"] = [i for i in doc["instructions"] if i["id"] != victim["id"]]
    doc["queues"] = [[x for x in q if x != victim["id"]] for q in doc["queues"]]
    for ins in doc["instructions"]:  # the waits on its stage now expect one signal fewer
        for wt in ins.get("waits", []):
            if wt["counter"] == victim["signals"][0]["counter"]:
                wt["value"] -= 1
    k, v = new_kv_cache(spec.config, spec.max_seq_len)
    logits = run_schedule(parse_schedule(doc), random_weights(spec.config), k, v, 1, 0)
    assert torch.isnan(logits).all()


def assert_legal(prog, trace: list[int]) -> None:
    """An independent check that a trace is a legal execution: queue order per worker, every wait met when it ran."""
    counters = [0] * prog.counters
    head = [0] * len(prog.queues)
    for ident in trace:
        i = prog.index[ident]
        w = prog.worker[i]
        assert prog.queues[w][head[w]] == i, f"#{ident} ran out of its queue's order"
        head[w] += 1
        for c, v in prog.waits[i]:
            assert counters[c] >= v, f"#{ident} ran with counter {c} = {counters[c]} < {v}"
        for c, add in prog.signals[i]:
            counters[c] += add
    assert head == [len(q) for q in prog.queues]


def _enum_knobs() -> dict[str, list[str]]:
    """The strategy's string-enum knobs (granularity, assignment, order, ... as far as this checkout has them)."""
    schema = Strategy.model_json_schema()
    defs = schema.get("$defs", {})
    out = {}
    for name, prop in schema["properties"].items():
        prop = defs.get(prop.get("$ref", "").split("/")[-1], prop)
        if isinstance(prop.get("enum"), list) and all(isinstance(v, str) for v in prop["enum"]):
            out[name] = prop["enum"]
    return out


def _strategies():
    from hypothesis import strategies as st

    tiles = st.fixed_dictionaries({}, optional={op: st.integers(1, 300) for op in (
        "embed", "attn_norm_qkv_rope", "o_proj_residual", "mlp_norm_gate_up", "down_proj_residual",
        "final_norm_lm_head")})
    ksplits = st.fixed_dictionaries({}, optional={op: st.integers(1, 4)
                                                  for op in ("o_proj_residual", "down_proj_residual")})
    enums = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in _enum_knobs().items()})
    return st.tuples(st.sampled_from(["tiny", "tiny-mha", "tiny-gqa4"]), st.integers(1, 24),
                     st.builds(lambda t, k, a, e: {"tiles": t, "k_splits": k, "attn_splits": a, **e},
                               tiles, ksplits, st.integers(1, 5), enums))


def test_random_strategies_match_reference() -> None:
    """Differential test over the strategy space: any lowering, any interleaving, the reference's logits."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_strategies())
    def check(case: tuple[str, int, dict]) -> None:
        model, workers, knobs = case
        spec = MODELS[model]
        cfg = spec.config
        prog = resolve(lower(spec, workers, Strategy(**knobs)))
        weights = random_weights(cfg, seed=2)
        ref = new_kv_cache(cfg, spec.max_seq_len)
        caches = {seed: new_kv_cache(cfg, spec.max_seq_len) for seed in range(3)}
        for pos, token in enumerate([5, 17, 2, 9]):
            want = decode_step(cfg, weights, *ref, token, pos)
            for seed, (k, v) in caches.items():
                trace: list[int] = []
                got = run_program(prog, weights, k, v, token, pos, seed=seed * 7 + pos, trace=trace)
                assert_legal(prog, trace)
                assert rel_err(got, want) <= 1e-5, f"{case} pos {pos} seed {seed}: {rel_err(got, want)}"

    check()


def test_matches_reference_beyond_4096() -> None:
    """A schedule lowered for 8192 positions on the tiny config (no published limit) at positions 5000 and 8191: a
    random history in the cache, every split of the attention reading past 4096, the new K/V written there."""
    spec = get_model("tiny", 8192)
    cfg = spec.config
    prog = resolve(lower(spec, 5, Strategy(attn_splits=3)))
    assert prog.geometry.max_seq_len == 8192
    weights = random_weights(cfg, seed=3)
    gen = torch.Generator().manual_seed(5)
    for pos in (5000, 8191):
        ref_k, ref_v = new_kv_cache(cfg, spec.max_seq_len)
        ref_k[:, :, :pos] = torch.randn(ref_k[:, :, :pos].shape, generator=gen)
        ref_v[:, :, :pos] = torch.randn(ref_v[:, :, :pos].shape, generator=gen)
        k, v = ref_k.clone(), ref_v.clone()
        want = decode_step(cfg, weights, ref_k, ref_v, 7, pos)
        got = run_program(prog, weights, k, v, 7, pos, seed=pos)
        assert rel_err(got, want) <= 1e-5, f"pos {pos}: {rel_err(got, want)}"
        assert rel_err(k[:, :, pos], ref_k[:, :, pos]) <= 1e-6 and float(ref_k[:, :, pos].abs().sum()) > 0
        assert torch.equal(k[:, :, pos + 1:], ref_k[:, :, pos + 1:])
