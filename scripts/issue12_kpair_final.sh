#!/usr/bin/env bash
# Row-paired K slots (StreamConfig.kpair) as the v10 default: two device calls. PART=check: every GPU test, memcheck
# and racecheck on the tiny configs, and the searched fused schedule with kpair on and off side by side (checked
# against the reference). PART=bench: `synth bench` beside PyTorch bf16 in a CUDA graph of the llama-1b fused
# 16-split strategy at ctx 128/1024/4096 and of the searched llama-3b and llama-8b schedules at ctx 1024.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-kpair}
mkdir -p "$OUT"
if [ "${PART:-check}" = check ]; then
  {
    echo "== pytest -m gpu"; timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -6
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool"
      timeout 150 compute-sanitizer --tool $tool python3 scripts/sanitize_tiny.py 2>&1 | tail -8
    done
    echo "== kpair on (v10) / off (v10kp0)"
    timeout 150 python3 scripts/gpu_check.py --out "$OUT" --quick --kernels v10 --variants v10kp0,v10 \
      --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 | tail -6
  } 2>&1 | tee "$OUT/check.log"
else
  {
    python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
    timeout 200 python3 -m megasynth.cli bench --model llama-1b --schedule /tmp/fs16.json --ctx 128 1024 4096 \
      --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_kpair.json" 2>&1 | tail -8
    timeout 120 python3 -m megasynth.cli bench --model llama-3b --schedule runs/llama-3b-h200/best/schedule.json \
      --ctx 1024 --variants torch_bf16,megakernel --json "$OUT/bench_llama3b_kpair.json" 2>&1 | tail -5
    timeout 150 python3 -m megasynth.cli bench --model llama-8b --schedule runs/llama-8b-fused-h200/best/schedule.json \
      --ctx 1024 --variants torch_bf16,megakernel --json "$OUT/bench_llama8b_kpair.json" 2>&1 | tail -5
  } 2>&1 | tee "$OUT/bench.log"
fi
