#!/usr/bin/env bash
# The H200 measurements of interpreter v10 as committed (run through the device tool; writes under $OUT):
# GPU tests, compute-sanitizer on the tiny configs, and `synth bench` for llama-1b (ctx 128/1024/4096, naive and the
# v10 best schedule) and llama-3b / llama-8b (ctx 1024, naive and the v10 best strategy lowered on the spot).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
synth() { python3 -m megasynth.cli "$@"; }
log="$OUT/h200_bench.log"
{
  echo "== pytest -m gpu"; timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -15
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"; timeout 150 compute-sanitizer --tool $tool python3 scripts/sanitize_tiny.py 2>&1 | tail -12
  done
  echo "== llama-1b"
  synth bench --model llama-1b --ctx 128 1024 4096 --variants torch_graph,torch_bf16,per_op_graph,megakernel \
    --json "$OUT/bench_llama1b_naive.json" 2>&1 | tail -12
  synth bench --model llama-1b --schedule bench/best_schedule_llama1b_h200.json --ctx 128 1024 4096 \
    --variants torch_bf16,per_op_graph,megakernel --json "$OUT/bench_llama1b_best.json" 2>&1 | tail -12
  for m in llama-3b llama-8b; do
    echo "== $m"
    synth lower --model $m --strategy bench/strategies/v10_best_$m.json -o /tmp/best_$m.json
    synth bench --model $m --ctx 1024 --variants torch_bf16,megakernel --json "$OUT/bench_${m/-/}_naive.json" 2>&1 | tail -8
    synth bench --model $m --ctx 1024 --schedule /tmp/best_$m.json --variants megakernel \
      --json "$OUT/bench_${m/-/}_best.json" 2>&1 | tail -8
  done
} 2>&1 | tee "$log"
