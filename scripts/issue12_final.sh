#!/usr/bin/env bash
# One device call after the fused merge + o_proj landed: every GPU test, compute-sanitizer memcheck and racecheck on
# the tiny configs (a fused schedule among them), and `synth bench` of the default search's best schedule
# (runs/llama-1b-fused-h200) at ctx 128/1024/4096 beside PyTorch bf16 in a CUDA graph. At most 8 files in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-final}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -15
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    timeout 150 compute-sanitizer --tool $tool python3 scripts/sanitize_tiny.py 2>&1 | tail -14
  done
  echo "== llama-1b, runs/llama-1b-fused-h200/best"
  timeout 150 python3 -m megasynth.cli bench --model llama-1b --schedule runs/llama-1b-fused-h200/best/schedule.json \
    --ctx 128 1024 4096 --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_fused.json" 2>&1 | tail -14
} 2>&1 | tee "$OUT/final.log"
