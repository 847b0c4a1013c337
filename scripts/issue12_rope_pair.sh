#!/usr/bin/env bash
# Ran at commit ea5786c (run 50); the two switches were removed after (both changes kept).
# Two chain tweaks side by side on the searched fused schedule (each process checked against the reference at one
# position): RoPE's cos/sin loaded before QKV's K loop (MEGASYNTH_V10_LATE_ROPE=0) and attention folding a slot's two
# position blocks in one online-softmax update (MEGASYNTH_V10_ATTN_PAIR=1); A = neither (the code before), B = both,
# C = the pair update only.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-rope-pair}
mkdir -p "$OUT"
for v in "A 0 1" "B 1 0" "C 1 1"; do
  set -- $v
  echo "== $1: ATTN_PAIR=$2 LATE_ROPE=$3"
  MEGASYNTH_V10_ATTN_PAIR=$2 MEGASYNTH_V10_LATE_ROPE=$3 timeout 120 python3 scripts/gpu_check.py --out "$OUT/$1" \
    --quick --skip-correctness --variants v10,v10 --lowerings searched_fused --ctx 1024,4096 --trace none 2>&1 \
    | grep -E "searched_fused.* ctx .*floor|PASS|FAIL|ERROR|errors:"
done 2>&1 | tee "$OUT/rope_pair.log"
