#!/usr/bin/env bash
# Issue 12, session 6, run 69: 3 fills in flight per SM between the default 4 and the 2 that shortened the releases
# (runs 61, 66: llama-1b -1 %) but cost llama-8b 5.6 % (run 62). The three models' searched bests (llama-1b via
# gpu_check's lead_best at ctx 1024 / 4096, llama-3b and -8b via scripts/config_bench.py at 1024), 4 and 3 in flight
# side by side in one process each, each checked against the reference.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-inflight}
mkdir -p "$OUT"
{
  echo "== llama-1b"
  timeout 120 python3 scripts/gpu_check.py --out "$OUT/l1b" --quick --skip-correctness --variants v10,v10i3,v10 \
    --lowerings lead_best --ctx 1024,4096 --trace none 2>&1 | grep -E "lead_best.* ctx .*floor|FAIL|ERROR|Error"
  for m in llama-3b llama-8b; do
    echo "== $m"
    timeout 150 python3 scripts/config_bench.py --model $m --schedule runs/$m-lead-h200/best/schedule.json \
      --ctx 1024 --json "$OUT/${m/-/}_inflight.json" i4=inflight=4 i3=inflight=3 2>&1 | grep -E "llama|rror"
  done
} 2>&1 | tee "$OUT/inflight.log"
