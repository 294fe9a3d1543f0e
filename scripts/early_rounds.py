"""Why IsoLoCo's first merges can undo a round: the spectra of the first pseudo-gradients.

For each matrix of the model, the mean pseudo-gradient M of the first round (R workers, the
`quick` preset) and what Iso-C makes of it: σ₁/σ̄ (how far its spectrum is from flat), the
share of ‖M‖² in its top direction, and ‖Iso-C(M)‖ / ‖M‖. Iso-C keeps M's directions but gives
each the mean singular value, so the top direction of a matrix with σ₁/σ̄ ≫ 1 moves by σ̄
instead of σ₁. Printed for the paper's 178M learning rates and for the ones tuned for the
tiny model, as a markdown table (docs/claims/early-rounds.md holds it):

    OMP_NUM_THREADS=1 python scripts/early_rounds.py --workers 8
"""

from __future__ import annotations

import argparse
import statistics

import torch

from isoloco import merge_functions
from isoloco.ortho import IsoSettings
from isoloco.bench.workload import trained_deltas

SETTINGS = {
    "paper 178M lrs (inner 0.00138)": {"method": "isoloco", "inner.lr": 0.00138, "outer.lr": 1.8},
    "tuned for tiny (inner 0.016)": {"method": "isoloco"},
}


def spectrum_row(mean: torch.Tensor) -> tuple[float, float, float]:
    sigma = torch.linalg.svdvals(mean)
    iso = merge_functions.iso_c([mean], IsoSettings(ortho="svd"))
    return ((sigma[0] / sigma.mean()).item(), (sigma[0] ** 2 / sigma.square().sum()).item(),
            (iso.norm() / mean.norm()).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="the run's steps (its schedule); round 1 is measured")
    args = parser.parse_args()
    print("| learning rates | matrices | σ₁/σ̄ | top direction's share of ‖M‖² | ‖Iso-C(M)‖/‖M‖ |")
    print("|---|---|---|---|---|")
    for label, overrides in SETTINGS.items():
        deltas = trained_deltas(1, "quick", workers=args.workers, steps=args.steps, **overrides)
        rows = {name: spectrum_row(torch.stack(d).mean(0)) for name, d in deltas.items() if d[0].ndim == 2}
        groups = {"embed_tokens": [r for n, r in rows.items() if "embed_tokens" in n],
                  "lm_head": [r for n, r in rows.items() if "lm_head" in n],
                  "hidden (median)": [r for n, r in rows.items() if "embed_tokens" not in n and "lm_head" not in n]}
        for group, members in groups.items():
            ratio, share, norm = (statistics.median(col) for col in zip(*members))
            print(f"| {label} | {group} | {ratio:.1f} | {share:.2f} | {norm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
