#!/usr/bin/env bash
# The outer-optimizer searches behind "The strongest mean baseline" (docs/claims/strongest-baseline.md):
# DiLoCo's outer lr x Nesterov momentum, DiLoCo-SGD's lr (momentum 0), and the same search
# for IsoLoCo, at R = 8, 16 and 1 on repro-cpu, seed 0. One sweep folder per setting under
# results/claims/strongest/; finished runs are skipped, so rerunning continues the grid.
# Nesterov's step is about lr/(1 - momentum) in steady state, so each momentum gets lrs
# spanning the same range of effective steps.
set -euo pipefail
OUT=${OUT:-results/claims/strongest}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A LRS=([0.9]="0.2 0.4 0.7" [0.8]="0.3 0.6 1.0" [0.6]="0.5 1.0 1.5" [0.3]="1.0 1.5 2.2")
SGD_LRS="1.0 1.6 2.4"
for method in ${METHODS:-diloco isoloco}; do
  for R in ${WORKERS:-8 16 1}; do
    for mu in 0.9 0.8 0.6 0.3; do
      for lr in ${LRS[$mu]}; do
        $ISOLOCO sweep repro-cpu outer.optimizer=nesterov outer.momentum=$mu outer.lr=$lr --methods $method \
          --workers $R --seeds 0 --jobs 1 --no-report --out "$OUT/$method-mu$mu-lr$lr"
      done
    done
    for lr in $SGD_LRS; do
      $ISOLOCO sweep repro-cpu outer.optimizer=sgd outer.lr=$lr --methods $method \
        --workers $R --seeds 0 --jobs 1 --no-report --out "$OUT/$method-sgd-lr$lr"
    done
  done
done
