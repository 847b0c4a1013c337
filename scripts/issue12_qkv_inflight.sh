#!/usr/bin/env bash
# Ran at commit 6e8e177 (run 47); the v10q* variants (StreamConfig.inflight_qkv) were removed after: no effect.
# With the cheaper attention merge: more of QKV's weights in flight (StreamConfig.inflight_qkv 6 / 8 / 11, others
# stay at 4), and the searched fused schedule with 8 attention splits or per-head edges, side by side (each variant
# checked against the reference at one position).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-qkv-inflight}
mkdir -p "$OUT"
timeout 500 python3 scripts/gpu_check.py --out "$OUT" --quick --skip-correctness \
  --variants ${VARIANTS:-v10,v10q6,v10q8,v10q11,v10} \
  --lowerings searched_fused,searched_fused_s8,searched_fused_head --ctx 1024,4096 --trace none 2>&1 \
  | grep -E "searched_fused.* ctx .*floor|FAIL|ERROR|errors:" | tee "$OUT/qkv_inflight.log"
