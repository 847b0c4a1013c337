#!/usr/bin/env bash
# Ran at commit 86ba853 (bench/device_logs/run29-run34); most variants it names were removed after (perf notes).
# Issue 12, third device call of the session: the ring banks only ~176 KB of a 512 KB gate/up tile, so gate/up streams
# ~2/3 of its bytes from HBM after the attention chain, during which HBM sat mostly idle. Variants: the loader
# prefetches the last 16 / 32 rows of each gate/up tile into L2 when it reaches the tile (l2_gate_up), with and
# without row-paired K slots (kpair). The searched fused schedule side by side, checked against the reference, traced.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-l2gu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
V="v10,v10kp,v10kpl16,v10kpl32,v10l32"
timeout 300 python3 scripts/gpu_check.py --out "$OUT/step" --quick --kernels v10kpl32 --variants $V \
    --lowerings searched_fused --ctx 1024,4096 --trace searched_fused 2>&1 | tail -30 | tee -a "$LOG"
rm -f "$OUT"/step/trace_*.json
