#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, fifth device call of the session: what bounds the slot turnover at ~45-55 KB/us per SM? Consumer-side
# changes (named hand-offs, software pipelining) did not move the fake-fill rate (DIAG=3). DIAG=4: fake fills and the
# compute warps read nothing from the slots: if the rate stays, the hand-offs (loader + barriers) bound it. Loader-side
# variants: no in-flight bound (one mbarrier wait per fill less), 4 boxes per slot (half the fills per byte), more
# loader registers.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-handoff}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
OPS=mlp_norm_gate_up,down_proj_residual,attn_norm_qkv_rope
V=v10kp,v10kpi0,v10kpb4,v10kplr56
MEGASYNTH_V10_DIAG=4 timeout 130 python3 scripts/stream_v10_bench.py --out "$OUT/s4" --variants $V --ops $OPS \
    2>&1 | tail -13 | sed 's/^/diag4 /' | tee -a "$LOG"
MEGASYNTH_V10_DIAG=3 timeout 130 python3 scripts/stream_v10_bench.py --out "$OUT/s3" --variants $V --ops $OPS \
    2>&1 | tail -13 | sed 's/^/diag3 /' | tee -a "$LOG"
