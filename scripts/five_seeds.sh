#!/usr/bin/env bash
# Seeds 3 and 4 where a verdict of docs/claims hinges on a tie: IsoLoCo against dp at
# R = 1 and 2 (claim 3), IsoLoCo against Iso-C at R = 16 (claim 4), IsoLoCo against tuned
# MuLoCo at R = 16 (claim 8), each added to the sweep folder of its first three seeds.
# First it retrains one committed run and stops unless the code gives its final loss exactly
# (the new seeds must come from the same numerics). Finished runs are skipped.
set -euo pipefail
ISOLOCO=${ISOLOCO:-isoloco}
CHECK=$(mktemp -d)
$ISOLOCO train repro-cpu method=isoloco workers=1 seed=0 --out "$CHECK/run" --quiet
python3 - "$CHECK/run/summary.json" results/claims/main/isoloco-R1-H30-s0/summary.json <<'PY'
import json, sys
ours, committed = (json.load(open(path))["final_val_loss"] for path in sys.argv[1:])
if ours != committed:
    sys.exit(f"this code gives {ours!r}, the committed run {committed!r}: not the same numerics")
print(f"same final loss as the committed run: {ours!r}")
PY
rm -rf "$CHECK"
$ISOLOCO sweep repro-cpu --methods dp,isoloco --workers 1,2 --seeds 3,4 --jobs 1 --no-report --out results/claims/main
$ISOLOCO sweep repro-cpu --methods isoc,isoloco --workers 16 --seeds 3,4 --jobs 1 --no-report --out results/claims/main
$ISOLOCO sweep repro-cpu outer.lr=1.0 --methods muloco --workers 16 --seeds 3,4 --jobs 1 --no-report \
  --out results/claims/muon-tuned
