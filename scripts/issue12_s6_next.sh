#!/usr/bin/env bash
# Issue 12, session 6, run 64: what the lead poll changes for two levers measured as a wash or a loss before it, on
# the searched best of runs/llama-1b-lead-h200 (gpu_check's lead_best): the tensor-core consumer (v10mma; +0.5 % in
# session 4) and per-head waits from QKV to attention and from attention to the merge + o_proj (lead_best_head;
# +0.9 % in session 4), side by side, each checked against the reference; then the trace of v10 on lead_best.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-next}
mkdir -p "$OUT"
timeout 400 python3 scripts/gpu_check.py --out "$OUT/next" --quick --skip-correctness \
  --variants v10mma,v10 --lowerings lead_best,lead_best_head --ctx 1024,4096 --trace lead_best 2>&1 \
  | grep -E "lead_best.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|trace " | tee "$OUT/next.log"
