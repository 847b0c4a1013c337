"""The op catalogue of the Llama family's decode step: per op, its arguments, footprint, coverage, cost and compute.

One owner per fact (STYLE.md): the validator reads footprints and coverage from here, the CPU executor and the
reference-checked GPU interpreter read the compute and the buffer layout, the cost model reads bytes and flops, the
agent's briefing reads the argument schemas. This module imports no torch; `compute` functions receive tensors.

Buffers (element counts; fp32 activations, KV cache in the model dtype):
  x            [H]                 residual stream, updated in place (embed writes it, o_proj/down reduce into it)
  q            [nH*hd]             roped queries of the current layer
  k_cache      [L, nKV, hd, S]     keys, roped; a KV head's cache over all positions is one contiguous range, and so
                                   is one of its columns (the footprint's order; the executors store [L, nKV, S, hd])
  v_cache      [L, nKV, hd, S]     values
  attn_o_part  [P, nH, hd]         per-split normalised attention outputs (P = the schedule's largest split count)
  attn_lse     [P, nH]             per-split log-sum-exp
  attn         [nH*hd]             merged attention output of the current layer (not used when attn_reduce is folded
                                   into o_proj: `attn_reduce_o_proj` merges the splits it needs itself)
  act          [I]                 silu(gate) * up
  logits       [V]
  qk_sq        [(nH+nKV)*hd/2]     qk_norm models, QK-norm apart from QKV: each q/k head's per-pair sums of squares
  k_new        [nKV*hd]            ... and the new k rows, weighted and roped but not yet normalised

The KV position `pos` (the token's index) is a runtime input: footprints are the union over every position < S, so
one schedule is valid for every position. Attention over `splits` splits covers, for the sequence length T = pos + 1,
positions [s*T//splits, (s+1)*T//splits) in split s (possibly empty).

A batch (Geometry.batch = B, the schedule's `model.batch`) decodes B sequences per step, each with its own position:
every buffer above is one sequence's part, B times over (sequence b's part of an activation buffer starts at b times
one sequence's size; the caches are [L, B, nKV, hd, S] in footprint order). The ops below describe one sequence; an
instruction of a weight op serves every sequence (`footprint` and `compute` place its accesses and run it per
sequence), one of `PER_SEQ_OPS` serves sequence `args.seq` (default 0).

Weights (read-only, no part in footprints), as `kernels` packs them: `embed` [V,H]; per layer `layers.{l}.attn_norm`
[H], `layers.{l}.wqkv` [q+2kv, H] (q rows, k rows, v rows), `layers.{l}.wo` [H, nH*hd], `layers.{l}.mlp_norm` [H],
`layers.{l}.w_gate` [I,H], `layers.{l}.w_up` [I,H], `layers.{l}.w_down` [H,I]; `final_norm` [H]; `lm_head` [V,H]; with
`qkv_bias` (Qwen2) `layers.{l}.bqkv` [q+2kv], added to the projections; with `qk_norm` (Qwen3) `layers.{l}.q_norm` and
`layers.{l}.k_norm` [hd]: RMSNorm over each q and k head before RoPE. A head's norm needs the whole head's sum of
squares, so for a `qk_norm` model a QKV tile holds whole q and k heads (its bounds inside the q and k rows are
multiples of head_dim; v rows may still be cut into RoPE pairs); the footprints are those of any QKV tile.
Or the norm is applied apart (`attn_norm_qkv_rope_sq`, tiles of any RoPE pairs, then `qk_norm_apply` per KV head): a
per-head scale commutes with RoPE but the per-element norm weight does not, so QKV applies the weight before the
rotation and records each pair's sum of squares; the apply op scales the group's q heads and writes the new k row.
Or attention applies it (`attn_partial` with `qk_norm` 1): each split scales its group's q heads from their sums of
squares as it loads them, and takes the row at pos from `k_new`, scaled, instead of the cache; `qk_norm_apply`
with `k_only` 1 then only writes the new k row into the cache, after the layer's attention (its footprint orders it
after every split's read of the cache), off the chain from QKV to attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megasynth.ir.model import ModelConfig

ACT_BYTES = 4  # fp32 activations
W_BYTES = 2  # bf16 weights and KV cache on the GPU


@dataclass(frozen=True)
class Geometry:
    """A model config plus the sizes a schedule fixes (max sequence length, largest attention split count, the
    number of sequences decoded together)."""

    cfg: ModelConfig
    max_seq_len: int
    max_splits: int = 1
    batch: int = 1

    @functools.cached_property
    def seq_sizes(self) -> dict[str, int]:
        """`seq_buffers`, computed once (footprints of a batch read it per instruction)."""
        return self.seq_buffers()

    def buffers(self) -> dict[str, int]:
        """Element counts of every buffer: one sequence's (`seq_buffers`) times the batch."""
        return {name: size * self.batch for name, size in self.seq_buffers().items()}

    def seq_buffers(self) -> dict[str, int]:
        """One sequence's part of each buffer; sequence b's part of an activation buffer starts at b times this, and
        its KV cache slot is the b-th of each layer's (the caches are [L, B, nKV, hd, S] in footprint order)."""
        c, s = self.cfg, self.max_seq_len
        kv = c.num_hidden_layers * c.num_key_value_heads * s * c.hd
        return {
            "x": c.hidden_size,
            "q": c.q_size,
            "k_cache": kv,
            "v_cache": kv,
            "attn_o_part": self.max_splits * c.q_size,
            "attn_lse": self.max_splits * c.num_attention_heads,
            "attn": c.q_size,
            "act": c.intermediate_size,
            "logits": c.vocab_size,
            **({"qk_sq": (c.num_attention_heads + c.num_key_value_heads) * c.hd // 2,
                "k_new": c.kv_size} if c.qk_norm else {}),
        }

    def kv_head_range(self, layer: int, g0: int, g1: int) -> tuple[int, int]:
        """Element range of KV heads [g0, g1) of one layer, every position, in one sequence's coordinates (as
        footprints are computed; `to_batch` places them in sequence b's cache slot)."""
        c, s = self.cfg, self.max_seq_len
        base = layer * c.num_key_value_heads
        return ((base + g0) * s * c.hd, (base + g1) * s * c.hd)

    def kv_column_range(self, layer: int, g: int, d0: int, d1: int) -> tuple[int, int]:
        """Element range of head-dim columns [d0, d1) of KV head g of one layer, every position."""
        lo, _ = self.kv_head_range(layer, g, g + 1)
        return (lo + d0 * self.max_seq_len, lo + d1 * self.max_seq_len)


def qkv_pair_pieces(cfg: ModelConfig, start: int, end: int) -> list[tuple[int, int, int]]:
    """A QKV tile's rows [start, end), numbered in RoPE-pair order (rows h*hd + 2j and h*hd + 2j + 1 are head h's
    rows j and j + hd/2), as (head, j0, j1): the pairs [j0, j1) of each fused head it covers. A tile of whole heads
    covers the same rows in either numbering."""
    half = cfg.hd // 2
    out = []
    p, pend = start // 2, end // 2
    while p < pend:
        head, j = divmod(p, half)
        n = min(half - j, pend - p)
        out.append((head, j, j + n))
        p += n
    return out


# An access: (kind, buffer, start, end) with kind in {"read", "write", "reduce"}.
Access = tuple[str, str, int, int]

CACHES = ("k_cache", "v_cache")
#: Ops whose instructions serve one sequence (args.seq, default 0); every other op serves the whole batch.
PER_SEQ_OPS = ("attn_partial", "attn_reduce")


def to_batch(geo: Geometry, accesses: list[Access], b: int) -> list[Access]:
    """One sequence's accesses placed in sequence b's part of each buffer: activations shift by b times one
    sequence's size, a cache range moves to sequence b's slot of its layer (a cache range never spans layers)."""
    if geo.batch == 1:
        return accesses
    out: list[Access] = []
    for kind, buf, lo, hi in accesses:
        start, step = _placement(geo, buf, lo)
        out.append((kind, buf, start + b * step, start + b * step + hi - lo))
    return out


def _placement(geo: Geometry, buf: str, lo: int) -> tuple[int, int]:
    """Where sequence 0's copy of one sequence's access from `lo` starts, and the stride to sequence b's: one
    sequence's part of an activation buffer, or one cache slot of the access's layer."""
    if buf in CACHES:
        block = geo.cfg.num_key_value_heads * geo.max_seq_len * geo.cfg.hd
        layer, off = divmod(lo, block)
        return layer * geo.batch * block + off, block
    return lo, geo.seq_sizes[buf]


def _every_sequence(geo: Geometry, one: list[Access]) -> list[Access]:
    """One sequence's accesses placed for every sequence of the batch (`to_batch`), ranges of the same kind and
    buffer that follow on from each other merged, sequence by sequence: a whole-batch read of x becomes one access,
    not B. Sequence b's range is an access's first plus b strides (one sequence's part, or a layer's cache slot), so
    a kind and buffer with one access merges in one step; a validated batch-8 schedule has ~50 000 such footprints."""
    batch = geo.batch
    specs: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for kind, buf, lo, hi in one:
        start, step = _placement(geo, buf, lo)
        specs.setdefault((kind, buf), []).append((start, hi - lo, step))
    out: list[Access] = []
    for (kind, buf), ss in specs.items():
        if len(ss) == 1:
            start, length, step = ss[0]
            if length == step:  # each sequence's range starts where the previous one's ends
                out.append((kind, buf, start, start + batch * step))
            else:
                out.extend((kind, buf, start + b * step, start + b * step + length) for b in range(batch))
            continue
        runs: list[list[int]] = []
        for b in range(batch):
            for start, length, step in ss:
                lo = start + b * step
                if runs and runs[-1][1] == lo:
                    runs[-1][1] = lo + length
                else:
                    runs.append([lo, lo + length])
        out.extend((kind, buf, lo, hi) for lo, hi in runs)
    return out


def sequences(geo: Geometry, op: str, a: Mapping[str, int]) -> range:
    """The sequences an instruction serves."""
    if op in PER_SEQ_OPS:
        return range(a.get("seq", 0), a.get("seq", 0) + 1)
    return range(geo.batch)


def footprint(geo: Geometry, op: str, layer: int, a: dict[str, int]) -> list[Access]:
    """An instruction's accesses over the sequences it serves (one sequence's, from the op, placed per sequence)."""
    one = OPS[op].footprint(geo, layer, a)
    if geo.batch == 1:
        return one
    seqs = sequences(geo, op, a)
    if len(seqs) == 1:
        return to_batch(geo, one, seqs[0])
    return _every_sequence(geo, one)


def seq_views(ws: Mapping[str, Any], rt: Mapping[str, Any], geo: Geometry, b: int) -> tuple[dict, dict]:
    """Sequence b's views of the workspace (activations [B, n] row b; caches [L, B, nKV, S, hd] slot b) and of the
    runtime inputs (pos, token, cos, sin as lists or [B, hd] rows)."""
    per = geo.seq_buffers()
    views = {name: t[:, b] if name in CACHES else t[b * per[name]:(b + 1) * per[name]] if name in per else t
             for name, t in ws.items()}
    return views, {"pos": rt["pos"][b], "token": rt["token"][b], "cos": rt["cos"][b], "sin": rt["sin"][b]}


def compute(ws: Mapping[str, Any], w: Mapping[str, Any], rt: Mapping[str, Any], geo: Geometry, op: str, layer: int,
            a: dict[str, int]) -> None:
    """Run an instruction on the sequences it serves (the op's compute works on one sequence's views)."""
    for b in sequences(geo, op, a):
        views, rt_b = seq_views(ws, rt, geo, b)
        OPS[op].compute(views, w, rt_b, geo, layer, a)
# A coverage tile: the logical output it produces, as (key, ((r0, r1), (k0, k1)), domain ((0, R), (0, K))).
Tile = tuple[tuple[Any, ...], tuple[tuple[int, int], tuple[int, int]], tuple[tuple[int, int], tuple[int, int]]]


class ArgError(ValueError):
    """An instruction's `op`/`layer`/`args` do not fit the catalogue; the message names the argument."""


@dataclass(frozen=True)
class OpSpec:
    """One catalogue op. `args` maps each argument name to its meaning (all are integers)."""

    name: str
    summary: str
    layered: bool
    args: Mapping[str, str]
    check: Callable[[Geometry, int, dict[str, int]], None]
    footprint: Callable[[Geometry, int, dict[str, int]], list[Access]]
    tile: Callable[[Geometry, int, dict[str, int]], Tile]
    cost: Callable[[Geometry, int, dict[str, int], int], tuple[int, int]]  # -> (bytes, flops) at sequence length T
    compute: Callable[..., None]  # one sequence's part: `compute` below runs it for each sequence served
    optional: Mapping[str, str] = dataclasses.field(default_factory=dict)  # arguments with a default of 0


# --------------------------------------------------------------------------------------------------------------
# Argument checks


def _interval(args: dict[str, int], lo: str, hi: str, limit: int, align: int = 1) -> tuple[int, int]:
    a, b = args[lo], args[hi]
    if not 0 <= a < b <= limit:
        raise ArgError(f"args.{lo}/{hi} = [{a}, {b}) must be a non-empty range inside [0, {limit})")
    if a % align or (b % align and b != limit):
        raise ArgError(f"args.{lo}/{hi} = [{a}, {b}) must be aligned to {align}")
    return a, b


def _check_rows(size: Callable[[ModelConfig], int], align: Callable[[ModelConfig], int] = lambda c: 1):
    def check(geo: Geometry, layer: int, args: dict[str, int]) -> None:
        _interval(args, "start", "end", size(geo.cfg), align(geo.cfg))
    return check


def _check_rows_k(rows: Callable[[ModelConfig], int], ks: Callable[[ModelConfig], int]):
    def check(geo: Geometry, layer: int, args: dict[str, int]) -> None:
        _interval(args, "start", "end", rows(geo.cfg))
        _interval(args, "k_start", "k_end", ks(geo.cfg))
    return check


def _check_qkv(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    c = geo.cfg
    start, end = _interval(args, "start", "end", c.qkv_size, 2)
    qk_end = c.q_size + c.kv_size
    if c.qk_norm and ((start < qk_end and start % c.hd) or (end < qk_end and end % c.hd)):
        raise ArgError(f"args.start/end = [{start}, {end}) cuts a q or k head: with qk_norm (RMSNorm over each head) "
                       f"a QKV tile's bounds below row {qk_end} must be multiples of head_dim = {c.hd}")


def _check_qkv_sq(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    if not geo.cfg.qk_norm:
        raise ArgError("attn_norm_qkv_rope_sq is for models with qk_norm (RMSNorm over each q and k head); this "
                       "config has none: use attn_norm_qkv_rope")
    _interval(args, "start", "end", geo.cfg.qkv_size, 2)


def _check_flag(args: dict[str, int], name: str) -> None:
    if args.get(name, 0) not in (0, 1):
        raise ArgError(f"args.{name} = {args[name]} must be 0 or 1")


def _check_kv_head(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    if not geo.cfg.qk_norm:
        raise ArgError("qk_norm_apply is for models with qk_norm; this config has none")
    if not 0 <= args["kv_head"] < geo.cfg.num_key_value_heads:
        raise ArgError(f"args.kv_head = {args['kv_head']} must be in [0, {geo.cfg.num_key_value_heads})")
    _check_flag(args, "k_only")


def _check_seq(geo: Geometry, args: dict[str, int]) -> None:
    if not 0 <= args.get("seq", 0) < geo.batch:
        raise ArgError(f"args.seq = {args['seq']} must be in [0, batch={geo.batch})")


def _check_partial(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    _check_seq(geo, args)
    c = geo.cfg
    if not 0 <= args["kv_head"] < c.num_key_value_heads:
        raise ArgError(f"args.kv_head = {args['kv_head']} must be in [0, {c.num_key_value_heads})")
    if not 1 <= args["splits"] <= geo.max_seq_len:
        raise ArgError(f"args.splits = {args['splits']} must be in [1, max_seq_len]")
    if not 0 <= args["split"] < args["splits"]:
        raise ArgError(f"args.split = {args['split']} must be in [0, splits={args['splits']})")
    _check_flag(args, "qk_norm")
    if args.get("qk_norm", 0) and not c.qk_norm:
        raise ArgError("args.qk_norm = 1 is for models with qk_norm (RMSNorm over each q and k head); this config "
                       "has none")


def _check_splits(geo: Geometry, args: dict[str, int]) -> None:
    if not 1 <= args["splits"] <= geo.max_seq_len:
        raise ArgError(f"args.splits = {args['splits']} must be in [1, max_seq_len]")


def _check_reduce(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    _check_seq(geo, args)
    _interval(args, "start", "end", geo.cfg.num_attention_heads, geo.cfg.group_size)
    _check_splits(geo, args)


def _check_reduce_oproj(geo: Geometry, layer: int, args: dict[str, int]) -> None:
    c = geo.cfg
    _interval(args, "start", "end", c.hidden_size)
    _interval(args, "k_start", "k_end", c.q_size, c.hd)  # whole heads: a head's splits are merged together
    _check_splits(geo, args)


# --------------------------------------------------------------------------------------------------------------
# Footprints


def _fp_embed(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    return [("write", "x", a["start"], a["end"])]


def _fp_qkv(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    c = geo.cfg
    half, nh, nkv = c.hd // 2, c.num_attention_heads, c.num_key_value_heads
    out: list[Access] = [("read", "x", 0, c.hidden_size)]
    for head, j0, j1 in qkv_pair_pieces(c, a["start"], a["end"]):
        cols = [(j0, j1)] if (j0, j1) == (0, half) else [(j0, j1), (half + j0, half + j1)]
        whole = [(0, c.hd)] if (j0, j1) == (0, half) else cols
        if head < nh:
            out.extend(("write", "q", head * c.hd + d0, head * c.hd + d1) for d0, d1 in whole)
        else:
            buf, g = ("k_cache", head - nh) if head < nh + nkv else ("v_cache", head - nh - nkv)
            out.extend(("write", buf, *geo.kv_column_range(layer, g, d0, d1)) for d0, d1 in whole)
    return out


def _fp_qkv_sq(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    """Like QKV's, but q and k pairs are written unnormalised (k to `k_new`, not the cache) along with their sums
    of squares in `qk_sq`; v rows go to the cache as in QKV."""
    c = geo.cfg
    half, nh, nkv = c.hd // 2, c.num_attention_heads, c.num_key_value_heads
    out: list[Access] = [("read", "x", 0, c.hidden_size)]
    for head, j0, j1 in qkv_pair_pieces(c, a["start"], a["end"]):
        cols = [(0, c.hd)] if (j0, j1) == (0, half) else [(j0, j1), (half + j0, half + j1)]
        if head < nh + nkv:
            buf, base = ("q", head * c.hd) if head < nh else ("k_new", (head - nh) * c.hd)
            out.extend(("write", buf, base + d0, base + d1) for d0, d1 in cols)
            out.append(("write", "qk_sq", head * half + j0, head * half + j1))
        else:
            out.extend(("write", "v_cache", *geo.kv_column_range(layer, head - nh - nkv, d0, d1)) for d0, d1 in cols)
    return out


def _fp_norm_inputs(c: ModelConfig, g: int) -> list[Access]:
    """What normalising KV head g's group reads: the sums of squares of its q heads and of its k head, and its new k
    row (unnormalised)."""
    half, nh = c.hd // 2, c.num_attention_heads
    h0, h1 = g * c.group_size, (g + 1) * c.group_size
    return [("read", "qk_sq", h0 * half, h1 * half), ("read", "qk_sq", (nh + g) * half, (nh + g + 1) * half),
            ("read", "k_new", g * c.hd, (g + 1) * c.hd)]


def _fp_qk_apply(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    """The group's q heads are scaled in place (unless `k_only`); the new k row goes from `k_new` into the cache (any
    position: the footprint is the KV head's whole range, as QKV's)."""
    c = geo.cfg
    g = a["kv_head"]
    h0, h1 = g * c.group_size, (g + 1) * c.group_size
    q: list[Access] = [] if a.get("k_only", 0) else [("read", "q", h0 * c.hd, h1 * c.hd),
                                                     ("write", "q", h0 * c.hd, h1 * c.hd)]
    return [*_fp_norm_inputs(c, g), *q, ("write", "k_cache", *geo.kv_head_range(layer, g, g + 1))]


def _fp_partial(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    c = geo.cfg
    g, split = a["kv_head"], a["split"]
    h0, h1 = g * c.group_size, (g + 1) * c.group_size
    nh = c.num_attention_heads
    kv = geo.kv_head_range(layer, g, g + 1)
    return [
        ("read", "q", h0 * c.hd, h1 * c.hd),
        *(_fp_norm_inputs(c, g) if a.get("qk_norm", 0) else []),
        ("read", "k_cache", *kv),
        ("read", "v_cache", *kv),
        ("write", "attn_o_part", (split * nh + h0) * c.hd, (split * nh + h1) * c.hd),
        ("write", "attn_lse", split * nh + h0, split * nh + h1),
    ]


def _fp_split_reads(geo: Geometry, h0: int, h1: int, splits: int) -> list[Access]:
    """What merging the splits of query heads [h0, h1) reads: every split's o and lse of those heads."""
    c, nh = geo.cfg, geo.cfg.num_attention_heads
    out: list[Access] = []
    for s in range(splits):
        out.append(("read", "attn_o_part", (s * nh + h0) * c.hd, (s * nh + h1) * c.hd))
        out.append(("read", "attn_lse", s * nh + h0, s * nh + h1))
    return out


def _fp_reduce(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    h0, h1, hd = a["start"], a["end"], geo.cfg.hd
    return [*_fp_split_reads(geo, h0, h1, a["splits"]), ("write", "attn", h0 * hd, h1 * hd)]


def _fp_oproj(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    return [("read", "attn", a["k_start"], a["k_end"]), ("reduce", "x", a["start"], a["end"])]


def _fp_reduce_oproj(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    hd = geo.cfg.hd
    return [*_fp_split_reads(geo, a["k_start"] // hd, a["k_end"] // hd, a["splits"]),
            ("reduce", "x", a["start"], a["end"])]


def _fp_gate_up(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    return [("read", "x", 0, geo.cfg.hidden_size), ("write", "act", a["start"], a["end"])]


def _fp_down(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    return [("read", "act", a["k_start"], a["k_end"]), ("reduce", "x", a["start"], a["end"])]


def _fp_lm_head(geo: Geometry, layer: int, a: dict[str, int]) -> list[Access]:
    return [("read", "x", 0, geo.cfg.hidden_size), ("write", "logits", a["start"], a["end"])]


# --------------------------------------------------------------------------------------------------------------
# Coverage tiles: each logical output of each layer must be produced exactly once.


def _tile_rows(op: str, size: Callable[[ModelConfig], int]):
    def tile(geo: Geometry, layer: int, a: dict[str, int]) -> Tile:
        return (op, layer), ((a["start"], a["end"]), (0, 1)), ((0, size(geo.cfg)), (0, 1))
    return tile


def _tile_rows_k(op: str, rows: Callable[[ModelConfig], int], ks: Callable[[ModelConfig], int]):
    def tile(geo: Geometry, layer: int, a: dict[str, int]) -> Tile:
        c = geo.cfg
        return (op, layer), ((a["start"], a["end"]), (a["k_start"], a["k_end"])), ((0, rows(c)), (0, ks(c)))
    return tile


def _tile_qk_apply(geo: Geometry, layer: int, a: dict[str, int]) -> Tile:
    return ("qk_norm_apply", layer, a["kv_head"]), ((0, 1), (0, 1)), ((0, 1), (0, 1))


def _seq_key(geo: Geometry, a: dict[str, int]) -> tuple[int, ...]:
    """A per-sequence op's coverage key gains the sequence in a batch (batch 1 keeps the keys it always had)."""
    return (a.get("seq", 0),) if geo.batch > 1 else ()


def _tile_partial(geo: Geometry, layer: int, a: dict[str, int]) -> Tile:
    key = ("attn_partial", layer, a["kv_head"], *_seq_key(geo, a))
    return key, ((a["split"], a["split"] + 1), (0, 1)), ((0, a["splits"]), (0, 1))


def _tile_reduce(geo: Geometry, layer: int, a: dict[str, int]) -> Tile:
    key = ("attn_reduce", layer, *_seq_key(geo, a))
    return key, ((a["start"], a["end"]), (0, 1)), ((0, geo.cfg.num_attention_heads), (0, 1))


# --------------------------------------------------------------------------------------------------------------
# Cost: (bytes moved through device memory, flops) at sequence length T = pos + 1, for the cost model.


def _cost_matvec(rows_of: Callable[[dict[str, int]], int], k_of: Callable[[Geometry, dict[str, int]], int],
                 norm: bool = False, out_mult: int = 1):
    def cost(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
        r, k, n = rows_of(a), k_of(geo, a), geo.batch  # the weights once, the activations of every sequence
        inp = geo.cfg.hidden_size if norm else k
        nbytes = r * out_mult * k * W_BYTES + n * (inp * ACT_BYTES + r * ACT_BYTES * (2 if not norm else 1))
        return nbytes, 2 * r * out_mult * k * n
    return cost


def _rows(a: dict[str, int]) -> int:
    return a["end"] - a["start"]


_cost_qkv_matvec = _cost_matvec(_rows, lambda g, a: g.cfg.hidden_size, norm=True)


def _cost_qkv(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    """The matvec, plus a bias element per row (qkv_bias) and the head_dim weights of each QK norm the tile uses
    (qk_norm: q_norm when it holds q rows, k_norm when it holds k rows; every head of the tile shares them)."""
    nbytes, flops = _cost_qkv_matvec(geo, layer, a, seq)
    c = geo.cfg
    if c.qkv_bias:
        nbytes += _rows(a) * W_BYTES
    if c.qk_norm:
        norms = (a["start"] < c.q_size) + (a["start"] < c.q_size + c.kv_size and a["end"] > c.q_size)
        nbytes += norms * c.hd * W_BYTES
    return nbytes, flops


def _cost_qk_apply(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    """Sums of squares and q heads read, q heads written (fp32), the k row read (fp32) and written (cache dtype);
    with `k_only` the k head's part only."""
    c = geo.cfg
    qh = 0 if a.get("k_only", 0) else c.group_size
    heads = qh + 1
    one = heads * c.hd // 2 * ACT_BYTES + 2 * qh * c.hd * ACT_BYTES + c.hd * (ACT_BYTES + W_BYTES)
    return geo.batch * one, geo.batch * 3 * heads * c.hd


def _cost_partial(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    c = geo.cfg
    n = (a["split"] + 1) * seq // a["splits"] - a["split"] * seq // a["splits"]
    kv_bytes = 2 * n * c.hd * W_BYTES
    io = (c.group_size * c.hd * 2 + c.group_size) * ACT_BYTES
    if a.get("qk_norm", 0):  # the sums of squares of the group and its k head, and the new k row
        io += ((c.group_size + 1) * c.hd // 2 + c.hd) * ACT_BYTES
    return kv_bytes + io, 4 * n * c.hd * c.group_size


def _merge_cost(heads: int, hd: int, splits: int) -> tuple[int, int]:
    """(bytes read, flops) of merging `splits` splits of `heads` query heads."""
    return splits * heads * (hd + 1) * ACT_BYTES, 3 * splits * heads * hd


def _cost_reduce(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    heads, hd = a["end"] - a["start"], geo.cfg.hd
    nbytes, flops = _merge_cost(heads, hd, a["splits"])
    return nbytes + heads * hd * ACT_BYTES, flops


def _cost_reduce_oproj(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    k, n = a["k_end"] - a["k_start"], geo.batch
    mb, mf = _merge_cost(k // geo.cfg.hd, geo.cfg.hd, a["splits"])
    rows = a["end"] - a["start"]
    return rows * k * W_BYTES + n * (mb + 2 * rows * ACT_BYTES), n * (mf + 2 * rows * k)


def _cost_embed(geo: Geometry, layer: int, a: dict[str, int], seq: int) -> tuple[int, int]:
    return geo.batch * _rows(a) * (W_BYTES + ACT_BYTES), 0


# --------------------------------------------------------------------------------------------------------------
# Compute (PyTorch; tensors passed in). `ws` maps buffer names to flat fp32 tensors (k/v caches shaped
# [L, nKV, S, hd]), `w` maps weight names to tensors, `rt` holds the runtime inputs: `pos`, `token`, `cos`, `sin`.


def rope_inv_freq(cfg: ModelConfig, rope_scaling: Mapping[str, Any] | None = None) -> list[float]:
    """RoPE inverse frequencies, with Llama-3's frequency scaling when `rope_scaling` asks for it."""
    hd = cfg.hd
    inv = [1.0 / (cfg.rope_theta ** (i / hd)) for i in range(0, hd, 2)]
    scaling = rope_scaling if rope_scaling is not None else cfg.rope_scaling_dict()
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv
    factor = scaling["factor"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    lo_wave, hi_wave = old / lo, old / hi
    out = []
    for f in inv:
        wave = 2 * math.pi / f
        if wave < hi_wave:
            out.append(f)
        elif wave > lo_wave:
            out.append(f / factor)
        else:
            smooth = (old / wave - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _rmsnorm(x: Any, weight: Any, eps: float) -> Any:
    xf = x.float()
    return xf * (xf.pow(2).mean() + eps).rsqrt() * weight.float()


def _c_embed(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    ws["x"][a["start"]:a["end"]] = w["embed"][rt["token"], a["start"]:a["end"]].float()


def _qkv_pairs(ws, w, geo: Geometry, layer: int, a: dict[str, int]) -> Iterator[tuple[int, int, int, Any, Any]]:
    """A QKV tile's projections, piece by piece: (head, j0, j1, y1, y2) with y1 the rows of pairs [j0, j1) of the
    fused head and y2 their partners (rows j + hd/2), bias added (qkv_bias); both QKV ops start from these."""
    c = geo.cfg
    half = c.hd // 2
    xn = _rmsnorm(ws["x"], w[f"layers.{layer}.attn_norm"], c.rms_norm_eps)
    wqkv = w[f"layers.{layer}.wqkv"]
    bias = w[f"layers.{layer}.bqkv"] if c.qkv_bias else None
    for head, j0, j1 in qkv_pair_pieces(c, a["start"], a["end"]):
        r = head * c.hd
        y1 = wqkv[r + j0:r + j1].float() @ xn
        y2 = wqkv[r + half + j0:r + half + j1].float() @ xn
        if bias is not None:
            y1, y2 = y1 + bias[r + j0:r + j1].float(), y2 + bias[r + half + j0:r + half + j1].float()
        yield head, j0, j1, y1, y2


def _rope(rt, j0: int, j1: int, y1: Any, y2: Any) -> tuple[Any, Any]:
    """RoPE on pairs [j0, j1) (HF convention): (y1, y2) -> (y1 cos - y2 sin, y2 cos + y1 sin)."""
    cs, sn = rt["cos"][j0:j1], rt["sin"][j0:j1]  # [hd]: the first and second halves repeat the pair frequencies
    return y1 * cs - y2 * sn, y2 * cs + y1 * sn


def _c_qkv(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    half, nh, nkv = c.hd // 2, c.num_attention_heads, c.num_key_value_heads
    for head, j0, j1, y1, y2 in _qkv_pairs(ws, w, geo, layer, a):
        r = head * c.hd
        if c.qk_norm and head < nh + nkv:  # the check keeps q and k tiles whole heads: (j0, j1) == (0, half)
            g = w[f"layers.{layer}.q_norm" if head < nh else f"layers.{layer}.k_norm"].float()
            inv = ((y1.pow(2).sum() + y2.pow(2).sum()) / c.hd + c.rms_norm_eps).rsqrt()
            y1, y2 = y1 * inv * g[:half], y2 * inv * g[half:]
        if head < nh + nkv:
            y1, y2 = _rope(rt, j0, j1, y1, y2)
        if head < nh:
            dst = ws["q"][r:r + c.hd]
        else:
            buf, g = ("k_cache", head - nh) if head < nh + nkv else ("v_cache", head - nh - nkv)
            dst = ws[buf][layer, g, rt["pos"]]
        dst[j0:j1] = y1
        dst[half + j0:half + j1] = y2


def split_range(seq: int, split: int, splits: int) -> tuple[int, int]:
    """Positions [start, end) that split `split` of `splits` covers at sequence length `seq`."""
    return split * seq // splits, (split + 1) * seq // splits


def _c_qkv_sq(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    half, nh, nkv = c.hd // 2, c.num_attention_heads, c.num_key_value_heads
    for head, j0, j1, y1, y2 in _qkv_pairs(ws, w, geo, layer, a):
        if head < nh + nkv:  # the norm weight before the rotation; the per-head scale comes in qk_norm_apply
            ws["qk_sq"][head * half + j0:head * half + j1] = y1.pow(2) + y2.pow(2)
            g = w[f"layers.{layer}.q_norm" if head < nh else f"layers.{layer}.k_norm"].float()
            y1, y2 = _rope(rt, j0, j1, y1 * g[j0:j1], y2 * g[half + j0:half + j1])
            dst = ws["q"][head * c.hd:(head + 1) * c.hd] if head < nh else \
                ws["k_new"][(head - nh) * c.hd:(head - nh + 1) * c.hd]
        else:
            dst = ws["v_cache"][layer, head - nh - nkv, rt["pos"]]
        dst[j0:j1] = y1
        dst[half + j0:half + j1] = y2


def _head_scale(ws, geo: Geometry, head: int) -> Any:
    """rsqrt(mean square + eps) of one q or k head (k head g is head nH + g), from its pairs' sums of squares."""
    c = geo.cfg
    return (ws["qk_sq"].view(-1, c.hd // 2)[head].sum() / c.hd + c.rms_norm_eps).rsqrt()


def _new_k(ws, geo: Geometry, g: int) -> Any:
    """KV head g's new k row, normalised (from `k_new`)."""
    c = geo.cfg
    return ws["k_new"][g * c.hd:(g + 1) * c.hd] * _head_scale(ws, geo, c.num_attention_heads + g)


def _c_qk_apply(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    g = a["kv_head"]
    if not a.get("k_only", 0):
        for h in range(g * c.group_size, (g + 1) * c.group_size):
            ws["q"][h * c.hd:(h + 1) * c.hd] *= _head_scale(ws, geo, h)
    ws["k_cache"][layer, g, rt["pos"]] = _new_k(ws, geo, g)


def _c_partial(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    g, split, nh = a["kv_head"], a["split"], c.num_attention_heads
    h0, h1 = g * c.group_size, (g + 1) * c.group_size
    lo, hi = split_range(rt["pos"] + 1, split, a["splits"])
    o = ws["attn_o_part"].view(-1, nh, c.hd)[split, h0:h1]
    lse = ws["attn_lse"].view(-1, nh)[split, h0:h1]
    if lo == hi:
        o.zero_()
        lse.fill_(float("-inf"))
        return
    q = ws["q"].view(nh, c.hd)[h0:h1]
    k = ws["k_cache"][layer, g, lo:hi].float()
    if a.get("qk_norm", 0):  # q and the row at pos arrive unnormalised; the row at pos is not in the cache yet
        q = q.clone()
        for i in range(h1 - h0):
            q[i] *= _head_scale(ws, geo, h0 + i)
        if lo <= rt["pos"] < hi:
            k[rt["pos"] - lo] = _new_k(ws, geo, g).to(ws["k_cache"].dtype).float()
    v = ws["v_cache"][layer, g, lo:hi].float()
    scores = (q @ k.T) * (1.0 / math.sqrt(c.hd))
    m = scores.max(dim=-1, keepdim=True).values
    p = (scores - m).exp()
    denom = p.sum(dim=-1, keepdim=True)
    o.copy_((p @ v) / denom)
    lse.copy_((m + denom.log()).squeeze(-1))


def _merged(ws, geo: Geometry, h0: int, h1: int, splits: int) -> Any:
    """The attention output of query heads [h0, h1) merged over `splits` splits by log-sum-exp, flat."""
    c = geo.cfg
    nh = c.num_attention_heads
    o = ws["attn_o_part"].view(-1, nh, c.hd)[:splits, h0:h1]
    lse = ws["attn_lse"].view(-1, nh)[:splits, h0:h1]
    total = lse.logsumexp(dim=0)
    weight = (lse - total).exp().unsqueeze(-1)
    return (weight * o).sum(dim=0).reshape(-1)


def _c_reduce(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    hd = geo.cfg.hd
    ws["attn"][a["start"] * hd:a["end"] * hd] = _merged(ws, geo, a["start"], a["end"], a["splits"])


def _c_oproj(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    s, e, k0, k1 = a["start"], a["end"], a["k_start"], a["k_end"]
    ws["x"][s:e] += w[f"layers.{layer}.wo"][s:e, k0:k1].float() @ ws["attn"][k0:k1]


def _c_reduce_oproj(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    s, e, k0, k1, hd = a["start"], a["end"], a["k_start"], a["k_end"], geo.cfg.hd
    ws["x"][s:e] += w[f"layers.{layer}.wo"][s:e, k0:k1].float() @ _merged(ws, geo, k0 // hd, k1 // hd, a["splits"])


def _c_gate_up(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    xn = _rmsnorm(ws["x"], w[f"layers.{layer}.mlp_norm"], c.rms_norm_eps)
    s, e = a["start"], a["end"]
    gate = w[f"layers.{layer}.w_gate"][s:e].float() @ xn
    up = w[f"layers.{layer}.w_up"][s:e].float() @ xn
    ws["act"][s:e] = gate * gate.sigmoid() * up


def _c_down(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    s, e, k0, k1 = a["start"], a["end"], a["k_start"], a["k_end"]
    ws["x"][s:e] += w[f"layers.{layer}.w_down"][s:e, k0:k1].float() @ ws["act"][k0:k1]


def _c_lm_head(ws, w, rt, geo: Geometry, layer: int, a: dict[str, int]) -> None:
    c = geo.cfg
    xn = _rmsnorm(ws["x"], w["final_norm"], c.rms_norm_eps)
    ws["logits"][a["start"]:a["end"]] = w["lm_head"][a["start"]:a["end"]].float() @ xn


# --------------------------------------------------------------------------------------------------------------
# The table

_ROWS = {"start": "first output row (inclusive)", "end": "last output row (exclusive)"}
_ROWS_K = {**_ROWS, "k_start": "first input column of the K-split (inclusive)",
           "k_end": "last input column of the K-split (exclusive); partial sums are reduce-added into x"}

OPS: dict[str, OpSpec] = {
    op.name: op
    for op in [
        OpSpec("embed", "x[start:end] = embed[token, start:end]", False, _ROWS,
               _check_rows(lambda c: c.hidden_size), _fp_embed,
               _tile_rows("embed", lambda c: c.hidden_size), _cost_embed, _c_embed),
        OpSpec("attn_norm_qkv_rope",
               "rows [start,end) of wqkv @ rmsnorm(x); RoPE on q/k heads; q to `q`, k/v appended to the cache at pos",
               True, {"start": "first fused-QKV row, even (rows in RoPE-pair order: a head's rows 2j, 2j+1 are its "
                               "rows j, j+hd/2; whole heads are the same rows in either order; with qk_norm, q and k "
                               "tiles are whole heads)",
                      "end": "end row, even"},
               _check_qkv, _fp_qkv,
               _tile_rows("attn_norm_qkv_rope", lambda c: c.qkv_size), _cost_qkv, _c_qkv),
        OpSpec("attn_partial",
               "attention of the query heads of one KV head over one split of the sequence; writes o and lse",
               True, {"kv_head": "KV head (its group of query heads)", "split": "split index",
                      "splits": "number of splits of the sequence"},
               _check_partial, _fp_partial, _tile_partial, _cost_partial, _c_partial,
               {"seq": "sequence of the batch whose attention it computes (default 0)",
                "qk_norm": "1: apply the QK-norm here (a qk_norm model whose QKV is attn_norm_qkv_rope_sq): scale "
                           "the group's q heads from their sums of squares and take the row at pos from `k_new`, "
                           "scaled; that layer's qk_norm_apply then has k_only 1 (default 0)"}),
        OpSpec("attn_reduce", "merge the splits of query heads [start,end) by log-sum-exp into `attn`", True,
               {"start": "first query head, a multiple of the GQA group", "end": "end query head",
                "splits": "number of splits to merge (must match attn_partial)"},
               _check_reduce, _fp_reduce, _tile_reduce, _cost_reduce, _c_reduce,
               {"seq": "sequence of the batch it merges (default 0)"}),
        OpSpec("o_proj_residual", "x[start:end] += wo[start:end, k_start:k_end] @ attn[k_start:k_end]", True,
               _ROWS_K, _check_rows_k(lambda c: c.hidden_size, lambda c: c.q_size), _fp_oproj,
               _tile_rows_k("o_proj_residual", lambda c: c.hidden_size, lambda c: c.q_size),
               _cost_matvec(_rows, lambda g, a: a["k_end"] - a["k_start"]), _c_oproj),
        OpSpec("attn_reduce_o_proj",
               "attn_reduce folded into o_proj: x[start:end] += wo[start:end, k_start:k_end] @ the attention output "
               "of columns [k_start, k_end), merged from its splits here (no `attn` buffer, one counter hop less)",
               True, {**_ROWS_K, "k_start": "first input column, a multiple of head_dim (whole query heads)",
                      "k_end": "end input column, a multiple of head_dim",
                      "splits": "number of splits to merge (must match attn_partial)"},
               _check_reduce_oproj, _fp_reduce_oproj,
               _tile_rows_k("o_proj_residual", lambda c: c.hidden_size, lambda c: c.q_size),
               _cost_reduce_oproj, _c_reduce_oproj),
        OpSpec("mlp_norm_gate_up", "act[start:end] = silu(w_gate @ rmsnorm(x)) * (w_up @ rmsnorm(x)), rows [start,end)",
               True, _ROWS, _check_rows(lambda c: c.intermediate_size), _fp_gate_up,
               _tile_rows("mlp_norm_gate_up", lambda c: c.intermediate_size),
               _cost_matvec(_rows, lambda g, a: g.cfg.hidden_size, norm=True, out_mult=2), _c_gate_up),
        OpSpec("down_proj_residual", "x[start:end] += w_down[start:end, k_start:k_end] @ act[k_start:k_end]", True,
               _ROWS_K, _check_rows_k(lambda c: c.hidden_size, lambda c: c.intermediate_size), _fp_down,
               _tile_rows_k("down_proj_residual", lambda c: c.hidden_size, lambda c: c.intermediate_size),
               _cost_matvec(_rows, lambda g, a: a["k_end"] - a["k_start"]), _c_down),
        OpSpec("final_norm_lm_head", "logits[start:end] = lm_head[start:end] @ rmsnorm(x)", False, _ROWS,
               _check_rows(lambda c: c.vocab_size), _fp_lm_head,
               _tile_rows("final_norm_lm_head", lambda c: c.vocab_size),
               _cost_matvec(_rows, lambda g, a: g.cfg.hidden_size, norm=True), _c_lm_head),
        OpSpec("attn_norm_qkv_rope_sq",
               "QKV of a qk_norm model with the norm applied apart: rows [start,end) of wqkv @ rmsnorm(x); q and k "
               "pairs times their norm weight, roped, to `q` and `k_new`, their sums of squares to `qk_sq`; v rows "
               "to the cache at pos", True,
               {"start": "first fused-QKV row, even (RoPE-pair order, as attn_norm_qkv_rope; any pair range)",
                "end": "end row, even"},
               _check_qkv_sq, _fp_qkv_sq, _tile_rows("attn_norm_qkv_rope_sq", lambda c: c.qkv_size), _cost_qkv,
               _c_qkv_sq),
        OpSpec("qk_norm_apply",
               "QK-norm of one KV head's group: its q heads times rsqrt(mean square + eps) in place, and its new k "
               "row, so scaled, from `k_new` into the cache at pos", True,
               {"kv_head": "KV head (its group of query heads)"},
               _check_kv_head, _fp_qk_apply, _tile_qk_apply, _cost_qk_apply, _c_qk_apply,
               {"k_only": "1: write only the k row (attention applies the norm itself: attn_partial's qk_norm 1); "
                          "default 0"}),
    ]
}

#: Op order within a decode step (the order `ids` follow in a lowering). The table's own order (new ops last) gives
#: the interpreters' opcodes, so that adding an op leaves the others' codes alone.
OP_ORDER = ["embed", "attn_norm_qkv_rope", "attn_norm_qkv_rope_sq", "qk_norm_apply", "attn_partial", "attn_reduce",
            "o_proj_residual", "attn_reduce_o_proj", "mlp_norm_gate_up", "down_proj_residual", "final_norm_lm_head"]
assert sorted(OP_ORDER) == sorted(OPS), "OP_ORDER lists every catalogue op once"


def check_instruction(geo: Geometry, op: str, layer: int | None, args: Mapping[str, Any]) -> dict[str, int]:
    """Check an instruction's layer and args against the catalogue; return the args as ints or raise `ArgError`."""
    spec = OPS[op]
    if spec.layered:
        if layer is None or not 0 <= layer < geo.cfg.num_hidden_layers:
            raise ArgError(f"layer must be in [0, {geo.cfg.num_hidden_layers}) for {op}, got {layer}")
    elif layer is not None:
        raise ArgError(f"{op} takes no layer, got {layer}")
    missing = [k for k in spec.args if k not in args]
    if missing:
        raise ArgError(f"args.{missing[0]} is missing ({spec.args[missing[0]]})")
    extra = [k for k in args if k not in spec.args and k not in spec.optional]
    if extra:
        raise ArgError(f"args.{extra[0]} is not an argument of {op} (it takes "
                       f"{', '.join([*spec.args, *spec.optional])})")
    out: dict[str, int] = {}
    for k in [*spec.args, *(k for k in spec.optional if k in args)]:
        v = args[k]
        if not isinstance(v, int) or isinstance(v, bool) or not -(2**31) <= v < 2**31:
            raise ArgError(f"args.{k} must be a 32-bit integer, got {v!r}")
        out[k] = v
    spec.check(geo, layer if layer is not None else -1, out)
    return out


#: Ops that merge attention splits, and the op whose output tiles the fused one produces (it covers o_proj's output;
#: a layer whose o_proj is fused throughout needs no attn_reduce).
FUSED_OPROJ = "attn_reduce_o_proj"
MERGE_OPS = ("attn_reduce", FUSED_OPROJ)


def required_tiles(geo: Geometry, unfused: set[int] | None = None,
                   qk_apart: set[int] | None = None) -> list[tuple[Any, ...]]:
    """Every coverage key a complete decode step must produce. `unfused`: the layers with a plain o_proj
    instruction (default: all); attn_reduce is required in those only. `qk_apart`: the layers whose QKV applies the
    QK-norm apart (attn_norm_qkv_rope_sq, then qk_norm_apply of every KV head; default: none)."""
    c = geo.cfg
    seqs = [(b,) for b in range(geo.batch)] if geo.batch > 1 else [()]
    keys: list[tuple[Any, ...]] = [("embed", -1)]
    for layer in range(c.num_hidden_layers):
        if qk_apart and layer in qk_apart:
            keys.append(("attn_norm_qkv_rope_sq", layer))
            keys.extend(("qk_norm_apply", layer, g) for g in range(c.num_key_value_heads))
        else:
            keys.append(("attn_norm_qkv_rope", layer))
        keys.extend(("attn_partial", layer, g, *b) for b in seqs for g in range(c.num_key_value_heads))
        if unfused is None or layer in unfused:
            keys.extend(("attn_reduce", layer, *b) for b in seqs)
        keys.extend([("o_proj_residual", layer), ("mlp_norm_gate_up", layer), ("down_proj_residual", layer)])
    keys.append(("final_norm_lm_head", -1))
    return keys
