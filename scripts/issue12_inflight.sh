#!/usr/bin/env bash
# Issue 12, device call after kpair became the default: gate/up takes ~14.6 us per 512 KB instruction in the step
# whatever the consume rate (runs 32/34) and with half its tile prefetched into L2 (run 31). Is it the loader's bound
# on fills in flight (4 slots = 64 KB per SM; at ~2 us loaded latency that is ~32-38 KB/us)? The searched fused
# schedule with 4 (v10), 6, 8 and unbounded (the whole ring) fills in flight, side by side, traced with the last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-inflight}
mkdir -p "$OUT"
timeout 130 python3 scripts/stream_v10_bench.py --out "$OUT/s0" --variants v10,v10i8,v10i0 \
    --ops mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope 2>&1 | tail -10 | tee "$OUT/log.txt"
timeout 200 python3 scripts/gpu_check.py --out "$OUT/step" --skip-correctness --variants v10,v10i6,v10i0,v10i8 \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -10 | tee -a "$OUT/log.txt"
rm -f "$OUT"/step/trace_*.json
