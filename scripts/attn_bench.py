"""How long does each instruction of the attention chain take when nothing waits? (docs/perf-notes.md)

In the step, an attention instruction takes ~5.5 us after its wait for 16 KB of K/V (ctx 1024), QKV ~5.1 us and the
merge + o_proj ~5.2 us: ~18 us of a ~46 us layer for ~5 us of bytes. This takes the searched fused llama-1b lowering,
keeps the instructions of ONE op (all layers) with their waits dropped, and times them on the real interpreter
(CUDA-graph replays): the time divided by the longest queue is one instruction's own cost (the embedding alone, one
instruction, shows the fixed cost of a replay), with the signals (release atomics) kept or dropped.

    python scripts/attn_bench.py [--out DIR] [--ctx 1024,4096] [--ops attn_partial,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from stream_v10_bench import only  # noqa: E402  (one op's instructions alone)

from megasynth.ir.schedule import parse_schedule  # noqa: E402
from megasynth.kernels.gpu import Megakernel  # noqa: E402
from megasynth.kernels.gpu.stream import StreamConfig  # noqa: E402
from megasynth.kernels.gpu.timing import time_schedule  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402
from megasynth.lowering.lower import lower  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.lowering.strategy import Strategy  # noqa: E402

#: the searched fused llama-1b schedule's strategy (runs/llama-1b-fused-h200, gpu_check's `searched_fused`)
TILES = {"embed": 1 << 20, "attn_norm_qkv_rope": 32, "o_proj_residual": 64, "mlp_norm_gate_up": 64,
         "down_proj_residual": 64, "final_norm_lm_head": 256}
STRATEGY = Strategy(tiles=TILES, attn_splits=16, k_splits={"o_proj_residual": 4, "down_proj_residual": 4},
                    fuse_attn_reduce=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "attn_bench_out"))
    ap.add_argument("--ctx", default="1024,4096")
    ap.add_argument("--ops", default="embed,attn_norm_qkv_rope,attn_partial,attn_reduce_o_proj")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_model("llama-1b")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = random_weights(spec.config, seed=0, dtype=torch.bfloat16, device="cuda", draw_on="cuda")
    base = lower(spec, sms, STRATEGY).to_json()
    mk = None
    rows = []
    for op in args.ops.split(","):
        for signals in (False, True):
            doc = only(base, op, signals)
            longest = max(len(q) for q in doc["queues"])
            sched = parse_schedule(doc)
            if mk is None:
                mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=StreamConfig())
            for ctx in (int(c) for c in args.ctx.split(",")):
                r = time_schedule(mk, sched, ctx, reps=args.reps)
                per = r["median_ms"] * 1e3 / longest
                rows.append({"op": op, "signals": signals, "ctx": ctx, "median_ms": r["median_ms"],
                             "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"], "longest_queue": longest,
                             "us_per_instruction": per})
                print(f"{op:20s} signals {'on ' if signals else 'off'} ctx {ctx:5d} "
                      f"{r['median_ms'] * 1e3:7.1f} us for {longest} per SM: {per:5.2f} us each", flush=True)
    (out / "attn_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
