#!/usr/bin/env bash
# Tokens/s by batch on one GPU: `synth bench --batch 1,2,4,8,16` at ctx 1024 for the models named on the command line
# (default llama-1b and llama-8b): the batched bf16 PyTorch step, its torch.compile (default mode) and the megakernel
# (interpreter v10; at a batch, one wgmma per ring slot for every sequence). Each batch's schedule is the lowering of
# the model's reference search result (bench/runs/<model>-h200: its tiles and K splits) adapted to the batch by
# `megasynth.lowering.strategy.for_batch`: attention split batch times less, its merge folded into o_proj where that
# leaves one split (two become one at batch 8 for 64-dim heads), and from batch 8, where v10's ring slots are [128, 64]
# tiles, o_proj and down tiles of at least 128 rows (K split as much finer), QKV tiles of 64, gate/up tiles of a
# multiple of 64 rows and the embedding 256 columns an instruction. Writes <model>_batch<N>.json and
# <model>_batch_h200.log under $OUT, or bench/results/batch when OUT is unset; BATCHES="1 8" times those batches only,
# VARIANTS="torch_bf16,megakernel" leaves out the compile (COMPILE_TIMEOUT: its limit in seconds, 120 by default;
# llama-8b at batch 8 needs more). QKV tiles keep the reference run's RoPE pairs (at least 64 rows from batch 8);
# QKV=heads rounds them up to whole heads. About 6 minutes for llama-1b on an H200, 8 for
# llama-8b without the compile (its compile: 3.5 minutes for batch 1 alone).
# `--tiles` times interpreter v9 at batch 8 on wide tiles instead (the lowering of
# bench/results/batch/llama-1b_batch8_tiles.strategy.json; in the kernel, the weight tile as the product's first
# operand at 128 rows, 16384-element K tiles and no register cap), side by side with the PyTorch steps:
# llama-1b_batch8_tiles.json (about 2 minutes). KERNEL_OPTIONS="interpreter=v10 ..." passes each KEY=VALUE to the
# megakernel (`--kernel-option`), e.g. "stage_groups=1" (a QK-norm model's batch, Qwen3, runs on v10 with
# RoPE-pair QKV tiles and the norm inside attention, as `for_batch` lowers it).
set -uo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results/batch}
mkdir -p "$RESULTS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic' 2>/dev/null; then  # wheels carried to a machine without them
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
read -r -a BATCHES <<< "${BATCHES:-1 2 4 8 16}"  # BATCHES="1 8" times those only
lower_batches() {  # $1 model, $2 folder: s<N>.json for every batch, from the reference run's strategy
  python3 - "$1" "$2" "${BATCHES[@]}" <<'PY' || return 1
import gzip, json, os, sys
from megasynth.lowering.models import get_model, with_batch
from megasynth.lowering.strategy import Strategy, for_batch
model, out, *batches = sys.argv[1:]
# QKV tiles of the reference run's RoPE pairs (side by side faster than whole heads: llama-1b 3 % at batches 2 and
# 4, llama-8b 3 % at batch 8 on 96 SMs instead of 48; docs/perf-notes.md); QKV=heads asks for whole heads
qkv = os.environ.get("QKV", "pairs")
if qkv not in ("heads", "pairs"):
    sys.exit(f"QKV={qkv!r}: heads or pairs (unset: pairs)")
strategy = Strategy.model_validate(
    json.load(gzip.open(f"bench/runs/{model}-h200/best/schedule.json.gz"))["meta"]["strategy"])
for b in map(int, batches):
    s = for_batch(strategy, with_batch(get_model(model), b), qkv == "heads").model_dump(mode="json")
    json.dump(s, open(f"{out}/strategy{b}.json", "w"))
PY
  for b in "${BATCHES[@]}"; do
    python3 -m megasynth.cli lower --model "$1" --batch "$b" --strategy "$2/strategy$b.json" -o "$2/s$b.json" || return 1
  done
}
if [ "${1:-}" = --tiles ]; then
  work=$(mktemp -d)
  {
    python3 -m megasynth.cli lower --model llama-1b --batch 8 \
      --strategy bench/results/batch/llama-1b_batch8_tiles.strategy.json -o "$work/schedule.json" &&
    python3 -m megasynth.commands.bench bench --model llama-1b --ctx 1024 --batch 8 --schedule "$work/schedule.json" \
      --kernel-option interpreter=v9 --kernel-option batch_weight_first=true --kernel-option batch_rows=128 \
      --kernel-option batch_tile=16384 --kernel-option maxnreg=255 --variants torch_bf16,torch_compile,megakernel \
      --compile-mode default --compile-timeout 120 --json "$RESULTS/llama-1b_batch8_tiles.json"
  } 2>&1 | tee "$RESULTS/batch_tiles_h200.log"
  exit
fi
kopts=()
for kv in ${KERNEL_OPTIONS:-}; do kopts+=(--kernel-option "$kv"); done
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama-1b llama-8b)
for model in "${models[@]}"; do
  work=$(mktemp -d)
  {
    lower_batches "$model" "$work" &&
    python3 -m megasynth.commands.bench bench --model "$model" --ctx 1024 --batch "$(IFS=,; echo "${BATCHES[*]}")" \
      --schedule "$work/s{batch}.json" --variants "${VARIANTS:-torch_bf16,torch_compile,megakernel}" "${kopts[@]}" \
      --compile-mode default --compile-timeout "${COMPILE_TIMEOUT:-120}" --json "$RESULTS/${model}_batch{batch}.json"
  } 2>&1 | tee "$RESULTS/${model}_batch_h200.log"
done
