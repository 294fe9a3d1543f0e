#!/usr/bin/env bash
# The runs behind "Early rounds: the budget and robust variants" (docs/claims/early-rounds.md).
#   budget:   dp, DiLoCo and IsoLoCo on the `quick` preset at R = 2 and 8 for 60, 120 and
#             210 steps (2, 4 and 7 synchronisations; 210 is the preset's own budget, the
#             most its data allows without repeating), validation after every round.
#   variants: IsoLoCo with the flattening softened (merge.iso_power=0.5), with the small
#             singular values left alone (merge.iso_floor=0.1), and with the embedding and
#             LM head left to the mean (merge.exclude=...), at the short budget (`quick`,
#             60 steps, R = 2 and 8) and the long one (repro-cpu, R = 8), paired by seed with
#             plain IsoLoCo (the budget runs; for repro-cpu, results/claims/main).
# Seeds 0-2; each setting in its own sweep folder under results/claims/early-budget/.
# Finished runs are skipped, so rerunning continues the grid. ONLY= picks parts.
# inner.kernel=foreach: the AdamW kernel these runs were made with (quick now defaults to fused).
set -euo pipefail
set -f  # the exclude patterns are words, not file globs
OUT=${OUT:-results/claims/early-budget}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A VARIANTS=(
  [power0.5]="merge.iso_power=0.5"
  [floor0.1]="merge.iso_floor=0.1"
  [mean-embed-head]="merge.exclude=*embed_tokens*,lm_head.weight"
)
for part in ${ONLY:-budget60 short long budget120 budget210}; do
  case $part in
    budget*)
      steps=${part#budget}
      $ISOLOCO sweep quick steps="$steps" eval_every=30 inner.kernel=foreach --methods dp,diloco,isoloco --workers 2,8 \
        --seeds 0,1,2 --jobs 1 --no-report --out "$OUT/steps$steps" ;;
    short)
      for name in power0.5 floor0.1 mean-embed-head; do
        # shellcheck disable=SC2086  # the overrides are separate words
        $ISOLOCO sweep quick steps=60 eval_every=30 inner.kernel=foreach ${VARIANTS[$name]} --methods isoloco --workers 2,8 \
          --seeds 0,1,2 --jobs 1 --no-report --out "$OUT/steps60-$name"
      done ;;
    long)
      for name in power0.5 floor0.1 mean-embed-head; do
        # shellcheck disable=SC2086
        $ISOLOCO sweep repro-cpu ${VARIANTS[$name]} --methods isoloco --workers 8 \
          --seeds 0,1,2 --jobs 1 --no-report --out "$OUT/repro-cpu-$name"
      done ;;
    *) echo "unknown part $part (budget60|budget120|budget210|short|long)" >&2; exit 2 ;;
  esac
done
