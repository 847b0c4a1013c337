#!/usr/bin/env bash
# Issue 12, session 6, run 67: the final code once more on the GPU: every GPU test, then compute-sanitizer memcheck on
# the tiny configs (the phase trace fields came after run 61's full check).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-final}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
  echo "== compute-sanitizer memcheck"
  timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_tiny.py 2>&1 | tail -2
} 2>&1 | tee "$OUT/final.log"
