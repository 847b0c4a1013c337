"""Batched decode on the CPU: B sequences per step, each with its own KV cache slot and its own position (ragged),
against the reference run sequence by sequence; the proofs see each sequence's attention."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from megasynth.ir.catalogue import ArgError, Geometry, check_instruction
from megasynth.ir.errors import ScheduleError
from megasynth.ir.program import resolve
from megasynth.ir.schedule import Schedule, parse_schedule
from megasynth.kernels.cpu_executor import ExecutorError, run_program
from megasynth.kernels.reference import decode_batch, decode_step, new_kv_cache
from megasynth.kernels.weights import random_weights
from megasynth.lowering.lower import lower
from megasynth.lowering.models import BatchError, ModelSpec, get_model, with_batch
from megasynth.lowering.strategy import Strategy
from megasynth.search.surrogate import cut
from megasynth.validator.verify import verify
from tests.kernels.test_families import FAMILIES, MAX_SEQ, rel_err

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = [
    ("llama", 3, 4, {"attn_splits": 2, "tiles": {"attn_norm_qkv_rope": 10}}),
    ("qwen3", 2, 5, {"attn_splits": 3, "fuse_attn_reduce": True, "default_granularity": "head",
                     "assignment": "critical_path"}),
    ("qwen2", 4, 3, {"qk_norm": "apart", "k_splits": {"down_proj_residual": 2}}),
    ("qwen3", 3, 4, {"qk_norm": "apart", "tiles": {"attn_norm_qkv_rope": 12}, "attn_splits": 2}),
    ("qwen3", 2, 4, {"qk_norm": "in_attention", "tiles": {"attn_norm_qkv_rope": 12}, "attn_splits": 3}),
    # sizes interpreter v10 runs a batch of: its QKV tiles stay RoPE pairs (5 pairs, across heads' halves)
    ("tiny", 3, 5, {"attn_splits": 2, "tiles": {"attn_norm_qkv_rope": 10}}),
    # a v10 batch's fold: one split, o_proj merging it (for_batch's schedule where one split is left)
    ("tiny", 4, 6, {"attn_splits": 1, "fuse_attn_reduce": True, "tiles": {"attn_norm_qkv_rope": 10}}),
]


def _spec(family: str, batch: int) -> ModelSpec:
    if family not in FAMILIES:
        return with_batch(replace(get_model(family), max_seq_len=MAX_SEQ), batch)
    return ModelSpec(family, family, FAMILIES[family], MAX_SEQ, batch=batch)


@pytest.mark.parametrize(("family", "batch", "workers", "knobs"), CASES)
def test_batched_schedule_matches_the_reference_at_ragged_positions(family: str, batch: int, workers: int,
                                                                    knobs: dict) -> None:
    spec = _spec(family, batch)
    cfg = spec.config
    schedule = lower(spec, workers, Strategy(**knobs))
    assert schedule.model is not None and schedule.model.batch == batch
    qkv = {i.args["end"] - i.args["start"] for i in schedule.instructions if i.op.startswith("attn_norm_qkv")}
    # pair tiles only where v10 runs the batch: tiny's, and a QK-norm applied apart or inside attention (on a build
    # with qk_pairs; interpreter v9 applies it inside QKV only)
    v10 = family == "tiny" or (cfg.qk_norm and knobs.get("qk_norm", "in_qkv") != "in_qkv")
    assert v10 == any(rows % cfg.hd for rows in qkv)
    assert verify(schedule).accepted
    prog = resolve(schedule)
    weights = random_weights(cfg, seed=3)
    ref_k, ref_v = new_kv_cache(cfg, MAX_SEQ, batch=batch)
    gen = torch.Generator().manual_seed(11)
    starts = [3 * b for b in range(batch)]  # sequence b already holds 3b tokens: every step is ragged
    for b, n in enumerate(starts):
        for p in range(n):
            decode_step(cfg, weights, ref_k[:, b], ref_v[:, b], int(torch.randint(cfg.vocab_size, (1,), generator=gen)),
                        p)
    caches = {seed: (ref_k.clone(), ref_v.clone()) for seed in range(3)}
    for step in range(4):
        tokens = torch.randint(cfg.vocab_size, (batch,), generator=gen).tolist()
        positions = [n + step for n in starts]
        want = decode_batch(cfg, weights, ref_k, ref_v, tokens, positions)
        for seed, (k, v) in caches.items():
            got = run_program(prog, weights, k, v, tokens, positions, seed=seed + 7 * step)
            assert got.shape == want.shape
            for b in range(batch):
                assert rel_err(got[b], want[b]) <= 1e-5, (step, seed, b, rel_err(got[b], want[b]))
            assert rel_err(k, ref_k) <= 1e-6 and rel_err(v, ref_v) <= 1e-6
    assert rel_err(want[0], want[-1]) > 0.1  # the sequences differ


def test_batch_one_keeps_its_schedule() -> None:
    """A batch of one is the schedule it always was: no `batch` in the model, no `seq` in any instruction."""
    spec = _spec("llama", 1)
    doc = lower(spec, 3, Strategy(attn_splits=2)).to_json()
    assert "batch" not in doc["model"] and all("seq" not in ins["args"] for ins in doc["instructions"])
    doc3 = lower(replace(spec, batch=3), 3, Strategy(attn_splits=2)).to_json()
    assert doc3["model"]["batch"] == 3
    assert all(doc3["buffers"][name] == 3 * doc["buffers"][name] for name in ("x", "k_cache", "attn_o_part"))
    parts = [ins for ins in doc3["instructions"] if ins["op"] == "attn_partial"]
    assert sorted({ins["args"]["seq"] for ins in parts}) == [0, 1, 2]
    assert len(parts) == 3 * len([ins for ins in doc["instructions"] if ins["op"] == "attn_partial"])
    mat = [ins for ins in doc3["instructions"] if ins["op"] == "mlp_norm_gate_up"]  # weights once for the batch
    assert len(mat) == len([ins for ins in doc["instructions"] if ins["op"] == "mlp_norm_gate_up"])


def test_one_sequences_dropped_wait_is_a_race_and_its_missing_attention_a_gap() -> None:
    doc = lower(_spec("llama", 3), 24, Strategy(attn_splits=2)).to_json()
    by_id = {ins["id"]: ins for ins in doc["instructions"]}

    def covered_by_program_order(ins: dict) -> bool:  # an earlier instruction of its queue waits the same
        queue = next(q for q in doc["queues"] if ins["id"] in q)
        before = queue[:queue.index(ins["id"])]
        return any(w in by_id[j]["waits"] for j in before for w in ins["waits"])

    target = next(ins for ins in doc["instructions"] if ins["op"] == "attn_partial" and ins["layer"] == 1
                  and ins["args"]["seq"] == 2 and not covered_by_program_order(ins))
    racy = {**doc, "instructions": [{**ins, "waits": []} if ins["id"] == target["id"] else ins
                                    for ins in doc["instructions"]]}
    report = verify(parse_schedule(racy))
    assert not report.accepted
    assert any(f.category == "race" and target["id"] in f.instructions for f in report.findings)

    missing = {**doc, "instructions": [ins for ins in doc["instructions"] if ins["id"] != target["id"]],
               "queues": [[i for i in q if i != target["id"]] for q in doc["queues"]]}
    report = verify(parse_schedule(missing))
    assert any(f.category == "coverage" and f"attn_partial layer 1 kv_head {target['args']['kv_head']} seq 2"
               in f.message for f in report.findings), [f.message for f in report.findings][:3]


def test_bad_batch_inputs_are_named() -> None:
    cfg = FAMILIES["llama"]
    prog = resolve(lower(_spec("llama", 2), 2, Strategy()))
    weights = random_weights(cfg, seed=1)
    k, v = new_kv_cache(cfg, MAX_SEQ, batch=2)
    with pytest.raises(ExecutorError, match="decodes 2 sequence"):
        run_program(prog, weights, k, v, [1, 2, 3], [0, 0, 0])
    with pytest.raises(ExecutorError, match="sequence 1: pos 16 outside"):
        run_program(prog, weights, k, v, [1, 2], [0, MAX_SEQ])
    with pytest.raises(ExecutorError, match=r"k_cache has shape"):
        run_program(prog, weights, *new_kv_cache(cfg, MAX_SEQ), [1, 2], [0, 0])
    with pytest.raises(ArgError, match="args.seq = 2 must be in"):
        check_instruction(Geometry(cfg, MAX_SEQ, 1, 2), "attn_partial", 0, {"kv_head": 0, "split": 0, "splits": 1,
                                                                           "seq": 2})
    with pytest.raises(BatchError, match="--batch 17 is out of range"):
        with_batch(get_model("tiny"), 17)


@pytest.mark.slow
def test_batch_8_llama_8b_validates_in_15_s() -> None:
    schedule = lower(with_batch(get_model("llama-8b"), 8), 132, Strategy(attn_splits=16, fuse_attn_reduce=True))
    t = time.perf_counter()
    report = verify(schedule)  # the command's defaults (1000 interleavings)
    elapsed = time.perf_counter() - t
    assert report.accepted
    assert elapsed <= 15, elapsed


def test_a_batch_lowers_and_searches_only_what_its_interpreter_runs() -> None:
    """A batch runs on interpreter v10, or on v9 where v10 cannot build it (sizes that are no multiples of 64: tiny-mha
    and the test families; `pack.default_batch_interpreter`): the lowering rounds QKV tiles to whole heads for v9 (it
    computes QKV a head at a time), a v10 batch keeps its RoPE-pair tiles as batch 1 does, a QK-norm model's too (its
    norm inside attention where the strategy says inside QKV: qwen3-8b's naive 64-row tiles are half heads); the
    search space offers a QK-norm model's batch the norm apart or inside attention on v10 only (and only whole-head
    QKV tiles on v9) and a folded merge only on v10, with one attention split (the two knobs move together), and a
    proposal that asks for what the interpreter lacks anyway (a fold of two splits; on v9 the QK-norm apart or in
    attention; on tile slots with x in fp16 an o_proj or down tile starting on an odd row) is refused when it is
    built, naming the interpreter and the instruction, not after the search picked it; v10's two QK-norm builds
    (with and without `qk_pairs`) refuse each other's forms the same way."""
    from megasynth.kernels.gpu.pack import check_runs_batched_on_v10, check_runs_on_v9, pack
    from megasynth.lowering.strategy import SearchSpace, tile_choices
    from megasynth.search.evaluate import build
    from megasynth.search.proposers.base import Proposal

    qwen = cut(with_batch(get_model("qwen3-8b"), 2), 2)  # two layers: the checks read what repeats per layer
    naive = lower(qwen, 132)  # v10: the naive 64-row QKV tiles, half heads, the norm inside attention
    check_runs_batched_on_v10(pack(naive, "v10"), qk_pairs=True)
    assert {i.args["end"] - i.args["start"] for i in naive.instructions if i.op == "attn_norm_qkv_rope_sq"} == {64}
    assert all(i.args.get("qk_norm") == 1 for i in naive.instructions if i.op == "attn_partial")
    with pytest.raises(ScheduleError, match="not inside attention"):  # the build without qk_pairs
        check_runs_batched_on_v10(pack(naive, "v10"))
    pairs = lower(cut(with_batch(get_model("llama-8b"), 2), 2), 132)  # v10's batch keeps the naive 64-row tiles
    check_runs_batched_on_v10(pack(pairs, "v10"))
    assert {i.args["end"] - i.args["start"] for i in pairs.instructions if i.op == "attn_norm_qkv_rope"} == {64}
    with pytest.raises(ScheduleError, match="whole heads"):
        check_runs_on_v9(pack(pairs, "v9"), 128, "")
    rng = random.Random(3)
    for spec, workers, whole, v9 in ((with_batch(get_model("tiny-qwen3"), 3), 8, False, False),
                                     (_spec("qwen3", 3), 4, True, True),
                                     (with_batch(get_model("tiny"), 3), 6, False, False),
                                     (with_batch(get_model("tiny-mha"), 3), 6, True, True)):
        space = SearchSpace(spec, workers)
        knob = {k.name: k for k in space.knobs}
        assert ("fuse_attn_reduce" in knob) != v9
        assert ("qk_norm" in knob) == (spec.config.qk_norm and not v9)
        if "qk_norm" in knob:  # in_qkv lowers as in_attention on v10: not a choice of its own
            assert knob["qk_norm"].choices == ("apart", "in_attention")
            assert space.value(Strategy(), "qk_norm") == "in_attention"
        if not v9:  # folding sets one split; more splits unfold
            fused = space.with_value(Strategy(attn_splits=4), "fuse_attn_reduce", True)
            assert (fused.attn_splits, fused.fuse_attn_reduce) == (1, True)
            assert not space.with_value(fused, "attn_splits", 2).fuse_attn_reduce
        qkv = tile_choices(spec, workers, "attn_norm_qkv_rope")
        assert all(t % spec.config.hd == 0 for t in qkv) == whole and all(t % 2 == 0 for t in qkv)
        for _ in range(6):  # random points and mutations of them all build for the batch's interpreter
            st = space.mutate(space.random(rng), rng, 2)
            build(spec, workers, Proposal(st, [], "random", "test"))
        bad = [(Strategy(attn_splits=2, fuse_attn_reduce=True), "attn_reduce_o_proj")]
        if v9 and spec.config.qk_norm:
            bad += [(Strategy(qk_norm="apart"), "qk_norm"), (Strategy(qk_norm="in_attention"), "qk_norm")]
        for st, where in bad:
            with pytest.raises(ScheduleError, match=where):
                build(spec, workers, Proposal(st, [], "asked for it", "llm"))
    # tile slots keep x in fp16, which o_proj and down add into two rows at a time: a tile starting on an odd row is
    # refused by name where it is built (the search never offers one there)
    l8 = cut(with_batch(get_model("llama-1b"), 8), 2)
    odd = Strategy(tiles={"down_proj_residual": 63, "o_proj_residual": 128}, k_splits={"down_proj_residual": 2})
    with pytest.raises(ScheduleError, match=r"\$\.instructions\[\d+\]\.args: .*fp16.*odd"):
        build(l8, 132, Proposal(odd, [], "asked for it", "llm"))
    check_runs_batched_on_v10(pack(lower(l8, 132, odd), "v10"))  # fine where x is fp32
    assert all(t % 2 == 0 for t in tile_choices(l8, 132, "down_proj_residual"))
    # v10's QK-norm builds: with qk_pairs (the default) the norm apart or inside attention, without it inside QKV
    # (where the strategy asks for it by name; 'auto' is inside attention on v10)
    qk3 = with_batch(get_model("tiny-qwen3"), 3)
    in_qkv = pack(lower(qk3, 8, Strategy(qk_norm="in_qkv")), "v10")  # QKV that normalises whole heads
    check_runs_batched_on_v10(in_qkv)
    with pytest.raises(ScheduleError, match=r"\$\.instructions\[\d+\]\.op: .*qk_pairs.*not inside QKV"):
        check_runs_batched_on_v10(in_qkv, qk_pairs=True)
    for mode, what in (("apart", r"\$\.instructions\[\d+\]\.op: .*not apart"),
                       ("in_attention", r"\$\.instructions\[\d+\]\.args: .*not inside attention")):
        sched = lower(qk3, 8, Strategy(qk_norm=mode, tiles={"attn_norm_qkv_rope": 24}))
        with pytest.raises(ScheduleError, match=what):
            check_runs_batched_on_v10(pack(sched, "v10"))
        check_runs_batched_on_v10(pack(sched, "v10"), qk_pairs=True)
        assert {i.args["end"] - i.args["start"] for i in sched.instructions if i.op == "attn_norm_qkv_rope_sq"
                } - {qk3.config.qkv_size % 24} == {24}


def test_a_batch_1_strategy_is_adapted_to_the_batch_as_measured() -> None:
    """`for_batch` turns llama-1b's reference strategy into the batch-8 schedule the published batch rows ran (o_proj
    and down 128 rows at a time with K split as much finer, so as many instructions; QKV 64 rows, 32 at batch 16 (as
    many RoPE pairs as the build's K-packed QKV boxes hold); gate/up whole 64-row halves; attention split batch times
    less; the merge folded into o_proj only where one split is left: at batch 16, and at batch 8, where the two splits
    of 64-dim heads become one, but not llama-8b's 128-dim heads), the embedding `EMBED_TILE_COLUMNS` columns an
    instruction from batch 8, keeps batch 1 as it is, gives a QK-norm model's v10 batch the pair tiles and fold of
    any v10 batch with the norm inside attention where the strategy says inside QKV (a v9 batch whole-head QKV tiles
    with the norm inside QKV and no fold), and never exceeds an op's rows (tiny)."""
    from megasynth.kernels.gpu.pack import check_runs_batched_on_v10, check_runs_on_v9, pack
    from megasynth.lowering.strategy import EMBED_TILE_COLUMNS, TILE_FILL, for_batch

    ref = Strategy(tiles={"attn_norm_qkv_rope": 32, "o_proj_residual": 64, "mlp_norm_gate_up": 64,
                          "down_proj_residual": 64, "final_norm_lm_head": 256},
                   k_splits={"o_proj_residual": 4, "down_proj_residual": 4}, attn_splits=16, fuse_attn_reduce=True,
                   assignment="critical_path")
    llama = get_model("llama-1b")

    def lowered(spec: ModelSpec, strategy: Strategy) -> Schedule:  # two layers: what the checks read repeats per layer
        return lower(cut(spec, 2), 132, strategy)

    assert for_batch(ref, llama) == ref
    b8 = for_batch(ref, with_batch(llama, 8))
    assert b8.tiles["o_proj_residual"] == b8.tiles["down_proj_residual"] == 128
    assert b8.k_splits == {"o_proj_residual": 8, "down_proj_residual": 8}
    # QKV tiles of 16 pairs: the K-packed 16-row QKV boxes of 64-dim heads
    assert (b8.tiles["attn_norm_qkv_rope"], b8.tiles["mlp_norm_gate_up"], b8.tiles["final_norm_lm_head"]) == (32, 64,
                                                                                                             256)
    assert (b8.attn_splits, b8.fuse_attn_reduce, b8.assignment) == (1, True, "critical_path")
    assert b8.tiles["embed"] == EMBED_TILE_COLUMNS  # 8 embed instructions on llama-1b
    check_runs_batched_on_v10(pack(lowered(with_batch(llama, 8), b8), "v10"))
    big = for_batch(ref, with_batch(get_model("llama-8b"), 8))
    assert (big.attn_splits, big.fuse_attn_reduce) == (2, False)
    for op in ("o_proj_residual", "down_proj_residual"):  # as many instructions as batch 1's
        assert (llama.config.hidden_size // b8.tiles[op] * b8.k_splits[op]
                == llama.config.hidden_size // ref.tiles[op] * ref.k_splits[op])
    b16 = for_batch(ref, with_batch(llama, 16))
    assert (b16.attn_splits, b16.fuse_attn_reduce) == (1, True)
    assert b16.tiles["attn_norm_qkv_rope"] == 32
    assert big.tiles["attn_norm_qkv_rope"] == 64  # 32 pairs of a 128-dim head, not the whole head
    check_runs_batched_on_v10(pack(lowered(with_batch(llama, 16), b16), "v10"))
    b2 = for_batch(ref, with_batch(llama, 2))  # row-pair slots below batch 8: the tiles stay
    assert b2.tiles == {**Strategy().tiles, **ref.tiles} and b2.attn_splits == 8 and not b2.fuse_attn_reduce
    assert for_batch(ref, with_batch(llama, 2), whole_heads=True).tiles["attn_norm_qkv_rope"] == llama.config.hd
    # a QK-norm model's v10 batch: the strategy's pair tiles (at least the K-packed boxes' 64 rows on tiles), the norm
    # inside attention where the strategy says inside QKV, the fold where one split is left, as any v10 batch has them
    qwen_ref = Strategy(tiles={"attn_norm_qkv_rope": 32}, fuse_attn_reduce=True, attn_splits=16)
    for batch in (2, 8, 16):
        qwen = with_batch(get_model("qwen3-8b"), batch)
        q = for_batch(qwen_ref, qwen)
        assert q.tiles["attn_norm_qkv_rope"] == (64 if batch >= 8 else 32) and q.qk_norm == "in_attention"
        assert q.fuse_attn_reduce == (q.attn_splits == 1) and q.attn_splits == max(1, 16 // batch)
        sched = lowered(qwen, q)
        check_runs_batched_on_v10(pack(sched, "v10"), qk_pairs=True, x16=batch >= 8)
        with pytest.raises(ScheduleError, match="interpreter v9"):
            check_runs_on_v9(pack(sched, "v9"), qwen.config.hd, "")
        assert for_batch(qwen_ref.model_copy(update={"qk_norm": "apart"}), qwen).qk_norm == "apart"
    v9_qwen = _spec("qwen3", 8)  # on v9 (sizes no multiples of 64): whole heads, the norm inside QKV, no fold
    q9 = for_batch(qwen_ref.model_copy(update={"qk_norm": "in_attention"}), v9_qwen)
    assert (q9.qk_norm, q9.fuse_attn_reduce, q9.tiles["attn_norm_qkv_rope"] % v9_qwen.config.hd) == ("in_qkv", False, 0)
    check_runs_on_v9(pack(lower(v9_qwen, 4, q9), "v9"), v9_qwen.config.hd, "")
    mha = with_batch(get_model("tiny-mha"), 8)  # v9: whole heads, no fold
    m8 = for_batch(Strategy(attn_splits=8, fuse_attn_reduce=True), mha)
    assert m8.attn_splits == 1 and not m8.fuse_attn_reduce and m8.tiles["attn_norm_qkv_rope"] % mha.config.hd == 0
    tiny = with_batch(get_model("tiny"), 8)
    t8 = for_batch(ref, tiny)
    assert t8.tiles["o_proj_residual"] == min(TILE_FILL["o_proj_residual"], tiny.config.hidden_size)
    check_runs_batched_on_v10(pack(lower(tiny, 6, t8), "v10"))


def test_a_tile_batch_is_offered_tiles_that_fill_its_slots_and_adapted_seeds() -> None:
    """From batch 8 (v10's [128, 64] tile slots) the search offers o_proj, down and gate/up tiles of whole slots
    (or the op's whole rows), below it and at batch 1 the batch-1 choices; the hand-written seeds come adapted to the
    batch and lower for it."""
    from megasynth.lowering.strategy import TILE_FILL, SearchSpace, tile_choices
    from megasynth.search.evaluate import build
    from megasynth.search.proposers.base import SearchContext
    from megasynth.search.proposers.heuristic import HeuristicProposer

    for name in ("llama-1b", "tiny"):
        rows = {"o_proj_residual": get_model(name).config.hidden_size,
                "mlp_norm_gate_up": get_model(name).config.intermediate_size}
        for op, fill in TILE_FILL.items():
            if op not in rows:
                continue
            at8 = tile_choices(with_batch(get_model(name), 8), 132, op)
            assert at8 and all(t % fill == 0 or t == rows[op] for t in at8), (name, op, at8)
            assert tile_choices(with_batch(get_model(name), 4), 132, op) == tile_choices(get_model(name), 132, op)
    assert 16 in tile_choices(get_model("llama-1b"), 132, "o_proj_residual")
    spec = with_batch(get_model("tiny"), 8)
    proposals = HeuristicProposer(SearchSpace(spec, 6), hill_climb=False).propose(
        SearchContext("tiny", 6, "cpu", None, [], None, True), 3)
    assert len(proposals) == 3
    for p in proposals:
        assert "adapted to batch 8" in p.rationale and p.strategy.fuse_attn_reduce == (p.strategy.attn_splits == 1)
        build(spec, 6, p)
