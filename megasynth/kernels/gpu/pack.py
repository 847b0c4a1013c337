"""Pack pass: a resolved schedule -> the int32 tables the persistent Triton interpreter walks (numpy, no torch).

The tables are data, not code: a new assignment, order or counter layout is a new set of tables for the same compiled
kernel. Layout (all int32):

  ins    [N, ROW]   per instruction, in queue order (worker w's queue is rows qoff[w]:qoff[w+1], so a program reads its
                    next row with no indirection and can load it ahead): opcode, layer, four op arguments in the
                    catalogue's argument order (`OPS[op].args`, then its optional ones: attention's `seq`), the
                    instruction id, (offset, count) into `waits` and `sigs`, the first wait (counter, value) and first
                    signal (counter, add) inline (the common case needs no table access), the instruction's index
                    (ascending-id order), and two L2 warm-up hints (`warm_hints`): rows of this worker's o_proj and
                    gate/up instructions of the same layer whose weights it may start pulling into L2 before this
                    instruction's waits (-1: none), and the fifth op argument (attn_reduce_o_proj's `splits`)
  waits  [NW, 2]    (counter, value) pairs, all waits of each instruction (the first is also inline)
  sigs   [NS, 2]    (counter, add) pairs, likewise
  qoff   [W + 1]    worker offsets into `ins`
  qitems [N]        instruction index of each row (ascending-id order), for the host
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megasynth.ir.catalogue import FUSED_OPROJ, OPS
from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ModelConfig
from megasynth.ir.program import Program, resolve
from megasynth.ir.schedule import Schedule

#: Opcodes: the catalogue table's order, new ops last (one owner per fact: the kernel's `OP_*` constants are checked
#: against this).
OPCODES: dict[str, int] = {name: i for i, name in enumerate(OPS)}
#: QK-norm applied apart from QKV (the strategy's qk_norm = "apart"): interpreter v10 runs these, v9 does not.
QK_APART_OPS = frozenset({"attn_norm_qkv_rope_sq", "qk_norm_apply"})
#: The catalogue ops each interpreter executes (its name -> ops): v10 (kernels/gpu/stream.py) runs every op; v9
#: (kernels/gpu/v9.py) runs neither QK_APART_OPS op (and Megakernel refuses its other limits: QKV tiles of whole heads,
#: no attn_reduce_o_proj).
INTERPRETER_OPS: dict[str, frozenset[str]] = {"v10": frozenset(OPS), "v9": frozenset(OPS) - QK_APART_OPS}
#: The interpreters that run a batched schedule (`model.batch` > 1), one sequence's attention per instruction: v9, and
#: v10 within its batch limits (`check_runs_batched_on_v10`, `stream.batch_limits`).
BATCH_INTERPRETERS = frozenset({"v9", "v10"})
#: The ops some GPU interpreter executes.
GPU_OPS = frozenset().union(*INTERPRETER_OPS.values())
ROW = 19  # fields per instruction row
F_OP, F_LAYER, F_A0, F_ID, F_WOFF, F_WN, F_SOFF, F_SN = 0, 1, 2, 6, 7, 8, 9, 10
F_C0, F_V0, F_SC0, F_SA0, F_IDX, F_WARM_O, F_WARM_GU, F_A4 = 11, 12, 13, 14, 15, 16, 17, 18
#: int64 fields per instruction of a trace buffer: wait start, start, end (ns), worker (the compute side, both
#: interpreters), then when v10's loader reached the instruction and when it issued its last fill, then when v10's
#: compute warps had staged its activations (a batch's attention, or an inlined one: when its positions' loop
#: ended; 0 for ops without either) and when its op ended, before its signals (0 on v9)
TRACE_FIELDS = 8
#: The row field of each op argument, in the catalogue's order.
ARG_FIELDS = (F_A0, F_A0 + 1, F_A0 + 2, F_A0 + 3, F_A4)
#: The ops whose weights a worker warms into L2 while its layer's attention runs (their stream is the next thing the
#: worker does once the attention chain is through, and the chain itself leaves HBM mostly idle).
WARM_OPS = {F_WARM_O: "o_proj_residual", F_WARM_GU: "mlp_norm_gate_up"}
MAX_ARGS = len(ARG_FIELDS)
#: Interpreter v10's batch-1 build streams an o_proj or down instruction's weights by TMA from its first K column,
#: and a TMA box starts on 16 bytes: 8 bf16 columns (a K range starting elsewhere faults on the H200).
K_ALIGN = 8
#: What that build's staging loads take o_proj's and down's K ranges to start and end at multiples of
#: (`StreamConfig.k_vec`): 4 fp32 activations, one 16-byte load.
K_VEC = 4
#: The most sequences interpreter v10 decodes in one step (a batch's wgmma has N = 16, or 32 with hi/lo operands, at
#: most).
V10_MAX_BATCH = 16
#: The smallest batch whose v10 ring slots are [128, 64] tiles of two 64-row halves (`StreamConfig.batch_tiles`'s
#: default; smaller batches keep the batch-1 row-pair slots): the batch lowering rounds tiles to fill them.
V10_TILE_BATCH = 8


def v10_qkv_box_rows(head_dim: int, batch: int, qk_heads: bool = False) -> int:
    """Rows of each RoPE half a v10 batch's QKV tile fill carries, K-packed (`StreamConfig.qkv_box_rows`' default):
    a QKV tile of that many pairs fills its ring slots, so the batch lowering rounds QKV tiles to twice as many rows
    (`lowering.strategy.for_batch`). 32 (half a 64-dim head, a quarter of a 128-dim one); 16 for 64-dim heads, whose
    QKV tiles of 16 pairs then run on twice the SMs (llama-1b at batch 16: 1.065 ms against 1.084 with whole heads;
    at batch 8, with the stage in 2 groups, 0.850 against 0.862 with 32-pair tiles: docs/perf-notes.md). A QK-norm
    model's build whose QKV normalises (`qk_heads`: without `StreamConfig.qk_pairs`), half a head: its tiles are whole
    heads, normalised one head per slot half (`v10_tile_slots`)."""
    if qk_heads:
        return head_dim // 2
    return min(16 if head_dim <= 64 and batch >= V10_TILE_BATCH else 32, head_dim // 2)


def v10_tile_slots(c: ModelConfig, batch: int, batch_tiles: int = V10_TILE_BATCH, qk_heads: bool = False) -> bool:
    """Whether interpreter v10 runs `batch` sequences of this model on [128, 64] tile slots (`StreamConfig.batch_tiles`
    and up) rather than on the batch-1 row-pair slots. A QK-norm model's batch whose QKV normalises (`qk_heads`: a
    build without `StreamConfig.qk_pairs`) always takes tiles: its QKV epilogue normalises each q and k head over the
    head's rows, which a tile slot's 64-row half holds whole (up to 128-dim heads, not K-packed), where a row-pair slot
    holds 16 of them."""
    return batch > 1 and (1 < batch_tiles <= batch or (c.qk_norm and qk_heads))


#: How to select each interpreter, for the messages that send an op to another one.
_HOW = {"v10": "StreamConfig, Megakernel's default on Hopper", "v9": "KernelConfig"}

for _name, _spec in OPS.items():
    if len(_spec.args) > MAX_ARGS:  # pragma: no cover - a catalogue change the kernel must follow
        raise RuntimeError(f"catalogue op {_name} has more than {MAX_ARGS} arguments; widen the packed row")


@dataclass
class Packed:
    """One schedule as interpreter tables (numpy) plus what the host needs to launch and explain it."""

    ins: np.ndarray
    waits: np.ndarray
    sigs: np.ndarray
    qoff: np.ndarray
    qitems: np.ndarray
    workers: int
    counters: int
    max_splits: int
    ids: list[int]
    labels: list[str]
    ops: list[str]
    layers: list[int | None]
    worker_of: list[int]
    expected_counters: np.ndarray  # each counter's value once every instruction has signalled
    device: dict[str, object] = field(default_factory=dict)  # device copies, filled by the interpreter
    schedule: Schedule | None = None  # the packed schedule (for trace metadata)

    @property
    def n(self) -> int:
        return len(self.ids)


def pack_program(prog: Program, interpreter: str = "v10") -> Packed:
    """Pack a resolved program for `interpreter` ("v10" or "v9"); ops the catalogue does not know, or that this
    interpreter does not execute (`INTERPRETER_OPS`), cannot run and raise `ScheduleError`, as does a batch."""
    if interpreter not in INTERPRETER_OPS:
        raise ValueError(f"interpreter must be one of {sorted(INTERPRETER_OPS)}, got {interpreter!r}")
    if prog.geometry is not None and prog.geometry.batch > 1 and interpreter not in BATCH_INTERPRETERS:
        raise ScheduleError(f"interpreter {interpreter} decodes one sequence per step; this schedule decodes "
                            f"{prog.geometry.batch}: interpreter v9 ({_HOW['v9']}) and the CPU executor run batches",
                            "$.model.batch")
    runs = INTERPRETER_OPS[interpreter]
    n = prog.n
    rows = np.zeros((max(n, 1), ROW), dtype=np.int32)  # by instruction index; reordered into queue order below
    waits: list[tuple[int, int]] = []
    sigs: list[tuple[int, int]] = []
    expected = np.zeros(max(prog.counters, 1), dtype=np.int64)
    max_splits = 1
    for i in range(n):
        op = prog.op[i]
        if op not in OPCODES:
            raise ScheduleError(f"op {op!r} is not a catalogue op; the GPU interpreter cannot execute it",
                                f"{prog.path(i)}.op")
        if op not in runs:
            others = [name for name, ops in INTERPRETER_OPS.items() if op in ops]
            raise ScheduleError(f"op {op!r} has no GPU implementation in interpreter {interpreter}: interpreter "
                                f"{' and '.join(others)} runs it ({_HOW[others[0]]})"
                                + (", or lower with the strategy's qk_norm = 'in_qkv'" if op in QK_APART_OPS else ""),
                                f"{prog.path(i)}.op")
        row = rows[i]
        row[F_OP] = OPCODES[op]
        layer = prog.layer[i]
        row[F_LAYER] = layer if layer is not None else 0
        for fld, name in zip(ARG_FIELDS, [*OPS[op].args, *OPS[op].optional], strict=False):
            row[fld] = prog.args[i].get(name, 0)  # an optional argument (attention's `seq`) defaults to 0
        if "splits" in prog.args[i]:
            max_splits = max(max_splits, prog.args[i]["splits"])
        row[F_ID] = prog.ids[i]
        row[F_WOFF], row[F_WN] = len(waits), len(prog.waits[i])
        waits.extend(prog.waits[i])
        row[F_SOFF], row[F_SN] = len(sigs), len(prog.signals[i])
        sigs.extend(prog.signals[i])
        if prog.waits[i]:
            row[F_C0], row[F_V0] = prog.waits[i][0]
        if prog.signals[i]:
            row[F_SC0], row[F_SA0] = prog.signals[i][0]
        row[F_IDX] = i
        for c, add in prog.signals[i]:
            expected[c] += add
    if int(expected.max(initial=0)) >= 2**31:
        raise ScheduleError("a counter's total adds exceed the int32 range", "$.instructions")
    qoff = np.zeros(len(prog.queues) + 1, dtype=np.int32)
    for w, q in enumerate(prog.queues):
        qoff[w + 1] = qoff[w] + len(q)
    qitems = np.array([i for q in prog.queues for i in q] or [0], dtype=np.int32)
    ins = np.ascontiguousarray(rows[qitems]) if n else rows
    warm_hints(prog, qoff, ins)
    return Packed(
        ins=ins, waits=np.array(waits or [(0, 0)], dtype=np.int32).reshape(-1, 2),
        sigs=np.array(sigs or [(0, 0)], dtype=np.int32).reshape(-1, 2), qoff=qoff, qitems=qitems,
        workers=len(prog.queues), counters=prog.counters, max_splits=max_splits, ids=list(prog.ids),
        labels=[prog.label(i) for i in range(n)], ops=list(prog.op), layers=list(prog.layer),
        worker_of=list(prog.worker), expected_counters=expected[:prog.counters].astype(np.int32))


def warm_hints(prog: Program, qoff: np.ndarray, ins: np.ndarray) -> None:
    """Fill the L2 warm-up fields of `ins` (queue order) in place: on each worker, the first instruction of each
    layer points at that worker's first instruction of each `WARM_OPS` op in the same layer (when it is a later
    one). The hints are prefetches only: they change no result and no ordering, so the validator never sees them."""
    ins[:, F_WARM_O] = -1
    ins[:, F_WARM_GU] = -1
    for w, queue in enumerate(prog.queues):
        first: dict[int, int] = {}
        for pos, i in enumerate(queue):
            layer = prog.layer[i]
            if layer is None:
                continue
            trigger = first.setdefault(layer, pos)
            for fld, op in WARM_OPS.items():
                row = ins[qoff[w] + trigger]
                if prog.op[i] == op and pos != trigger and row[fld] < 0:
                    row[fld] = qoff[w] + pos


def pack(schedule: Schedule, interpreter: str = "v10") -> Packed:
    """Resolve (structural checks) and pack a schedule for `interpreter` ("v10", the default on Hopper, or "v9")."""
    packed = pack_program(resolve(schedule), interpreter)
    packed.schedule = schedule
    return packed


def check_runs_on_v9(p: Packed, hd: int, advice: str) -> None:
    """Raise ScheduleError, naming the first instruction's JSON path, where interpreter v9 cannot run the packed
    schedule `p` (`pack` already refused the ops it lacks): it computes QKV a whole head at a time (tiles of
    multiples of `hd` rows), has no attn_reduce folded into o_proj and no QK-norm inside attention. `advice` ends the
    message (what to run instead)."""
    qkv = p.ins[:, F_OP] == OPCODES["attn_norm_qkv_rope"]
    pairs = qkv & (((p.ins[:, F_A0] % hd) != 0) | ((p.ins[:, F_A0 + 1] % hd) != 0))
    fused = p.ins[:, F_OP] == OPCODES[FUSED_OPROJ]
    qk_in_attention = (p.ins[:, F_OP] == OPCODES["attn_partial"]) & (p.ins[:, F_A4] != 0)
    _refuse(p, "v9", advice, (
        (pairs, f"needs QKV tiles of whole heads (multiples of head_dim {hd}); {{}} is not one", "args"),
        (fused, f"has no {FUSED_OPROJ} (attn_reduce folded into o_proj), which {{}} is", "op"),
        (qk_in_attention, "applies no QK-norm inside attention (attn_partial qk_norm 1), which {} asks for", "args")))


def batch_model_limits(c: ModelConfig, batch: int) -> str | None:
    """Why interpreter v10 cannot run a batch of this model, whatever its compile-time settings (None: it can; then
    `stream.batch_limits` checks the settings). A batch's weight products run on the tensor cores, so every K must be
    a multiple of 64 (a QK-norm model's batch then applies the norm inside QKV: `check_runs_batched_on_v10`). Light
    (no torch, no Triton): the search asks it."""
    if batch == 1:
        return None
    if not 1 <= batch <= V10_MAX_BATCH:
        return f"a batch of {batch} is outside 1..{V10_MAX_BATCH}"
    if any(k % 64 for k in (c.hidden_size, c.q_size, c.intermediate_size)):
        return "a batch runs on the tensor cores, which need hidden, q and intermediate sizes that are multiples of 64"
    return None


def default_batch_interpreter(c: ModelConfig, batch: int) -> str:
    """The interpreter a batch of this model runs on where none is named: v10 where it can build the batch
    (`batch_model_limits`), v9 elsewhere. A QK-norm model's batch runs on v10 with `StreamConfig.qk_pairs` (RoPE-pair
    QKV tiles, the norm apart or inside attention): qwen3-1.7b at batch 8 1.756 ms against v9's 4.057, qwen3-8b
    4.84 against 13.34 (docs/perf-notes.md). Light (no torch, no Triton): the lowering and the search ask it."""
    if batch > 1 and batch_model_limits(c, batch) is not None:
        return "v9"
    return "v10"


def odd_residual_rows(p: Packed) -> np.ndarray:
    """The queue rows of o_proj or down (or the folded merge) whose output rows start on an odd row: a build that keeps
    x in fp16 (`StreamConfig.x_dtype`) adds two adjacent rows as one 32-bit reduction, which must be 4-byte aligned
    (the lowering's tiles on tile slots are multiples of 128 rows; a hand-written or v9 schedule's may not be)."""
    ops = [OPCODES["o_proj_residual"], OPCODES["down_proj_residual"], OPCODES[FUSED_OPROJ]]
    return np.isin(p.ins[:, F_OP], ops) & (p.ins[:, F_A0] % 2 != 0)


def check_runs_batched_on_v10(p: Packed, qk_pairs: bool = False, x16: bool = False) -> None:
    """Raise ScheduleError, naming the first instruction's JSON path, where interpreter v10 cannot run the packed
    batched schedule `p`: a batch folds attn_reduce into o_proj only where attention has one split (then o_proj
    stages the partials as they are; a merge of several splits per o_proj row tile measured 16-56 % slower); a QK-norm
    model's build with `qk_pairs` (`StreamConfig.qk_pairs`, its default: RoPE-pair QKV tiles) applies the norm apart
    or inside attention, its build without it (and any other model's) inside QKV, and each has the code of its own
    form only; with x in fp16 (`x16`) o_proj's and down's tiles start on even rows (`odd_residual_rows`)."""
    fused = (p.ins[:, F_OP] == OPCODES[FUSED_OPROJ]) & ((p.ins[:, F_A4] != 1) | (p.max_splits != 1))
    apart = np.isin(p.ins[:, F_OP], [OPCODES[op] for op in sorted(QK_APART_OPS)])
    qk_in_attention = (p.ins[:, F_OP] == OPCODES["attn_partial"]) & (p.ins[:, F_A4] != 0)
    in_qkv = p.ins[:, F_OP] == OPCODES["attn_norm_qkv_rope"]
    heads = ("applies a batch's QK-norm inside QKV (built with qk_pairs false), not {} as {{}} does: build with "
             "qk_pairs (the default)")
    checks = ((fused, f"folds attn_reduce into o_proj ({FUSED_OPROJ}) at a batch only with 1 attention split; {{}} "
                      "merges more: lower the batch with attn_splits 1 or fuse_attn_reduce off", "args"),)
    if qk_pairs:
        checks += ((in_qkv, "built with qk_pairs (QKV tiles of RoPE pairs, the default) applies a batch's QK-norm "
                            "apart or inside attention, not inside QKV as {} does: lower the batch with the "
                            "strategy's qk_norm auto, in_attention or apart, or build with qk_pairs false", "op"),)
    else:
        checks += ((qk_in_attention, heads.format("inside attention"), "args"), (apart, heads.format("apart"), "op"))
    if x16:
        checks += ((odd_residual_rows(p), "keeps x in fp16 and adds two adjacent rows at a time, so an o_proj or down "
                                          "tile starts on an even row; {} starts on an odd one: lower with even "
                                          "tiles, or build with x_dtype fp32", "args"),)
    _refuse(p, "v10", "", checks)


def check_mma_k_starts(p: Packed) -> None:
    """Raise ScheduleError where interpreter v10's tensor-core path (`StreamConfig.mma`, batch 1) cannot run `p`: it
    streams a K range in TMA boxes of 64 columns from its start, so o_proj and down K ranges (and the folded merge's)
    must start at multiples of 64. (A batch build rounds the start down itself and stages zeros below it.)"""
    ops = [OPCODES["o_proj_residual"], OPCODES["down_proj_residual"], OPCODES[FUSED_OPROJ]]
    bad = np.isin(p.ins[:, F_OP], ops) & (p.ins[:, F_A0 + 2] % 64 != 0)
    _refuse(p, "v10", "", ((bad, "multiplies on the tensor cores (mma) from K offsets that are multiples of 64; {} "
                                 "starts elsewhere: split K at multiples of 64, or run with mma off", "args"),))


def misaligned_k_ranges(p: Packed, cfg: ModelConfig) -> np.ndarray:
    """The queue rows whose o_proj or down K range starts off a multiple of `K_ALIGN`, or ends off one before the
    matrix's last column (a hand-written schedule's may; the lowering's never do)."""
    op = p.ins[:, F_OP]
    k0, k1 = p.ins[:, F_A0 + 2], p.ins[:, F_A0 + 3]
    last = np.where(op == OPCODES["o_proj_residual"], cfg.q_size, cfg.intermediate_size)
    ops = np.isin(op, [OPCODES["o_proj_residual"], OPCODES["down_proj_residual"]])
    return ops & ((k0 % K_ALIGN != 0) | ((k1 % K_ALIGN != 0) & (k1 != last)))


def check_k_ranges(p: Packed, cfg: ModelConfig) -> None:
    """Raise ScheduleError where interpreter v10's batch-1 build cannot run `p` (`misaligned_k_ranges`)."""
    why = (f"streams o_proj's and down's weights by TMA from a K range's first column, which must fall on 16 bytes; "
           f"{{}} starts or ends off a multiple of {K_ALIGN} columns: split K at multiples of {K_ALIGN}, or run it on "
           "interpreter v9")
    _refuse(p, "v10", "", ((misaligned_k_ranges(p, cfg), why, "args"),))


def _refuse(p: Packed, interpreter: str, advice: str, checks: tuple[tuple[np.ndarray, str, str], ...]) -> None:
    """ScheduleError for the first check whose mask (over queue rows) holds for some row: its message (formatted with
    the label of the first such instruction, in instruction order) and that instruction's JSON path."""
    for bad, why, key in checks:
        if bad.any():
            k = int(p.qitems[bad].min())
            at = k if p.schedule is None else next(
                j for j, ins in enumerate(p.schedule.instructions) if ins.id == p.ids[k])
            tail = f": {advice}" if advice else ""
            raise ScheduleError(f"interpreter {interpreter} {why.format(p.labels[k])}{tail}",
                                f"$.instructions[{at}].{key}")
