"""Lowering: model spec + strategy -> schedule. Instructions in ascending-id decode order, counters, queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from synth.models import ModelSpec
from synth.strategy import Strategy
from validator.catalogue import Geometry
from validator.schedule import FORMAT, Schedule, parse_schedule


@dataclass
class Stage:
    """All instructions of one op in one layer; the unit of an all-join dependency."""

    op: str
    layer: int | None
    args: list[dict[str, int]] = field(default_factory=list)
    deps: list[int] = field(default_factory=list)  # indices of producer stages this stage waits on (all-join)


def _tiles(total: int, tile: int, align: int = 1) -> list[tuple[int, int]]:
    tile = max(align, tile - tile % align)
    return [(s, min(s + tile, total)) for s in range(0, total, tile)]


def plan_stages(spec: ModelSpec, strategy: Strategy) -> list[Stage]:
    """The decode step as stages in execution order, each with its producer stages."""
    c = spec.config
    t = strategy.tiles
    splits = min(strategy.attn_splits, spec.max_seq_len)
    stages: list[Stage] = [Stage("embed", None, [{"start": s, "end": e} for s, e in
                                                _tiles(c.hidden_size, t.get("embed", c.hidden_size))])]

    def add(op: str, layer: int | None, args: list[dict[str, int]], deps: list[int]) -> int:
        stages.append(Stage(op, layer, args, deps))
        return len(stages) - 1

    def rows_k(op: str, rows: int, ks: int) -> list[dict[str, int]]:
        kt = _tiles(ks, -(-ks // strategy.k_splits.get(op, 1)))
        return [{"start": s, "end": e, "k_start": k0, "k_end": k1} for s, e in _tiles(rows, t.get(op, 16))
                for k0, k1 in kt]

    prev = 0
    for layer in range(c.num_hidden_layers):
        qkv = add("attn_norm_qkv_rope", layer, [{"start": s, "end": e} for s, e in
                                               _tiles(c.qkv_size, t.get("attn_norm_qkv_rope", c.hd), c.hd)], [prev])
        part = add("attn_partial", layer, [{"kv_head": g, "split": s, "splits": splits}
                                           for g in range(c.num_key_value_heads) for s in range(splits)], [qkv])
        red = add("attn_reduce", layer, [{"start": g * c.group_size, "end": (g + 1) * c.group_size, "splits": splits}
                                         for g in range(c.num_key_value_heads)], [part])
        oproj = add("o_proj_residual", layer, rows_k("o_proj_residual", c.hidden_size, c.q_size), [red])
        gate = add("mlp_norm_gate_up", layer, [{"start": s, "end": e} for s, e in
                                               _tiles(c.intermediate_size, t.get("mlp_norm_gate_up", 16))], [oproj])
        prev = add("down_proj_residual", layer, rows_k("down_proj_residual", c.hidden_size, c.intermediate_size),
                   [gate])
    add("final_norm_lm_head", None, [{"start": s, "end": e} for s, e in
                                    _tiles(c.vocab_size, t.get("final_norm_lm_head", 256))], [prev])
    return stages


def lower(spec: ModelSpec, workers: int, strategy: Strategy | None = None, proposer: str = "naive") -> Schedule:
    """Lower a model to a complete schedule: one all-join counter per stage, round-robin over workers."""
    strategy = strategy or Strategy()
    stages = plan_stages(spec, strategy)
    instructions: list[dict[str, Any]] = []
    queues: list[list[int]] = [[] for _ in range(workers)]
    for counter, stage in enumerate(stages):
        waits = [{"counter": d, "value": len(stages[d].args)} for d in stage.deps]
        for args in stage.args:
            ident = len(instructions)
            ins: dict[str, Any] = {"id": ident, "op": stage.op, "args": args, "waits": waits,
                                   "signals": [{"counter": counter, "add": 1}]}
            if stage.layer is not None:
                ins["layer"] = stage.layer
            instructions.append(ins)
            queues[ident % workers].append(ident)
    geo = Geometry(spec.config, spec.max_seq_len, min(strategy.attn_splits, spec.max_seq_len))
    doc = {
        "format": FORMAT,
        "model": {"name": spec.name, "config": spec.config.to_hf(), "max_seq_len": spec.max_seq_len},
        "target": {"workers": workers, "device": "NVIDIA H200"},
        "buffers": geo.buffers(),
        "counters": len(stages),
        "instructions": instructions,
        "queues": queues,
        "meta": {"proposer": proposer, "strategy": strategy.model_dump(mode="json"), "parent": None},
    }
    return parse_schedule(doc)
