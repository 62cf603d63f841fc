#!/bin/bash
# Reproduces the runs of the ARM table (docs/results.md) and of GSB Tables 1-3 at a shorter budget
# (docs/results/gsb-short-runs.md), one training process at a time, one thread each: about 45 minutes
# on a 2-core machine. Run from the repository root. The binarized MNIST files
# are read from storch-bench's default data folder; add --data-dir DIR to C below if they are elsewhere.
set -u
P=${PYTHON:-python}
C="--data binarized-mnist --batch-size 50 --lr 1e-3 --eval-size 1000 --eval-k 200 --no-var --threads 1 --no-progress"

# one process for 3 seeds
plain() { model=$1; est=$2; steps=$3; every=$4; out=$5; shift 5
  $P -m storch.bench $C --model $model --estimator $est --steps $steps --eval-every $every --seed 0 1 2 --out $out "$@"; }

# REBAR / RELAX: 250-step chunks, each in a fresh process (--checkpoint-every + --resume), as these runs
# were made; one piece gives the same result.
chunked() { model=$1; est=$2; steps=$3; out=$4; shift 4
  for seed in "$@"; do
    $P -m storch.bench $C --model $model --estimator $est --steps 250 --eval-every 250 --checkpoint-every 250 \
       --seed $seed --out $out --overwrite
    for ((k=500; k<=steps; k+=250)); do
      $P -m storch.bench --resume $out/${model}_binarized-mnist_${est}_seed$seed --steps $k --threads 1 --no-progress
    done
  done; }

# 1. ARM paper, linear SBN
plain sbn-linear score-function 3000 200 runs/arm --baseline none
plain sbn-linear rloo 3000 200 runs/arm
plain sbn-linear arm 3000 200 runs/arm
plain sbn-linear disarm 3000 200 runs/arm
chunked sbn-linear rebar 3000 runs/arm 0 1 2      # (seed 0 of the reported runs: one piece, --eval-every 200)
# 2. GSB Table 1 (REBAR of sbn-linear: runs/arm)
chunked sbn-linear relax 3000 runs/gsb1 0 1 2
plain sbn-linear local-expectation 250 50 runs/gsb1
chunked sbn-two-layer relax 2000 runs/gsb1 0 1 2
chunked sbn-two-layer rebar 2000 runs/gsb1 0 1 2
# sbn-two-layer local-expectation: docs/results/gsb_at_scale.sh runs it
chunked bernoulli-vae rebar 2000 runs/gsb1 0 1 2
chunked bernoulli-vae relax 2000 runs/gsb1 0 1 2
plain bernoulli-vae local-expectation 250 50 runs/gsb1
# 3. GSB Table 2
plain categorical-vae gumbel-softmax 3000 250 runs/gsb2
plain categorical-vae local-expectation 250 50 runs/gsb2
plain sbn-categorical gumbel-softmax 3000 200 runs/gsb2-sbn
plain sbn-categorical local-expectation 1000 250 runs/gsb2-sbn

# tables and figures
$P -m storch.bench compare runs/arm runs/gsb1 runs/gsb2 runs/gsb2-sbn
AT=200 $P docs/results/tables.py runs/arm
$P docs/results/tables.py runs/arm runs/gsb1 runs/gsb2 runs/gsb2-sbn
$P docs/results/plot_runs.py docs/results/arm_sbn_linear.png "ARM-paper table: linear SBN, 3000 steps (3 epochs), mean ± std over 3 seeds" runs/arm
ONLY=rebar,relax,local-expectation $P docs/results/plot_runs.py docs/results/gsb_table1.png "GSB Table 1: BSB (local-expectation) vs REBAR vs RELAX, mean ± std over 3 seeds" runs/arm runs/gsb1
ONLY=rebar,relax,local-expectation X=seconds $P docs/results/plot_runs.py docs/results/gsb_table1_seconds.png "GSB Table 1 against training time" runs/arm runs/gsb1
$P docs/results/plot_runs.py docs/results/gsb_table2.png "GSB Table 2: CSB (local-expectation) vs Gumbel-softmax, 3 seeds" runs/gsb2
