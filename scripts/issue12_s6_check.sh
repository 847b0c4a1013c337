#!/usr/bin/env bash
# Issue 12, session 6, run 61: the lead-warp poll as the default, checked and measured once more. Every GPU test (the
# watchdog with both pollers, a lone wait and several; both pollers on multi-wait schedules), then side by side on the
# searched fused schedule, each checked against the reference: v10 (lead poll, abort flag read only after 20 us of
# waiting), the abort flag read every round (MEGASYNTH_V10_ABORT_AFTER_NS=0, a second process), every warp polling
# (v10pa), and 2 fills in flight; then compute-sanitizer memcheck and racecheck on the tiny configs.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-check}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
  echo "== abort flag every round"
  MEGASYNTH_V10_ABORT_AFTER_NS=0 timeout 100 python3 scripts/gpu_check.py --out "$OUT/abort0" --quick \
    --skip-correctness --variants v10 --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error"
  echo "== pollers"
  timeout 200 python3 scripts/gpu_check.py --out "$OUT/poll" --quick --skip-correctness \
    --variants v10,v10pa,v10pli2,v10 --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error"
  echo "== compute-sanitizer memcheck"
  timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_tiny.py 2>&1 | tail -2
  echo "== compute-sanitizer racecheck"
  timeout 150 compute-sanitizer --tool racecheck python3 scripts/sanitize_tiny.py 2>&1 | grep -vE "^=========     (at|by|Saved)" | tail -14
} 2>&1 | tee "$OUT/check.log"
