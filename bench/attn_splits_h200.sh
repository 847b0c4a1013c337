#!/usr/bin/env bash
# Long contexts on one H200: llama-1b's reference strategy (bench/runs/llama-1b-h200/best) with its attention split
# count replaced, lowered for max_seq_len 32768 or 131072 and benched at that ctx (the megakernel; PyTorch's plain bf16
# step beside the 16-split rows). Writes bench/results/long/llama-1b_ctx<N>_splits<S>.json (or under $OUT/long).
# About 2.5 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results}/long
mkdir -p "$RESULTS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic' 2>/dev/null; then  # wheels carried to a machine without them
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
work=$(mktemp -d)
probe() {  # max_seq_len = ctx, splits, variants
  local ctx=$1 splits=$2 variants=$3
  python3 - "$splits" "$work/strategy.json" <<'PY'
import gzip, json, sys
meta = json.loads(gzip.open("bench/runs/llama-1b-h200/best/schedule.json.gz").read())["meta"]
json.dump({**meta["strategy"], "attn_splits": int(sys.argv[1])}, open(sys.argv[2], "w"))
PY
  python3 -m megasynth.cli lower --model llama-1b --strategy "$work/strategy.json" --max-seq-len "$ctx" \
    -o "$work/schedule.json" >/dev/null &&
  python3 -m megasynth.commands.bench bench --model llama-1b --max-seq-len "$ctx" --schedule "$work/schedule.json" \
    --ctx "$ctx" --variants "$variants" --json "$RESULTS/llama-1b_ctx{ctx}_splits$splits.json" 2>&1 |
    grep -E "^ *(floor|megakernel|torch bf16)"
}
{
  probe 32768 16 torch_bf16,megakernel
  for s in 32 64 128; do probe 32768 $s megakernel; done
  probe 131072 16 torch_bf16,megakernel
  probe 131072 64 megakernel
} 2>&1 | tee "$RESULTS/attn_splits_h200.log"
rm -rf "$work"
