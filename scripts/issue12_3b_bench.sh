#!/usr/bin/env bash
# One device call: the llama-3b search on interpreter v10 (-> runs/llama-3b-h200, packed into $OUT as soon as it
# ends), then `synth bench` (torch_bf16 vs megakernel) of the best schedules of the committed searches
# (llama-1b-noseed-h200 at ctx 128/1024/4096, llama-8b-h200 at ctx 1024), of the new llama-3b best and of the naive
# llama-3b, each at ctx 1024. Every step has its own `timeout`, and all of them end by START + ${DEADLINE:-555} s.
# $OUT gets at most 8 files (the device tool's limit): the 3b log and tarball, 4 bench JSONs, benches.log (the
# tail -15 of each bench) and, from the caller, device.log.
# DRY=1 skips the search and runs the benches with --dry-run (CPU) on a tiny ctx, to check the schedule lookup.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-out}
PY=${PY:-python3}
mkdir -p "$OUT" runs
START=$(date +%s)
DEADLINE=${DEADLINE:-555}
left() { echo $(( START + DEADLINE - $(date +%s) )); }
cap() {  # seconds for a step: its own cap, or what is left before the deadline, whichever is smaller
    local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
best_of() {  # the best schedule of a run folder, after checking best/ is the leaderboard's first entry
    local run=runs/$1
    "$PY" - "$run" <<'EOF' >&2
import json, sys
run = sys.argv[1]
lb = json.load(open(f"{run}/leaderboard.json"))
top = lb["entries"][0]
t = json.load(open(f"{run}/best/timing.json"))
same = abs(top["ms"] - t["median_ms"]) < 1e-9
print(f"{run}: leaderboard top {top['candidate']} {top['ms']:.4f} ms, best/timing {t['median_ms']:.4f} ms, "
      f"naive {lb['baseline_ms']:.4f} ms -> {'best/ is the top entry' if same else 'MISMATCH'}")
EOF
    [ -f "$run/best/schedule.json" ] && echo "$run/best/schedule.json"
}
bench() {  # name, seconds, arguments
    local name=$1 secs lines=${TAIL:-15}; secs=$(cap "$2"); shift 2
    [ "$name" = bench_llama1b_searched ] && lines=45  # one table per ctx
    if [ "$secs" -le 5 ]; then echo "== $name: skipped, no time left"; return; fi
    local extra=()
    [ "${DRY:-0}" = 1 ] && extra=(--dry-run --reps 2 --warmup 1)
    echo "== $name (timeout ${secs}s): synth bench $* ${extra[*]}" | tee -a "$OUT/benches.log"
    local t0; t0=$(date +%s)
    timeout -k 10 "$secs" "$PY" -m megasynth.cli bench "$@" "${extra[@]}" 2>&1 | tail -"$lines" | tee -a "$OUT/benches.log"
    local rc=${PIPESTATUS[0]}
    echo "   rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/benches.log"
}
echo "== device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
if [ "${DRY:-0}" != 1 ]; then
    echo "== search llama-3b-h200 (timeout 305s)"
    t0=$(date +%s)
    timeout -s INT -k 15 305 "$PY" -m megasynth.cli search --no-progress --seed 13 --interleavings 50 \
        --final-interleavings 300 --run llama-3b-h200 --model llama-3b --budget 24 --time-limit 200 2>&1 \
        | tee "$OUT/llama3b.log"
    echo "   rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
    tar -cJf "$OUT/llama-3b-h200.tar.xz" --exclude=study.db-journal runs/llama-3b-h200
fi
C1=128; C2=1024; C3=4096
[ "${DRY:-0}" = 1 ] && { C1=16; C2=16; C3=32; }
S1=$(best_of llama-1b-noseed-h200) && bench bench_llama1b_searched 110 --model llama-1b --schedule "$S1" \
    --ctx $C1 $C2 $C3 --variants torch_bf16,megakernel --json "$OUT/bench_llama1b_searched.json"
S8=$(best_of llama-8b-h200) && bench bench_llama8b_searched 80 --model llama-8b --schedule "$S8" \
    --ctx $C2 --variants torch_bf16,megakernel --json "$OUT/bench_llama8b_searched.json"
if S3=$(best_of llama-3b-h200); then
    bench bench_llama3b_searched 60 --model llama-3b --schedule "$S3" --ctx $C2 --variants torch_bf16,megakernel \
        --json "$OUT/bench_llama3b_searched.json"
else
    echo "== bench_llama3b_searched: no runs/llama-3b-h200/best/schedule.json"
fi
bench bench_llama3b_naive 60 --model llama-3b --ctx $C2 --variants torch_bf16,megakernel \
    --json "$OUT/bench_llama3b_naive.json"
echo "== total $(( $(date +%s) - START )) s"
ls -la "$OUT"
