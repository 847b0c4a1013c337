#!/usr/bin/env bash
# Issue 12, session 4: the schedules were searched on the kernel before attention's cheaper merge. One device call: the
# default llama-1b search at ctx 1024 on the kernel with the cheaper attention merge -> runs/llama-1b-attnmerge-h200,
# packed into $OUT (no bench after it: the session's device time ran out).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-attnmerge-search}
mkdir -p "$OUT" runs
timeout "${T_SEARCH_WALL:-330}" python3 -m megasynth.cli search --no-progress --seed 13 --interleavings 50 \
    --final-interleavings 300 --run llama-1b-attnmerge-h200 --model llama-1b --ctx 1024 --budget "${BUDGET:-50}" \
    --time-limit "${T_SEARCH:-230}" 2>&1 | tee "$OUT/search.log" | tail -30
tar -cJf "$OUT/llama-1b-attnmerge-h200.tar.xz" --exclude=study.db-journal runs/llama-1b-attnmerge-h200
