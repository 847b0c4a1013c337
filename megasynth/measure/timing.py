"""The timing harness and the byte accounting: per-repetition CUDA-event timing, CUDA-graph capture, the
device-to-device copy bandwidth, the bytes a decode step must move (the floor) and the environment's description."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

from megasynth.ir.catalogue import ACT_BYTES, OPS, W_BYTES
from megasynth.ir.model import ModelConfig
from megasynth.measure.options import BenchError


def summarize(samples_ms: list[float]) -> dict[str, float | int]:
    """Median, p10/p90 (linear interpolation), min, max and mean of per-repetition times in ms."""
    if not samples_ms:
        raise ValueError("no samples")
    xs = sorted(samples_ms)

    def q(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": xs[0], "max_ms": xs[-1],
            "mean_ms": sum(xs) / len(xs), "reps": len(xs)}


def time_fn(fn: Callable[[], Any], *, reps: int, warmup: int, device: str,
            between: Callable[[], None] | None = None) -> dict[str, float | int]:
    """Time `fn` per repetition: CUDA events around each call on the GPU, perf_counter on the CPU.

    `between` runs before each repetition outside the timed region (the L2 flush).
    """
    import torch

    if reps < 1:
        raise BenchError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    if device == "cuda":
        from megasynth.kernels.gpu.timing import wait_for_gpu

        wait_for_gpu(f"{warmup} warm-up runs")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if between is not None:
                between()
            starts[i].record()
            fn()
            ends[i].record()
        wait_for_gpu(f"{reps} timed runs")
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        samples = []
        for _ in range(reps):
            if between is not None:
                between()
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return summarize(samples)


def capture_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Capture `fn` in a CUDA graph (after warm-up on a side stream, as PyTorch asks); returns a replay function
    that gives the graph's static output."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    replay.graph = graph  # type: ignore[attr-defined]  # keep it alive with the function
    return replay


def measure_copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 20) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written per second) of one large `copy_`."""
    import torch

    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), reps=reps, warmup=3, device=device)
    moved = 2 * n * 2
    return {"bytes": moved, "tbps": moved / (timing["median_ms"] * 1e-3) / 1e12, "timing": timing}


def floor_bytes(cfg: ModelConfig, ctx: int, batch: int = 1) -> dict[str, int]:
    """The bytes one decode step at sequence length `ctx` must move through device memory, at the least.

    Weights once (bf16; a tied head counted once; an untied embedding table contributes only the token's row), the
    KV history read (ctx - 1 positions, K and V, every layer), the new K/V written, the fp32 logits written. A
    `batch` of sequences, all at `ctx`, shares the weights (read once per step: batching's gain) but each has its
    own history, new K/V, logits and embedding row, counted `batch` times.
    """
    weights = cfg.weight_bytes(W_BYTES)
    if not cfg.tie_word_embeddings:
        weights -= (cfg.vocab_size - min(batch, cfg.vocab_size)) * cfg.hidden_size * W_BYTES
    per_pos = 2 * cfg.num_hidden_layers * cfg.kv_size * W_BYTES
    out = {"weights": weights, "kv_read": batch * (ctx - 1) * per_pos, "kv_write": batch * per_pos,
           "activations": batch * cfg.vocab_size * ACT_BYTES}
    out["total"] = sum(out.values())
    return out


def schedule_bytes(schedule: Any, ctx: int) -> int:
    """Bytes the schedule's instructions move at sequence length ctx, by the catalogue's cost (its own accounting)."""
    from megasynth.ir.program import resolve

    prog = resolve(schedule)
    geo = prog.geometry
    if geo is None:
        return 0
    total = 0
    for i in range(prog.n):
        op = prog.op[i]
        if op in OPS:
            layer = prog.layer[i]
            total += OPS[op].cost(geo, layer if layer is not None else -1, prog.args[i], ctx)[0]
    return total


def versions() -> dict[str, str | None]:
    """Versions of what the numbers depend on (read from package metadata: importing triton is not needed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers", "megasynth"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover - torch is a dependency
        out["cuda"] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out["git"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if out["git"] and dirty:  # the measured code is not that commit's: say so
            out["git"] += "+modified"
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def device_info(device: str) -> dict[str, Any]:
    """The device's name and, on CUDA, its SM count, L2 size, memory and compute capability."""
    import torch

    if device != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()})", "kind": "cpu",
                "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "kind": "cuda", "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}"}
