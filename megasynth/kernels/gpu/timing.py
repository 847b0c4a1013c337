"""Time one schedule on the persistent interpreter: CUDA-graph replays of the whole step, timed with CUDA events; and
wait for launched work with a bound (`wait_for_gpu`), so that a kernel that never ends is an error, not a hang."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from megasynth.ir.schedule import Schedule

if TYPE_CHECKING:
    import torch

#: How long the host waits for launched GPU work before it calls it hung. A counter wait has its own watchdog on the
#: device (`Megakernel`'s timeout_s); a ring slot's mbarrier wait in interpreter v10 has none, so a loader that never
#: fills a slot would otherwise block the host forever. Far above any step or timing loop (100 replays of a 10 ms
#: step take 1 s).
HANG_S = 60.0
#: How long `wait_for_gpu` polls without sleeping (as `torch.cuda.synchronize` spins) before it naps 1 ms per poll.
SPIN_S = 0.05


class WatchdogError(RuntimeError):
    """A worker waited past the watchdog timeout, or launched work never finished: the schedule (or the kernel)
    would have hung the GPU."""


class GpuHangError(WatchdogError):
    """Launched work never finished (`wait_for_gpu`): the kernel still runs, and nothing more can run on this GPU
    in this process."""


def wait_for_gpu(what: str, device: torch.device | None = None, limit_s: float = HANG_S) -> None:
    """`torch.cuda.synchronize()` with a bound: wait until the current stream of `device` (default: the current
    device) has run everything enqueued so far, or raise `GpuHangError` naming `what` after `limit_s` seconds (the
    GPU context cannot be used after that: the kernel still runs; the message says to restart the process)."""
    import torch

    done = torch.cuda.Event()
    with torch.cuda.device(device):
        done.record()
    start = time.monotonic()
    deadline = start + limit_s
    while not done.query():
        now = time.monotonic()
        if now > start + SPIN_S:  # a step ends within the spin as soon as a synchronize would see it; then naps
            time.sleep(1e-3)
        if now > deadline:
            raise GpuHangError(f"{what} has not finished after {limit_s:g} s: a wait inside the kernel without a "
                                "watchdog of its own (a ring slot's mbarrier on interpreter v10) never completed; the "
                                "kernel still occupies the GPU, so restart the process")


def _stats(times: list[float]) -> dict[str, Any]:
    s = sorted(times)
    n = len(s)

    def q(f: float) -> float:
        return s[min(n - 1, max(0, round(f * (n - 1))))]

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "max_ms": s[-1], "reps": n}


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = 100, warmup: int = 10) -> dict[str, Any]:
    """Median/p10/p90 ms of single replays of `graph` (each replay bracketed by its own pair of CUDA events)."""
    import torch

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
    wait_for_gpu(f"{reps + warmup} replays of the step")
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
