"""Where one decode step's time goes, per op, from a traced step on the GPU (interpreter v10).

    python scripts/trace_ops.py SCHEDULE [--max-seq-len N] [--ctx N] [KEY=VALUE ...]

KEY=VALUE are `StreamConfig` fields (as `synth bench --kernel-option`), e.g. attn_mma=true inflight=6. Per op it prints
the mean time from the start (after the waits) to the end, the staging part (a batch's attention: its positions' loop,
which the merge and stores follow; 0 for attention as a function of its own, batch 1's default), the signal part (from
the op's end to its last release add), the wait, how long the loader took from reaching the instruction to issuing its
last fill, and how long the compute warps ran after that fill was issued: when that last figure is about the ring's
depth times one slot's compute, the compute warps, not memory, set the pace (the loader waits for free slots). Then each
op's span per layer (first start to last end, the middle half of the layers) and the layer period.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megasynth.ir.errors import ScheduleError  # noqa: E402
from megasynth.ir.model import ModelConfig  # noqa: E402
from megasynth.ir.schedule import load_schedule  # noqa: E402
from megasynth.kernels.gpu import Megakernel  # noqa: E402
from megasynth.kernels.gpu.runtime import config_with  # noqa: E402
from megasynth.kernels.gpu.stream import stream_config  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402


def summary(mk: Megakernel, label: str) -> str:
    """The per-op and per-layer tables of `mk`'s last traced step."""
    p = mk.packed
    assert p is not None
    tr = mk.raw_trace().astype(np.int64)
    ld = mk.raw_loader_trace().astype(np.int64)
    ph = mk.raw_phase_trace().astype(np.int64)
    ops = np.array([str(o) for o in p.ops])
    layers = np.array([-1 if x is None else x for x in p.layers])
    t0 = tr[:, 1][tr[:, 1] > 0].min()
    lines = [f"== {label}: makespan {(tr[:, 2].max() - t0) / 1e3:.1f} us",
             f"  {'op':22s} {'n':>5s} {'run us':>7s} {'p90':>7s} {'stage':>6s} {'signal':>6s} {'wait':>6s} "
             f"{'loader':>7s} {'after':>6s}"]
    for op in dict.fromkeys(ops):
        m = ops == op
        run = (tr[m, 2] - tr[m, 1]) / 1e3
        stage = np.where(ph[m, 0] > 0, ph[m, 0] - tr[m, 1], 0) / 1e3
        signal = np.where(ph[m, 1] > 0, tr[m, 2] - ph[m, 1], 0) / 1e3
        wait, loader = (tr[m, 1] - tr[m, 0]) / 1e3, (ld[m, 1] - ld[m, 0]) / 1e3
        lines.append(f"  {op:22s} {m.sum():5d} {run.mean():7.2f} {np.percentile(run, 90):7.2f} {stage.mean():6.2f} "
                     f"{signal.mean():6.2f} {wait.mean():6.2f} {loader.mean():7.2f} "
                     f"{((tr[m, 2] - ld[m, 1]) / 1e3).mean():6.2f}")
    known = sorted(set(layers[layers >= 0].tolist()))
    mid = known[len(known) // 4: 3 * len(known) // 4] or known
    for op in dict.fromkeys(ops):
        spans = [(tr[m, 2].max() - tr[m, 1].min()) / 1e3 for m in ((ops == op) & (layers == x) for x in mid)
                 if m.any()]
        if spans:
            lines.append(f"  span of {op:22s} {np.mean(spans):7.2f} us a layer")
    starts = [tr[layers == x, 1].min() for x in mid]
    if len(starts) > 1:
        lines.append(f"  layer period {np.diff(starts).mean() / 1e3:.2f} us")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("schedule")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV cache positions (default: the schedule's)")
    ap.add_argument("--ctx", type=int, default=None, help="the step's context (default: max-seq-len)")
    ap.add_argument("options", nargs="*", help="StreamConfig fields, KEY=VALUE")
    args = ap.parse_intermixed_args()  # KEY=VALUE options after --ctx, as the usage above writes them
    try:
        sched = load_schedule(args.schedule)
    except ScheduleError as exc:
        ap.error(str(exc))
    assert sched.model is not None
    msl = args.max_seq_len or sched.model.max_seq_len
    ctx = args.ctx or msl
    cfg = ModelConfig.from_hf(sched.model.config)
    w = random_weights(cfg, seed=0, dtype=torch.bfloat16, device="cuda", draw_on="cuda")
    mk = Megakernel(sched, w, max_seq_len=msl, trace=True, config=config_with(stream_config(cfg), args.options))
    for _ in range(3):  # the last of three steps: warm caches and clocks
        mk.traced_step(*mk.uniform_inputs(1, ctx - 1))  # a batch: every sequence at ctx - 1
    print(summary(mk, f"{args.schedule} ctx {ctx} {' '.join(args.options)}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
