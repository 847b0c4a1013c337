#!/usr/bin/env bash
# Session 5, run 53: where the ring runs ahead. The trace-enabled kernel now also records, per instruction, when the
# loader reached it and when it issued its last fill (megasynth/kernels/gpu/pack.py TRACE_FIELDS); gpu_check prints per stage
# how long before the compute warps started an instruction its fills were issued. Traced on the searched fused
# schedule at ctx 1024 with the FMA consumer (v10) and the tensor-core consumer (v10mma), each in its own process.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-loader}
mkdir -p "$OUT"
for v in v10 v10mma; do
  echo "== $v"
  timeout 170 python3 scripts/gpu_check.py --out "$OUT/$v" --quick --skip-correctness --variants $v \
    --lowerings searched_fused --ctx 1024 --trace searched_fused 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|loader reached| L7: "
done 2>&1 | tee "$OUT/loader.log"
