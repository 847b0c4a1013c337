#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, fourth device call of the session. Run 31 showed gate/up does not speed up with half its tile prefetched
# into L2: in the step the consumer (compute warps, ~40-46 KB/us per SM) bounds it, not HBM. Variant: the row-paired
# slot loops software-pipelined (slot t + 1 read from shared memory before slot t is multiplied: v10kpp, and with
# named-barrier hand-offs v10nbkpp). 1. consume rate over a full ring (DIAG=3) and the stream alone, 2. the searched
# fused schedule side by side, checked against the reference, traced with the last variant.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-pipe}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
timeout 100 python3 scripts/gpu_check.py --out "$OUT/smoke" --smoke --kernels v10kpp,v10nbkpp 2>&1 | tail -4 | tee -a "$LOG"
MEGASYNTH_V10_DIAG=3 timeout 120 python3 scripts/stream_v10_bench.py --out "$OUT/s3" --variants v10kp,v10kpp,v10nbkpp \
    --ops $OPS 2>&1 | tail -10 | sed 's/^/diag3 /' | tee -a "$LOG"
timeout 120 python3 scripts/stream_v10_bench.py --out "$OUT/s0" --variants v10kp,v10kpp,v10nbkpp --ops $OPS \
    2>&1 | tail -10 | sed 's/^/diag0 /' | tee -a "$LOG"
timeout 240 python3 scripts/gpu_check.py --out "$OUT/step" --quick --kernels v10kpp --variants v10,v10kp,v10nbkpp,v10kpp \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -24 | tee -a "$LOG"
rm -f "$OUT"/step/trace_*.json
