#!/usr/bin/env bash
# Issue 12, session 6, run 60: who polls a counter. v10 (every compute warp polls: 8 requests per SM per poll round
# on an all-join counter) against v10pl (StreamConfig.poll="lead": the first warp polls, the others wait at a CTA
# barrier), each also with 2 fills in flight (less queued in front of a poll), side by side on the searched fused
# schedule, each checked against the reference; the trace of v10pl at ctx 1024 (the hops).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-poll}
mkdir -p "$OUT"
{
  echo "== poll"
  timeout 420 python3 scripts/gpu_check.py --out "$OUT/poll" --quick --skip-correctness \
    --variants v10,v10pl,v10i2,v10pli2,v10pl --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|trace "
} 2>&1 | tee "$OUT/poll.log"
