"""The CPU executor: runs a schedule of catalogue ops with PyTorch in one legal, seeded interleaving of its workers.

Semantics (docs/design.md §2): each worker runs its queue in order; an instruction starts once every wait
`counters[c] >= value` holds, runs the catalogue's `compute`, then adds its signals. At every step one runnable worker
is picked at random (seeded), so different seeds give different legal interleavings: a schedule that is race-free
gives the same logits under all of them, which is what the tests check against the reference decode step. When no
worker can run and some queue is unfinished, `DeadlockError` names each stuck instruction and the counter it waits
on; the executor never spins.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megasynth.ir.catalogue import OPS, compute
from megasynth.ir.program import Program, resolve
from megasynth.ir.schedule import Schedule
from megasynth.kernels.reference import rope_cos_sin

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Stuck:
    """A worker that cannot proceed: its next instruction and the first wait it fails."""

    worker: int
    id: int
    op: str
    layer: int | None
    counter: int
    current: int
    needed: int

    def describe(self) -> str:
        layer = f" L{self.layer}" if self.layer is not None else ""
        return (f"worker {self.worker}: #{self.id} {self.op}{layer} waits on counter {self.counter} "
                f"(now {self.current}, needs {self.needed})")


class DeadlockError(RuntimeError):
    """No worker can run and some queue is unfinished. `stuck` lists the blocked workers; `order` what ran."""

    def __init__(self, stuck: list[Stuck], order: list[int], total: int, shown: int = 8) -> None:
        self.stuck, self.order = stuck, order
        more = f"; and {len(stuck) - shown} more" if len(stuck) > shown else ""
        super().__init__(f"deadlock after {len(order)} of {total} instructions: "
                         + "; ".join(s.describe() for s in stuck[:shown]) + more)


class ExecutorError(ValueError):
    """The schedule or the inputs cannot be executed here (not a catalogue schedule, wrong cache shape, ...)."""


def _inputs(prog: Program, k_cache: torch.Tensor, v_cache: torch.Tensor, token: int | Sequence[int],
            pos: int | Sequence[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The tokens and positions as lists of the batch's length and the caches as [L, B, nKV, S, hd] views; a defect
    raises `ExecutorError` naming it."""
    geo = prog.geometry
    if geo is None:
        raise ExecutorError("$.model: the CPU executor needs a schedule with a model")
    for i in range(prog.n):
        if prog.op[i] not in OPS:
            raise ExecutorError(f"{prog.path(i)}.op: {prog.op[i]!r} is not a catalogue op")
    c, n = geo.cfg, geo.batch
    tokens = list(token) if isinstance(token, list | tuple) else [int(token)]  # a scalar: one sequence
    positions = list(pos) if isinstance(pos, list | tuple) else [int(pos)]
    if len(tokens) != n or len(positions) != n:
        raise ExecutorError(f"the schedule decodes {n} sequence(s) per step; got {len(tokens)} token(s) and "
                            f"{len(positions)} position(s)")
    want = (c.num_hidden_layers, n, c.num_key_value_heads, geo.max_seq_len, c.hd)
    caches = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if n == 1 and cache.dim() == 4:
            cache = cache.unsqueeze(1)  # one sequence's [L, nKV, S, hd] cache, as a slot of a batch of one
        if tuple(cache.shape) != want:
            raise ExecutorError(f"{name} has shape {list(cache.shape)}; the schedule needs {list(want)}"
                                + (f" or {[want[0], *want[2:]]}" if n == 1 else ""))
        caches.append(cache)
    for b, (t, p) in enumerate(zip(tokens, positions, strict=True)):
        where = f"sequence {b}: " if n > 1 else ""
        if not 0 <= p < geo.max_seq_len:
            raise ExecutorError(f"{where}pos {p} outside [0, max_seq_len={geo.max_seq_len})")
        if not 0 <= t < c.vocab_size:
            raise ExecutorError(f"{where}token {t} outside the vocabulary [0, {c.vocab_size})")
    return tokens, positions, caches[0], caches[1]


def workspace(prog: Program, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """Flat fp32 activation buffers, filled with NaN so that a read of never-written data poisons the logits;
    the caller's caches stand in for k_cache/v_cache."""
    ws = {name: torch.full((size,), float("nan"), dtype=torch.float32, device=k_cache.device)
          for name, size in prog.buffers.items() if name not in ("k_cache", "v_cache")}
    ws["k_cache"], ws["v_cache"] = k_cache, v_cache
    return ws


def run_program(prog: Program, weights: Weights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                token: int | Sequence[int], pos: int | Sequence[int], *, seed: int = 0, max_steps: int | None = None,
                trace: list[int] | None = None) -> torch.Tensor:
    """`run_schedule` on an already resolved `Program` (resolve once, run many interleavings)."""
    tokens, positions, k5, v5 = _inputs(prog, k_cache, v_cache, token, pos)
    geo = prog.geometry
    assert geo is not None
    rope = [rope_cos_sin(geo.cfg, p, k_cache.device) for p in positions]
    rt = {"pos": positions, "token": tokens, "cos": torch.stack([r[0] for r in rope]),
          "sin": torch.stack([r[1] for r in rope])}
    ws = workspace(prog, k5, v5)
    rng = random.Random(seed)
    counters = [0] * prog.counters
    head = [0] * len(prog.queues)
    order: list[int] = [] if trace is None else trace
    start = len(order)
    limit = prog.n if max_steps is None else max_steps

    def runnable(w: int) -> bool:
        q = prog.queues[w]
        return head[w] < len(q) and all(counters[c] >= v for c, v in prog.waits[q[head[w]]])

    for _ in range(limit):
        ready = [w for w in range(len(prog.queues)) if runnable(w)]
        if not ready:
            break
        w = rng.choice(ready)
        i = prog.queues[w][head[w]]
        layer = prog.layer[i]
        compute(ws, weights, rt, geo, prog.op[i], layer if layer is not None else -1, prog.args[i])
        for c, add in prog.signals[i]:
            counters[c] += add
        head[w] += 1
        order.append(prog.ids[i])

    done = len(order) - start
    if done < prog.n:
        stuck = []
        for w, q in enumerate(prog.queues):
            if head[w] < len(q):
                i = q[head[w]]
                unmet = [(c, v) for c, v in prog.waits[i] if counters[c] < v]
                if unmet:
                    c, v = unmet[0]
                    stuck.append(Stuck(w, prog.ids[i], prog.op[i], prog.layer[i], c, counters[c], v))
        if stuck and len(stuck) == sum(head[w] < len(q) for w, q in enumerate(prog.queues)):
            raise DeadlockError(stuck, order[start:], prog.n)
        raise ExecutorError(f"stopped after max_steps={limit} of {prog.n} instructions")
    logits = ws["logits"][:geo.batch * geo.cfg.vocab_size].view(geo.batch, -1).clone()
    return logits if isinstance(token, list | tuple) else logits[0]


def run_schedule(schedule: Schedule, weights: Weights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 token: int | Sequence[int], pos: int | Sequence[int], *, seed: int = 0,
                 max_steps: int | None = None, trace: list[int] | None = None) -> torch.Tensor:
    """Run one decode step of `schedule`; return the fp32 logits [V] (for one `token` at one `pos`), or [B, V] for
    lists of a batch's tokens and positions, with the caches [L, B, nKV, S, hd] (one slot per sequence). K/V of
    each token land in its sequence's slot at its position.

    `seed` picks the interleaving; `max_steps` bounds the instructions run (default: all of them); `trace`, when
    given, receives the instruction ids in the order they ran. Raises `DeadlockError` when the schedule stalls and
    `ExecutorError` for inputs that do not fit it (a structural defect raises `megasynth.ir.errors.ScheduleError`).
    """
    return run_program(resolve(schedule), weights, k_cache, v_cache, token, pos, seed=seed, max_steps=max_steps,
                       trace=trace)
