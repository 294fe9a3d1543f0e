"""The R-to-128 grid behind "Claims 1-2 to R = 128" (docs/claims/claims-1-3.md): dp, tuned DiLoCo and
tuned IsoLoCo at R in {1, 2, 4, 8, 16, 32, 64, 128} on the repro-cpu-r128 preset.

    OMP_NUM_THREADS=1 python scripts/r128_grid.py [--out DIR] [--lanes N] [--dry-run]

Selection on seed 0, evaluation on seeds 1-3 (`isoloco.tuned`):
- dp's inner lr is searched at this batch over 0.008, 0.016 and 0.032 (the ladder beyond an
  edge); dp's seeds 1-3 run at the choice. DiLoCo's and IsoLoCo's workers keep the preset's
  inner lr (repro-cpu's), as the paper keeps one inner lr for every R.
- DiLoCo's and IsoLoCo's outer step (Nesterov momentum x lr) is searched at R = 16 and at
  R = 128, the lr ladder past an edge, then the momentum past an edge (`MOMENTA`) at the best lr. Each R is evaluated at the choice of the searched R nearest on a log scale: R <= 32
  at R = 16's, R >= 64 at R = 128's.

Layout under DIR: `select/<search>-<step>/` (one seed-0 run each), `dp/`, `<method>-R<R>/` (seeds
1-3) and `selection.md`. Finished runs are skipped, so rerunning continues the grid; the file
`DIR/lanes`, if present, holds how many runs go at once.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from isoloco.tuned import NESTEROV_STEPS, Search, Task, grid_main, selection_rows

PRESET = "repro-cpu-r128"
METHODS = ("diloco", "isoloco")
SEARCHED = (16, 128)
WORKERS = (1, 2, 4, 8, 16, 32, 64, 128)
EVAL_SEEDS = "1,2,3"
#: Nesterov momenta tried past the grid's (0.3, 0.6) where the best sits at its edge: the
#: paper's DiLoCo runs at 0.9.
MOMENTA = (0.1, 0.3, 0.6, 0.8, 0.9)
INNER_LRS = (0.008, 0.016, 0.032)
INNER_LADDER = (0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128)


def nearest_searched(workers: int) -> int:
    """The searched R whose choice R runs at: the nearest in log2 (a tie goes to the smaller)."""
    return min(SEARCHED, key=lambda searched: (abs(math.log2(workers / searched)), searched))


def plan(out: Path) -> tuple[list[Task], list[Search]]:
    """Every task in the order they start: dp's search and R = 16's, then the evaluations that
    rest on them (dp's, R <= 32), then R = 128's search and the evaluations at R >= 64, so that the
    grid's first half is whole before its second begins."""
    select = out / "select"
    inner = Search(select, "inner", "dp", 1, "", PRESET, render=lambda lr, _: f"inner.lr={lr}",
                   label=lambda lr, _: f"lr{lr}", ladder=INNER_LADDER)
    for lr in INNER_LRS:
        inner.add((lr, 0.0))
    outer = {}
    for workers in SEARCHED:
        for method in METHODS:
            search = outer[method, workers] = Search(select, "", method, workers, "", PRESET, momenta=MOMENTA)
            for step in NESTEROV_STEPS:
                search.add(step)
    tasks = [*inner.grid]
    for searched in SEARCHED:
        tasks += [task for method in METHODS for task in outer[method, searched].grid]
        if searched == SEARCHED[0]:
            tasks.append(Task(out / "dp", "dp", 1, EVAL_SEEDS, "", PRESET, search=inner))
        tasks += [Task(out / f"{method}-R{workers}", method, workers, EVAL_SEEDS, "", PRESET,
                       search=outer[method, searched])
                  for workers in WORKERS if nearest_searched(workers) == searched for method in METHODS]
    return tasks, [inner, *outer.values()]


def write_selection(out: Path, searches: list[Search]) -> None:
    """selection.md: every seed-0 final loss, the choice in bold once a search is complete."""
    lines = ["# The steps chosen on seed 0 for the R-to-128 grid", "",
             "`python scripts/r128_grid.py` writes this file: seed 0's final validation loss at every step tried "
             "(dp: its inner lr; DiLoCo and IsoLoCo: Nesterov's momentum μ and outer lr), in the order tried, the "
             "chosen one in bold; seeds 1-3 ran at it (R <= 32 at R = 16's choice, R >= 64 at R = 128's).", "",
             "## Seed 0 of every search", "",
             "| method | searched at R | step: final loss (seed 0) | chosen |", "|---|---|---|---|"]
    lines += selection_rows(searches, lambda search: f"{search.method} | {search.workers}")
    (out / "selection.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    return grid_main(__doc__, Path("results/claims/r128"), plan, write_selection)


if __name__ == "__main__":
    sys.exit(main())
