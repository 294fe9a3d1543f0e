#!/usr/bin/env bash
# The runs behind the stragglers section of docs/claims.md (issue 32 item 7): tuned DiLoCo
# (Nesterov, momentum 0.3, lr 1.0) and tuned IsoLoCo (momentum 0.6, lr 1.5), the settings the
# strongest-baseline search chose on seed 0, at R = 8 on repro-cpu, evaluated on seeds 1-3
# (seed 0 chose them), with unequal or missing workers:
#   slow-equal, slow-tokens   half the workers at speed 0.25 (worker_speeds=1,0.25 cycles over
#                             the workers), merged with equal weights or weighted by tokens;
#   late0.1-drop ... late0.3-carry   each worker misses a round with probability 0.1 or 0.3,
#                             its pseudo-gradient dropped or carried to its next arrival.
# The fault-free reference is results/claims/compressed/<method>-exact's R = 8 runs: their
# config.yaml equals these runs' without the setting, key for key, but for the keys added since
# (worker_speeds, merge.weighting, faults.*, merge.compress*): absent there, off here. One sweep
# folder per method and setting under results/claims/stragglers/; finished runs are skipped, so
# rerunning continues the grid.
# METHOD=diloco|isoloco runs one method's settings; ONLY="..." a subset of the settings;
# DRY_RUN=1 lists the runs and checks their configs (exit 2 on a refused one), training nothing.
set -euo pipefail
OUT=${OUT:-results/claims/stragglers}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A TUNED=(
  [diloco]="outer.optimizer=nesterov outer.momentum=0.3 outer.lr=1.0"
  [isoloco]="outer.optimizer=nesterov outer.momentum=0.6 outer.lr=1.5"
)
declare -A SETTINGS=(
  [slow-equal]="worker_speeds=1,0.25 merge.weighting=equal"
  [slow-tokens]="worker_speeds=1,0.25 merge.weighting=tokens"
  [late0.1-drop]="faults.late_rate=0.1 faults.late=drop"
  [late0.1-carry]="faults.late_rate=0.1 faults.late=carry"
  [late0.3-drop]="faults.late_rate=0.3 faults.late=drop"
  [late0.3-carry]="faults.late_rate=0.3 faults.late=carry"
)
for name in ${ONLY:-slow-equal slow-tokens late0.1-drop late0.1-carry late0.3-drop late0.3-carry}; do
  for method in ${METHOD:-diloco isoloco}; do
    # shellcheck disable=SC2086  # the overrides are separate words
    $ISOLOCO sweep repro-cpu ${TUNED[$method]} ${SETTINGS[$name]} --methods "$method" --workers 8 \
      --seeds 1,2,3 --jobs 1 --no-report ${DRY_RUN:+--dry-run} --out "$OUT/$method-$name"
  done
done
