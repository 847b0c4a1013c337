#!/usr/bin/env bash
# Ran at the parent of the commit that removed the two switches (both kept: no effect measured, one round trip less each).
# Session 5, run 52: three cheap cuts at the chain's latency, side by side on the searched fused schedule (each process
# checked against the reference at one position). MEGASYNTH_V10_POLL=1: a poll's abort-flag load is issued before its
# acquire load (both in flight: one L2 round trip per poll, not two). MEGASYNTH_V10_NWFIRST=1: `_stage` loads the norm
# weight with the activation vector, not after the sum of squares' CTA reduction. v10 = 12 ring slots (the shared-memory
# reserve cut from 12 KB to 2 KB; the compiled kernel uses 229.7 KB of 227 KB), v10s11 = 11 (as before).
# A = neither switch (the code before), B = both, C = the poll only.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-poll}
mkdir -p "$OUT"
for v in "A 0 0 none" "B 1 1 searched_fused" "C 1 0 none"; do
  set -- $v
  echo "== $1: POLL=$2 NWFIRST=$3"
  MEGASYNTH_V10_POLL=$2 MEGASYNTH_V10_NWFIRST=$3 timeout 170 python3 scripts/gpu_check.py --out "$OUT/$1" \
    --quick --skip-correctness --variants v10s11,v10 --lowerings searched_fused --ctx 1024,4096 --trace "$4" 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|error"
done 2>&1 | tee "$OUT/poll.log"
