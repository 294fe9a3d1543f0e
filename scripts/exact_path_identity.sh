#!/usr/bin/env bash
# Whether the exact merge path trains the same bits at the commits the compression grids ran at:
# the exact baselines (ac86b9e) and the compressed treatments (106ea4c, d93299d). Retrains the
# compressed grid's exact runs of DiLoCo and IsoLoCo (R = 8, seed 1) for their first 60 steps
# (two synchronisations) with each commit's src/, and compares every step's training loss and
# the validation loss. Prints one line per method; exit 1 if any commit differs.
#   OMP_NUM_THREADS=1 scripts/exact_path_identity.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-$(mktemp -d)}
PY=${PYTHON:-.venv/bin/python}
COMMITS=(ac86b9e 106ea4c d93299d)
for commit in "${COMMITS[@]}"; do
  tree="$WORK/src-$commit"
  if [ ! -d "$tree" ]; then
    mkdir -p "$tree" && git archive "$commit" src | tar -x -C "$tree"
    # d93299d's merge.py names a Knobs field whose rules.py half was committed later; its runs
    # left those lines out (docs/claims/slow-link.md), and so does this check.
    if [ "$commit" = d93299d ]; then
      sed -i '/factor_paths/d; s/^\(        \)#: How many workers.*$//' "$tree/src/isoloco/merge.py"
      sed -i 's/^        self\._knobs = dataclasses\.replace(cfg\.knobs, factor_paths=self\.factor_paths)$//' "$tree/src/isoloco/merge.py"
      grep -q "self._knobs = cfg.knobs" "$tree/src/isoloco/merge.py" ||
        sed -i 's/^\(        \)self\._rule = RULES\[cfg\.rule\]$/\1self._knobs = cfg.knobs\n\1self._rule = RULES[cfg.rule]/' "$tree/src/isoloco/merge.py"
    fi
  fi
done
status=0
for method in diloco isoloco; do
  config=results/claims/compressed/$method-exact/$method-R8-H30-s1/config.yaml
  for commit in "${COMMITS[@]}"; do
    out="$WORK/$method-$commit"
    [ -f "$out/summary.json" ] || PYTHONPATH="$WORK/src-$commit/src" HF_HUB_OFFLINE=1 "$PY" -m isoloco train "$config" \
      steps=60 eval_every=60 checkpoint_every=60 --out "$out" --quiet --force > "$out.log" 2>&1
  done
  "$PY" - "$WORK" "$method" "${COMMITS[@]}" <<'PYEOF' || status=1
import json, sys
work, method, commits = sys.argv[1], sys.argv[2], sys.argv[3:]
def losses(commit):
    lines = [json.loads(line) for line in open(f"{work}/{method}-{commit}/metrics.jsonl")]
    return [(line["step"], line["train_loss"], line.get("val_loss")) for line in lines]
first = losses(commits[0])
same = [commit for commit in commits[1:] if losses(commit) == first]
print(f"{method}: {len(first)} steps, final validation loss {first[-1][2]!r} at {commits[0]}; "
      + ("the same bits at " + ", ".join(same) if len(same) == len(commits) - 1
         else "differs at " + ", ".join(c for c in commits[1:] if c not in same)))
sys.exit(0 if len(same) == len(commits) - 1 else 1)
PYEOF
done
exit $status
