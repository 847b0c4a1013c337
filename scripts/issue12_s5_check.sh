#!/usr/bin/env bash
# Issue 12, session 5, run 59: the GPU trace test with its new loader-side assertions, then the ring's depth knobs
# once more on the 12-slot kernel (fills in flight 3 / 6, 4 boxes per slot), side by side on the searched fused
# schedule, each checked against the reference.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s5-check}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu -k trace"; timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k trace 2>&1 | tail -3
  echo "== ring knobs"
  timeout 200 python3 scripts/gpu_check.py --out "$OUT/knobs" --quick --skip-correctness \
    --variants v10,v10i3,v10i6,v10b4 --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error"
} 2>&1 | tee "$OUT/check.log"
