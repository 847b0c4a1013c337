#!/usr/bin/env bash
# Issue 12, session 6, run 65: where the chain's instructions spend their time. The trace now also records, per
# instruction, when its activations were staged and when its op ended before its signals (megasynth/kernels/gpu/pack.py's
# TRACE_FIELDS 8): gpu_check prints the medians per stage (stage / body / signals) for the searched best of
# runs/llama-1b-lead-h200 at ctx 1024 and 4096; then the GPU trace test with its new phase checks.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-phases}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu -k trace"; timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k trace 2>&1 | tail -3
  timeout 200 python3 scripts/gpu_check.py --out "$OUT/phases" --quick --skip-correctness \
    --variants v10 --lowerings lead_best --ctx 1024,4096 --trace lead_best 2>&1 \
    | grep -E "lead_best.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|trace |stage .* us, body| L7: start"
} 2>&1 | tee "$OUT/phases.log"
