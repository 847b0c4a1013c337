#!/usr/bin/env bash
# One device call: the llama-1b search with no seeds (the descent alone) in the space that holds the fused merge +
# o_proj (-> runs/llama-1b-noseed-fused-h200), then `synth bench` at ctx 1024 and 4096 of the default search's best
# strategy with 16 attention splits instead of 8 (bench/strategies/v10_fused_s16_llama-1b.json: the searched
# schedule is tuned at ctx 1024, where 8 splits won; at 4096, 16 splits measured faster). At most 8 files in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue13-noseed}
mkdir -p "$OUT" runs
timeout "${T_SEARCH_WALL:-300}" python3 -m megasynth.cli search --no-progress --seed 7 --interleavings 50 \
    --final-interleavings 300 --run llama-1b-noseed-fused-h200 --model llama-1b --proposer descent \
    --budget "${BUDGET:-60}" --time-limit "${T_SEARCH:-200}" 2>&1 | tee "$OUT/noseed.log" | tail -12
tar -cJf "$OUT/llama-1b-noseed-fused-h200.tar.xz" --exclude=study.db-journal runs/llama-1b-noseed-fused-h200
python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
timeout 150 python3 -m megasynth.cli bench --model llama-1b --schedule /tmp/fs16.json --ctx 1024 4096 \
    --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_fused_s16.json" 2>&1 | tee "$OUT/bench.log" | tail -14
