#!/usr/bin/env bash
# Ran at commit 6e8e177 (run 46); MEGASYNTH_V10_OLD_MERGE was removed after (the old merge lives in 8e5aa6e).
# Attention's position-lane merge through an explicit per-warp partial in shared memory (session 4) against Triton's
# reduction over the warp axis (MEGASYNTH_V10_OLD_MERGE=1, the code before): the chain's instructions alone
# (scripts/attn_bench.py) and the whole step on the searched fused schedule, every step checked against the reference;
# the tiny configs' correctness first.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-attn-merge}
mkdir -p "$OUT"
{
  echo "== correctness (new merge)"
  timeout 200 python3 scripts/gpu_check.py --out "$OUT/check" --quick --kernels v10 --variants v10 --lowerings naive \
    --ctx 1024 --trace none 2>&1 | grep -E "^(PASS|FAIL|ERROR)|errors:" | tail -16
  for old in 1 0; do
    echo "== old merge = $old"
    MEGASYNTH_V10_OLD_MERGE=$old timeout 100 python3 scripts/attn_bench.py --out "$OUT/attn$old" \
      --ops embed,attn_partial 2>&1 | grep -E "^diag|Error"
    MEGASYNTH_V10_OLD_MERGE=$old timeout 150 python3 scripts/gpu_check.py --out "$OUT/step$old" --quick \
      --skip-correctness --variants v10,v10 --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 \
      | grep -E "searched_fused ctx|PASS|FAIL|attn_partial +L7|errors:"
  done
} 2>&1 | tee "$OUT/merge.log"
