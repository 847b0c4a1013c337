"""GPU correctness of the persistent Triton megakernel against the PyTorch reference (all marked `gpu`).

bf16 weights and KV cache, random weights; a random KV history is pre-filled so that positions >= 2048 are reached
without decoding 2000 tokens (the reference and the kernel then decode the same steps from the same cache). Skipped
cleanly without CUDA or Triton.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

from megasynth.ir.schedule import parse_schedule  # noqa: E402
from megasynth.lowering.lower import lower  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.lowering.strategy import Strategy  # noqa: E402

TOL = 2e-2  # relative L2 error of the logits
#: ... where a batch's weight products take bf16 activations (interpreter v10's default at a batch, as the bf16
#: PyTorch step does; that step is at 2.5-2.9e-2 against the fp32 reference on llama-1b)
TOL_BF16 = 5e-2
MARGIN = 0.05  # the greedy token must match where the reference's top-2 margin exceeds this


def _weights(cfg, seed: int):
    """megasynth.kernels.weights.random_weights drawn on the GPU (llama-1b in a second), bf16."""
    from megasynth.kernels.weights import random_weights

    return random_weights(cfg, seed=seed, dtype=torch.bfloat16, device="cuda", draw_on="cuda")


def _variant(spec, workers: int, strategy: Strategy, seed: int):
    """A lowering with the worker assignment reversed and the counter ids permuted (plus unused counters)."""
    doc = lower(spec, workers, strategy).to_json()
    doc["queues"] = list(reversed(doc["queues"]))
    n = doc["counters"]
    perm = list(range(n))
    random.Random(seed).shuffle(perm)
    doc["counters"] = n + 5
    for ins in doc["instructions"]:
        for w in ins.get("waits", []):
            w["counter"] = perm[w["counter"]] + 5
        for s in ins.get("signals", []):
            s["counter"] = perm[s["counter"]] + 5
    return parse_schedule(doc)


def _decode_and_compare(spec, schedule, weights, positions, history, mk=None, config=None):
    from megasynth.kernels.gpu import Megakernel
    from megasynth.kernels.reference import decode_step

    cfg = spec.config
    if mk is None:
        mk = Megakernel(schedule, weights, max_seq_len=spec.max_seq_len, config=config)
    else:
        mk.set_schedule(schedule)
    gen = torch.Generator(device="cuda").manual_seed(7)
    mk.k_cache.zero_()
    mk.v_cache.zero_()
    if history:
        mk.k_cache[:, :, :history] = torch.randn(mk.k_cache[:, :, :history].shape, generator=gen, device="cuda") * .5
        mk.v_cache[:, :, :history] = torch.randn(mk.v_cache[:, :, :history].shape, generator=gen, device="cuda")
    kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
    for pos in positions:
        token = (pos * 7919 + 11) % cfg.vocab_size
        out = mk.step(token, pos)
        ref = decode_step(cfg, weights, kref, vref, token, pos)
        assert torch.isfinite(out).all(), f"non-finite logits at pos {pos}"
        rel = float((out - ref).norm() / ref.norm())
        assert rel <= TOL, f"pos {pos}: relative L2 error {rel:.3e} > {TOL}"
        top2 = torch.topk(ref, 2).values
        if float(top2[0] - top2[1]) > MARGIN:
            assert int(out.argmax()) == int(ref.argmax()), f"pos {pos}: greedy token differs"
    assert (mk.counters() == mk.packed.expected_counters).all(), "counters did not reach their final values"
    assert float((mk.k_cache.float() - kref.float()).abs().max()) < 0.1
    return mk


@pytest.fixture(scope="module")
def llama():
    spec = get_model("llama-1b")
    return spec, _weights(spec.config, seed=0)


def test_llama_1b_naive_32_positions_past_2048(llama):
    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _decode_and_compare(spec, lower(spec, sms), w, range(2048, 2080), 2048)


def test_llama_1b_other_assignment_and_counters(llama):
    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    strat = Strategy(attn_splits=4, k_splits={"o_proj_residual": 2, "down_proj_residual": 2})
    _decode_and_compare(spec, _variant(spec, sms - 3, strat, seed=1), w, range(2500, 2516), 2500)


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa4", "tiny-mha"])
def test_tiny_configs(name):
    spec = get_model(name)
    w = _weights(spec.config, seed=2)
    hist = spec.max_seq_len // 2
    mk = _decode_and_compare(spec, lower(spec, 8), w, range(hist, hist + 6), hist)
    strat = Strategy(attn_splits=3, k_splits={"o_proj_residual": 2, "down_proj_residual": 2},
                     tiles={"attn_norm_qkv_rope": spec.config.hd, "o_proj_residual": 8, "mlp_norm_gate_up": 24,
                            "down_proj_residual": 8, "final_norm_lm_head": 40})
    _decode_and_compare(spec, _variant(spec, 5, strat, seed=3), w, range(0, 4), 0, mk=mk)
    # per-instruction counters: many waits per instruction (the interpreter's multi-wait path)
    fine = Strategy(attn_splits=2, default_granularity="tile", tiles={"o_proj_residual": 8, "down_proj_residual": 8})
    _decode_and_compare(spec, lower(spec, 6, fine), w, range(hist, hist + 3), hist, mk=mk)


def test_k_splits_off_16_bytes_are_refused_by_v10_and_run_on_v9():
    """A hand-written K split of tiny's down moved 2 columns (off the 16 bytes a TMA box starts on): v10 refuses it
    when the schedule is packed, naming an instruction (before this check it faulted with an illegal instruction);
    v9 decodes it as the reference does, and v10 decodes the split moved 8 columns."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu.runtime import kernel_config
    from tests.conftest import shift_k_splits

    spec = get_model("tiny")
    w = _weights(spec.config, seed=9)
    even = lower(spec, 6, Strategy(k_splits={"o_proj_residual": 2, "down_proj_residual": 2}))
    mk = _decode_and_compare(spec, shift_k_splits(even, "down_proj_residual", 8), w, range(3), 0)
    odd = shift_k_splits(even, "down_proj_residual", 2)
    if mk.v10:
        with pytest.raises(ScheduleError, match="multiple of 8 columns") as info:
            mk.set_schedule(odd)
        assert info.value.path.startswith("$.instructions[")
    _decode_and_compare(spec, odd, w, range(3), 0, config=kernel_config(["interpreter=v9"], cfg=spec.config))


def _compiled_count() -> int | None:
    from megasynth.kernels.gpu.stream import stream_megakernel
    from megasynth.kernels.gpu.v9 import v9_megakernel

    try:
        return sum(len(v[0]) for k in (v9_megakernel, stream_megakernel) for v in k.device_caches.values())
    except (AttributeError, TypeError, IndexError):  # another Triton version's cache layout
        return None


def test_new_schedule_needs_no_recompile():
    spec = get_model("tiny")
    w = _weights(spec.config, seed=4)
    mk = _decode_and_compare(spec, lower(spec, 4), w, range(3), 0)
    before = _compiled_count()
    _decode_and_compare(spec, _variant(spec, 7, Strategy(attn_splits=2), seed=5), w, range(3), 0, mk=mk)
    if before is not None:
        assert _compiled_count() == before, "a new schedule triggered a recompile"


def test_schedule_set_switches_by_position_without_a_recompile():
    """A set of two schedules (positions 0-15: 1 attention split on 4 workers; 16-63: 4 splits, K splits, other
    counters, on 7 workers): decoding 0..40 in one run switches members at 16 and matches the reference at every
    position; the switch compiles nothing, and going back to a short position picks the first member again."""
    from megasynth.ir.schedule_set import ScheduleSet

    spec = get_model("tiny")
    w = _weights(spec.config, seed=6)
    short = lower(spec, 4, Strategy(attn_splits=1))
    long = _variant(spec, 7, Strategy(attn_splits=4, k_splits={"o_proj_residual": 2}), seed=8)
    sset = ScheduleSet([16, spec.max_seq_len], [short, long], ["short", "long"])
    mk = _decode_and_compare(spec, sset, w, range(0, 3), 0)
    assert mk.packed is mk.members[0]
    before = _compiled_count()
    _decode_and_compare(spec, sset, w, range(0, 41), 0, mk=mk)
    assert mk.packed is mk.members[1] and mk.member_for(15) is mk.members[0]
    if before is not None:
        assert _compiled_count() == before, "switching members triggered a recompile"
    _decode_and_compare(spec, sset, w, range(5, 8), 5, mk=mk)
    assert mk.packed is mk.members[0]


def _batched_steps(mk, spec, w, batch: int, top: int, tol: float = TOL) -> None:
    """Three steps of a batch, every sequence at its own position (spread over [0, top]) with its own random history
    in its own cache slot, each matching the reference decoding it alone; the counters end where the schedule says
    and the caches change only at the written rows."""
    from megasynth.kernels.reference import decode_batch

    cfg = spec.config
    gen = torch.Generator(device="cuda").manual_seed(11)
    mk.k_cache.copy_(torch.randn(mk.k_cache.shape, generator=gen, device="cuda") * 0.5)
    mk.v_cache.copy_(torch.randn(mk.v_cache.shape, generator=gen, device="cuda"))
    for step in range(3):
        positions = [(top * (b + 1) // batch + 7 * step) % (top + 1) for b in range(batch)]
        tokens = [(p * 7919 + b * 31 + 11) % cfg.vocab_size for b, p in enumerate(positions)]
        kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
        out = mk.step(tokens, positions)
        ref = decode_batch(cfg, w, kref, vref, tokens, positions)
        assert out.shape == (batch, cfg.vocab_size) and torch.isfinite(out).all()
        for b in range(batch):
            rel = float((out[b] - ref[b]).norm() / ref[b].norm())
            assert rel <= tol, f"sequence {b} at pos {positions[b]}: relative L2 error {rel:.3e} > {tol}"
            top2 = torch.topk(ref[b], 2).values
            if float(top2[0] - top2[1]) > MARGIN * tol / TOL:
                assert int(out[b].argmax()) == int(ref[b].argmax()), f"sequence {b}: greedy token differs"
        assert (mk.counters() == mk.packed.expected_counters).all()
        assert float((mk.k_cache.float() - kref.float()).abs().max()) < 0.1 * tol / TOL


@pytest.mark.parametrize("name, batch, workers, kernel", [
    ("tiny", 3, 8, {}), ("tiny-qwen3", 3, 8, {}), ("llama-1b", 8, None, {}),
    ("llama-1b", 8, None, {"batch_rows": 64}),
    ("llama-1b", 4, None, {"batch_weight_first": True, "batch_rows": 128, "batch_tile": 16384, "maxnreg": 255})])
def test_batched_decode_on_interpreter_v9(name, batch, workers, kernel):
    """A batched schedule runs on interpreter v9 (KernelConfig): every sequence at its own position, with its own
    history in its own cache slot, matches the reference decoding it alone; each weight tile is streamed once for the
    whole batch (with the default tiles, 64-row tiles, and the weight tile as the first operand of 128-row warpgroup
    MMAs). A QK-norm model's batch is lowered with its norm inside QKV, the one form v9 runs (the default lowers the
    Hopper default's, v10's)."""
    from megasynth.kernels.gpu import KernelConfig, Megakernel
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    sms = workers or torch.cuda.get_device_properties(0).multi_processor_count
    w = _weights(spec.config, seed=9)
    sched = lower(spec, sms, Strategy(attn_splits=4, k_splits={"o_proj_residual": 2}, qk_norm="in_qkv"))
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=KernelConfig(**kernel))
    assert not mk.v10 and mk.batch == batch
    _batched_steps(mk, spec, w, batch, spec.max_seq_len - 1 if name.startswith("tiny") else 3000)


@pytest.mark.parametrize("name, batch, workers, splits, kernel, qkv", [
    ("tiny", 3, 8, 4, {}, None), ("tiny-qwen2", 3, 8, 2, {}, None), ("tiny-gqa4", 8, 16, 3, {}, None),
    ("llama-1b", 8, None, 2, {}, None), ("llama-1b", 3, None, 4, {"batch_hilo": True}, None),
    ("llama-1b", 16, None, 1, {}, None), ("llama-1b", 8, None, 2, {"act_bf16": False}, None),
    ("tiny", 3, 8, 2, {}, 10), ("tiny-gqa4", 8, 16, 2, {}, 12), ("llama-1b", 4, None, 4, {}, 32),
    ("llama-1b", 8, None, 2, {"stage_groups": 4}, 16), ("llama-1b", 8, None, 2, {"stage_groups": 1}, None),
    ("llama-1b", 8, None, 2, {}, 32), ("llama-1b", 8, None, 2, {"qkv_box_rows": 32}, None),
    ("llama-1b", 16, None, 1, {}, 32), ("llama-8b", 16, None, 1, {}, None), ("llama-8b", 8, None, 2, {}, 64),
    ("llama-8b", 8, None, 2, {"qkv_box_rows": 64}, 64), ("llama-1b", 8, None, 2, {"x_dtype": "fp32"}, None),
    ("llama-8b", 16, None, 1, {"x_dtype": "fp32"}, None), ("tiny-qwen3", 3, 8, 2, {}, None),
    ("tiny-qwen3", 8, 8, 1, {}, None), ("qwen3-0.6b", 8, None, 2, {}, None), ("qwen3-1.7b", 3, None, 4, {}, None),
    ("qwen3-8b", 16, None, 1, {}, None)])
def test_batched_decode_on_interpreter_v10(name, batch, workers, splits, kernel, qkv):
    """A batch runs on interpreter v10 by default on Hopper: one wgmma per ring slot multiplies the weight tile with
    every sequence's staged vector (bf16, or hi/lo pairs with batch_hilo), QKV tiles of whole heads or of RoPE pairs
    (on row-pair slots and on tiles), each sequence's attention streams its own history, and K spans longer than
    the staged window (tiny-qwen2's down) or starting off a 64-column box (its o_proj K split at 96) go in windows;
    act and attn are kept in bf16 (fp32 with hi/lo operands or act_bf16 off); llama-1b's batch 8 stages x in groups
    whose products start as each lands (2 by default, 4 with 32-row QKV boxes, 4 asked for) or whole (`stage_groups`
    1), llama-8b's batch 16 in its two `stage_values` groups the same way; QKV tiles K-packed in boxes of
    `pack.v10_qkv_box_rows` rows by default (llama-8b's 32 pairs in 32-row boxes, and in 64-row ones, half of each the
    next pairs' rows; llama-1b's 16 pairs, and whole heads, in 16-row boxes, and at batch 8 in 32-row boxes too); its
    batch-8 gate/up keeps 3 fills in flight (`gate_up_inflight`); x in fp16 on tile slots by default (o_proj and down
    adding row pairs into it), fp32 on row-pair slots and where `x_dtype` asks; every sequence matches the reference
    decoding it alone (QKV bias included; a QK-norm model's norm inside attention on RoPE-pair QKV tiles, the naive
    lowering's form of its batch on the default build, `StreamConfig.qk_pairs`). The fused attn_reduce_o_proj of
    several splits is refused by name, and so is the QK-norm in attention on a build without qk_pairs."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu import Megakernel
    from megasynth.kernels.gpu.pack import v10_tile_slots
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    sms = workers or torch.cuda.get_device_properties(0).multi_processor_count
    w = _weights(spec.config, seed=9)
    tiles = {"attn_norm_qkv_rope": qkv} if qkv else {}  # RoPE-pair QKV tiles (5, 6 or 16 pairs)
    sched = lower(spec, sms, Strategy(attn_splits=splits, k_splits={"o_proj_residual": 2}, tiles=tiles))
    hilo = kernel.get("batch_hilo", False)
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig(**kernel) if kernel else None)
    assert mk.v10 and mk.batch == batch and not mk.geo["QKH"]
    fp32 = hilo or not kernel.get("act_bf16", True)
    assert mk.act.dtype == mk.attn.dtype == (torch.float32 if fp32 else torch.bfloat16)
    fp16_x = v10_tile_slots(spec.config, batch) and kernel.get("x_dtype", "") != "fp32"
    assert mk.x.dtype == (torch.float16 if fp16_x else torch.float32)
    _batched_steps(mk, spec, w, batch, spec.max_seq_len - 1 if name.startswith("tiny") else 3000,
                   TOL if hilo else TOL_BF16)
    if name == "tiny":
        fused = lower(spec, sms, Strategy(attn_splits=splits, fuse_attn_reduce=True))
        with pytest.raises(ScheduleError, match="only with 1 attention split"):
            mk.set_schedule(fused)
        qk = with_batch(get_model("tiny-qwen3"), batch)
        with pytest.raises(ScheduleError, match="not inside attention"):
            Megakernel(lower(qk, sms), _weights(qk.config, seed=9), max_seq_len=qk.max_seq_len,
                       config=StreamConfig(qk_pairs=False))


@pytest.mark.parametrize("name, batch, workers, splits, mode, qkv", [
    ("tiny-qwen3", 3, 8, 2, "in_attention", 12), ("tiny-qwen3", 3, 8, 2, "apart", 12),
    ("tiny-qwen3", 8, 8, 1, "in_attention", 12), ("qwen3-0.6b", 16, None, 1, "in_attention", 64),
    ("qwen3-1.7b", 8, None, 2, "in_attention", 64), ("qwen3-1.7b", 4, None, 4, "apart", 32),
    ("qwen3-8b", 8, None, 2, "in_attention", 64), ("qwen3-8b", 16, None, 1, "apart", 64)])
def test_batched_qk_norm_on_qkv_pairs(name, batch, workers, splits, mode, qkv):
    """A QK-norm model's batch on a v10 build with `qk_pairs`: QKV tiles of RoPE pairs (K-packed on tile slots, on
    row-pair slots below batch 8) write every sequence's pairs unnormalised with their sums of squares, and the norm
    comes inside attention (q scaled as it is loaded, the row at pos from `k_new`; the k row into the cache by
    qk_norm_apply after the layer's attention) or apart (qk_norm_apply of every sequence before attention); every
    sequence matches the reference decoding it alone."""
    from megasynth.kernels.gpu import Megakernel
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    sms = workers or torch.cuda.get_device_properties(0).multi_processor_count
    w = _weights(spec.config, seed=9)
    sched = lower(spec, sms, Strategy(attn_splits=splits, fuse_attn_reduce=splits == 1, qk_norm=mode,
                                      k_splits={"o_proj_residual": 2}, tiles={"attn_norm_qkv_rope": qkv}))
    assert any(i.op == "attn_norm_qkv_rope_sq" and (i.args["end"] - i.args["start"]) % spec.config.hd
               for i in sched.instructions)
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig(qk_pairs=True))
    assert mk.v10 and mk.batch == batch and not mk.geo["QKH"]
    _batched_steps(mk, spec, w, batch, spec.max_seq_len - 1 if name.startswith("tiny") else 3000, TOL_BF16)


@pytest.mark.parametrize("name, batch, splits", [("tiny-qwen3", 3, 2), ("qwen3-0.6b", 8, 2), ("qwen3-8b", 16, 1)])
def test_a_whole_head_qk_norm_batch_runs_without_qk_pairs(name, batch, splits):
    """A QK-norm model's batch whose QKV normalises whole heads (the strategy's qk_norm in_qkv, v9's form) runs on v10
    built with `qk_pairs` off: on tile slots at every batch, each q and k head normalised in one tile half; every
    sequence matches the reference decoding it alone. The default build refuses that QKV by name."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu import Megakernel
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    sms = 8 if name.startswith("tiny") else torch.cuda.get_device_properties(0).multi_processor_count
    w = _weights(spec.config, seed=9)
    sched = lower(spec, sms, Strategy(attn_splits=splits, k_splits={"o_proj_residual": 2}, qk_norm="in_qkv"))
    assert "attn_norm_qkv_rope" in {i.op for i in sched.instructions}
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig(qk_pairs=False))
    assert mk.v10 and mk.geo["QKH"] and mk.geo["TILE"]
    _batched_steps(mk, spec, w, batch, spec.max_seq_len - 1 if name.startswith("tiny") else 3000, TOL_BF16)
    with pytest.raises(ScheduleError, match="not inside QKV"):
        Megakernel(sched, w, max_seq_len=spec.max_seq_len)


def test_fp16_residual_overflow_is_named():
    """A tile batch keeps x in fp16 (`StreamConfig.x_dtype`): where a checkpoint's residual values pass 65504 the
    logits turn non-finite, and `Megakernel.step` says so and names the fp32 build, which decodes the same weights
    to finite logits."""
    from megasynth.kernels.gpu import Megakernel, ResidualOverflow
    from megasynth.kernels.gpu.stream import StreamConfig
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model("tiny-gqa4"), 8)
    w = _weights(spec.config, seed=9)
    w["embed"] = w["embed"] * 1e6  # x past fp16's range from the first op on
    sched = lower(spec, 16, Strategy(attn_splits=2))
    tokens, positions = list(range(1, 9)), [3] * 8
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len)
    assert mk.x.dtype == torch.float16
    with pytest.raises(ResidualOverflow, match="x_dtype=fp32"):
        mk.step(tokens, positions)
    mk32 = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig(x_dtype="fp32"))
    assert torch.isfinite(mk32.step(tokens, positions)).all()


@pytest.mark.parametrize("name, batch, workers", [("tiny-gqa4", 8, 16), ("tiny", 3, 8), ("llama-1b", 8, None),
                                                   ("llama-1b", 16, None)])
def test_batched_merge_folded_into_o_proj_with_one_split(name, batch, workers):
    """With one attention split a batch folds attn_reduce into o_proj (attn_reduce_o_proj): o_proj stages each
    sequence's only partial as its attention output, on tile slots (batch 8 and 16) and row-pair slots (tiny at
    batch 3), and every sequence matches the reference decoding it alone."""
    from megasynth.kernels.gpu import Megakernel
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    sms = workers or torch.cuda.get_device_properties(0).multi_processor_count
    w = _weights(spec.config, seed=9)
    sched = lower(spec, sms, Strategy(attn_splits=1, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2}))
    assert "attn_reduce" not in {i.op for i in sched.instructions}
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len)
    assert mk.v10 and mk.batch == batch
    _batched_steps(mk, spec, w, batch, spec.max_seq_len - 1 if name.startswith("tiny") else 3000, TOL_BF16)


@pytest.mark.parametrize("name, batch, splits, rows, exp2", [
    ("llama-1b", 8, 2, True, True), ("llama-1b", 8, 3, True, False), ("llama-1b", 16, 1, True, True),
    ("qwen2.5-0.5b", 8, 2, True, True), ("llama-8b", 8, 2, True, True), ("llama-1b", 8, 2, False, True)])
def test_batched_attention_rows_and_lanes(name, batch, splits, rows, exp2):
    """A batch's attention with positions as the tensor-core products' rows (`StreamConfig.attn_rows`, the default
    where it applies: 128 positions a ring slot, 16 per warp; splits whose ranges end inside a slot and hold pos;
    qwen2.5-0.5b's 7 query heads a KV head in 8 product columns; llama-8b's 128-dim heads, K and V in two slots),
    and on the CUDA cores' position lanes, matches the reference decoding every sequence alone."""
    from megasynth.kernels.gpu import Megakernel
    from megasynth.kernels.gpu.stream import KV_ROWS, StreamConfig
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model(name), batch)
    w = _weights(spec.config, seed=9)
    sched = lower(spec, torch.cuda.get_device_properties(0).multi_processor_count,
                  Strategy(attn_splits=splits, k_splits={"o_proj_residual": 2}))
    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig(attn_rows=rows, attn_exp2=exp2))
    assert mk.v10 and (mk.geo["KV_RING"] == KV_ROWS) == rows and mk.geo["BTK"] == (128 if rows else 64)
    _batched_steps(mk, spec, w, batch, 3000, TOL_BF16)


def test_v10_is_the_default_and_v9_stays_selectable(llama):
    """Megakernel runs interpreter v10 on this GPU unless given v9's KernelConfig; both match the reference."""
    from megasynth.kernels.gpu import KernelConfig

    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mk = _decode_and_compare(spec, lower(spec, sms), w, range(1500, 1504), 1500)
    assert mk.v10
    mk9 = _decode_and_compare(spec, lower(spec, sms), w, range(1500, 1504), 1500, config=KernelConfig())
    assert not mk9.v10


@pytest.mark.parametrize("kv_ring, attn_mma, attn_exp2", [(True, True, False), (True, False, False),
                                                           (True, False, True), (False, False, False),
                                                           (False, False, True)])
def test_v10_qkv_pair_tiles_and_kv_ring(llama, kv_ring, attn_mma, attn_exp2):
    """The v10 best-schedule shape (QKV tiles of 16 RoPE pairs, down K-split 2) with and without the loader
    streaming attention's K/V history, read on the tensor cores or on the CUDA cores (softmax in base e, or in base 2
    with the flush-to-zero ex2); on a tiny config, pair tiles that straddle heads."""
    from megasynth.kernels.gpu.stream import StreamConfig

    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = {"attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 64, "down_proj_residual": 32, "final_norm_lm_head": 972}
    strat = Strategy(tiles=tiles, attn_splits=16, k_splits={"down_proj_residual": 2})
    cfg = StreamConfig(kv_ring=kv_ring, attn_mma=attn_mma, attn_exp2=attn_exp2)
    mk = _decode_and_compare(spec, lower(spec, sms, strat), w, range(3000, 3008), 3000, config=cfg)
    assert mk.geo["KV_RING"] == (2 if attn_mma else int(kv_ring))
    tiny = get_model("tiny-gqa4")
    odd = Strategy(attn_splits=3, tiles={"attn_norm_qkv_rope": 10}, default_granularity="head")
    _decode_and_compare(tiny, lower(tiny, 7, odd), _weights(tiny.config, 8), range(60, 64), 60, config=cfg)


@pytest.mark.parametrize("k_split", [1, 4])
def test_v10_attn_reduce_folded_into_o_proj(llama, k_split):
    """o_proj merging the attention splits itself (attn_reduce_o_proj), whole K and a K-split of 8 heads, per-KV-head
    waits on the partials; on a tiny config, a K range that leaves part of a staged chunk unused and 3 splits."""
    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = {"attn_norm_qkv_rope": 32, "o_proj_residual": 64, "mlp_norm_gate_up": 64, "down_proj_residual": 64}
    strat = Strategy(tiles=tiles, attn_splits=16, fuse_attn_reduce=True, k_splits={"o_proj_residual": k_split},
                     edges={"attn_partial->attn_reduce_o_proj": "head"})
    _decode_and_compare(spec, lower(spec, sms, strat), w, range(1000, 1006), 1000)
    tiny = get_model("tiny-gqa4")
    odd = Strategy(attn_splits=3, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2},
                   tiles={"o_proj_residual": 8}, default_granularity="tile")
    _decode_and_compare(tiny, lower(tiny, 7, odd), _weights(tiny.config, 8), range(60, 64), 60)


def test_v10_row_paired_k_slots(llama):
    """o_proj, down and the LM head with row-paired slots (rows r and r + 16 per slot): 48-row tiles end on a 16-row
    group with no partner, K splits of 2 and 4; on a tiny config, 8-row tiles (the second box is never filled) and a
    24-row LM head."""
    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = {"attn_norm_qkv_rope": 32, "o_proj_residual": 48, "mlp_norm_gate_up": 64, "down_proj_residual": 48,
             "final_norm_lm_head": 1008}
    strat = Strategy(tiles=tiles, attn_splits=8, k_splits={"o_proj_residual": 2, "down_proj_residual": 4})
    _decode_and_compare(spec, lower(spec, sms, strat), w, range(2000, 2004), 2000)
    tiny = get_model("tiny")
    small = Strategy(attn_splits=2, k_splits={"down_proj_residual": 2},
                     tiles={"o_proj_residual": 8, "down_proj_residual": 8, "final_norm_lm_head": 24})
    _decode_and_compare(tiny, lower(tiny, 5, small), _weights(tiny.config, 8), range(40, 44), 40)


def test_v10_tensor_core_consumer(llama):
    """StreamConfig(mma=True), wgmma on the ring's slots: the searched fused shape and a 48-row tile whose last 16-row
    group has no partner; on tiny configs, BK past the hidden size (zero-filled boxes), odd QKV pair tiles, a fused
    K split of 2 (a split of 3 puts K ranges off 16 bytes, which v10 refuses) and 8-row tiles (the second box is
    never filled); tiny-mha (intermediate 160) falls back to FMAs."""
    from megasynth.kernels.gpu.stream import StreamConfig

    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = StreamConfig(mma=True)
    tiles = {"attn_norm_qkv_rope": 32, "o_proj_residual": 64, "mlp_norm_gate_up": 64, "down_proj_residual": 48,
             "final_norm_lm_head": 1008}
    strat = Strategy(tiles=tiles, attn_splits=16, fuse_attn_reduce=True,
                     k_splits={"o_proj_residual": 4, "down_proj_residual": 4})
    mk = _decode_and_compare(spec, lower(spec, sms, strat), w, range(2500, 2504), 2500, config=cfg)
    assert mk.kcfg.mma
    gqa4 = get_model("tiny-gqa4")
    odd = Strategy(attn_splits=3, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2},
                   tiles={"attn_norm_qkv_rope": 10, "o_proj_residual": 8}, default_granularity="head")
    _decode_and_compare(gqa4, lower(gqa4, 7, odd), _weights(gqa4.config, 8), range(60, 64), 60, config=cfg)
    for name in ("tiny", "tiny-mha"):
        tiny = get_model(name)
        small = Strategy(attn_splits=2, k_splits={"down_proj_residual": 2},
                         tiles={"o_proj_residual": 8, "down_proj_residual": 8, "final_norm_lm_head": 24})
        _decode_and_compare(tiny, lower(tiny, 5, small), _weights(tiny.config, 8), range(20, 24), 20, config=cfg)


@pytest.mark.parametrize("name, mma", [("llama-1b", False), ("llama-1b", True), ("qwen3-1.7b", False)])
def test_v10_down_in_k_windows(name, mma):
    """StreamConfig.down_window: the staging buffer holds what QKV, o_proj and attention's lane merge need (16 KB
    here), so a down instruction whose K range is longer (no K split: llama-1b's 8192 columns, two whole windows of
    4096; qwen3-1.7b's 6144, a whole window and a half) is staged and multiplied one window at a time, its products
    added into x, on the CUDA cores and the tensor cores; the ring has the slot the buffer gave up."""
    from megasynth.kernels.gpu.stream import StreamConfig

    spec = get_model(name)
    w = _weights(spec.config, seed=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    strat = Strategy(tiles={"attn_norm_qkv_rope": 32, "down_proj_residual": 32}, attn_splits=16,
                     k_splits={"down_proj_residual": 1})
    mk = _decode_and_compare(spec, lower(spec, sms, strat), w, range(1500, 1503), 1500, config=StreamConfig(mma=mma))
    assert mk.geo["stage_k"] == 4096 < spec.config.intermediate_size and mk.geo["stage_bytes"] == 16384
    assert mk.geo["NS"] == 13


@pytest.mark.parametrize("kernel", ["default", "v9"])
@pytest.mark.parametrize("extra_wait", [False, True])
def test_watchdog_turns_a_hang_into_an_error(kernel, extra_wait):
    """A wait that can never hold ends the kernel with WatchdogError instead of hanging, on the default interpreter
    (v10 on Hopper: only the first warp polls and times out, and the other warps must still meet it at every later
    barrier) and on v9, for a lone wait and for an instruction with several (the vector poll)."""
    from megasynth.kernels.gpu import KernelConfig, Megakernel, WatchdogError

    spec = get_model("tiny")
    doc = lower(spec, 6).to_json()
    victim = doc["instructions"][40]
    stuck = {"counter": victim["waits"][0]["counter"], "value": 99_999}
    victim["waits"] = victim["waits"] + [stuck] if extra_wait else [stuck]
    config = KernelConfig() if kernel == "v9" else None
    mk = Megakernel(parse_schedule(doc), _weights(spec.config, 5), max_seq_len=spec.max_seq_len, timeout_s=0.3,
                    config=config)
    with pytest.raises(WatchdogError, match=r"stuck at #40 .* needs 99999"):
        mk.step(1, 2)


def test_v10_polls_one_and_several_counters(llama):
    """Interpreter v10's first-warp poll on a schedule whose instructions wait on several counters (chunk and
    per-head edges: the vector poll) and on one (all-joins)."""
    spec, w = llama
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    strat = Strategy(tiles={"attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 64}, attn_splits=8,
                     edges={"mlp_norm_gate_up->down_proj_residual": "chunk",
                            "attn_norm_qkv_rope->attn_partial": "head"})
    sched = lower(spec, sms, strat)
    assert max(len(i.waits) for i in sched.instructions) > 1
    _decode_and_compare(spec, sched, w, range(1500, 1503), 1500)


def test_trace_export():
    from megasynth.kernels.gpu import Megakernel
    from megasynth.trace import check_trace, summarize

    spec = get_model("tiny")
    sched = lower(spec, 4)
    mk = Megakernel(sched, _weights(spec.config, 6), max_seq_len=spec.max_seq_len)
    tr = mk.traced_step(3, 5, {"model": "tiny"})
    check_trace(tr)
    evs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(evs) == len(sched.instructions)
    assert {e["tid"] for e in evs} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["args"]["wait_us"] >= 0 for e in evs)
    s = summarize(tr)
    assert s["instructions"] == len(evs) and s["critical_path"]
    if mk.v10:  # the loader's side of the trace: it reaches each instruction, then issues its fills, on the same clock
        from megasynth.lowering.costmodel import LOADER_OPS

        raw, lr, ops = mk.raw_trace(), mk.raw_loader_trace(), mk.packed.ops
        assert all(0 < reach <= last for reach, last in lr.tolist())
        assert all(lr[i][1] <= raw[i][2] for i, op in enumerate(ops) if op in LOADER_OPS)  # fills before its end
        # the compute side's phases: staged (ops with a stage), then the op's end, then the signals, within its span
        ph = mk.raw_phase_trace()
        staged = {"attn_norm_qkv_rope", "mlp_norm_gate_up", "o_proj_residual", "attn_reduce_o_proj",
                  "down_proj_residual", "final_norm_lm_head"}
        assert all(raw[i][1] <= ph[i][0] <= ph[i][1] for i, op in enumerate(ops) if op in staged)
        assert all(ph[i][0] == 0 for i, op in enumerate(ops) if op not in staged)
        # (each thread reads the clock itself; no barrier between the op's end and the signals' end: 0.5 us slack)
        assert all(raw[i][1] <= ph[i][1] <= raw[i][2] + 500 for i in range(len(ops)))


def test_a_batch_trace_marks_the_end_of_attention_loop():
    """At a batch, each attention instruction's trace row records when its positions' loop ended (the phase trace's
    staged field, which `scripts/trace_ops.py` prints as attention's stage): after the instruction's start and before
    its op's end, for every sequence at its own position."""
    from megasynth.kernels.gpu import Megakernel
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model("tiny"), 3)
    sched = lower(spec, 8, Strategy(attn_splits=2))
    mk = Megakernel(sched, _weights(spec.config, seed=9), max_seq_len=spec.max_seq_len)
    assert mk.v10
    mk.traced_step([1, 2, 3], [5, 17, spec.max_seq_len - 1])
    raw, ph, ops = mk.raw_trace(), mk.raw_phase_trace(), mk.packed.ops
    attn = [i for i, op in enumerate(ops) if op == "attn_partial"]
    assert len(attn) == 3 * 2 * spec.config.num_key_value_heads * spec.config.num_hidden_layers
    assert all(raw[i][1] <= ph[i][0] <= ph[i][1] for i in attn)


def _tiny_qwen(family: str):
    """Tiny specs of the families beyond Llama (the configs of tests/kernels/test_stream_compile.py's compile checks),
    the rows `tiny-qwen3` and `tiny-qwen2`. Qwen3: QK-norm, head_dim 128 (4 groups of 16 RoPE pairs per head, as the
    real models) with hidden 256 and 4 heads, untied head. Qwen2: q/k/v bias, hidden 192 (the last K box
    zero-filled), 3 query heads per KV head, tied head."""
    from megasynth.lowering.models import get_model

    return get_model(f"tiny-{family}")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tiny_qwen_families(family):
    """QK-norm (Qwen3) and the QKV bias (Qwen2) on v10: whole-head QKV tiles; for Qwen3 tiles of 5 heads (one spans
    q and k heads, the other k and v heads), for Qwen2 10-row pair tiles that straddle heads; K splits, the fused
    attn_reduce_o_proj, per-instruction counters, the tensor-core consumer; and interpreter v9 on the same model."""
    from megasynth.kernels.gpu import KernelConfig
    from megasynth.kernels.gpu.stream import StreamConfig

    spec = _tiny_qwen(family)
    c = spec.config
    w = _weights(c, seed=9)
    hist = spec.max_seq_len // 2
    mk = _decode_and_compare(spec, lower(spec, 8), w, range(hist, hist + 6), hist)
    assert mk.v10
    qkv = 5 * c.hd if family == "qwen3" else 10
    strat = Strategy(attn_splits=3, k_splits={"o_proj_residual": 2, "down_proj_residual": 2},
                     tiles={"attn_norm_qkv_rope": qkv, "o_proj_residual": 8, "mlp_norm_gate_up": 24,
                            "down_proj_residual": 8, "final_norm_lm_head": 40})
    _decode_and_compare(spec, _variant(spec, 5, strat, seed=3), w, range(0, 4), 0, mk=mk)
    fused = Strategy(attn_splits=3, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2},
                     tiles={"attn_norm_qkv_rope": 2 * c.hd if family == "qwen3" else 32, "o_proj_residual": 16},
                     default_granularity="tile")
    _decode_and_compare(spec, lower(spec, 7, fused), w, range(hist, hist + 3), hist, mk=mk)
    mma = _decode_and_compare(spec, lower(spec, 6), w, range(hist, hist + 3), hist, config=StreamConfig(mma=True))
    assert mma.v10 and mma.kcfg.mma
    mk9 = _decode_and_compare(spec, lower(spec, 6), w, range(hist, hist + 3), hist, config=KernelConfig())
    assert not mk9.v10


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_qwen_full_size(name):
    """The published shapes on v10, random weights: Qwen3-0.6B (head_dim 128, q rows 2048 against hidden 1024, QK-norm
    over 4 groups per head), Qwen2.5-0.5B (hidden 896: a partial last K box; 7 query heads per KV head; QKV bias);
    naive, then the searched shape (16-pair QKV tiles where the family allows them, fused attn_reduce_o_proj)."""
    spec = get_model(name)
    c = spec.config
    w = _weights(c, seed=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mk = _decode_and_compare(spec, lower(spec, sms), w, range(2048, 2056), 2048)
    tiles = {"attn_norm_qkv_rope": c.hd if c.qk_norm else 32, "mlp_norm_gate_up": 64, "down_proj_residual": 32}
    strat = Strategy(tiles=tiles, attn_splits=16, fuse_attn_reduce=True, k_splits={"down_proj_residual": 2},
                     edges={"attn_partial->attn_reduce_o_proj": "head"})
    _decode_and_compare(spec, lower(spec, sms, strat), w, range(3000, 3004), 3000, mk=mk)


def _cuts_heads(schedule, hd: int) -> bool:
    """Whether some QKV tile of the QK-norm apart starts or ends inside a head."""
    return any(i.args["start"] % hd or i.args["end"] % hd for i in schedule.instructions
               if i.op == "attn_norm_qkv_rope_sq")


def test_tiny_qwen3_qk_norm_apart():
    """QK-norm applied apart from QKV on v10 (attn_norm_qkv_rope_sq, then qk_norm_apply per KV head): QKV tiles of 12
    RoPE pairs that cut q and k heads; 20-pair tiles (a 16-pair group and a 4-pair one, crossing heads) with per-head
    edges into and out of the apply, K splits, reversed workers and permuted counters, from position 0 (attention
    over the apply's k row alone); 5-pair tiles with per-instruction counters (the apply and attention wait on many
    QKV tiles) and the fused attn_reduce_o_proj; the tensor-core consumer. Interpreter v9 refuses the schedule."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu import KernelConfig, Megakernel
    from megasynth.kernels.gpu.stream import StreamConfig

    spec = _tiny_qwen("qwen3")
    c = spec.config
    w = _weights(c, seed=9)
    hist = spec.max_seq_len // 2
    cut = lower(spec, 8, Strategy(qk_norm="apart", tiles={"attn_norm_qkv_rope": 24}))
    assert _cuts_heads(cut, c.hd)
    mk = _decode_and_compare(spec, cut, w, range(hist, hist + 6), hist)
    assert mk.v10 and "qk_norm_apply" in mk.packed.ops and "attn_norm_qkv_rope" not in mk.packed.ops
    strat = Strategy(qk_norm="apart", attn_splits=3, k_splits={"o_proj_residual": 2, "down_proj_residual": 2},
                     tiles={"attn_norm_qkv_rope": 40, "o_proj_residual": 8, "mlp_norm_gate_up": 24,
                            "down_proj_residual": 8, "final_norm_lm_head": 40},
                     edges={"attn_norm_qkv_rope_sq->qk_norm_apply": "head", "qk_norm_apply->attn_partial": "head"})
    _decode_and_compare(spec, _variant(spec, 5, strat, seed=3), w, range(0, 4), 0, mk=mk)
    fine = Strategy(qk_norm="apart", attn_splits=3, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2},
                    tiles={"attn_norm_qkv_rope": 10, "o_proj_residual": 16}, default_granularity="tile")
    _decode_and_compare(spec, lower(spec, 7, fine), w, range(hist, hist + 3), hist, mk=mk)
    mma = _decode_and_compare(spec, cut, w, range(hist, hist + 3), hist, config=StreamConfig(mma=True))
    assert mma.kcfg.mma
    with pytest.raises(ScheduleError, match="'attn_norm_qkv_rope_sq' has no GPU implementation in interpreter v9"):
        Megakernel(cut, w, max_seq_len=spec.max_seq_len, config=KernelConfig())


def test_tiny_qwen3_qk_norm_in_attention():
    """QK-norm applied by attention on v10 (attn_partial qk_norm 1, then qk_norm_apply k_only after the layer's
    attention): 12-pair QKV tiles, 3 splits, from position 0 (the new row alone) and past half the cache; per-
    instruction counters with the fused attn_reduce_o_proj; attention loading its K/V itself instead of from the
    ring; the tensor-core consumer; the softmax in base 2 (attn_exp2). Each step's cache row at pos is checked too
    (`_decode_and_compare`), so the k row written after attention is the one attention used."""
    from megasynth.kernels.gpu.stream import StreamConfig

    spec = _tiny_qwen("qwen3")
    c = spec.config
    w = _weights(c, seed=9)
    hist = spec.max_seq_len // 2
    strat = Strategy(qk_norm="in_attention", attn_splits=3, tiles={"attn_norm_qkv_rope": 24})
    sched = lower(spec, 8, strat)
    assert _cuts_heads(sched, c.hd)
    mk = _decode_and_compare(spec, sched, w, range(0, 3), 0)
    _decode_and_compare(spec, sched, w, range(hist, hist + 4), hist, mk=mk)
    assert mk.v10 and "qk_norm_apply" in mk.packed.ops
    fine = Strategy(qk_norm="in_attention", attn_splits=2, fuse_attn_reduce=True, k_splits={"o_proj_residual": 2},
                    tiles={"attn_norm_qkv_rope": 10, "o_proj_residual": 16}, default_granularity="tile")
    _decode_and_compare(spec, _variant(spec, 7, fine, seed=4), w, range(hist, hist + 3), hist, mk=mk)
    _decode_and_compare(spec, sched, w, range(hist, hist + 3), hist, config=StreamConfig(kv_ring=False))
    _decode_and_compare(spec, sched, w, range(hist, hist + 3), hist, config=StreamConfig(mma=True))
    _decode_and_compare(spec, sched, w, range(0, 2), 0, config=StreamConfig(attn_exp2=True))


def test_qwen3_full_size_qk_norm_in_attention():
    """Qwen3-0.6B's published shape with the QK-norm in attention, past position 1000: the searched shape (16-pair
    QKV tiles on every SM, 16 attention splits, the fused attn_reduce_o_proj)."""
    spec = get_model("qwen3-0.6b")
    w = _weights(spec.config, seed=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    strat = Strategy(qk_norm="in_attention", tiles={"attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 64,
                                                    "down_proj_residual": 32},
                     attn_splits=16, fuse_attn_reduce=True, k_splits={"down_proj_residual": 2},
                     edges={"attn_partial->attn_reduce_o_proj": "head"})
    _decode_and_compare(spec, lower(spec, sms, strat), w, range(1500, 1506), 1500)


def test_qwen3_full_size_qk_norm_apart():
    """Qwen3-0.6B's published shape with the QK-norm apart, past position 1000: the searched shape's 16-pair QKV
    tiles (a head is 4 of them) on every SM, per-head edges from the apply into attention, 16 attention splits and
    the fused attn_reduce_o_proj."""
    spec = get_model("qwen3-0.6b")
    c = spec.config
    w = _weights(c, seed=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = {"attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 64, "down_proj_residual": 32}
    strat = Strategy(qk_norm="apart", tiles=tiles, attn_splits=16, fuse_attn_reduce=True,
                     k_splits={"down_proj_residual": 2},
                     edges={"attn_partial->attn_reduce_o_proj": "head", "qk_norm_apply->attn_partial": "head"})
    sched = lower(spec, sms, strat)
    assert _cuts_heads(sched, c.hd)
    _decode_and_compare(spec, sched, w, range(1500, 1506), 1500)


def test_bf16_unpack_is_exact_and_in_order():
    """`ptx.gl_bf16_to_f32` (the weights' and the K/V ring's widening: a shift and an AND a pair) gives each element
    its own value, bit for bit as PyTorch's conversion, signs, subnormals, infinities and NaN included: a swapped pair
    would read as a permutation of the row."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from megasynth.kernels.gpu import ptx

    @gluon.jit
    def widen(src, dst, BLOCK: gl.constexpr, PER: gl.constexpr):
        lay: gl.constexpr = gl.BlockedLayout([PER], [32], [4], [0])
        offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=lay)
        gl.store(dst + offs, ptx.gl_bf16_to_f32(gl.load(src + offs)))

    bits = torch.arange(0, 1 << 16, dtype=torch.int32, device="cuda").to(torch.int16)
    x = bits.view(torch.bfloat16)  # every bf16 bit pattern once, in order
    for per in (2, 8):
        y = torch.empty(x.numel(), dtype=torch.float32, device="cuda")
        widen[(x.numel() // 1024,)](x, y, BLOCK=1024, PER=per, num_warps=4)
        assert torch.equal(y.view(torch.int32), x.float().view(torch.int32)), f"{per} elements a thread"
