#!/bin/bash
# The GSB paper's Tables 1-2 with local expectation (BSB / CSB, S = 1) at the same number of steps as its
# competitors: 3000 steps, the gradient-variance probe every 500 steps, checkpoints every 500 steps.
# One thread per training process; seed 0 of every model first, then seeds 1 and 2. Several copies may
# run side by side (one per core): a run is claimed with a lock folder, finished runs are skipped and
# interrupted ones resume from their last checkpoint.
# Run from the repository root: bash docs/results/gsb_at_scale.sh [SEEDS...]   (default: 0 1 2)
# The binarized MNIST files are read from storch-bench's default data folder; add --data-dir DIR to C
# below if they are elsewhere.
set -u
P=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gsb-scale}
C="--data binarized-mnist --batch-size 50 --lr 1e-3 --eval-size 1000 --eval-k 200 --threads 1 --no-progress
   --steps 3000 --eval-every 250 --var-every 500 --var-reps 20 --checkpoint-every 500 --out $OUT"
run() {  # model estimator seed [options]: skips a run whose summary exists, resumes one with a checkpoint
  model=$1; est=$2; seed=$3; shift 3
  dir=$OUT/${model}_binarized-mnist_${est}_seed$seed
  if [ -f "$dir/summary.json" ]; then return; fi
  mkdir -p "$OUT"; mkdir "$dir.lock" 2>/dev/null || return  # another copy runs it
  if [ -d "$dir" ] && ls "$dir" | grep -q checkpoint; then
    $P -m storch.bench --resume "$dir" --steps 3000 --threads 1 --no-progress
  else
    $P -m storch.bench $C --model $model --estimator $est --seed $seed --overwrite "$@"
  fi
  rmdir "$dir.lock"
}
for seed in ${@:-0 1 2}; do
  run sbn-categorical local-expectation $seed; run sbn-categorical gumbel-softmax $seed
  run sbn-linear local-expectation $seed; run sbn-linear rebar $seed; run sbn-linear relax $seed
  run sbn-linear disarm $seed
  run categorical-vae local-expectation $seed; run categorical-vae gumbel-softmax $seed
  run sbn-two-layer local-expectation $seed; run sbn-two-layer rebar $seed; run sbn-two-layer relax $seed
  run bernoulli-vae local-expectation $seed; run bernoulli-vae rebar $seed; run bernoulli-vae relax $seed
done
