#!/usr/bin/env bash
# After a refactor of v10's split merge (one `_merge_heads` for attn_reduce and attn_reduce_o_proj): every GPU test,
# then the searched schedule and its fused variant side by side at ctx 1024 (checked against the reference).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-recheck}
mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
timeout 150 python3 scripts/gpu_check.py --out "$OUT" --skip-correctness --kernels v10 --variants v10 \
    --lowerings searched,searched_fused --ctx 1024 --trace none 2>&1 | tee "$OUT/gpu_check.log" | tail -6
