#!/usr/bin/env bash
# Issue 12, session 5: `synth search` on the final kernel (12 ring slots), one run per model, each packed into $OUT as
# soon as it ends: SEARCHES="model:budget:time-limit ..." (defaults: llama-3b and llama-8b; llama-1b in a second
# call). Runs are named runs/<model>-$SUFFIX-h200 (SUFFIX: ring12 by default; session 6 used lead).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s5-search}
mkdir -p "$OUT" runs
for spec in ${SEARCHES:-llama-3b:24:170 llama-8b:16:180}; do
  IFS=: read -r model budget tl <<< "$spec"
  run=$model-${SUFFIX:-ring12}-h200
  echo "== $run (budget $budget, time limit $tl s)"
  timeout $((tl + 120)) python3 -m megasynth.cli search --no-progress --seed 13 --interleavings 50 \
      --final-interleavings 300 --run "$run" --model "$model" --ctx 1024 --budget "$budget" --time-limit "$tl" \
      2>&1 | tee "$OUT/search_$model.log" | tail -8
  tar -cJf "$OUT/$run.tar.xz" --exclude=study.db-journal "runs/$run"
done
