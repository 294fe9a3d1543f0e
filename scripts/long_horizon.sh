#!/usr/bin/env bash
# The runs behind "A longer horizon" (docs/claims/longer-horizon.md): repro-cpu trained for 1,800 steps
# (2.02 epochs of the training split, so the data repeats; 60 synchronisations at H = 30) instead of 480, for
# dp and each method at the outer setting the strongest-baseline search found best
# (DiLoCo: momentum 0.3, lr 1.0; IsoLoCo: momentum 0.6, lr 1.5), at R = 1 and 8, seeds 0-2.
# Finished runs are skipped, so rerunning continues the grid.
set -euo pipefail
OUT=${OUT:-results/claims/long-horizon}
ISOLOCO=${ISOLOCO:-isoloco}
LONG="steps=1800 data.allow_repeat=true eval_every=120 checkpoint_every=300"
# shellcheck disable=SC2086  # the overrides are separate words
$ISOLOCO sweep repro-cpu $LONG --methods dp --seeds 0,1,2 --jobs 1 --no-report --out "$OUT/dp"
for entry in "diloco:mu0.3-lr1.0:outer.momentum=0.3 outer.lr=1.0" "isoloco:mu0.6-lr1.5:outer.momentum=0.6 outer.lr=1.5"; do
  IFS=: read -r method suffix overrides <<<"$entry"
  # shellcheck disable=SC2086
  $ISOLOCO sweep repro-cpu $LONG $overrides --methods "$method" --workers 1,8 --seeds 0,1,2 --jobs 1 \
    --no-report --out "$OUT/$method-$suffix"
done
