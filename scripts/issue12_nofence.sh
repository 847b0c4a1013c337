#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, sixth device call of the session. Run 33: with fake fills the hand-offs alone turn slots over at 115-178
# KB/us per SM (DIAG=4) but only ~47 once the compute warps read them (DIAG=3): the reads + arithmetic bound the
# consumer. The software-pipelined loop (read slot t + 1 before multiplying slot t) could not help while each release
# runs fence.proxy.async, which compiles to MEMBAR.ALL.CTA and waits for the next slot's loads in flight. So: the same
# variants with the fence off (MEGASYNTH_V10_RELEASE_FENCE=0; the slot's values were already consumed by then), in a
# second process, v10kp in both as the common reference. Consume rate (DIAG=3), then the step.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-nofence}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
MEGASYNTH_V10_RELEASE_FENCE=0 MEGASYNTH_V10_DIAG=3 timeout 100 python3 scripts/stream_v10_bench.py --out "$OUT/s3" \
    --variants v10kp,v10kpp,v10nbkpp --ops $OPS 2>&1 | tail -10 | sed 's/^/diag3nofence /' | tee -a "$LOG"
timeout 150 python3 scripts/gpu_check.py --out "$OUT/fence" --skip-correctness --variants v10,v10kp \
    --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 | tail -4 | sed 's/^/fence /' | tee -a "$LOG"
MEGASYNTH_V10_RELEASE_FENCE=0 timeout 200 python3 scripts/gpu_check.py --out "$OUT/nofence" --quick --kernels v10kpp \
    --variants v10kp,v10nbkpp,v10kpp --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 \
    | tail -12 | sed 's/^/nofence /' | tee -a "$LOG"
rm -f "$OUT"/*/trace_*.json
