"""QKV tiles of RoPE pairs (rows in pair order): footprints, coverage, the CPU executor and the proofs.

Interpreter v10 spreads QKV over every SM with tiles smaller than a head; a tile's rows are numbered in RoPE-pair
order (a head's rows 2j, 2j+1 are its rows j, j + hd/2), so any even-aligned range holds whole pairs and whole-head
tiles keep their old meaning.
"""

from __future__ import annotations

import pytest
import torch

from megasynth.ir.catalogue import OPS, ArgError, Geometry, check_instruction, qkv_pair_pieces
from megasynth.ir.program import resolve
from megasynth.ir.schedule import parse_schedule
from megasynth.kernels.cpu_executor import run_program
from megasynth.kernels.reference import decode_step, new_kv_cache
from megasynth.kernels.weights import random_weights
from megasynth.lowering.lower import lower
from megasynth.lowering.models import MODELS
from megasynth.lowering.strategy import Strategy
from megasynth.validator.verify import Options, verify

pytestmark = pytest.mark.usefixtures("single_thread")


def _spans(accesses: list[tuple[str, str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for kind, buf, lo, hi in accesses:
        if kind == "write":
            out.setdefault(buf, []).append((lo, hi))
    return out


@pytest.mark.parametrize("tile", [2, 10, 16, 22, 32, 96])
def test_pair_tiles_write_each_element_once_and_whole_heads_as_before(tile: int) -> None:
    """The writes of a layer's tiles partition exactly what the whole-head tiles write, whatever the tile size."""
    spec = MODELS["tiny-gqa4"]
    c = spec.config
    geo = Geometry(c, spec.max_seq_len, 1)
    fp = OPS["attn_norm_qkv_rope"].footprint

    def covered(size: int) -> dict[str, list[int]]:
        marks: dict[str, list[int]] = {}
        for s in range(0, c.qkv_size, size):
            for buf, spans in _spans(fp(geo, 1, {"start": s, "end": min(s + size, c.qkv_size)})).items():
                cells = marks.setdefault(buf, [0] * geo.buffers()[buf])
                for lo, hi in spans:
                    for k in range(lo, hi):
                        cells[k] += 1
        return marks

    whole = covered(c.hd)
    pairs = covered(tile)
    assert set(whole) == set(pairs) == {"q", "k_cache", "v_cache"}
    for buf in whole:
        assert max(pairs[buf]) == 1, f"{buf}: an element written twice"
        assert pairs[buf] == whole[buf], f"{buf}: tiles of {tile} rows write other elements than whole heads"


def test_pair_pieces_split_at_head_boundaries() -> None:
    c = MODELS["tiny"].config  # hd 32: 16 pairs per head
    assert qkv_pair_pieces(c, 0, 32) == [(0, 0, 16)]
    assert qkv_pair_pieces(c, 20, 44) == [(0, 10, 16), (1, 0, 6)]
    assert qkv_pair_pieces(c, 64, 66) == [(2, 0, 1)]


def test_odd_qkv_rows_are_rejected() -> None:
    spec = MODELS["tiny"]
    geo = Geometry(spec.config, spec.max_seq_len, 1)
    with pytest.raises(ArgError, match="aligned to 2"):
        check_instruction(geo, "attn_norm_qkv_rope", 0, {"start": 3, "end": 8})


@pytest.mark.parametrize(("model", "workers", "tile", "granularity"),
                         [("tiny", 6, 16, "all"), ("tiny-gqa4", 5, 22, "head"), ("tiny-mha", 4, 10, "tile")])
def test_pair_tiles_match_the_reference(model: str, workers: int, tile: int, granularity: str) -> None:
    """The CPU executor with pair tiles reproduces the reference decode step over several positions and
    interleavings (its workspace starts as NaN, so an element no tile writes would poison the logits)."""
    spec = MODELS[model]
    cfg = spec.config
    prog = resolve(lower(spec, workers, Strategy(tiles={"attn_norm_qkv_rope": tile}, attn_splits=2,
                                                 default_granularity=granularity)))
    weights = random_weights(cfg, seed=5)
    ref_k, ref_v = new_kv_cache(cfg, spec.max_seq_len)
    k, v = new_kv_cache(cfg, spec.max_seq_len)
    for pos, token in enumerate([3, 17, 1, 9]):
        want = decode_step(cfg, weights, ref_k, ref_v, token, pos)
        got = run_program(prog, weights, k, v, token, pos, seed=pos)
        assert float((got - want).norm() / want.norm()) <= 1e-5
        # fp32 rows summed in another order than the reference's whole matmul (and in another order on another
        # CPU's BLAS): a few ulps of O(1) values; an element no tile writes, or a wrong one, is off by far more
        assert torch.allclose(k[:, :, :pos + 1], ref_k[:, :, :pos + 1], atol=1e-5)
        assert torch.allclose(v[:, :, :pos + 1], ref_v[:, :, :pos + 1], atol=1e-5)


@pytest.mark.parametrize("granularity", ["all", "head", "tile"])
def test_pair_tiles_are_proven(granularity: str) -> None:
    spec = MODELS["tiny-gqa4"]
    sched = lower(spec, 9, Strategy(tiles={"attn_norm_qkv_rope": 12}, attn_splits=3, default_granularity=granularity))
    report = verify(sched, options=Options(interleavings=200))
    assert report.accepted, [f.to_json() for f in report.findings]


def test_a_missing_wait_on_half_a_key_head_is_a_race() -> None:
    """attn_partial reads all of its KV head: with the head's second pair tile unwaited, the proof must fail."""
    spec = MODELS["tiny"]
    doc = lower(spec, 6, Strategy(tiles={"attn_norm_qkv_rope": 16}, default_granularity="tile")).to_json()
    c = spec.config
    k_rows = range(c.q_size, c.q_size + c.hd)  # pair-ordered rows of key head 0
    producers = {i["id"] for i in doc["instructions"] if i["op"] == "attn_norm_qkv_rope" and i["layer"] == 0
                 and i["args"]["start"] in k_rows}
    assert len(producers) == 2, "key head 0 should take two 16-row pair tiles"
    victim = max(producers)
    counters = {s["counter"] for i in doc["instructions"] if i["id"] == victim for s in i["signals"]}
    for ins in doc["instructions"]:
        if ins["op"] == "attn_partial" and ins["layer"] == 0 and ins["args"]["kv_head"] == 0:
            ins["waits"] = [w for w in ins["waits"] if w["counter"] not in counters]
    report = verify(parse_schedule(doc), options=Options(interleavings=200))
    races = [f for f in report.findings if f.category == "race"]
    assert races, [f.to_json() for f in report.findings]
    assert any(victim in f.instructions for f in races), "the race must involve the unwaited pair tile"


def test_interpreter_v9_refuses_pair_tiles() -> None:
    """v9 computes QKV a head at a time: it must say so instead of computing the wrong rows."""
    pytest.importorskip("triton")
    from megasynth.ir.errors import ScheduleError
    from megasynth.kernels.gpu import KernelConfig, Megakernel

    spec = MODELS["tiny"]
    w = random_weights(spec.config, seed=3)
    whole = lower(spec, 1, Strategy(tiles={"attn_norm_qkv_rope": 64}))  # (the CPU stands for one SM)
    Megakernel(whole, w, device="cpu", config=KernelConfig())  # whole heads: fine
    pairs = lower(spec, 1, Strategy(tiles={"attn_norm_qkv_rope": 16}))
    with pytest.raises(ScheduleError, match="whole heads") as err:
        Megakernel(pairs, w, device="cpu", config=KernelConfig())
    assert err.value.path.startswith("$.instructions[")
