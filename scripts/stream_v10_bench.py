"""How fast does each interpreter stream one op's weights when nothing waits? (docs/perf-notes.md)

Takes a lowering of llama-1b, keeps the instructions of ONE op (all layers), drops every wait and signal, and times
the result on the real interpreter (CUDA-graph replays, as `time_schedule` does): the op's weight bytes over the
median time, against the copy bandwidth of the same run. No counters means no stage structure: what is left is the
stream itself (TMA ring, loader, compute warps' per-slot work for v10; the software-pipelined K loop for v9). Kernel
variants (ring depth, compute warps) show which of them bounds it.

    python scripts/stream_v10_bench.py [--out DIR] [--variants v10,v10s4,...] [--ops mlp_norm_gate_up,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_check import VARIANTS  # noqa: E402  (the interpreter variants, named as gpu_check names them)

from megasynth.ir.catalogue import W_BYTES  # noqa: E402
from megasynth.ir.schedule import parse_schedule  # noqa: E402
from megasynth.kernels.gpu import Megakernel  # noqa: E402
from megasynth.kernels.gpu.timing import time_schedule  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402
from megasynth.lowering.lower import lower  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.lowering.strategy import Strategy  # noqa: E402

#: down in 32-row tiles with a K split of 2 (as the searched schedules; row-paired slots need 32 rows): 128
#: instructions of 256 KB per layer, as 16-row tiles over the whole K
TILES = {"embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 64,
         "down_proj_residual": 32, "final_norm_lm_head": 1024}
K_SPLITS = {"down_proj_residual": 2}


def only(doc: dict[str, Any], op: str, signals: bool = False) -> dict[str, Any]:
    """The schedule's instructions of `op` alone, in their queues, with no waits (and no signals unless `signals`:
    they then count up counters nobody waits on, which is legal)."""
    keep = {i["id"]: {**i, "waits": [], "signals": i["signals"] if signals else []}
            for i in doc["instructions"] if i["op"] == op}
    return {**doc, "counters": doc["counters"] if signals else 0, "instructions": list(keep.values()),
            "queues": [[j for j in q if j in keep] for q in doc["queues"]]}


def weight_bytes(doc: dict[str, Any], spec: Any) -> int:
    """Weight bytes the instructions stream (activations come from L2 and are not counted)."""
    h = spec.config.hidden_size
    total = 0
    for ins in doc["instructions"]:
        a = ins["args"]
        rows = a["end"] - a["start"]
        k = a["k_end"] - a["k_start"] if "k_end" in a else h
        total += rows * k * W_BYTES * (2 if ins["op"] == "mlp_norm_gate_up" else 1)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "stream_v10_out"))
    ap.add_argument("--variants", default="v10,v10mma")
    ap.add_argument("--ops", default="mlp_norm_gate_up,down_proj_residual,final_norm_lm_head,attn_norm_qkv_rope,"
                                     "o_proj_residual")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_model("llama-1b")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = random_weights(spec.config, seed=0, dtype=torch.bfloat16, device="cuda", draw_on="cuda")
    base = lower(spec, sms, Strategy(tiles=TILES, attn_splits=16, k_splits=K_SPLITS)).to_json()
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(10):
        ev[0].record()
        b.copy_(a)
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    copy_bw = 2 * a.numel() * 2 / (sorted(times)[5] * 1e-3) / 1e12
    del a, b
    rows = []
    for vname in args.variants.split(","):
        mk = None
        for op in args.ops.split(","):
            doc = only(base, op)
            sched = parse_schedule(doc)
            if mk is None:
                mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=VARIANTS[vname])
            r = time_schedule(mk, sched, 1024, reps=args.reps)
            nbytes = weight_bytes(doc, spec)
            tb = nbytes / (r["median_ms"] * 1e-3) / 1e12
            row = {"variant": vname, "op": op, "instructions": len(doc["instructions"]), "bytes": nbytes,
                   "median_ms": r["median_ms"], "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"], "tb_s": tb,
                   "of_copy": tb / copy_bw, "gb_s_per_sm": tb * 1e3 / sms}
            rows.append(row)
            print(f"{vname:6s} {op:20s} {r['median_ms'] * 1e3:8.1f} us [{r['p10_ms'] * 1e3:.1f}, "
                  f"{r['p90_ms'] * 1e3:.1f}] {tb:5.2f} TB/s = {tb / copy_bw:4.2f} of copy", flush=True)
        del mk
        torch.cuda.empty_cache()
    (out / "stream_v10_bench.json").write_text(json.dumps({"copy_tb_s": copy_bw, "rows": rows, "w_bytes": W_BYTES},
                                                         indent=1))
    print(f"\ncopy {copy_bw:.2f} TB/s")
    for r in rows:
        print(f"{r['variant']:6s} {r['op']:20s} {r['median_ms'] * 1e3:8.1f} us {r['tb_s']:5.2f} TB/s "
              f"{r['of_copy']:4.2f} of copy {r['gb_s_per_sm']:5.1f} GB/s/SM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
