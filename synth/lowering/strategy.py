"""The strategy space a lowering takes (DESIGN.md §5): a JSON document with a schema, `synth lower --strategy FILE`.

Knobs: tile sizes per op, K-splits, the attention split over the KV sequence, dependency granularity per
producer->consumer edge, counter sharing across layers, worker assignment and the order within a queue. The defaults
are the naive baseline (all-join counters, round-robin in id order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from validator.catalogue import OP_ORDER
from validator.errors import ScheduleError, json_path

Tile = Annotated[int, Field(ge=1, le=1 << 20)]

#: How a producer stage's instructions are grouped into counters for one consumer op: one counter for the stage
#: ("all"), one per KV head / head group ("head"), `chunks[edge]` contiguous chunks ("chunk"), one per instruction
#: ("tile"). A consumer waits for every group that holds an instruction it conflicts with.
Granularity = Literal["all", "head", "chunk", "tile"]
Assignment = Literal["round_robin", "zigzag", "cost_balanced", "critical_path", "spatial"]
Order = Literal["id", "critical_path"]
Sharing = Literal["none", "across_layers"]

GRANULARITIES: tuple[str, ...] = ("all", "head", "chunk", "tile")
ASSIGNMENTS: tuple[str, ...] = ("round_robin", "zigzag", "cost_balanced", "critical_path", "spatial")
ORDERS: tuple[str, ...] = ("id", "critical_path")


def edge_name(producer: str, consumer: str) -> str:
    """The key of a producer->consumer edge in `Strategy.edges` / `Strategy.chunks`."""
    return f"{producer}->{consumer}"


def _check_edge_keys(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        parts = key.split("->")
        if len(parts) != 2 or any(p not in OP_ORDER for p in parts):
            raise ValueError(f"edge {key!r} must be 'producer_op->consumer_op' with ops from {OP_ORDER}")
    return value


class Strategy(BaseModel):
    """Knobs of a lowering. The defaults are the naive baseline: fixed tiles, one all-join counter per op per layer,
    round-robin over workers in id order (like the default of the public Llama-1B megakernel)."""

    model_config = ConfigDict(extra="forbid")

    tiles: dict[str, Tile] = Field(default_factory=lambda: {
        "embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 16,
        "down_proj_residual": 16, "final_norm_lm_head": 256},
        description="output rows per instruction, per op (qkv rows are rounded to an even count: RoPE pairs)")
    k_splits: dict[str, Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=lambda: {
        "o_proj_residual": 1, "down_proj_residual": 1},
        description="split of the input (K) dimension of o_proj/down_proj; partial sums are reduce-added into x")
    attn_splits: Annotated[int, Field(ge=1, le=256)] = Field(1, description="splits of the KV sequence (flash-decode)")
    edges: dict[str, Granularity] = Field(default_factory=dict, description=(
        "dependency granularity per 'producer_op->consumer_op' edge; missing edges use `default_granularity`"))
    default_granularity: Granularity = "all"
    chunks: dict[str, Annotated[int, Field(ge=1, le=4096)]] = Field(default_factory=dict, description=(
        "number of producer chunks for edges with granularity 'chunk' (default 8)"))
    counter_sharing: Sharing = Field("none", description=(
        "'across_layers': one counter per (op, group) for all layers, waited on with cumulative values"))
    assignment: Assignment = Field("round_robin", description="how instructions are placed on workers")
    order: Order = Field("id", description=(
        "order within a queue: ascending id, or the start order of a critical-path list schedule on the cost model"))
    spatial: dict[str, Annotated[float, Field(gt=0, le=1000)]] = Field(default_factory=dict, description=(
        "for assignment 'spatial': relative share of the workers per op (default: its share of the estimated time)"))

    @field_validator("edges", "chunks")
    @classmethod
    def _known_edges(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_edge_keys(value)

    @field_validator("tiles", "k_splits", "spatial")
    @classmethod
    def _known_ops(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key not in OP_ORDER:
                raise ValueError(f"unknown op {key!r}; ops: {', '.join(OP_ORDER)}")
        return value

    def granularity(self, producer: str, consumer: str) -> str:
        return self.edges.get(edge_name(producer, consumer), self.default_granularity)

    def n_chunks(self, producer: str, consumer: str) -> int:
        return self.chunks.get(edge_name(producer, consumer), 8)


def strategy_schema() -> dict[str, Any]:
    """The JSON Schema of a strategy (`synth strategy-schema`; part of the agent's briefing)."""
    out = Strategy.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "megasynth strategy"
    return out


def parse_strategy(data: Any, file: str | None = None, where: str = "$") -> Strategy:
    """Validate decoded JSON into a `Strategy`; the first defect raises `ScheduleError` with its JSON path."""
    try:
        return Strategy.model_validate(data)
    except ValidationError as exc:
        err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
        path = json_path(err["loc"])
        path = where + path[1:] if where != "$" else path
        raise ScheduleError(f"{err['msg']} (got {str(err.get('input'))[:60]})", path, file) from None


def load_strategy(path: str | Path) -> Strategy:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScheduleError(f"cannot read strategy: {exc.strerror or exc}", "$", str(path)) from None
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"invalid JSON: {exc.msg} at line {exc.lineno}", "$", str(path)) from None
    return parse_strategy(data, str(path))
