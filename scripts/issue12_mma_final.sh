#!/usr/bin/env bash
# The tensor-core consumer as an option (StreamConfig.mma, off by default): one device call. Every GPU test (the new
# one runs mma on llama-1b and the tiny configs), memcheck on the tiny configs with and without mma, and the in-kernel
# consume rate of each weight op with and without mma (DIAG 3: the loader fake-fills, so this is the compute warps'
# own rate; DIAG 0: real fills).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-mma-final}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -6
  for flag in "" "--mma"; do
    echo "== compute-sanitizer memcheck $flag"
    timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_tiny.py $flag 2>&1 | tail -4
  done
  OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
  for diag in 3 0; do
    MEGASYNTH_V10_DIAG=$diag timeout 100 python3 scripts/stream_v10_bench.py --out "$OUT/s$diag" --variants v10,v10mma \
      --ops $OPS 2>&1 | tail -8 | sed "s/^/diag$diag /"
  done
} 2>&1 | tee "$OUT/final.log"
