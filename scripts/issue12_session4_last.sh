#!/usr/bin/env bash
# Session 4's last device call, on the final code (run 50's two chain changes, switches removed): every GPU test and
# `synth bench` of the llama-1b fused 16-split strategy beside PyTorch bf16 at ctx 128 / 1024 / 4096.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s4-last}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
  python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
  timeout 90 python3 -m megasynth.cli bench --model llama-1b --schedule /tmp/fs16.json --ctx 128 1024 4096 \
    --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_final.json" 2>&1 | grep -E "llama-1b|wrote" | tail -6
} 2>&1 | tee "$OUT/last.log"
