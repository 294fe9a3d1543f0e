#!/usr/bin/env bash
# The 3 seeds behind "The strongest mean baseline" (docs/claims/strongest-baseline.md): each method at the
# outer setting its search (scripts/strongest_baseline.sh) found best, at every R of
# repro-cpu, in that setting's sweep folder (seed 0 at R = 1, 8, 16 is the search's own run).
# SETTINGS: "method:folder-suffix:overrides" entries; finished runs are skipped.
set -euo pipefail
OUT=${OUT:-results/claims/strongest}
ISOLOCO=${ISOLOCO:-isoloco}
SETTINGS=${SETTINGS:-"diloco:mu0.3-lr1.0:outer.optimizer=nesterov outer.momentum=0.3 outer.lr=1.0"}
while IFS= read -r entry; do
  [ -n "$entry" ] || continue
  IFS=: read -r method suffix overrides <<<"$entry"
  # shellcheck disable=SC2086  # the overrides are separate words
  $ISOLOCO sweep repro-cpu $overrides --methods "$method" --workers 1,2,4,8,16 --seeds 0,1,2 --jobs 1 \
    --no-report --out "$OUT/$method-$suffix"
done <<<"$SETTINGS"
