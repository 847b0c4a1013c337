#!/usr/bin/env bash
# The README's results table on one GPU: one `synth bench` JSON per row (floor, the best plain PyTorch step among
# torch_bf16 and torch_compile, and the megakernel running the model's reference searched schedule,
# bench/runs/<model>-h200/best/schedule.json[.gz]), for the models named on the command line (default: all).
# Writes <model>_ctx<N>.json and h200_bench.log under $OUT, or bench/results when OUT is unset. About 2 minutes per
# model on an H200 (llama-1b's three rows: 3). torch.compile runs in its default mode here: on the
# H200 max-autotune-no-cudagraphs gave the same step time (llama-1b, ctx 1024: 1.680 against 1.689 ms) for 3-4x the
# compile time, which would not fit all rows in 10 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic' 2>/dev/null; then  # wheels carried to a machine without them
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
schedule() { ls "bench/runs/$1-h200/best/schedule.json.gz" "bench/runs/$1-h200/best/schedule.json" 2>/dev/null | head -1; }
row() {  # model, compile time limit (s), ctx values
  local model=$1 limit=$2
  shift 2
  echo "== $model, ctx $*"
  python3 -m megasynth.commands.bench bench --model "$model" --schedule "$(schedule "$model")" --ctx "$@" \
    --variants torch_bf16,torch_compile,megakernel --compile-mode default --compile-timeout "$limit" \
    --json "$RESULTS/${model}_ctx{ctx}.json"
}
rows() {  # the models named on the command line, default all
  local model models=("$@")
  [ ${#models[@]} -gt 0 ] || models=(llama-1b llama-3b llama-8b qwen3-0.6b qwen3-1.7b qwen3-8b)
  for model in "${models[@]}"; do
    case $model in
      llama-1b) row llama-1b 150 128 1024 4096 ;;
      *8b) row "$model" 150 1024 ;;
      *) row "$model" 120 1024 ;;
    esac
  done
}
rows "$@" 2>&1 | tee "$RESULTS/h200_bench.log"
