#!/usr/bin/env bash
# Ran at commit 7d1a718 (the HOLD switch was removed in the next commit: slower, perf notes v10 session 6).
# Issue 12, session 6, run 68: the compute warps hold an instruction's last ring slots until its signals are out
# (MEGASYNTH_V10_HOLD=K: every slot goes back K slots late, the last K after the release), so that no fill is in
# flight when the instruction releases its counter (runs 65-66: 1-2 us per release with fills in flight, 0.4 without).
# llama-1b's searched best (gpu_check's lead_best) at K = 0 / 2 / 4, each process checked against the reference, with
# the phase trace; then llama-8b's searched best at K = 0 / 4 (scripts/config_bench.py, checked at one position).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-hold}
mkdir -p "$OUT"
{
  for k in 0 2 4; do
    echo "== llama-1b HOLD=$k"
    MEGASYNTH_V10_HOLD=$k timeout 120 python3 scripts/gpu_check.py --out "$OUT/h$k" --quick --skip-correctness \
      --variants v10 --lowerings lead_best --ctx 1024,4096 --trace lead_best 2>&1 \
      | grep -E "lead_best.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|trace |stage .* us, body"
  done
  for k in 0 4; do
    echo "== llama-8b HOLD=$k"
    MEGASYNTH_V10_HOLD=$k timeout 150 python3 scripts/config_bench.py --model llama-8b \
      --schedule runs/llama-8b-lead-h200/best/schedule.json --ctx 1024 --json "$OUT/llama8b_h$k.json" "h$k=" 2>&1 \
      | grep -E "llama|rror"
  done
} 2>&1 | tee "$OUT/hold.log"
