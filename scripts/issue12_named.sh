#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, this session's first device call: how fast do the compute warps consume a full ring, and does handing
# slots back per warp (named barriers, release="named") instead of through a CTA barrier + one mbarrier arrive help?
# 1. the named-release kernel on the tiny configs (smoke), 2. each op's stream alone with real fills (DIAG=0) and with
# fake ones (DIAG=3: the loader arrives instead of loading, so the rate is the compute warps' own), 3. the searched
# fused schedule side by side, checked against the reference, traced with the new kernel.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-named}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
V="v10,v10nb,v10b4,v10nbb4,v10nbw4"
OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
timeout 120 python3 scripts/gpu_check.py --out "$OUT/smoke" --smoke --kernels v10nb 2>&1 | tail -4 | tee -a "$LOG"
MEGASYNTH_V10_DIAG=3 timeout 170 python3 scripts/stream_v10_bench.py --out "$OUT/s3" --variants $V --ops $OPS \
    2>&1 | tail -16 | sed 's/^/diag3 /' | tee -a "$LOG"
timeout 130 python3 scripts/stream_v10_bench.py --out "$OUT/s0" --variants $V --ops $OPS \
    2>&1 | tail -16 | sed 's/^/diag0 /' | tee -a "$LOG"
timeout 170 python3 scripts/gpu_check.py --out "$OUT/step" --quick --kernels v10nb --variants v10,v10nbb4,v10nb \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -30 | tee -a "$LOG"
rm -f "$OUT"/step/trace_*.json
