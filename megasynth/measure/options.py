"""What one `synth bench` run measures (`BenchOptions`) and the two ways it stops short (`BenchError`, `Skip`)."""

from __future__ import annotations

from dataclasses import dataclass, field

FORMAT = "megasynth-bench/1"


class BenchError(Exception):
    """Bad input or an unusable environment; the CLI prints it as one line."""


class ScheduleRejected(BenchError):
    """The validator rejected the schedule to be timed (exit 1, where bad input exits 2)."""


class Skip(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A variant cannot run here; the message says why (it is reported as `skipped: reason`)."""


@dataclass
class BenchOptions:
    """What to measure. `device` is "cuda" or "cpu" (the dry run); `variants` None means the default set."""

    model: str = "llama-1b"
    max_seq_len: int | None = None  # None: the model row's
    schedule: str | None = None
    ctxs: list[int] = field(default_factory=lambda: [1024])
    reps: int = 100
    warmup: int = 10
    seed: int = 0
    weights_dir: str | None = None  # a Hugging Face checkpoint folder; None = random weights from `seed`
    token: int = 1
    device: str = "cuda"
    variants: list[str] | None = None
    compile_timeout_s: float = 300.0
    compile_backend: str = "inductor"  # "eager" skips inductor (tests use it to exercise the worker quickly)
    # without inductor's own CUDA graphs: the compiled step is captured in a plain CUDA graph like the eager one
    compile_mode: str | None = "max-autotune-no-cudagraphs"
    flush_l2: bool = False
    copy_bytes: int = 1 << 30
    verify: bool = True
    batch: int = 1  # sequences per step, all at the same ctx, each with its own KV history and token
    #: the megakernel's interpreter settings, KEY=VALUE (`megasynth.kernels.gpu.runtime.kernel_config`)
    kernel_options: list[str] = field(default_factory=list)
