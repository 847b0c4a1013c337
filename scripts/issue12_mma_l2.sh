#!/usr/bin/env bash
# Run 42 ran this on the code just before commit 1de8ce8 (wgmma on four [16, 64] TMA boxes per 16 rows; 1de8ce8 has the
# same L2 hints with one [16, 4, 64] box). The L2-hint variants (v10l*, v10fmal32) were removed after (perf notes, v10
# fourth session); "v10" there is today's v10mma and "v10fma" today's v10.
# Tensor-core consumer + L2 hints of gate/up's tail (StreamConfig.l2_gate_up), side by side with the CUDA-core
# consumer, on the searched fused schedule at ctx 1024 and 4096 (each variant checked against the reference); a trace
# of the last variant.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-mma-l2}
mkdir -p "$OUT"
timeout 500 python3 scripts/gpu_check.py --out "$OUT" --quick --skip-correctness \
  --variants ${VARIANTS:-v10fma,v10,v10i6,v10fmal32,v10l16,v10l48,v10l32n,v10l32} \
  --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -30 | tee "$OUT/mma_l2.log"
