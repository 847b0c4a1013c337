#!/usr/bin/env bash
# One device call (docs/perf-notes.md, "v10: the merge inside o_proj"; docs/search.md, "GPU runs"):
#   1. the proxy fence before a ring slot goes back to the loader, on and off (MEGASYNTH_V10_RELEASE_FENCE), each
#      timing the searched schedule and its fused variant at ctx 1024 (and checking them against the reference);
#   2. the default llama-1b search (seeds, then descent) with the fused merge + o_proj in its space
#      -> runs/llama-1b-fused-h200, packed into $OUT as soon as it ends.
# $OUT gets at most 8 files (the device tool's limit).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue13-fused}
mkdir -p "$OUT" runs
for f in 1 0; do
    MEGASYNTH_V10_RELEASE_FENCE=$f timeout 150 python3 scripts/gpu_check.py --out "$OUT/f$f" --skip-correctness \
        --kernels v10 --variants v10 --lowerings searched,searched_fused,searched --ctx 1024,4096 --trace none \
        2>&1 | tail -8
    mv "$OUT/f$f/gpu_check.json" "$OUT/fence$f.json" && rm -rf "$OUT/f$f"
done
timeout "${T_SEARCH_WALL:-400}" python3 -m megasynth.cli search --no-progress --seed 13 --interleavings 50 \
    --final-interleavings 300 --run llama-1b-fused-h200 --model llama-1b --budget "${BUDGET:-60}" \
    --time-limit "${T_SEARCH:-280}" 2>&1 | tee "$OUT/search.log" | tail -40
tar -cJf "$OUT/llama-1b-fused-h200.tar.xz" --exclude=study.db-journal runs/llama-1b-fused-h200
ls -la "$OUT"
