#!/usr/bin/env bash
# Long contexts on one H200: a model's reference strategy (bench/runs/<model>-h200/best) with its attention split
# count replaced, lowered for max_seq_len 32768 or 131072 and benched at that ctx (the megakernel; PyTorch's plain bf16
# step beside the 16-split rows): llama-1b at both contexts and several split counts, llama-8b at 32768 with 16 splits.
# Writes bench/results/long/<model>_ctx<N>_splits<S>.json (or under $OUT/long). About 4 minutes; SPLITS="16" runs
# only the probes at those split counts (the published rows, about 2 minutes).
set -uo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results}/long
mkdir -p "$RESULTS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic' 2>/dev/null; then  # wheels carried to a machine without them
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
work=$(mktemp -d)
probe() {  # model, max_seq_len = ctx, splits, variants
  local model=$1 ctx=$2 splits=$3 variants=$4
  [[ " ${SPLITS:-$splits} " == *" $splits "* ]] || return 0
  python3 - "$model" "$splits" "$work/strategy.json" <<'PY'
import gzip, json, sys
model, splits, out = sys.argv[1:]
meta = json.loads(gzip.open(f"bench/runs/{model}-h200/best/schedule.json.gz").read())["meta"]
json.dump({**meta["strategy"], "attn_splits": int(splits)}, open(out, "w"))
PY
  python3 -m megasynth.cli lower --model "$model" --strategy "$work/strategy.json" --max-seq-len "$ctx" \
    -o "$work/schedule.json" >/dev/null &&
  python3 -m megasynth.commands.bench bench --model "$model" --max-seq-len "$ctx" --schedule "$work/schedule.json" \
    --ctx "$ctx" --variants "$variants" --json "$RESULTS/${model}_ctx{ctx}_splits$splits.json" 2>&1 |
    grep -E "^ *(floor|megakernel|torch bf16)"
}
{
  probe llama-1b 32768 16 torch_bf16,megakernel
  for s in 32 64 128; do probe llama-1b 32768 $s megakernel; done
  probe llama-1b 131072 16 torch_bf16,megakernel
  probe llama-1b 131072 64 megakernel
  probe llama-8b 32768 16 torch_bf16,megakernel
} 2>&1 | tee "$RESULTS/attn_splits_h200.log"
rm -rf "$work"
