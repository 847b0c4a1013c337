#!/usr/bin/env bash
# Tokens/s by batch on one GPU: `synth bench --batch 1,2,4,8,16` at ctx 1024 for the models named on the command
# line (default llama-1b and llama-8b): the batched bf16 PyTorch step, its torch.compile (default mode) and the
# megakernel (interpreter v9 for a batch, v10 at batch 1; the naive lowering of each batch). Writes
# <model>_batch<N>.json and batch_h200.log under $OUT, or bench/results/batch when OUT is unset. About 5 minutes
# per model on an H200 (one device call each). For llama-1b it then times batch 8 on wide tiles (the lowering of
# bench/results/batch/llama-1b_batch8_tiles.strategy.json; in the kernel, the weight tile as the product's first
# operand at 128 rows, 16384-element K tiles and no register cap), side by side with the PyTorch steps:
# llama-1b_batch8_tiles.json. `--tiles` runs that step alone (about 2 minutes).
set -uo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results/batch}
mkdir -p "$RESULTS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic' 2>/dev/null; then  # wheels carried to a machine without them
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
wide_tiles() {
  local work
  work=$(mktemp -d)
  python3 -m megasynth.cli lower --model llama-1b --batch 8 \
    --strategy bench/results/batch/llama-1b_batch8_tiles.strategy.json -o "$work/schedule.json" &&
  python3 -m megasynth.commands.bench bench --model llama-1b --ctx 1024 --batch 8 --schedule "$work/schedule.json" \
    --kernel-option batch_weight_first=true --kernel-option batch_rows=128 --kernel-option batch_tile=16384 \
    --kernel-option maxnreg=255 --variants torch_bf16,torch_compile,megakernel --compile-mode default \
    --compile-timeout 120 --json "$RESULTS/llama-1b_batch8_tiles.json"
  rm -rf "$work"
}
if [ "${1:-}" = --tiles ]; then
  wide_tiles 2>&1 | tee "$RESULTS/batch_tiles_h200.log"
  exit
fi
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama-1b llama-8b)
for model in "${models[@]}"; do
  echo "== $model"
  python3 -m megasynth.commands.bench bench --model "$model" --ctx 1024 --batch 1,2,4,8,16 \
    --variants torch_bf16,torch_compile,megakernel --compile-mode default --compile-timeout 120 \
    --json "$RESULTS/${model}_batch{batch}.json"
  if [ "$model" = llama-1b ]; then
    wide_tiles
  fi
done 2>&1 | tee "$RESULTS/batch_h200.log"
