"""Time one schedule on the persistent interpreter: CUDA-graph replays of the whole step, timed with CUDA events."""

from __future__ import annotations

from typing import Any

import torch

from megasynth.ir.schedule import Schedule


def _stats(times: list[float]) -> dict[str, Any]:
    s = sorted(times)
    n = len(s)

    def q(f: float) -> float:
        return s[min(n - 1, max(0, round(f * (n - 1))))]

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "max_ms": s[-1], "reps": n}


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = 100, warmup: int = 10) -> dict[str, Any]:
    """Median/p10/p90 ms of single replays of `graph` (each replay bracketed by its own pair of CUDA events)."""
    if reps < 1:
        raise ValueError("reps must be >= 1")
    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends, strict=True):
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return _stats([a.elapsed_time(b) for a, b in zip(starts, ends, strict=True)])


def time_schedule(mk: Any, schedule: Schedule | None, ctx: int, reps: int = 100, warmup: int = 10,
                  token: int = 1) -> dict[str, Any]:
    """Time `schedule` (None: the Megakernel's current one) at context length `ctx` (the step at position ctx - 1).

    The timed region is one CUDA-graph replay = counter reset + the persistent kernel (embedding, every layer, LM head).
    A batch's sequences all decode at position ctx - 1, each its own token (`Megakernel.uniform_inputs`).
    The watchdog is checked once after the timed replays; a hang raises `WatchdogError`.
    """
    if not 1 <= ctx <= mk.max_seq_len:
        raise ValueError(f"ctx {ctx} outside [1, {mk.max_seq_len}]")
    packed = mk.set_schedule(schedule) if schedule is not None else mk.packed
    mk.set_position(*mk.uniform_inputs(token, ctx - 1))
    graph = mk.graph(packed)
    out = time_graph(graph, reps=reps, warmup=warmup)
    mk.check(packed)
    out.update({"ctx": ctx, "launch": "cuda_graph", "workers": packed.workers, "instructions": packed.n})
    return out
