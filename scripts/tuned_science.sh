#!/usr/bin/env bash
# `scripts/tuned_science.sh GRID`: the runs behind a page of docs/claims that compares
# tuned DiLoCo (Nesterov, momentum 0.3, lr 1.0) with tuned IsoLoCo (momentum 0.6, lr 1.5), the
# outer steps the strongest-baseline search chose on seed 0, on repro-cpu, evaluated on seeds
# 1-3 (seed 0 chose them). GRID picks the settings and the workers:
#   compressed  "The slow link with the compressed sum": exact, int8 and int4 pseudo-gradients
#               with and without error feedback, R = 8 and 16;
#   compress    "Compression at 100×": low rank (PowerSGD) at ranks 1, 2, 4 and 8 and top-k at
#               densities 10%, 3% and 1%, with int8 factors or values and error feedback, R = 8
#               (float32, int8-ef and int4-ef are the compressed grid's runs);
#   stragglers  "Stragglers and late workers", R = 8: half the workers at speed 0.25
#               (worker_speeds=1,0.25 cycles over the workers) with equal or token weighting,
#               and late rate 0.1 and 0.3 with the late pseudo-gradient dropped or carried
#               (at rate 0.3 also carried in full, faults.stale_weight=1); the fault-free runs
#               are the compressed grid's exact ones at R = 8 (their config.yaml is these runs'
#               without the setting, key for key, but for the keys added since, which are absent
#               there and off here).
# One sweep folder per method and setting under results/claims/GRID/<method>-<setting>;
# finished runs are skipped, so rerunning continues the grid. METHOD=diloco|isoloco runs one
# method's settings, ONLY="..." a subset of the settings, WORKERS=... other worker counts.
set -euo pipefail
GRID=${1:?usage: scripts/tuned_science.sh compressed|compress|stragglers}
OUT=${OUT:-results/claims/$GRID}
ISOLOCO=${ISOLOCO:-isoloco}
declare -A TUNED=(
  [diloco]="outer.optimizer=nesterov outer.momentum=0.3 outer.lr=1.0"
  [isoloco]="outer.optimizer=nesterov outer.momentum=0.6 outer.lr=1.5"
)
declare -A SETTINGS
case "$GRID" in
  compressed)
    SETTINGS=(
      [exact]=""
      [int8]="merge.quantize=int8"
      [int8-ef]="merge.quantize=int8 merge.error_feedback=true"
      [int4]="merge.quantize=int4"
      [int4-ef]="merge.quantize=int4 merge.error_feedback=true"
    )
    ORDER="exact int8-ef int4-ef int8 int4" DEFAULT_WORKERS=8,16 ;;
  compress)
    EF="merge.quantize=int8 merge.error_feedback=true"
    SETTINGS=(
      [lowrank1]="merge.compress=lowrank merge.compress_rank=1 $EF"
      [lowrank2]="merge.compress=lowrank merge.compress_rank=2 $EF"
      [lowrank4]="merge.compress=lowrank merge.compress_rank=4 $EF"
      [lowrank8]="merge.compress=lowrank merge.compress_rank=8 $EF"
      [topk10]="merge.compress=topk merge.compress_density=0.1 $EF"
      [topk3]="merge.compress=topk merge.compress_density=0.03 $EF"
      [topk1]="merge.compress=topk merge.compress_density=0.01 $EF"
    )
    ORDER="lowrank4 topk3 lowrank1 topk1 lowrank8 topk10 lowrank2" DEFAULT_WORKERS=8 ;;
  stragglers)
    SETTINGS=(
      [slow-equal]="worker_speeds=1,0.25 merge.weighting=equal"
      [slow-tokens]="worker_speeds=1,0.25 merge.weighting=tokens"
      [late0.1-drop]="faults.late_rate=0.1 faults.late=drop"
      [late0.1-carry]="faults.late_rate=0.1 faults.late=carry"
      [late0.3-drop]="faults.late_rate=0.3 faults.late=drop"
      [late0.3-carry]="faults.late_rate=0.3 faults.late=carry"
      [late0.3-carry-full]="faults.late_rate=0.3 faults.late=carry faults.stale_weight=1.0"
    )
    ORDER="slow-equal slow-tokens late0.1-drop late0.1-carry late0.3-drop late0.3-carry late0.3-carry-full"
    DEFAULT_WORKERS=8 ;;
  *) echo "unknown grid $GRID: choose compressed, compress or stragglers" >&2; exit 2 ;;
esac
for name in ${ONLY:-$ORDER}; do
  for method in ${METHOD:-diloco isoloco}; do
    # shellcheck disable=SC2086  # the overrides are separate words
    $ISOLOCO sweep repro-cpu ${TUNED[$method]} ${SETTINGS[$name]} --methods "$method" \
      --workers "${WORKERS:-$DEFAULT_WORKERS}" --seeds 1,2,3 --jobs 1 --no-report --out "$OUT/$method-$name"
  done
done
