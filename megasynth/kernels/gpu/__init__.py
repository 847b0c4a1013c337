"""The persistent Triton megakernel on the GPU. Importing this package imports neither torch nor triton: the names
below load lazily, so CPU-only code can reference `megasynth.kernels.gpu` and guard on `torch.cuda.is_available()`."""

from __future__ import annotations

from typing import Any

__all__ = ["KernelConfig", "Megakernel", "ResidualOverflow", "WatchdogError", "kernel_config", "time_schedule"]


def __getattr__(name: str) -> Any:
    if name in ("Megakernel", "ResidualOverflow", "WatchdogError", "kernel_config"):
        from megasynth.kernels.gpu import runtime

        return getattr(runtime, name)
    if name == "KernelConfig":
        from megasynth.kernels.gpu.v9 import KernelConfig

        return KernelConfig
    if name == "time_schedule":
        from megasynth.kernels.gpu.timing import time_schedule

        return time_schedule
    raise AttributeError(f"module 'megasynth.kernels.gpu' has no attribute {name!r}")
