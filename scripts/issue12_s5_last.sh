#!/usr/bin/env bash
# Issue 12, session 5, the last device call: `synth bench` of llama-1b at ctx 128 / 1024 / 4096 for the hand-lowered
# fused 16-split strategy (bench/strategies/v10_fused_s16_llama-1b.json, what gpu_check times as searched_fused and
# session 4's final bench used) next to run 57's searched best (runs/llama-1b-ring12-h200), which read 0.822 ms in its
# search loop but 0.835 in `synth bench`; then compute-sanitizer memcheck on the tiny configs (FMA and wgmma consumers).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s5-last}
mkdir -p "$OUT"
{
  python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
  for s in "fs16 /tmp/fs16.json" "ring12 runs/llama-1b-ring12-h200/best/schedule.json"; do
    set -- $s
    echo "== synth bench llama-1b $1"
    timeout 100 python3 -m megasynth.cli bench --model llama-1b --schedule "$2" --ctx 128 1024 4096 \
      --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_$1.json" 2>&1 | grep -E "^│|wrote|rror" | tail -8
  done
  for flag in "" --mma; do
    echo "== compute-sanitizer memcheck $flag"
    timeout 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_tiny.py $flag 2>&1 | tail -2
  done
} 2>&1 | tee "$OUT/last.log"
