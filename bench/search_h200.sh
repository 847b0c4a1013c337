#!/usr/bin/env bash
# The reference runs in bench/runs/<model>-h200 on one H200: one `synth search` per model named on the command line
# (default: every model with a reference run), ctx 1024, seed 13, 40 candidates, 50 adversarial interleavings per
# candidate and 300 for the best. Writes <model>-h200 under $OUT/runs, or runs/ when OUT is unset, packed (`synth runs
# pack`: one candidates.json.gz) as bench/runs holds them. About 2-3 minutes per model. SEED, BUDGET and LIMIT (the
# search's seconds) override the defaults for every model named: the longer qwen3-1.7b search of
# bench/results/qwen3-1.7b_bound/ is `SEED=7 BUDGET=200 LIMIT=470 bash bench/search_h200.sh qwen3-1.7b` (8 minutes).
set -uo pipefail
export PYTHONUNBUFFERED=1
RUNS=${OUT:+$OUT/runs}
RUNS=${RUNS:-runs}
mkdir -p "$RUNS"
if [ -d .whl ] && ! python3 -c 'import z3, pydantic, optuna' 2>/dev/null; then  # wheels carried to a bare machine
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama-1b llama-3b llama-8b qwen3-0.6b qwen3-1.7b qwen3-8b)
for model in "${models[@]}"; do
  case $model in *8b) limit=170 ;; llama-1b) limit=130 ;; *) limit=120 ;; esac
  echo "== $model"
  python3 -m megasynth.cli search --no-progress --seed "${SEED:-13}" --interleavings 50 --final-interleavings 300 \
    --runs-dir "$RUNS" --run "$model-h200" --model "$model" --ctx 1024 --budget "${BUDGET:-40}" \
    --time-limit "${LIMIT:-$limit}" &&
    python3 -m megasynth.cli runs pack "$model-h200" --runs-dir "$RUNS"
done 2>&1 | tee "$RUNS/search_h200.log"
