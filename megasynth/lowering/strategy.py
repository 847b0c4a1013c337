"""The strategy space a lowering takes (docs/design.md): a JSON document with a schema, `synth lower --strategy FILE`,
and `SearchSpace`, the discrete choices of each knob that the proposers search for one model and worker count.

Knobs: tile sizes per op, K-splits, the attention split over the KV sequence, dependency granularity per
producer->consumer edge, counter sharing across layers, worker assignment and the order within a queue. The defaults
are the naive baseline (all-join counters, round-robin in id order).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from megasynth.ir.catalogue import OP_ORDER
from megasynth.ir.errors import ScheduleError, json_path
from megasynth.kernels.gpu.pack import default_batch_interpreter, v10_qkv_box_rows, v10_tile_slots

if TYPE_CHECKING:
    from megasynth.lowering.models import ModelSpec

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
        description="output rows per instruction, per op (qkv rows are rounded down to an even count, RoPE "
                    "pairs, or to whole heads for a QK-norm model with the norm inside QKV and for a batch)")
    k_splits: dict[str, Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=lambda: {
        "o_proj_residual": 1, "down_proj_residual": 1},
        description="split of the input (K) dimension of o_proj/down_proj; partial sums are reduce-added into x")
    attn_splits: Annotated[int, Field(ge=1, le=256)] = Field(1, description="splits of the KV sequence (flash-decode)")
    fuse_attn_reduce: bool = Field(False, description=(
        "fold attn_reduce into o_proj: each o_proj instruction merges the attention splits of its K range's heads "
        "itself (op attn_reduce_o_proj; K-split tiles are rounded to whole heads). One counter hop less per layer, "
        "the merge repeated by every o_proj row tile. Interpreter v10 only"))
    qk_norm: Literal["auto", "in_qkv", "apart", "in_attention"] = Field("auto", description=(
        "for a QK-norm model (Qwen3): 'in_qkv' normalises inside QKV, whose tiles then hold whole q and k heads; "
        "'apart' lets QKV tiles cut heads into RoPE pairs (op attn_norm_qkv_rope_sq) and scales each KV head's group "
        "in one qk_norm_apply instruction before attention: more QKV tiles, one counter hop more; 'in_attention' "
        "takes the same QKV tiles and lets attention normalise its q heads and the new k row itself (attn_partial "
        "qk_norm 1), with qk_norm_apply (k_only 1) writing the k row into the cache after the layer's attention: no "
        "hop more; 'auto' (the default): 'in_attention' for a batch on interpreter v10 (whose default build takes "
        "RoPE-pair QKV tiles), 'in_qkv' elsewhere. 'apart' and 'in_attention' run on the CPU executor and interpreter "
        "v10 (v9 refuses them). Ignored for other models"))
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


# ----------------------------------------------------------------------------------------------------------------
# The search space: every performance decision a schedule makes, as discrete choices per knob


#: Rows of one TMA box of interpreter v10 (`BR` in kernels/gpu/stream.py; tests/test_search_space.py checks it): a
#: tile whose rows are a multiple of it fills its boxes, so the space offers wave tiles rounded up to it too.
BOX_ROWS = 16
#: Rows of one half of a v10 batch's tile slot (from `V10_TILE_BATCH` sequences a slot is a [128, 64] tile: 64 gate
#: and 64 up rows, a RoPE pair's two halves, or 128 rows of o_proj and down).
TILE_HALF = 64
#: Producer->consumer edges where a consumer reads only part of its producer's output, so a finer dependency can
#: overlap the two stages (every other edge is all-to-all: a norm reads the whole of x).
FINE_EDGES: tuple[str, ...] = ("attn_norm_qkv_rope->attn_partial", "attn_partial->attn_reduce",
                               "attn_reduce->o_proj_residual", "attn_partial->attn_reduce_o_proj",
                               "mlp_norm_gate_up->down_proj_residual")
CHUNK_COUNTS: tuple[int, ...] = (2, 4, 8, 16, 32)
K_SPLIT_OPS: tuple[str, ...] = ("o_proj_residual", "down_proj_residual")
#: Ops whose tile size is searched (the embed is one instruction at batch 1; `for_batch` sets a batch's).
TILED_OPS: tuple[str, ...] = ("attn_norm_qkv_rope", "o_proj_residual", "mlp_norm_gate_up", "down_proj_residual",
                              "final_norm_lm_head")
_WAVES = (1, 2)


@dataclass(frozen=True)
class Knob:
    """One searched decision: its name (`tiles.<op>`, `k_splits.<op>`, `attn_splits`, `edges.<edge>`, `assignment`,
    `order`), its choices, whether they are ordered (neighbours are the adjacent choices) and why it matters."""

    name: str
    choices: tuple[Any, ...]
    ordered: bool
    why: str


def _rows_of(spec: ModelSpec) -> dict[str, int]:
    c = spec.config
    return {"attn_norm_qkv_rope": c.qkv_size, "o_proj_residual": c.hidden_size,
            "mlp_norm_gate_up": c.intermediate_size, "down_proj_residual": c.hidden_size,
            "final_norm_lm_head": c.vocab_size}


def k_split_choices(spec: ModelSpec, op: str) -> tuple[int, ...]:
    """K-splits of o_proj / down_proj that cut K into equal parts of at least 16 columns."""
    c = spec.config
    k = c.q_size if op == "o_proj_residual" else c.intermediate_size
    return tuple(s for s in (1, 2, 4, 8) if k % s == 0 and k // s >= 16)


def wave_tiles(rows: int, workers: int, splits: tuple[int, ...] = (1,), align: int = 1, box: int = BOX_ROWS
               ) -> list[int]:
    """Tiles that make one or two whole waves: ceil(rows * k_split / (workers * waves)) for each K-split, as is
    (rounded up to `align`) and rounded up to whole boxes of `box` rows (e.g. the LM head of llama-1b on 132 SMs:
    972 and 976 rows, 132 instructions)."""
    out: set[int] = set()
    for ks in splits:
        for waves in _WAVES:
            t = math.ceil(rows * ks / (workers * waves))
            out.add(max(align, -(-t // align) * align))
            out.add(max(box, -(-t // box) * box))
    return sorted(t for t in out if t <= rows)


def v10_batch(spec: ModelSpec) -> bool:
    """Whether interpreter v10 runs the spec's batch where none is named (`pack.default_batch_interpreter`); v9 runs
    the others, and the lowering and the search target it."""
    return spec.batch > 1 and default_batch_interpreter(spec.config, spec.batch) == "v10"


def whole_head_qkv(spec: ModelSpec) -> bool:
    """Whether a batch's QKV tiles must be whole heads: its interpreter is v9, which computes QKV a head at a time
    (and applies a QK-norm inside QKV). v10 takes RoPE-pair tiles at any batch, a QK-norm model's batch too (the norm
    apart or inside attention: `StreamConfig.qk_pairs`)."""
    return spec.batch > 1 and not v10_batch(spec)


def qk_norm_mode(spec: ModelSpec, mode: str) -> str:
    """Where a QK-norm model applies its norm for a strategy that asks for `mode`: as asked, and for 'auto' inside
    attention on a batch that runs on interpreter v10 (RoPE-pair QKV tiles, `StreamConfig.qk_pairs`: qwen3-1.7b at
    batch 8 1.756 ms against 4.057 on v9), inside QKV at batch 1 and on v9."""
    if mode != "auto":
        return mode
    return "in_attention" if v10_batch(spec) else "in_qkv"


#: From `V10_TILE_BATCH` sequences, the rows an op's tile should be a multiple of to fill the batch's [128, 64] tile
#: slots: o_proj and down fill a slot with 128 rows, gate/up with 64 gate and 64 up rows. At batch 8 on llama-1b
#: 64-row o_proj and down tiles took 1.215 ms against 1.090 for 128-row ones (docs/perf-notes.md).
TILE_FILL = {"o_proj_residual": 2 * TILE_HALF, "down_proj_residual": 2 * TILE_HALF, "mlp_norm_gate_up": TILE_HALF}


def _tile_slots(spec: ModelSpec) -> bool:
    """Whether the spec's batch runs on v10's tile slots by default (`v10_batch` and `pack.v10_tile_slots`:
    `V10_TILE_BATCH` sequences and up)."""
    return v10_batch(spec) and v10_tile_slots(spec.config, spec.batch)


#: head dims up to which `for_batch` folds two attention splits into one on tile slots (llama-1b's 64: a sequence's
#: K/V head at ctx 1024 is 256 KB, one instruction's worth; 128-dim heads measured slower folded)
FOLD_TWO_SPLITS_HD = 64
#: Hidden columns per embed instruction on tile slots: a batch's embedding as that many instructions on as many SMs,
#: each one round trip for every sequence's rows, instead of one SM taking them pass after pass (llama-1b, batch 16:
#: the embed traced at 14.1 -> 4.5 us; docs/perf-notes.md).
EMBED_TILE_COLUMNS = 256


def for_batch(strategy: Strategy, spec: ModelSpec, whole_heads: bool | None = None) -> Strategy:
    """A batch-1 strategy adapted to `spec.batch` sequences as the H200 measurements say a batch wants it
    (docs/perf-notes.md, the v10 batch entries): attention split batch times less, so a layer has as many attention
    instructions, and where that leaves one split on interpreter v10 the merge folded into o_proj (then o_proj stages
    the only partial: llama-1b and llama-8b at batch 16 1.6-1.7 % faster; a merge of several splits is not folded at a
    batch); on tile slots with heads of at most `FOLD_TWO_SPLITS_HD` dims two splits become one, folded (at batch 8 and
    ctx 1024 llama-1b 1.5 % faster than two splits apart, llama-8b's 128-dim heads 0.6 % slower; a long context wants
    the splits: the search weighs them at its own ctx); QKV tiles of whole heads where the batch runs on interpreter v9
    (`whole_head_qkv`) or `whole_heads` asks for them; a QK-norm model's norm inside QKV on v9, and on v10 apart or
    inside attention (there where the strategy says inside QKV, on RoPE-pair tiles); and on v10's tile slots
    (`pack.v10_tile_slots`: `V10_TILE_BATCH` sequences and up), where a v10 ring slot is a [128, 64] tile of two
    64-row halves, o_proj and down rows 128 at a time (K split as much finer, as many instructions, at most the
    largest split offered), QKV tiles of at least as many pairs as the build's K-packed QKV boxes hold
    (`pack.v10_qkv_box_rows`: 64 rows, 32 for 64-dim heads), gate/up tiles of whole 64-row halves and the embedding
    `EMBED_TILE_COLUMNS` columns an instruction. `synth search --batch` starts from its seeds adapted so, and
    `bench/batch_h200.sh` lowers each model's reference strategy with it. Batch 1: the strategy as it is."""
    b = spec.batch
    if b == 1:
        return strategy
    c = spec.config
    v10 = v10_batch(spec)
    tile_slots = v10 and v10_tile_slots(c, b)
    d = strategy.model_dump(mode="json")
    tiles = {**Strategy().tiles, **strategy.tiles}
    splits = {op: strategy.k_splits.get(op, 1) for op in K_SPLIT_OPS}
    d["attn_splits"] = max(1, strategy.attn_splits // b)
    if d["attn_splits"] == 2 and tile_slots and c.hd <= FOLD_TWO_SPLITS_HD:
        d["attn_splits"] = 1
    d["fuse_attn_reduce"] = d["attn_splits"] == 1 and v10
    qkv = "attn_norm_qkv_rope"
    if tile_slots:
        for op in K_SPLIT_OPS:
            if tiles[op] < TILE_FILL[op]:
                top = max(k_split_choices(spec, op))
                splits[op] = min(top, splits[op] * -(-TILE_FILL[op] // tiles[op]))
        tiles = {op: -(-t // TILE_FILL[op]) * TILE_FILL[op] if op in TILE_FILL else t for op, t in tiles.items()}
        tiles[qkv] = max(2 * v10_qkv_box_rows(c.hd, b), tiles[qkv])
        tiles["embed"] = min(tiles["embed"], EMBED_TILE_COLUMNS)
    if c.qk_norm:  # v9 applies it inside QKV only; on v10 a batch-1 strategy's norm inside QKV goes inside attention
        if whole_head_qkv(spec):
            d["qk_norm"] = "in_qkv"
        elif d["qk_norm"] in ("auto", "in_qkv"):
            d["qk_norm"] = "in_attention"
    if whole_head_qkv(spec) or whole_heads:
        tiles[qkv] = -(-tiles[qkv] // c.hd) * c.hd
    rows = _rows_of(spec)
    d["tiles"] = {op: min(t, rows.get(op, t)) for op, t in tiles.items()}
    d["k_splits"] = splits
    return Strategy.model_validate(d)


def tile_choices(spec: ModelSpec, workers: int, op: str) -> tuple[int, ...]:
    """Rows per instruction offered for one op: powers of two around the useful range and the wave tiles. QKV tiles
    are RoPE pairs (any even row count; a whole head is `head_dim` rows). A QK-norm model is offered the same pair
    tiles, which its `qk_norm: "apart"` lowers as they are; with the norm inside QKV the lowering rounds a tile down to
    whole heads (at least one). A batch on interpreter v9 (which computes QKV a whole head at a time:
    `whole_head_qkv`) is offered whole-head QKV tiles only; on v10 a batch's are pair tiles, as at batch 1 (a QK-norm
    model's too: its batch applies the norm apart or inside attention), and on tile slots o_proj, down and gate/up
    tiles fill them whole (`TILE_FILL`)."""
    c = spec.config
    rows = _rows_of(spec)[op]
    if op == "attn_norm_qkv_rope" and whole_head_qkv(spec):
        cands = {c.hd << n for n in range(8)} | set(wave_tiles(rows, workers, align=c.hd, box=c.hd))
    elif op == "attn_norm_qkv_rope":  # a box pair holds 16 RoPE pairs: 32 rows
        base = {8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, c.hd, 2 * c.hd}
        cands = base | set(wave_tiles(rows, workers, align=2, box=2 * BOX_ROWS))
        if c.qk_norm:  # the whole-head tiles that QK-norm inside QKV needs
            cands |= {c.hd * n for n in (1, 2, 4) if c.hd * n <= rows}
    else:
        lo, hi = {"final_norm_lm_head": (256, 8192)}.get(op, (8, 256))
        pows = {1 << k for k in range(20) if lo <= 1 << k <= hi}
        splits = k_split_choices(spec, op) if op in K_SPLIT_OPS else (1,)
        cands = pows | set(wave_tiles(rows, workers, splits))
        if op in TILE_FILL and _tile_slots(spec):  # whole tile slots: a part-filled slot streams as long as a full one
            cands = {min(rows, -(-t // TILE_FILL[op]) * TILE_FILL[op]) for t in cands}
    return tuple(sorted(t for t in cands if 1 <= t <= rows))


#: KV cache length from which the search offers more attention splits (64, 128).
LONG_CONTEXT = 16384


def attn_split_choices(spec: ModelSpec, workers: int) -> tuple[int, ...]:
    """Flash-decode splits: powers of two and the count that makes one wave of attn_partial instructions (workers //
    KV heads); for a long KV cache (max_seq_len >= LONG_CONTEXT) also 64 and 128, since there attention's bytes rival
    the weights' and the balance between its splits and their merge is the search's to find."""
    c = spec.config
    wave = max(1, workers // c.num_key_value_heads)
    pows = {1, 2, 4, 8, 16, 32} | ({64, 128} if spec.max_seq_len >= LONG_CONTEXT else set())
    top = 128 if spec.max_seq_len >= LONG_CONTEXT else 64
    return tuple(sorted(s for s in pows | {wave} if s <= min(top, spec.max_seq_len)))


def edge_choices(spec: ModelSpec) -> tuple[str, ...]:
    """Dependency granularity of one edge as one value ("all", "head", "tile" or "chunk:N"), from coarse to fine:
    "head" sits where its group count (the KV heads) falls among the chunk counts."""
    heads = spec.config.num_key_value_heads
    chunks = [f"chunk:{n}" for n in CHUNK_COUNTS]
    at = sum(1 for n in CHUNK_COUNTS if n < heads)
    return ("all", *chunks[:at], "head", *chunks[at:], "tile")


class SearchSpace:
    """The knobs the proposers search for one model on `workers` SMs, each with its discrete choices, and the moves
    on them (a random point, neighbours, mutations). Everything a schedule decides that changes its speed on the
    interpreter is here: tiles per op (powers of two, one-wave tiles from the worker count, QKV pair tiles of any
    even size), K-splits of o_proj and down_proj, the attention split, the dependency granularity of every edge
    where a finer one can overlap two stages, whether o_proj merges the attention splits itself, where a QK-norm
    model applies its norm, the assignment of instructions to SMs and the order within a queue.

    Not searched, on purpose: a QKV K-split (RoPE needs whole dot products; pair tiles spread QKV instead), counter
    sharing across layers and spatial shares (no effect on speed the cost model or the GPU has shown), and the
    interpreter's compile-time constants (ring slots, boxes per slot, loads in flight: kernel constants, not schedule
    data; measured within 1 % on v10, docs/search.md). A batch folds the merge into o_proj only with one attention
    split (v10 runs no other fold at a batch; v9 none), so there the two knobs move together (`with_value`); where
    the batch runs on interpreter v9, no fold; on v9 (`whole_head_qkv`) whole-head QKV tiles with a QK-norm inside
    QKV; on v10 a batch's QKV tiles are RoPE pairs, as at batch 1, and a QK-norm model's batch chooses between the
    norm apart and inside attention (the default build's forms, `StreamConfig.qk_pairs`)."""

    def __init__(self, spec: ModelSpec, workers: int) -> None:
        self.spec, self.workers = spec, workers
        knobs = [Knob(f"tiles.{op}", tile_choices(spec, workers, op), True, _TILE_WHY[op]) for op in TILED_OPS]
        knobs += [Knob(f"k_splits.{op}", k_split_choices(spec, op), True,
                       "split of the input dimension: more, smaller instructions whose partial sums add into x")
                  for op in K_SPLIT_OPS]
        knobs.append(Knob("attn_splits", attn_split_choices(spec, workers), True,
                          "flash-decode splits of the KV sequence: attention on more SMs, one more merge"))
        if spec.batch == 1:
            knobs.append(Knob("fuse_attn_reduce", (False, True), False,
                              "merge the attention splits inside o_proj: one counter hop less per layer, the merge "
                              "repeated per o_proj row tile (interpreter v10)"))
        elif v10_batch(spec):
            knobs.append(Knob("fuse_attn_reduce", (False, True), False,
                              "no attn_reduce: o_proj stages attention's output itself, one counter hop less per "
                              "layer; at a batch only with one attention split (setting it sets attn_splits 1)"))
        if spec.config.qk_norm and (spec.batch == 1 or v10_batch(spec)):
            modes = ("in_qkv", "apart", "in_attention") if spec.batch == 1 else ("apart", "in_attention")
            knobs.append(Knob("qk_norm", modes, False,
                              "QK-norm inside QKV (whole-head QKV tiles), apart (QKV tiles of any RoPE pairs, then "
                              "one qk_norm_apply per KV head: more SMs on QKV, one counter hop more) or in attention "
                              "(the same QKV tiles; attention normalises q and the new k row, no hop more)"))
        knobs += [Knob(f"edges.{e}", edge_choices(spec), True,
                       "which producers a consumer waits for: all of the stage, its KV head's, a chunk's, its tile's")
                  for e in FINE_EDGES]
        knobs.append(Knob("assignment", tuple(a for a in ASSIGNMENTS if a != "spatial"), False,
                          "how instructions are placed on SMs"))
        knobs.append(Knob("order", ORDERS, False, "order within a queue: by id, or a critical-path list schedule"))
        self.knobs: list[Knob] = knobs
        self.by_name = {k.name: k for k in knobs}

    # -- reading and writing one knob ---------------------------------------------------------------------------
    def value(self, strategy: Strategy, name: str) -> Any:
        """The strategy's value of one knob (a tile size the naive default leaves implicit included)."""
        kind, _, key = name.partition(".")
        if kind == "tiles":
            return strategy.tiles.get(key, Strategy().tiles.get(key))
        if kind == "k_splits":
            return strategy.k_splits.get(key, 1)
        if kind == "edges":
            p, q = key.split("->")
            g = strategy.granularity(p, q)
            return f"chunk:{strategy.n_chunks(p, q)}" if g == "chunk" else g
        if name == "qk_norm" and self.spec.config.qk_norm:  # 'auto' as the lowering reads it
            return qk_norm_mode(self.spec, strategy.qk_norm)
        return getattr(strategy, name)

    def with_value(self, strategy: Strategy, name: str, value: Any) -> Strategy:
        """A copy of the strategy with one knob set."""
        d = strategy.model_dump(mode="json")
        kind, _, key = name.partition(".")
        if kind in ("tiles", "k_splits"):
            d[kind][key] = value
        elif kind == "edges":  # the default granularity is left implicit: one strategy, one spelling
            g, _, n = str(value).partition(":")
            d["chunks"].pop(key, None)
            if g == d["default_granularity"]:
                d["edges"].pop(key, None)
            else:
                d["edges"][key] = g
            if g == "chunk":
                d["chunks"][key] = int(n)
        else:
            d[name] = value
        if self.spec.batch > 1 and d["fuse_attn_reduce"] and d["attn_splits"] != 1:  # a batch folds one split only
            if name == "attn_splits":
                d["fuse_attn_reduce"] = False
            else:
                d["attn_splits"] = 1
        return Strategy.model_validate(d)

    def point(self, strategy: Strategy) -> dict[str, Any]:
        """The strategy as knob -> value (what TPE and the briefing see)."""
        return {k.name: self.value(strategy, k.name) for k in self.knobs}

    def from_point(self, point: dict[str, Any], base: Strategy | None = None) -> Strategy:
        """A strategy with the given knob values set on `base` (default: the naive baseline)."""
        st = base or Strategy()
        for name, value in point.items():
            st = self.with_value(st, name, value)
        return st

    # -- moves ------------------------------------------------------------------------------------------------
    def random(self, rng: random.Random) -> Strategy:
        """A point drawn uniformly, each knob independently."""
        return self.from_point({k.name: rng.choice(k.choices) for k in self.knobs})

    def neighbours(self, strategy: Strategy, knob: str, reach: int = 1) -> list[Any]:
        """Other values of one knob worth trying from this strategy: the `reach` nearest choices on each side for an
        ordered knob (from where the current value would sit), every other choice for a categorical one."""
        k = self.by_name[knob]
        cur = self.value(strategy, knob)
        if k.ordered and cur in k.choices:
            at = k.choices.index(cur)
            lower, upper = list(k.choices[max(0, at - reach):at]), list(k.choices[at + 1:at + 1 + reach])
        elif k.ordered and isinstance(cur, int | float):
            lower = [v for v in k.choices if v < cur][-reach:]
            upper = [v for v in k.choices if v > cur][:reach]
        else:
            return [v for v in k.choices if v != cur]
        return lower[::-1] + upper

    def mutate(self, strategy: Strategy, rng: random.Random, n: int = 1) -> Strategy:
        """Change `n` knobs: an ordered knob mostly to a nearby choice (a step of 1-3), sometimes to any."""
        for _ in range(n):
            k = rng.choice(self.knobs)
            if k.ordered and rng.random() < 0.75:
                options = self.neighbours(strategy, k.name, reach=rng.choice((1, 1, 2, 3)))
            else:
                options = [v for v in k.choices if v != self.value(strategy, k.name)]
            if options:
                strategy = self.with_value(strategy, k.name, rng.choice(options))
        return strategy

    def describe(self) -> list[str]:
        """One line per knob: name, choices, why (the agent's briefing and `synth strategy-schema --space`)."""
        return [f"{k.name}: {list(k.choices)}  ({k.why})" for k in self.knobs]


_TILE_WHY = {
    "attn_norm_qkv_rope": "QKV rows per instruction, RoPE pairs (even; head_dim = a whole head): smaller tiles put "
                          "QKV on more SMs",
    "o_proj_residual": "o_proj rows per instruction",
    "mlp_norm_gate_up": "gate/up rows per instruction (the largest stream: one wave of tiles is the aim)",
    "down_proj_residual": "down_proj rows per instruction",
    "final_norm_lm_head": "LM-head rows per instruction (one wave: ceil(vocab / SMs))",
}
