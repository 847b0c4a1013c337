#!/usr/bin/env bash
# Issue 12, session 5, the last long device call: the llama-1b search on the final kernel (runs/llama-1b-ring12-h200,
# packed into $OUT), then `synth bench` (PyTorch bf16 in a CUDA graph vs the megakernel, against the floor) of each
# model's searched best: llama-1b at ctx 128 / 1024 / 4096, llama-3b and llama-8b (runs/*-ring12-h200 of run 56) at
# ctx 1024; then every GPU test.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s5-bench}
mkdir -p "$OUT"
SEARCHES=llama-1b:40:140 OUT="$OUT" bash scripts/issue12_s5_search.sh
{
  for spec in "llama-1b 128 1024 4096" "llama-3b 1024" "llama-8b 1024"; do
    set -- $spec; model=$1; shift
    echo "== synth bench $model (runs/$model-ring12-h200/best) at ctx $*"
    timeout 150 python3 -m megasynth.cli bench --model "$model" --schedule "runs/$model-ring12-h200/best/schedule.json" \
      --ctx "$@" --variants torch_bf16,megakernel --json "$OUT/bench_${model/-/}_ring12.json" 2>&1 \
      | grep -E "llama|ctx|floor|megakernel|torch|wrote|rror" | tail -12
  done
  echo "== pytest -m gpu"; timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
} 2>&1 | tee "$OUT/bench.log"
