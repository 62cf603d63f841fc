#!/bin/bash
# The Bernoulli VAE's initial plateau: the diagnostics of benchmarks/vae_plateau.py for local
# expectation and its controls, at the GSB paper's settings (Adam 1e-4, batch 100) and at
# storch-bench's (Adam 1e-3, batch 50), seed 0, one thread per run; then the table and the figure.
# Run from the repository root: bash docs/results/vae_plateau.sh   (local expectation's runs take
# about 1 s per step each on an idle core: a few hours in all; OUT=DIR to write elsewhere).
# The binarized MNIST files are read from storch-bench's default data folder; add --data-dir DIR to
# C below if they are elsewhere.
set -eu
P=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/plateau}
C="benchmarks/vae_plateau.py --data binarized-mnist --threads 1"
paper() { name=$1; shift; $P $C --lr 1e-4 --batch-size 100 --diag-every 100 --out $OUT/paper_$name.csv "$@"; }
fast() { name=$1; shift; $P $C --lr 1e-3 --batch-size 50 --eval-size 500 --out $OUT/fast_$name.csv "$@"; }
# the paper's settings; local expectation with a reference comparison every 500 steps
paper le --estimator local-expectation --steps 1700 --ref-every 500 --ref-reps 20 --ref-pairs 100
paper rebar --estimator rebar --steps 1500
paper disarm --estimator disarm --steps 1500
# storch-bench's settings: the plateau, what leaves it, a KL warm-up, Auto
fast le --estimator local-expectation --steps 175 --diag-every 25
fast le_analytic_kl --estimator local-expectation --analytic-kl --steps 300 --diag-every 50
fast le_warmup100 --estimator local-expectation --kl-warmup 100 --steps 300 --diag-every 50
fast rebar --estimator rebar --steps 1000 --diag-every 100
fast rebar10 --estimator rebar --n-samples 10 --steps 600 --diag-every 100
fast disarm --estimator disarm --steps 1000 --diag-every 100
fast disarm20 --estimator disarm --n-samples 20 --steps 600 --diag-every 100
fast disarm20_warmup100 --estimator disarm --n-samples 20 --kl-warmup 100 --steps 600 --diag-every 100
fast disarm_glorot --estimator disarm --init glorot --steps 1000 --diag-every 200
# seed 1 of the contrast: the sampled KL, the KL in closed form, DisARM with 20 pairs
fast s1_le --seed 1 --estimator local-expectation --steps 200 --diag-every 50
fast s1_le_analytic_kl --seed 1 --estimator local-expectation --analytic-kl --steps 200 --diag-every 50
fast s1_disarm20 --seed 1 --estimator disarm --n-samples 20 --steps 400 --diag-every 100
fast auto4 --estimator auto --n-samples 4 --steps 1000 --diag-every 100
fast auto40 --estimator auto --n-samples 40 --steps 3000 --diag-every 100
fast auto40_reset100 --estimator auto --n-samples 40 --steps 1000 --diag-every 100 --reset-optimizer-at 100
fast auto40_optimizer --estimator auto --n-samples 40 --steps 1000 --diag-every 100 --auto-optimizer
$P docs/results/vae_plateau_plot.py $OUT docs/results/vae_plateau.png
