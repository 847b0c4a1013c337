#!/usr/bin/env bash
# One device call: the default llama-8b search with the fused merge + o_proj in its space
# (-> runs/llama-8b-fused-h200), then `synth bench` at ctx 128 of the llama-1b strategy with 16 splits
# (bench/strategies/v10_fused_s16_llama-1b.json; its ctx 1024/4096 rows are in bench/bench_llama1b_fused_s16.json).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-8b}
mkdir -p "$OUT" runs
python3 -m megasynth.cli lower --model llama-1b --strategy bench/strategies/v10_fused_s16_llama-1b.json -o /tmp/fs16.json
timeout 100 python3 -m megasynth.cli bench --model llama-1b --schedule /tmp/fs16.json --ctx 128 \
    --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_fused_s16_ctx128.json" 2>&1 | tee "$OUT/bench.log" | tail -8
timeout "${T_SEARCH_WALL:-330}" python3 -m megasynth.cli search --no-progress --seed 13 --interleavings 50 \
    --final-interleavings 300 --run llama-8b-fused-h200 --model llama-8b --budget "${BUDGET:-16}" \
    --time-limit "${T_SEARCH:-200}" 2>&1 | tee "$OUT/search8b.log" | tail -12
tar -cJf "$OUT/llama-8b-fused-h200.tar.xz" --exclude=study.db-journal runs/llama-8b-fused-h200
