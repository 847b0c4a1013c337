#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, second device call of the session: the compute warps' consume rate. Run 29 showed it is ~30-46 KB/us per
# SM over a full ring (fake fills), below HBM's share for down, and that Triton puts a CTA barrier before every
# mbarrier wait. Variants: slot hand-offs through named barriers both ways (v10nb*), K-split ops with row-paired
# slots (*kp), 4 boxes per slot (b4); fence off (RELEASE_FENCE=0) for the named ones. Then the searched fused
# schedule side by side, checked against the reference, traced with the last variant.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-named2}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
V="v10,v10kp,v10nb,v10nbkp,v10nbb4kp"
OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
timeout 120 python3 scripts/gpu_check.py --out "$OUT/smoke" --smoke --kernels v10nbkp,v10nbb4kp 2>&1 | tail -4 | tee -a "$LOG"
MEGASYNTH_V10_DIAG=3 timeout 150 python3 scripts/stream_v10_bench.py --out "$OUT/s3" --variants $V --ops $OPS \
    2>&1 | tail -16 | sed 's/^/diag3 /' | tee -a "$LOG"
MEGASYNTH_V10_DIAG=3 MEGASYNTH_V10_RELEASE_FENCE=0 timeout 100 python3 scripts/stream_v10_bench.py --out "$OUT/s3f" \
    --variants v10nbkp,v10nbb4kp --ops $OPS 2>&1 | tail -7 | sed 's/^/diag3nofence /' | tee -a "$LOG"
timeout 130 python3 scripts/stream_v10_bench.py --out "$OUT/s0" --variants $V --ops $OPS \
    2>&1 | tail -16 | sed 's/^/diag0 /' | tee -a "$LOG"
timeout 200 python3 scripts/gpu_check.py --out "$OUT/step" --quick --kernels v10nbkp --variants $V \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -30 | tee -a "$LOG"
rm -f "$OUT"/step/trace_*.json
