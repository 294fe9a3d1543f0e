#!/usr/bin/env bash
# The runs behind "The interference, measured" (docs/claims/interference.md): DiLoCo with log.spectra=true
# at R = 2, 4, 8, 16 (H = 30) and at H = 60, 120 (R = 8), and IsoLoCo at R = 8, seed 0, on
# repro-cpu, under results/claims/spectra/. Finished runs are skipped.
set -euo pipefail
OUT=${OUT:-results/claims/spectra}
ISOLOCO=${ISOLOCO:-isoloco}
$ISOLOCO sweep repro-cpu log.spectra=true --methods diloco --workers 2,4,8,16 --seeds 0 --jobs 1 --no-report --out "$OUT"
$ISOLOCO sweep repro-cpu log.spectra=true --methods diloco --workers 8 --inner-steps 60,120 --seeds 0 --jobs 1 \
  --no-report --out "$OUT"
$ISOLOCO sweep repro-cpu log.spectra=true --methods isoloco --workers 8 --seeds 0 --jobs 1 --no-report --out "$OUT"
