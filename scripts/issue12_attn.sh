#!/usr/bin/env bash
# What an attention-chain instruction costs on its own (scripts/attn_bench.py), whole and with parts of attention
# taken out (MEGASYNTH_V10_DIAG 5: no arithmetic over the K/V blocks, 6: no q / current-row loads, 7: no final merge).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-attn}
mkdir -p "$OUT"
for d in 0 5 6 7; do
  ops=embed,attn_norm_qkv_rope,attn_partial,attn_reduce_o_proj
  [ "$d" != 0 ] && ops=attn_partial
  MEGASYNTH_V10_DIAG=$d timeout 120 python3 scripts/attn_bench.py --out "$OUT" --ops $ops 2>&1 | grep -E "^diag|Error" | tail -16
done 2>&1 | tee "$OUT/attn.log"
