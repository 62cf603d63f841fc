#!/bin/bash
# storch.method.Auto against every fixed estimator of the catalog at equal CPU seconds of training:
# the five storch-bench models on the 8x8 digits, a budget of 4 cost evaluations per datum and step,
# 6 CPU seconds of training per run (--seconds: the training steps' CPU time, one thread;
# evaluations excluded), 3 seeds. Two copies run side by side (one per core); a finished run is
# skipped, so the same command continues an interrupted comparison. Then the tables and the figure.
# Run from the repository root: bash docs/results/auto_equal_time.sh
set -eu
P=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/auto-equal-time}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
mkdir -p "$OUT"
for part in 0/2 1/2; do
  $P docs/results/auto_equal_time.py "$OUT" --seconds "$SECONDS_PER_RUN" --seeds 0 1 2 --part $part \
    > "$OUT/log_${part%/*}.txt" 2>&1 &
done
wait
$P docs/results/auto_equal_time_table.py "$OUT" docs/results/auto_equal_time.png
