"""The strategy space a lowering takes (DESIGN.md §5): a JSON document with a schema, `synth lower --strategy FILE`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from validator.errors import ScheduleError, json_path

Tile = Annotated[int, Field(ge=1, le=1 << 20)]


class Strategy(BaseModel):
    """Knobs of a lowering. The defaults are the naive baseline: fixed tiles, one all-join counter per op per layer,
    round-robin over workers (like the default of the public Llama-1B megakernel)."""

    model_config = ConfigDict(extra="forbid")

    tiles: dict[str, Tile] = Field(default_factory=lambda: {
        "embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 16,
        "down_proj_residual": 16, "final_norm_lm_head": 256})
    k_splits: dict[str, Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=lambda: {
        "o_proj_residual": 1, "down_proj_residual": 1})
    attn_splits: Annotated[int, Field(ge=1, le=256)] = 1
    assignment: Literal["round_robin"] = "round_robin"


def load_strategy(path: str | Path) -> Strategy:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScheduleError(f"cannot read strategy: {exc.strerror or exc}", "$", str(path)) from None
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"invalid JSON: {exc.msg} at line {exc.lineno}", "$", str(path)) from None
    try:
        return Strategy.model_validate(data)
    except ValidationError as exc:
        err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
        raise ScheduleError(err["msg"], json_path(err["loc"]), str(path)) from None
