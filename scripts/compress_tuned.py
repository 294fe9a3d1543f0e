"""The tuned-per-compressor grid behind "Compression that merging survives" (docs/claims/compression.md).

For every compressor x method x R, the outer step is chosen on seed 0 from a small grid and
then evaluated on seeds 1-3, on repro-cpu:

    OMP_NUM_THREADS=1 python scripts/compress_tuned.py [--out DIR] [--lanes N] [--only NAME,..]

Nesterov methods (DiLoCo, IsoLoCo) search lr x momentum; SparseLoCo's methods search the lr of
their plain SGD step (SparseLoCo's error feedback plays momentum's role). The choice and the
ladder beyond an edge are `isoloco.tuned`'s. Two settings
without a search of their own (low rank 4 without error feedback, and with float32 factors)
are evaluated at the step low rank 4 chose, R = 8, to say what error feedback and int8
factors are worth.

Layout under DIR: `select/<method>-<setting>-R<R>-<step>/` (one seed-0 run each),
`<method>-<setting>-R<R>/` (seeds 1-3 at the chosen step) and `selection.md` (every seed-0
loss, the choice marked). Finished runs are skipped, so rerunning continues the grid; the file
`DIR/lanes`, if present, holds how many runs go at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from isoloco.tuned import NESTEROV_STEPS, Search, Task, drive, dry_run, extend, selection_rows

PRESET = "repro-cpu"
EF_INT8 = "merge.quantize=int8 merge.error_feedback=true"
LOWRANK4 = "merge.compress=lowrank merge.compress_rank=4"
HIDDEN = "merge.compress_exclude=[model.embed_tokens.weight,lm_head.weight]"

#: setting -> (methods, overrides). SparseLoCo sends its own tiles and values: no merge.* codec.
SETTINGS = {
    "lowrank4": (("diloco", "isoloco"), f"{LOWRANK4} {EF_INT8}"),
    "sparseloco": (("sparseloco", "sparseloco_isoc"), ""),
    "lowrank4-hidden": (("diloco", "isoloco"),
                        f"{LOWRANK4} merge.quantize=int4 merge.error_feedback=true {HIDDEN}"),
}
#: setting -> (overrides, the searched setting whose choice it takes, workers)
BORROWED = {
    "lowrank4-noef": (f"{LOWRANK4} merge.quantize=int8", "lowrank4", 8),
    "lowrank4-f32": (f"{LOWRANK4} merge.error_feedback=true", "lowrank4", 8),
}
SGD_STEPS = [(lr, 0.0) for lr in (0.5, 1.0, 1.5, 2.0)]
WORKERS = (8, 16)
EVAL_SEEDS = "1,2,3"


def steps_for(method: str) -> list[tuple[float, float]]:
    return SGD_STEPS if method.startswith("sparseloco") else NESTEROV_STEPS


def plan(out: Path, only: set[str] | None) -> tuple[list[Task], list[Search]]:
    """Every task in the order they start (a task waits for the search it depends on); the
    searches grow their grids as `run` finds their best at an edge."""
    tasks: list[Task] = []
    searches: dict[tuple[str, str, int], Search] = {}

    def search_and_evaluate(setting: str, workers: int) -> tuple[list[Task], list[Task]]:
        methods, overrides = SETTINGS[setting]
        grids, evaluations = [], []
        for method in methods:
            search = Search(out / "select", setting, method, workers, overrides, PRESET)
            for step in steps_for(method):
                search.add(step)
            searches[(setting, method, workers)] = search
            grids += search.grid
            evaluations.append(Task(out / f"{method}-{setting}-R{workers}", method, workers, EVAL_SEEDS, overrides,
                                    PRESET, search=search))
        return grids, evaluations

    # the settings that answer the question first, the hidden-matrices variant last
    for group in (("lowrank4", "sparseloco"), ("lowrank4-hidden",)):
        for workers in WORKERS:
            for setting in group:
                if not only or setting in only:
                    grids, evaluations = search_and_evaluate(setting, workers)
                    tasks += grids
                    tasks += evaluations
        for setting, (overrides, searched, workers) in BORROWED.items():
            if (only and setting not in only) or searched not in group:
                continue
            if not any(k[0] == searched and k[2] == workers for k in searches):
                search_and_evaluate(searched, workers)  # its search, to read the choice from
            for method in SETTINGS[searched][0]:
                tasks.append(Task(out / f"{method}-{setting}-R{workers}", method, workers, EVAL_SEEDS, overrides,
                                  PRESET, search=searches[(searched, method, workers)]))
    return tasks, list(searches.values())


def write_selection(out: Path, searches: list[Search]) -> None:
    """selection.md: every seed-0 final loss, the choice in bold once a search is complete."""
    lines = ["# The outer step of each compressor, method and R", "",
             "`python scripts/compress_tuned.py` writes this file: seed 0's final validation loss at every outer "
             "step tried (Nesterov's momentum μ and lr; SparseLoCo's methods: the lr of plain SGD), in the order "
             "tried, the chosen one in bold; seeds 1-3 ran at it.", "", "## Seed 0 of every search", "",
             "| setting | method | R | step: final loss (seed 0) | chosen |", "|---|---|---|---|---|"]
    lines += selection_rows(searches, lambda search: f"{search.setting} | {search.method} | {search.workers}")
    (out / "selection.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/claims/compress-tuned"))
    ap.add_argument("--lanes", type=int, default=2, help="runs at once (overridden by the file OUT/lanes)")
    ap.add_argument("--only", default="", help="comma-separated settings (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run next and stop")
    args = ap.parse_args()
    known = set(SETTINGS) | set(BORROWED)
    only = {s for s in args.only.split(",") if s} or None
    if only and only - known:
        print(f"--only {','.join(sorted(only - known))}: unknown; choose from {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    out = args.out.resolve()
    tasks, searches = plan(out, only)
    extend(tasks, searches)
    if args.dry_run:
        dry_run(out, tasks)
        return 0
    return drive(out, tasks, searches, args.lanes, lambda: write_selection(out, searches))


if __name__ == "__main__":
    sys.exit(main())
