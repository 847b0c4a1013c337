"""attn_reduce folded into o_proj (`attn_reduce_o_proj`): footprints, coverage, the CPU executor, the proofs, the
lowering knob and the interpreters that can or cannot run it.

The fused op merges the attention splits of its K range's heads itself, so a layer whose o_proj is fused throughout
has no attn_reduce and one counter hop less on its attention chain.
"""

from __future__ import annotations

import pytest

from megasynth.ir.catalogue import FUSED_OPROJ, OPS, ArgError, Geometry, check_instruction
from megasynth.ir.program import resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.kernels.cpu_executor import run_program
from megasynth.kernels.reference import decode_step, new_kv_cache
from megasynth.kernels.weights import random_weights
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS
from megasynth.lowering.strategy import SearchSpace, Strategy
from megasynth.validator.verify import Options, verify

pytestmark = pytest.mark.usefixtures("single_thread")


def _fused(**kw) -> Strategy:
    return Strategy(fuse_attn_reduce=True, attn_splits=3, **kw)


def test_footprint_reads_every_split_of_its_heads_and_reduces_x() -> None:
    spec = MODELS["tiny-gqa4"]
    c = spec.config
    geo = Geometry(c, spec.max_seq_len, 4)
    fp = OPS[FUSED_OPROJ].footprint(geo, 1, {"start": 8, "end": 24, "k_start": c.hd, "k_end": 3 * c.hd,
                                             "splits": 4})
    nh = c.num_attention_heads
    want_o = {("read", "attn_o_part", (s * nh + 1) * c.hd, (s * nh + 3) * c.hd) for s in range(4)}
    want_l = {("read", "attn_lse", s * nh + 1, s * nh + 3) for s in range(4)}
    assert set(fp) == want_o | want_l | {("reduce", "x", 8, 24)}
    assert not any(buf == "attn" for _, buf, _, _ in fp), "the fused op never touches the `attn` buffer"


def test_k_range_must_be_whole_heads() -> None:
    spec = MODELS["tiny"]
    c = spec.config
    geo = Geometry(c, spec.max_seq_len, 2)
    with pytest.raises(ArgError, match="k_start/k_end .* aligned to"):
        check_instruction(geo, FUSED_OPROJ, 0, {"start": 0, "end": 16, "k_start": 0, "k_end": c.hd // 2,
                                                "splits": 2})
    with pytest.raises(ArgError, match="args.splits"):
        check_instruction(geo, FUSED_OPROJ, 0, {"start": 0, "end": 16, "k_start": 0, "k_end": c.hd, "splits": 0})


@pytest.mark.parametrize(("model", "workers", "k_split", "granularity"),
                         [("tiny", 6, 1, "all"), ("tiny-gqa4", 5, 2, "head"), ("tiny-mha", 4, 4, "tile")])
def test_fused_lowering_matches_the_reference(model: str, workers: int, k_split: int, granularity: str) -> None:
    """The fused lowering has no attn_reduce, and the CPU executor running it reproduces the reference decode step
    over several positions and interleavings (the workspace starts as NaN: an unmerged head poisons the logits)."""
    spec = MODELS[model]
    cfg = spec.config
    sched = lower(spec, workers, _fused(k_splits={"o_proj_residual": k_split}, default_granularity=granularity))
    ops = {i.op for i in sched.instructions}
    assert FUSED_OPROJ in ops and "attn_reduce" not in ops and "o_proj_residual" not in ops
    prog = resolve(sched)
    weights = random_weights(cfg, seed=7)
    ref_k, ref_v = new_kv_cache(cfg, spec.max_seq_len)
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    for pos, token in enumerate([3, 17, 1, 9, 4]):
        want = decode_step(cfg, weights, ref_k, ref_v, token, pos)
        got = run_program(prog, weights, k, v, token, pos, seed=pos)
        assert float((got - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("granularity", ["all", "head", "tile"])
def test_fused_lowering_is_proven_and_shorter(granularity: str) -> None:
    spec = MODELS["tiny-gqa4"]
    plain = lower(spec, 9, Strategy(attn_splits=3, default_granularity=granularity))
    fused = lower(spec, 9, _fused(default_granularity=granularity))
    report = verify(fused, options=Options(interleavings=200))
    assert report.accepted, [f.to_json() for f in report.findings]
    n_reduce = sum(1 for i in plain.instructions if i.op == "attn_reduce")
    assert n_reduce > 0 and len(fused.instructions) == len(plain.instructions) - n_reduce


def test_a_plain_o_proj_without_attn_reduce_is_a_coverage_error() -> None:
    """Mixing is allowed, but a layer with a plain o_proj still needs its attn_reduce."""
    spec = MODELS["tiny"]
    doc = lower(spec, 4, _fused()).to_json()
    for ins in doc["instructions"]:
        if ins["op"] == FUSED_OPROJ and ins["layer"] == 1:
            ins["op"] = "o_proj_residual"
            del ins["args"]["splits"]
    report = verify(parse_schedule(doc), options=Options(interleavings=20))
    cov = [f.message for f in report.findings if f.category == "coverage"]
    assert any("attn_reduce layer 1" in m and "no instruction" in m for m in cov), cov


def test_a_fused_o_proj_merging_the_wrong_split_count_is_rejected() -> None:
    spec = MODELS["tiny"]
    doc = lower(spec, 4, _fused()).to_json()
    victim = next(i for i in doc["instructions"] if i["op"] == FUSED_OPROJ)
    victim["args"]["splits"] = 2
    report = verify(parse_schedule(doc), options=Options(interleavings=20))
    assert any("merges 2 splits" in f.message for f in report.findings), [f.message for f in report.findings]


def test_a_missing_wait_on_one_kv_head_is_a_race() -> None:
    """The fused op reads every split of its heads: drop its wait on one KV head's partials and the proof fails."""
    spec = MODELS["tiny-gqa4"]
    doc = lower(spec, 7, _fused(k_splits={"o_proj_residual": 4}, default_granularity="head")).to_json()
    parts = {i["id"]: i for i in doc["instructions"] if i["op"] == "attn_partial" and i["layer"] == 0}
    head0 = {s["counter"] for p in parts.values() if p["args"]["kv_head"] == 0 for s in p["signals"]}
    victims = [i for i in doc["instructions"] if i["op"] == FUSED_OPROJ and i["layer"] == 0
               and i["args"]["k_start"] == 0]
    assert victims
    for ins in victims:
        ins["waits"] = [w for w in ins["waits"] if w["counter"] not in head0]
    report = verify(parse_schedule(doc), options=Options(interleavings=200))
    races = [f for f in report.findings if f.category == "race"]
    assert races, [f.to_json() for f in report.findings]
    assert any({v["id"] for v in victims} & set(f.instructions) for f in races)


def test_the_search_space_offers_the_fusion() -> None:
    spec = MODELS["llama-1b"]
    space = SearchSpace(spec, 132)
    assert space.by_name["fuse_attn_reduce"].choices == (False, True)
    st = space.with_value(Strategy(attn_splits=16), "fuse_attn_reduce", True)
    assert st.fuse_attn_reduce and space.value(st, "fuse_attn_reduce") is True


def test_interpreter_v9_refuses_the_fused_op() -> None:
    pytest.importorskip("triton")
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu import KernelConfig, Megakernel

    spec = MODELS["tiny"]
    w = random_weights(spec.config, seed=3)
    with pytest.raises(ScheduleError, match=FUSED_OPROJ) as err:
        Megakernel(lower(spec, 1, _fused(tiles={"attn_norm_qkv_rope": 64})), w, device="cpu", config=KernelConfig())
    assert err.value.path.startswith("$.instructions[") and err.value.path.endswith(".op")
