#!/usr/bin/env bash
# The H200 runs of issue 13 in one device call, from the repository root (docs/search.md, "GPU runs"):
#   1. llama-1b, no seeds (the descent alone)           ~35 candidates, --time-limit 120  -> runs/llama-1b-noseed-h200
#   2. llama-1b, the default search (3 seeds + descent) ~30 candidates, --time-limit 110  -> runs/llama-1b-default-h200
#   3. llama-3b, the default search                     ~16 candidates, --time-limit 90   -> runs/llama-3b-h200
#   4. llama-8b, the default search                     ~12 candidates, --time-limit 120  -> runs/llama-8b-h200
# and packs each run folder into $OUT/<run>.tar.xz as it ends (schedules included: ~40 KB each compressed) and
# the logs into $OUT. Expected wall time ~7-8 min (each search stops at its time limit at the latest, then
# finishes the candidates in flight). With CALIBRATE=1 it also refits the cost model there (+1-2 min); else unpack
# here with `for f in *.tar.xz; do tar -xJf $f; done` and refit on a CPU (~8 min on 2 cores):
#   synth calibrate --fit-run runs/llama-1b-noseed-h200 --fit-run runs/llama-1b-default-h200 \
#     --fit-run runs/llama-3b-h200 --fit-run runs/llama-8b-h200 --measured bench/v10/measured_steps.json \
#     --holdout 0.3 -o megasynth/data/h200_costmodel.json
set -uo pipefail
OUT=${OUT:-/tmp/issue13-out}
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1
SYNTH=(python -m megasynth.cli search --no-progress --seed 13 --interleavings 50 --final-interleavings 300)
run() {  # name, log file, arguments; each run is packed as soon as it ends (a later one may not get to finish)
    local name=$1 log=$2
    shift 2
    echo "== $name: ${SYNTH[*]} $*"
    "${SYNTH[@]}" --run "$name" "$@" 2>&1 | tee "$OUT/$log"
    tar -cJf "$OUT/$name.tar.xz" --exclude=study.db-journal "runs/$name"
}
# Time limits per search (seconds), shorter when the session's device time is short: T_NOSEED, T_DEFAULT, T_3B, T_8B.
run llama-1b-noseed-h200 noseed.log --model llama-1b --proposer descent --budget 35 --time-limit "${T_NOSEED:-120}"
run llama-1b-default-h200 default.log --model llama-1b --budget 30 --time-limit "${T_DEFAULT:-110}"
run llama-3b-h200 llama3b.log --model llama-3b --budget 16 --time-limit "${T_3B:-90}"
run llama-8b-h200 llama8b.log --model llama-8b --budget 12 --time-limit "${T_8B:-120}"
if [ "${CALIBRATE:-0}" = 1 ]; then  # the refit on this machine's 16 cores (~1-2 min; ~8 min on 2 cores elsewhere)
    python -m megasynth.cli calibrate --fit-run runs/llama-1b-noseed-h200 --fit-run runs/llama-1b-default-h200 \
        --fit-run runs/llama-3b-h200 --fit-run runs/llama-8b-h200 --measured bench/v10/measured_steps.json \
        --holdout 0.3 --jobs 15 -o "$OUT/h200_costmodel.json" 2>&1 | tee "$OUT/calibrate.log"
fi
ls -la "$OUT"
