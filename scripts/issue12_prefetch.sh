#!/usr/bin/env bash
# Ran at 1083d00 (the prefetcher was removed after: both versions cost far more than they saved).
# Session 5, runs 54-55: the prefetcher partition (StreamConfig.ahead): a second walker warp prefetches each ring
# slot's rows into L2 at most `ahead` slots before the loader claims the slot, so HBM keeps streaming while the ring
# is full (run 53's loader trace: the loaders sit ~10 us per layer with a full ring during attention and o_proj).
# Side by side in one process on the searched fused schedule, each variant checked against the reference; the FMA
# consumer in the first process (traced: the last variant), the tensor-core consumer in the second.
# Run 54 (at the parent commit of the LSU version) prefetched with one cp.async.bulk.prefetch.L2 per row and slot:
# 1.34-1.40 ms against 0.818 for every distance. Run 55: prefetch.global.L2 per 128-byte line (the LSU path).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-prefetch}
mkdir -p "$OUT"
{
  echo "== FMA consumer"
  timeout 280 python3 scripts/gpu_check.py --out "$OUT/fma" --quick --skip-correctness \
    --variants v10,v10pf4,v10pf24,v10pf12 --lowerings searched_fused --ctx 1024,4096 \
    --trace searched_fused 2>&1 | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error|loader reached| L7: "
  echo "== tensor-core consumer"
  timeout 150 python3 scripts/gpu_check.py --out "$OUT/mma" --quick --skip-correctness \
    --variants v10mma,v10mmapf12 --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:|Error"
} 2>&1 | tee "$OUT/prefetch.log"
