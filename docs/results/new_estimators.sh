#!/bin/bash
# The estimators added since the Storchastic seeds (ARMS, double control variates, CARMS, ARSM, the
# coupled categorical estimator) against DisARM and RLOO at equal numbers of cost evaluations per image
# (--budget 2, 4, 8), on the linear SBN and the categorical VAE, binarized MNIST: 1000 steps, 3 seeds,
# the gradient-variance probe every 250 steps, one thread per run. Several copies may run side by side
# (one per core): a run is claimed with a lock folder, finished runs are skipped.
# Run from the repository root: bash docs/results/new_estimators.sh [SEEDS...]   (default: 0 1 2)
set -u
P=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/new-estimators}
C="--data binarized-mnist --batch-size 50 --lr 1e-3 --eval-size 1000 --eval-k 100 --threads 1 --no-progress
   --steps 1000 --eval-every 250 --var-every 250 --var-reps 20 --out $OUT"
run() {  # model estimator seed budget [options]: skips a finished run
  model=$1; est=$2; seed=$3; budget=$4; extra=${5:-}
  name=$est; case "$extra" in *iwae*) name=${est}_iwae;; esac  # storch-bench names iwae runs so
  dir=$OUT/${model}_binarized-mnist_${name}_budget=${budget}_seed${seed}
  if [ -f "$dir/summary.json" ]; then return; fi
  lock=$dir.lock
  mkdir -p "$OUT"; mkdir "$lock" 2>/dev/null || return
  $P -m storch.bench $C --model $model --estimator $est --seed $seed --budget $budget --overwrite $extra
  rmdir "$lock"
}
for seed in ${@:-0 1 2}; do
  for b in 2 4 8; do
    for e in disarm rloo arms double-cv; do run sbn-linear $e $seed $b; done
    for e in rloo carms coupled-categorical double-cv; do run categorical-vae $e $seed $b; done
  done
  run categorical-vae arsm $seed 46   # ARSM's one Dirichlet draw: 1 + 10*9/2 = 46 evaluations
done
# The older estimators the comparison asks for besides DisARM and RLOO: VIMCO (it trains the IWAE bound
# with K = budget samples, so compare its test -log p(x), not its -ELBO) and REBAR (3 evaluations per
# sample: budget 4 runs one sample, budget 8 two). Local expectation is not in this table: it needs
# 1 + D(K-1) evaluations (201 on sbn-linear, 181 on categorical-vae), see the GSB tables.
for seed in ${@:-0 1 2}; do
  for b in 2 4 8; do
    run sbn-linear vimco $seed $b "--objective iwae"; run categorical-vae vimco $seed $b "--objective iwae"
  done
  for b in 4 8; do run sbn-linear rebar $seed $b; run categorical-vae rebar $seed $b; done
done
