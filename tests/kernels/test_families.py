"""Qwen3 (QK-norm, head_dim != hidden/heads), Qwen2.5 (QKV bias), Llama with an explicit head_dim and Mistral: the
reference decode step against transformers (fp32, eager) from our weights, the CPU executor against the reference
under several legal interleavings and tilings, the QK-norm tiling rule, and the checkpoint round trip."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from megasynth.ir.catalogue import ArgError, Geometry, check_instruction
from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ModelConfig
from megasynth.ir.program import resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.kernels.cpu_executor import run_program
from megasynth.kernels.hf import hf_causal_lm
from megasynth.kernels.reference import decode_step, new_kv_cache
from megasynth.kernels.weights import load_hf_weights, random_weights, to_hf_state_dict, weight_shapes
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS, ModelSpec
from megasynth.lowering.strategy import Strategy, tile_choices
from megasynth.validator.verify import verify

pytestmark = pytest.mark.usefixtures("single_thread")

_SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 128}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
FAMILIES: dict[str, ModelConfig] = {
    "qwen3": ModelConfig(**_SIZES, num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, qk_norm=True),
    "qwen2": ModelConfig(**_SIZES, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, qkv_bias=True),
    "llama": ModelConfig(**_SIZES, num_key_value_heads=2, head_dim=32, rope_theta=5e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, rope_scaling=_LLAMA3),
    "mistral": ModelConfig(**_SIZES, num_key_value_heads=1, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-5,
                           tie_word_embeddings=False),
}
MAX_SEQ = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_model(family: str, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Any:
    """The transformers model of `family` (fp32, eager) with our weights loaded."""
    return hf_causal_lm(cfg, weights, family, max_position_embeddings=64)


def _tokens(cfg: ModelConfig, n: int = 8) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_matches_transformers(family: str) -> None:
    cfg = FAMILIES[family]
    weights = random_weights(cfg, seed=2)
    tokens = _tokens(cfg)
    k, v = new_kv_cache(cfg, MAX_SEQ)
    ours = [decode_step(cfg, weights, k, v, t, pos) for pos, t in enumerate(tokens)]
    with torch.no_grad():
        theirs = hf_model(family, cfg, weights)(torch.tensor([tokens])).logits[0]
    for pos in range(len(tokens)):
        assert rel_err(ours[pos], theirs[pos]) <= 1e-4, (pos, rel_err(ours[pos], theirs[pos]))
    assert rel_err(ours[0], ours[-1]) > 0.1


def test_the_variations_matter() -> None:
    """Dropping the bias or the QK-norm weights changes the logits: the reference really applies them."""
    for family, names in (("qwen2", ("bqkv",)), ("qwen3", ("q_norm", "k_norm"))):
        cfg = FAMILIES[family]
        weights = random_weights(cfg, seed=2)
        plain = {n: (torch.zeros_like(t) if n.endswith("bqkv") else torch.ones_like(t))
                 if n.endswith(names) else t for n, t in weights.items()}
        ka, kb = new_kv_cache(cfg, 4), new_kv_cache(cfg, 4)  # q and k matter from the second position on
        for pos, token in enumerate([3, 9, 27]):
            a, b = decode_step(cfg, weights, *ka, token, pos), decode_step(cfg, plain, *kb, token, pos)
        assert rel_err(a, b) > 1e-3, family


CASES = [
    ("qwen3", 3, {}),
    ("qwen3", 5, {"attn_splits": 3, "tiles": {"attn_norm_qkv_rope": 32}, "k_splits": {"o_proj_residual": 2},
                  "fuse_attn_reduce": True}),
    ("qwen2", 4, {"tiles": {"attn_norm_qkv_rope": 6}, "attn_splits": 2}),
    ("llama", 6, {"tiles": {"attn_norm_qkv_rope": 10}, "attn_splits": 3, "k_splits": {"down_proj_residual": 2}}),
    ("mistral", 3, {"tiles": {"attn_norm_qkv_rope": 4, "final_norm_lm_head": 48}}),
    ("qwen3", 4, {"qk_norm": "apart", "tiles": {"attn_norm_qkv_rope": 12}, "attn_splits": 2}),
    ("qwen3", 5, {"qk_norm": "apart", "tiles": {"attn_norm_qkv_rope": 40}, "default_granularity": "head",
                  "fuse_attn_reduce": True, "attn_splits": 3, "assignment": "critical_path"}),
    ("qwen3", 4, {"qk_norm": "in_attention", "tiles": {"attn_norm_qkv_rope": 12}, "attn_splits": 3}),
    ("qwen3", 5, {"qk_norm": "in_attention", "tiles": {"attn_norm_qkv_rope": 40}, "default_granularity": "head",
                  "fuse_attn_reduce": True, "attn_splits": 2, "assignment": "critical_path"}),
]


@pytest.mark.parametrize(("family", "workers", "knobs"), CASES)
def test_cpu_executor_matches_reference(family: str, workers: int, knobs: dict) -> None:
    cfg = FAMILIES[family]
    spec = ModelSpec(family, family, cfg, MAX_SEQ)
    schedule = lower(spec, workers, Strategy(**knobs))
    assert verify(schedule).accepted
    prog = resolve(schedule)
    weights = random_weights(cfg, seed=4)
    ref = new_kv_cache(cfg, MAX_SEQ)
    caches = {seed: new_kv_cache(cfg, MAX_SEQ) for seed in range(4)}
    for pos, token in enumerate(_tokens(cfg, 5)):
        want = decode_step(cfg, weights, *ref, token, pos)
        for seed, (k, v) in caches.items():
            got = run_program(prog, weights, k, v, token, pos, seed=seed + 10 * pos)
            assert rel_err(got, want) <= 1e-5, (pos, seed, rel_err(got, want))
            assert rel_err(k[:, :, :pos + 1], ref[0][:, :, :pos + 1]) <= 1e-6


def test_qk_norm_tiles_are_whole_q_and_k_heads() -> None:
    """A pair tile cannot see its head's sum of squares: the catalogue refuses a QKV tile that cuts a q or k head of
    a QK-norm model (v rows may still be pairs), and with the norm inside QKV the lowering rounds QKV tiles to whole
    heads."""
    cfg = FAMILIES["qwen3"]
    geo = Geometry(cfg, MAX_SEQ, 1)
    qk_end = cfg.q_size + cfg.kv_size  # 192 with hd 32
    for start, end in [(0, 16), (16, 64), (160, 170), (qk_end - 2, qk_end + 2)]:
        with pytest.raises(ArgError, match="cuts a q or k head"):
            check_instruction(geo, "attn_norm_qkv_rope", 0, {"start": start, "end": end})
    for start, end in [(0, 32), (32, 96), (qk_end - 32, qk_end + 6), (qk_end + 2, qk_end + 4)]:
        check_instruction(geo, "attn_norm_qkv_rope", 0, {"start": start, "end": end})
    plain = FAMILIES["qwen2"]
    check_instruction(Geometry(plain, MAX_SEQ, 1), "attn_norm_qkv_rope", 0, {"start": 2, "end": 6})

    spec = ModelSpec("qwen3", "qwen3", cfg, MAX_SEQ)
    doc = lower(spec, 4, Strategy(tiles={"attn_norm_qkv_rope": 6})).to_json()
    qkv = [ins["args"] for ins in doc["instructions"] if ins["op"] == "attn_norm_qkv_rope"]
    assert qkv and all(a["start"] % cfg.hd == 0 and a["end"] % cfg.hd == 0 for a in qkv)
    # the search offers pair tiles too (for the norm applied apart) and the whole-head ones; with the norm inside
    # QKV the lowering rounds each down to whole heads
    for model, hd in ((spec, cfg.hd), (MODELS["qwen3-8b"], 128)):
        choices = tile_choices(model, 132, "attn_norm_qkv_rope")
        assert hd in choices and any(t % hd for t in choices)
    for t in tile_choices(spec, 132, "attn_norm_qkv_rope"):
        rows = [i.args for i in lower(spec, 4, Strategy(tiles={"attn_norm_qkv_rope": t})).instructions
                if i.op == "attn_norm_qkv_rope"]
        assert all(a["start"] % cfg.hd == 0 and a["end"] % cfg.hd == 0 for a in rows), t

    i = next(k for k, ins in enumerate(doc["instructions"]) if ins["op"] == "attn_norm_qkv_rope")
    doc["instructions"][i]["args"] = {"start": 0, "end": 16}
    with pytest.raises(ScheduleError, match="cuts a q or k head") as info:
        resolve(parse_schedule(doc))
    assert info.value.path == f"$.instructions[{i}]"


def test_qk_norm_in_attention_is_off_the_chain_and_its_orders_matter() -> None:
    """With the QK-norm in attention, attention waits on QKV directly, every split normalises its q heads and the
    new k row, and a qk_norm_apply with k_only writes the row into the cache after the layer's attention. The
    proofs see each order: the cache write must follow every split's read of the cache (a dropped wait is a race) and
    the next layer's QKV must follow the write (it overwrites k_new); a q normalised twice or never is a finding;
    interpreter v9 refuses the attention that normalises."""
    from megasynth.kernels.gpu.pack import check_runs_on_v9, pack

    cfg = FAMILIES["qwen3"]
    spec = ModelSpec("qwen3", "qwen3", cfg, MAX_SEQ)
    doc = lower(spec, 4, Strategy(qk_norm="in_attention", attn_splits=2,
                                  tiles={"attn_norm_qkv_rope": 12})).to_json()
    assert verify(parse_schedule(doc)).accepted
    by_id = {ins["id"]: ins for ins in doc["instructions"]}
    stores = [ins for ins in doc["instructions"] if ins["op"] == "qk_norm_apply"]
    assert len(stores) == cfg.num_hidden_layers * cfg.num_key_value_heads
    assert all(ins["args"]["k_only"] == 1 for ins in stores)
    assert all(ins["args"]["qk_norm"] == 1 for ins in doc["instructions"] if ins["op"] == "attn_partial")
    # attention waits on no qk_norm_apply: the apply is off the chain
    signals_of = {s["counter"]: by_id[i]["op"] for i in by_id for s in by_id[i]["signals"]}
    assert not any(signals_of.get(w["counter"]) == "qk_norm_apply" for ins in doc["instructions"]
                   if ins["op"] == "attn_partial" for w in ins["waits"])

    def without_waits(op: str, layer: int, on: str) -> dict:
        cut = {s["counter"] for ins in doc["instructions"] if ins["op"] == on for s in ins["signals"]}
        return {**doc, "instructions": [
            {**ins, "waits": [w for w in ins["waits"] if w["counter"] not in cut]}
            if ins["op"] == op and ins["layer"] == layer else ins for ins in doc["instructions"]]}

    # the first cache write of layer 0, without its wait and first in its queue (later in the queue, program order
    # behind an attention merge of the layer would order it all the same)
    store = next(ins["id"] for ins in stores if ins["layer"] == 0)
    early = without_waits("qk_norm_apply", 0, "attn_partial")
    early["queues"] = [[store, *[i for i in q if i != store]] if store in q else q for q in doc["queues"]]
    report = verify(parse_schedule(early))
    assert any(f.category == "race" and "k_cache[" in f.message for f in report.findings), \
        [f.message for f in report.findings][:3]
    # and last in its queue, with the next layer's QKV no longer waiting for it
    late = without_waits("attn_norm_qkv_rope_sq", 1, "qk_norm_apply")
    late["queues"] = [[*[i for i in q if i != store], store] if store in q else q for q in doc["queues"]]
    report = verify(parse_schedule(late))
    assert any(f.category == "race" and ("k_new[" in f.message or "qk_sq[" in f.message) for f in report.findings), \
        [f.message for f in report.findings][:3]

    twice = {**doc, "instructions": [{**ins, "args": {"kv_head": ins["args"]["kv_head"]}}
                                     if ins["op"] == "qk_norm_apply" else ins for ins in doc["instructions"]]}
    findings = verify(parse_schedule(twice)).findings
    assert any(f.category == "coverage" and "normalised twice" in f.message for f in findings)
    never = {**doc, "instructions": [{**ins, "args": {**ins["args"], "qk_norm": 0}} if ins["op"] == "attn_partial"
                                     and ins["layer"] == 1 else ins for ins in doc["instructions"]]}
    findings = verify(parse_schedule(never)).findings
    assert any(f.category == "coverage" and "normalised never" in f.message for f in findings)
    plain = lower(spec, 4, Strategy(tiles={"attn_norm_qkv_rope": 32})).to_json()
    again = {**plain, "instructions": [{**ins, "args": {**ins["args"], "qk_norm": 1}} if ins["op"] == "attn_partial"
                                       else ins for ins in plain["instructions"]]}
    assert any("already did" in f.message for f in verify(parse_schedule(again)).findings)

    with pytest.raises(ScheduleError, match="'attn_norm_qkv_rope_sq' has no GPU implementation"):
        pack(parse_schedule(doc), "v9")
    packed = pack(parse_schedule(again), "v9")
    with pytest.raises(ScheduleError, match="applies no QK-norm inside attention"):
        check_runs_on_v9(packed, cfg.hd, "use the CPU executor")
    with pytest.raises(ArgError, match="qk_norm = 1 is for models with qk_norm"):
        check_instruction(Geometry(FAMILIES["llama"], MAX_SEQ, 1), "attn_partial", 0,
                          {"kv_head": 0, "split": 0, "splits": 1, "qk_norm": 1})
    with pytest.raises(ArgError, match="k_only = 2 must be 0 or 1"):
        check_instruction(Geometry(cfg, MAX_SEQ, 1), "qk_norm_apply", 0, {"kv_head": 0, "k_only": 2})


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_checkpoint_round_trip(tmp_path, family: str) -> None:
    cfg = FAMILIES[family]
    weights = random_weights(cfg, seed=9)
    sd = to_hf_state_dict(weights, cfg)
    want = {"qwen3": {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"},
            "qwen2": {f"model.layers.1.self_attn.{x}_proj.bias" for x in "qkv"} | {"lm_head.weight"}}[family]
    assert want <= set(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    loaded = load_hf_weights(tmp_path, cfg)
    assert set(loaded) == set(weights)
    for name in weights:
        assert torch.equal(loaded[name], weights[name]), name


def test_llama_weights_unchanged() -> None:
    """The new weights exist only for the models that have them: a Llama draws exactly the tensors it always did."""
    names = set(weight_shapes(MODELS["tiny"].config))
    assert not any(n.endswith(("bqkv", "q_norm", "k_norm")) for n in names)
    assert weight_shapes(FAMILIES["qwen3"])["layers.0.q_norm"] == (32,)
    assert weight_shapes(FAMILIES["qwen2"])["layers.1.bqkv"] == (FAMILIES["qwen2"].qkv_size,)


def test_qk_norm_apart_cuts_heads_and_its_waits_matter() -> None:
    """With the QK-norm apart, QKV tiles cut q and k heads into pairs, one qk_norm_apply per KV head scales them,
    and the proofs see every new edge: attention without its wait on the apply is a race, a missing apply a coverage
    gap, and interpreter v9 refuses the ops by name."""
    from megasynth.kernels.gpu.pack import pack

    cfg = FAMILIES["qwen3"]
    spec = ModelSpec("qwen3", "qwen3", cfg, MAX_SEQ)
    doc = lower(spec, 4, Strategy(qk_norm="apart", tiles={"attn_norm_qkv_rope": 12})).to_json()
    ops = [ins["op"] for ins in doc["instructions"]]
    assert "attn_norm_qkv_rope" not in ops
    assert ops.count("qk_norm_apply") == cfg.num_hidden_layers * cfg.num_key_value_heads
    assert any(ins["args"]["start"] % cfg.hd for ins in doc["instructions"] if ins["op"] == "attn_norm_qkv_rope_sq")
    assert {"qk_sq", "k_new"} <= set(doc["buffers"])
    assert verify(parse_schedule(doc)).accepted

    apply_ids = {ins["id"] for ins in doc["instructions"] if ins["op"] == "qk_norm_apply" and ins["layer"] == 1}
    applied = {s["counter"] for ins in doc["instructions"] if ins["id"] in apply_ids for s in ins["signals"]}
    racy = {**doc, "instructions": [
        {**ins, "waits": [w for w in ins["waits"] if w["counter"] not in applied]}
        if ins["op"] == "attn_partial" and ins["layer"] == 1 else ins for ins in doc["instructions"]]}
    report = verify(parse_schedule(racy))
    assert not report.accepted
    assert any(f.category == "race" and ("q[" in f.message or "k_cache[" in f.message) for f in report.findings), \
        [f.message for f in report.findings][:3]

    gone = next(ins["id"] for ins in doc["instructions"] if ins["op"] == "qk_norm_apply")
    missing = {**doc, "instructions": [ins for ins in doc["instructions"] if ins["id"] != gone],
               "queues": [[i for i in q if i != gone] for q in doc["queues"]]}
    report = verify(parse_schedule(missing))
    assert any(f.category == "coverage" and "qk_norm_apply layer 0 kv_head 0" in f.message for f in report.findings)

    with pytest.raises(ScheduleError, match="'attn_norm_qkv_rope_sq' has no GPU implementation"):
        pack(parse_schedule(doc), "v9")
    with pytest.raises(ArgError, match="for models with qk_norm"):
        check_instruction(Geometry(FAMILIES["llama"], MAX_SEQ, 1), "attn_norm_qkv_rope_sq", 0, {"start": 0, "end": 2})
    llama = lower(ModelSpec("llama", "llama", FAMILIES["llama"], MAX_SEQ), 2, Strategy(qk_norm="apart")).to_json()
    assert {ins["op"] for ins in llama["instructions"]} >= {"attn_norm_qkv_rope"}  # no QK-norm: the knob is moot
