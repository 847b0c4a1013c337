#!/usr/bin/env bash
# Issue 12, session 6: `synth search` on the lead-poll kernel (runs/<model>-lead-h200, each packed into $OUT as soon as
# it ends), PART=big: llama-3b and llama-8b, then llama-8b's winner with 4 and 2 fills in flight (inflight 2 read
# -0.6 / -1.4 % on llama-1b in runs 60-61); PART=small: llama-1b, then `synth bench` (PyTorch bf16 in a CUDA graph vs
# the megakernel, against the floor) of each model's winner: llama-1b at ctx 128 / 1024 / 4096, the others at 1024.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue12-s6-search}
mkdir -p "$OUT"
if [ "${PART:-big}" = big ]; then
  SUFFIX=lead SEARCHES="llama-3b:20:150 llama-8b:14:160" OUT="$OUT" bash scripts/issue12_s5_search.sh
  echo "== llama-8b winner: fills in flight"
  timeout 150 python3 scripts/config_bench.py --model llama-8b --schedule runs/llama-8b-lead-h200/best/schedule.json \
    --ctx 1024 --json "$OUT/inflight_llama8b.json" i4=inflight=4 i2=inflight=2 2>&1 | grep -E "llama|rror"
else
  SUFFIX=lead SEARCHES="llama-1b:40:130" OUT="$OUT" bash scripts/issue12_s5_search.sh
  for spec in "llama-1b 128 1024 4096" "llama-3b 1024" "llama-8b 1024"; do
    set -- $spec; model=$1; shift
    echo "== synth bench $model (runs/$model-lead-h200/best) at ctx $*"
    timeout 150 python3 -m megasynth.cli bench --model "$model" --schedule "runs/$model-lead-h200/best/schedule.json" \
      --ctx "$@" --variants torch_bf16,megakernel --json "$OUT/bench_${model/-/}_lead.json" 2>&1 \
      | grep -E "^│|wrote|rror" | tail -8
  done
fi 2>&1 | tee "$OUT/search_${PART:-big}.log"
