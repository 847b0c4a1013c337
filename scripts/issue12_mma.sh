#!/usr/bin/env bash
# Run 43 ran this at commit 1de8ce8, run 41 on the four-box version just before it; mma was the default then, so its
# "v10" is today's v10mma and its "v10fma" today's v10.
# Tensor-core consumer (StreamConfig.mma): one device call. A smoke test on a tiny config first (bounded), then every
# correctness check of gpu_check for v10 (now wgmma) and v10fma, and the searched fused schedule timed side by side
# (fma, mma) at ctx 1024 and 4096 with a trace of the mma kernel.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-mma}
mkdir -p "$OUT"
{
  echo "== smoke"
  timeout 120 python3 scripts/gpu_check.py --out "$OUT/smoke" --smoke --kernels ${KERNELS:-v10,v10fma} 2>&1 | tail -6
  echo "== check + time"
  timeout 400 python3 scripts/gpu_check.py --out "$OUT" --quick --kernels ${KERNELS:-v10,v10fma} --variants ${VARIANTS:-v10fma,v10} \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -45
} 2>&1 | tee "$OUT/mma.log"
