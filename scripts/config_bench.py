"""Time schedules under several interpreter-v10 configs side by side, for any model and batch; each variant's step is
first checked against the PyTorch reference at one position per sequence. Variants are NAME=field=value,... of
`StreamConfig` (`scripts/compile_check.py`'s syntax), where the item schedule=PATH times that schedule instead of
--schedule's; a batched schedule (its model's `batch`) runs every sequence at ctx - 1. Rounds repeat the whole list
(processes and rounds differ by up to 1 %):

    python scripts/config_bench.py --model llama-8b --schedule bench/runs/llama-8b-h200/best/schedule.json.gz \\
        --ctx 1024 --rounds 2 i4=inflight=4 i2=inflight=2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from compile_check import parse_variant  # noqa: E402

from megasynth.ir.schedule import load_schedule  # noqa: E402
from megasynth.kernels.gpu import Megakernel  # noqa: E402
from megasynth.kernels.gpu.stream import stream_config  # noqa: E402
from megasynth.kernels.gpu.timing import time_schedule  # noqa: E402
from megasynth.kernels.reference import decode_batch, decode_step  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.measure.torch_step import CHECK_TOL, PYTORCH_TOL  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--schedule", default=None, help="the schedule every variant without schedule=PATH times")
    ap.add_argument("--ctx", default="1024", help="comma-separated context lengths")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None, help="where to write the timings")
    ap.add_argument("variants", nargs="+", help="NAME=key=value,... (StreamConfig fields)")
    args = ap.parse_args()
    spec = get_model(args.model)
    cfg = spec.config
    w = random_weights(cfg, seed=0, dtype=torch.bfloat16, device="cuda", draw_on="cuda")
    variants = []
    for text in args.variants:
        name, _, body = text.partition("=")
        items = [i for i in body.split(",") if i]
        path = next((i.partition("=")[2] for i in items if i.startswith("schedule=")), args.schedule)
        if path is None:
            ap.error(f"variant {text!r}: no schedule (give --schedule or the item schedule=PATH)")
        rest = ",".join(i for i in items if not i.startswith("schedule="))
        name, sc = parse_variant(f"{name}={rest}", stream_config(cfg))
        variants.append((name, sc, load_schedule(path)))
    rows = []
    for rnd in range(args.rounds):
        for name, sc, sched in variants:
            mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=sc)
            gen = torch.Generator(device="cuda").manual_seed(5)
            mk.k_cache.normal_(generator=gen)
            mk.v_cache.normal_(generator=gen)
            pos = min(1500, spec.max_seq_len - 1)
            kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
            if mk.batch > 1:  # every sequence its own token and position
                positions = [pos - pos * b // mk.batch for b in range(mk.batch)]
                tokens = [77 + b for b in range(mk.batch)]
                got = mk.step(tokens, positions)
                ref = decode_batch(cfg, w, kref, vref, tokens, positions)
                rel = max(float((got[b] - ref[b]).norm() / ref[b].norm()) for b in range(mk.batch))
            else:
                got = mk.step(77, pos)
                ref = decode_step(cfg, w, kref, vref, 77, pos)
                rel = float((got - ref).norm() / ref.norm())
            del kref, vref
            # a batch's products take bf16 activations, as PyTorch's bf16 step does: its bound is that step's
            tol = PYTORCH_TOL if mk.batch > 1 else CHECK_TOL
            for ctx in (int(c) for c in args.ctx.split(",")):
                r = time_schedule(mk, None, ctx)
                r.update({"model": args.model, "variant": name, "round": rnd, "rel_l2": rel, "batch": mk.batch})
                rows.append(r)
                print(f"{args.model} {name:8s} ctx {ctx:5d}: {r['median_ms']:.3f} ms (p10 {r['p10_ms']:.3f} "
                      f"p90 {r['p90_ms']:.3f}) rel L2 {rel:.1e}{'' if rel <= tol else '  FAIL'}", flush=True)
            del mk
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
