#!/usr/bin/env bash
# Device run for attn_reduce folded into o_proj (docs/perf-notes.md, "v10: the merge inside o_proj"): the GPU tests
# of the fused op, then the searched best schedule against its fused variants side by side at ctx 1024 and 4096.
set -uo pipefail
OUT=${OUT:-/tmp/issue12-fused}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -k "fused or qkv_pair or tiny_configs" 2>&1 \
  | tail -15 | tee "$OUT/pytest_gpu.txt"
timeout 330 python3 scripts/gpu_check.py --out "$OUT" --skip-correctness --kernels v10 --variants v10 \
  --lowerings "${LOWERINGS:-searched,searched_fused,searched_fused_head,searched_fused_k2,searched_fused_k8,searched_fused_s8,q32_d32k2_fused,searched}" \
  --ctx 1024,4096 --trace "${TRACE:-searched,searched_fused}" 2>&1 | tee "$OUT/gpu_check.log" | tail -45
