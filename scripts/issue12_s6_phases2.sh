#!/usr/bin/env bash
# Issue 12, session 6, run 66: what the signals phase (1.6-2.2 us for QKV, gate/up and down in run 65, 0.4 for
# attention, whose loader sits on a full ring) waits for. The same phase trace as run 65 with 2 fills in flight
# instead of 4 (v10pli2), and with the loader issuing no fills at all (MEGASYNTH_V10_DIAG=3: it arrives on each slot's
# mbarrier instead; the results are WRONG, the timings are the compute side alone), on the searched best of
# runs/llama-1b-lead-h200 at ctx 1024.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-phases2}
mkdir -p "$OUT"
{
  for v in "i2 0 v10pli2" "nofill 3 v10"; do
    set -- $v
    echo "== $1"
    MEGASYNTH_V10_DIAG=$2 timeout 150 python3 scripts/gpu_check.py --out "$OUT/$1" --quick --skip-correctness \
      --variants $3 --lowerings lead_best --ctx 1024 --trace lead_best 2>&1 \
      | grep -E "lead_best.* ctx .*floor|ERROR|errors:|Error|trace |stage .* us, body"
  done
} 2>&1 | tee "$OUT/phases2.log"
