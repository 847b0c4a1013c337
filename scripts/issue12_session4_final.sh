#!/usr/bin/env bash
# Session 4's final device call, on the committed code (the cheaper attention merge; mma off): every GPU test,
# memcheck on the tiny configs with and without mma, and `synth bench` beside PyTorch bf16 in a CUDA graph: the
# llama-1b fused 16-split strategy at ctx 128/1024/4096 and the searched llama-3b and llama-8b schedules at ctx 1024.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s4-final}
mkdir -p "$OUT"
{
  echo "== pytest -m gpu"; timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
  for flag in "" "--mma"; do
    echo "== compute-sanitizer memcheck $flag"
    timeout 90 compute-sanitizer --tool memcheck python3 scripts/sanitize_tiny.py $flag 2>&1 | tail -2
  done
  python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
  timeout 200 python3 -m megasynth.cli bench --model llama-1b --schedule /tmp/fs16.json --ctx 128 1024 4096 \
    --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_attnmerge.json" 2>&1 | tail -8
  timeout 120 python3 -m megasynth.cli bench --model llama-3b --schedule runs/llama-3b-h200/best/schedule.json \
    --ctx 1024 --variants torch_bf16,megakernel --json "$OUT/bench_llama3b_attnmerge.json" 2>&1 | tail -5
  timeout 150 python3 -m megasynth.cli bench --model llama-8b --schedule runs/llama-8b-fused-h200/best/schedule.json \
    --ctx 1024 --variants torch_bf16,megakernel --json "$OUT/bench_llama8b_attnmerge.json" 2>&1 | tail -5
} 2>&1 | tee "$OUT/final.log"
