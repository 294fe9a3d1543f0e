#!/usr/bin/env bash
# The runs behind "The slow link: compressed and delayed pseudo-gradients" (docs/claims/slow-link.md):
# DiLoCo and IsoLoCo at R = 8 on repro-cpu, seeds 0-2, each setting in its own sweep folder
# under results/claims/link/, paired by seed against the exact runs (setting "exact").
# Finished runs are skipped, so rerunning continues the grid.
set -euo pipefail
OUT=${OUT:-results/claims/link}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A SETTINGS=(
  [exact]=""
  [int8]="merge.quantize=int8"
  [int8-ef]="merge.quantize=int8 merge.error_feedback=true"
  [int4]="merge.quantize=int4"
  [int4-ef]="merge.quantize=int4 merge.error_feedback=true"
  [overlap5]="outer.overlap_steps=5"
)
for name in ${ONLY:-exact int8 int8-ef int4 int4-ef overlap5}; do
  # shellcheck disable=SC2086  # the overrides are separate words
  $ISOLOCO sweep repro-cpu ${SETTINGS[$name]} --methods diloco,isoloco --workers 8 --seeds 0,1,2 \
    --jobs 1 --no-report --out "$OUT/$name"
done
