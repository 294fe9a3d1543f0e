#!/usr/bin/env bash
# The runs behind "The slow link with the compressed sum" (docs/claims.md): tuned DiLoCo
# (Nesterov, momentum 0.3, lr 1.0) and tuned IsoLoCo (momentum 0.6, lr 1.5), the settings the
# strongest-baseline search chose on seed 0, at R = 8 and 16 on repro-cpu, evaluated on seeds
# 1-3 (seed 0 chose them), exact and with int8 / int4 pseudo-gradients with and without error
# feedback. In the simulator every worker is an island: the compressed sum's exchange route.
# One sweep folder per method and setting under results/claims/compressed/; finished runs are
# skipped, so rerunning continues the grid. METHOD=diloco|isoloco runs one method's settings.
set -euo pipefail
OUT=${OUT:-results/claims/compressed}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A TUNED=(
  [diloco]="outer.optimizer=nesterov outer.momentum=0.3 outer.lr=1.0"
  [isoloco]="outer.optimizer=nesterov outer.momentum=0.6 outer.lr=1.5"
)
declare -A SETTINGS=(
  [exact]=""
  [int8]="merge.quantize=int8"
  [int8-ef]="merge.quantize=int8 merge.error_feedback=true"
  [int4]="merge.quantize=int4"
  [int4-ef]="merge.quantize=int4 merge.error_feedback=true"
)
for name in ${ONLY:-exact int8-ef int4-ef int8 int4}; do
  for method in ${METHOD:-diloco isoloco}; do
    # shellcheck disable=SC2086  # the overrides are separate words
    $ISOLOCO sweep repro-cpu ${TUNED[$method]} ${SETTINGS[$name]} --methods "$method" --workers 8,16 \
      --seeds 1,2,3 --jobs 1 --no-report --out "$OUT/$method-$name"
  done
done
