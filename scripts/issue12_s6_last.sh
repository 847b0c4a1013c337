#!/usr/bin/env bash
# Issue 12, session 6, run 70: 3 fills in flight as the default (run 69). Every GPU test on it, then `synth bench` of
# runs/llama-1b-lead-h200's best at ctx 128 / 1024 / 4096 (PyTorch bf16 in a CUDA graph beside it).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-last}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -3
  echo "== synth bench llama-1b (runs/llama-1b-lead-h200/best), inflight 3"
  timeout 100 python3 -m megasynth.cli bench --model llama-1b --schedule runs/llama-1b-lead-h200/best/schedule.json \
    --ctx 128 1024 4096 --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_lead_i3.json" 2>&1 \
    | grep -E "^│|wrote|rror" | tail -8
} 2>&1 | tee "$OUT/last.log"
