"""The tuned-per-compressor grid behind "Compression that merging survives" (docs/claims.md).

For every compressor x method x R, the outer step is chosen on seed 0 from a small grid and
then evaluated on seeds 1-3, on repro-cpu:

    OMP_NUM_THREADS=1 python scripts/compress_tuned.py [--out DIR] [--lanes N] [--only NAME,..]

Nesterov methods (DiLoCo, IsoLoCo) search lr x momentum; SparseLoCo's methods search the lr of
their plain SGD step (SparseLoCo's error feedback plays momentum's role). The choice is the
lowest final validation loss on seed 0 (a tie keeps the earlier point); where it is the smallest or
largest lr tried at its momentum, the next lr of `LR_LADDER` beyond it is tried as well, until the
best lies inside the range tried. Two settings
without a search of their own (low rank 4 without error feedback, and with float32 factors)
are evaluated at the step low rank 4 chose, R = 8, to say what error feedback and int8
factors are worth.

Layout under DIR: `select/<method>-<setting>-R<R>-<step>/` (one seed-0 run each),
`<method>-<setting>-R<R>/` (seeds 1-3 at the chosen step) and `selection.md` (every seed-0
loss, the choice marked). Finished runs are skipped, so rerunning continues the grid. The file
`DIR/lanes`, if present, holds how many runs go at once (read before each start), so the grid
can give a core back while the machine is needed for something else.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from isoloco.sweep import claim, release

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
NESTEROV_STEPS = [(lr, mu) for mu in (0.3, 0.6) for lr in (0.7, 1.0, 1.5)]
SGD_STEPS = [(lr, 0.0) for lr in (0.5, 1.0, 1.5, 2.0)]
#: Where a search's best lr is the smallest or largest tried at its momentum, the next of these
#: beyond it is tried too, until the best is inside the range or the list ends.
LR_LADDER = (0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
WORKERS = (8, 16)
EVAL_SEEDS = "1,2,3"


def steps_for(method: str) -> list[tuple[float, float]]:
    return SGD_STEPS if method.startswith("sparseloco") else NESTEROV_STEPS


def step_overrides(lr: float, mu: float) -> str:
    if mu == 0.0:
        return f"outer.optimizer=sgd outer.lr={lr}"
    return f"outer.optimizer=nesterov outer.momentum={mu} outer.lr={lr}"


def step_name(lr: float, mu: float) -> str:
    return f"sgd-lr{lr}" if mu == 0.0 else f"mu{mu}-lr{lr}"


@dataclass
class Task:
    """One `isoloco sweep` call: a seed-0 grid point (`step`), or seeds 1-3 at a search's choice."""
    out: Path
    method: str
    workers: int
    seeds: str
    overrides: str
    step: tuple[float, float] | None = None
    #: the search whose choice this task runs at (None: the step is in overrides)
    search: Search | None = None

    def runs(self) -> list[Path]:
        return [self.out / f"{self.method}-R{self.workers}-H30-s{s}" for s in self.seeds.split(",")]

    def done(self) -> bool:
        return all((run / "summary.json").exists() for run in self.runs())

    def ready(self) -> bool:
        return self.search is None or self.search.complete()

    def elsewhere(self) -> bool:
        """Whether another process (an earlier driver's sweep, say) holds one of its runs."""
        for run in self.runs():
            lock = self.out / "logs" / f"{run.name}.lock"
            if lock.exists() and not (run / "summary.json").exists():
                fd = claim(lock)
                if fd is None:
                    return True
                release(lock, fd, finished=False)
        return False

    def final_loss(self) -> float:
        loss = json.loads((self.runs()[0] / "summary.json").read_text()).get("final_val_loss")
        return loss if loss is not None and math.isfinite(loss) else math.inf

    def command(self, isoloco: list[str]) -> list[str]:
        overrides = self.overrides
        if self.search is not None:
            overrides = f"{step_overrides(*self.search.chosen().step)} {overrides}"
        return [*isoloco, "sweep", "repro-cpu", *overrides.split(), "--methods", self.method,
                "--workers", str(self.workers), "--seeds", self.seeds, "--jobs", "1", "--no-report",
                "--out", str(self.out)]


@dataclass
class Search:
    """Seed 0 of one setting, method and R over outer steps: the grid, then the ladder's lrs beyond
    its edge while the best sits there."""
    folder: Path
    setting: str
    method: str
    workers: int
    overrides: str
    grid: list[Task] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.method}-{self.setting}-R{self.workers}"

    def add(self, step: tuple[float, float]) -> Task:
        task = Task(self.folder / f"{self.name}-{step_name(*step)}", self.method, self.workers, "0",
                    f"{step_overrides(*step)} {self.overrides}", step=step)
        self.grid.append(task)
        return task

    def chosen(self) -> Task:
        """The lowest final loss; a tie keeps the earlier point."""
        return min(self.grid, key=Task.final_loss)

    def beyond(self) -> tuple[float, float] | None:
        """The step to try next, once every point so far finished: the ladder's next lr past the
        best one where the best is the smallest or largest lr tried at its momentum."""
        if not all(t.done() for t in self.grid):
            return None
        lr, mu = self.chosen().step
        tried = sorted(step[0] for step in (t.step for t in self.grid) if step[1] == mu)
        lower = [v for v in LR_LADDER if v < tried[0]]
        higher = [v for v in LR_LADDER if v > tried[-1]]
        if lr == tried[0] and lower:
            return lower[-1], mu
        if lr == tried[-1] and higher:
            return higher[0], mu
        return None

    def complete(self) -> bool:
        return all(t.done() for t in self.grid) and self.beyond() is None


def plan(out: Path, only: set[str] | None) -> tuple[list[Task], list[Search]]:
    """Every task in the order they start (a task waits for the search it depends on); the
    searches grow their grids as `run` finds their best at an edge."""
    tasks: list[Task] = []
    searches: dict[tuple[str, str, int], Search] = {}

    def search_and_evaluate(setting: str, workers: int) -> tuple[list[Task], list[Task]]:
        methods, overrides = SETTINGS[setting]
        grids, evaluations = [], []
        for method in methods:
            search = Search(out / "select", setting, method, workers, overrides)
            for step in steps_for(method):
                search.add(step)
            searches[(setting, method, workers)] = search
            grids += search.grid
            evaluations.append(Task(out / f"{method}-{setting}-R{workers}", method, workers, EVAL_SEEDS, overrides,
                                    search=search))
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
                                  search=searches[(searched, method, workers)]))
    return tasks, list(searches.values())


def extend(tasks: list[Task], searches: list[Search]) -> None:
    """Add the next step of every search whose best sits at its edge, right after its grid. The
    steps follow from the finished losses alone, so a new process finds the same ones again."""
    for search in searches:
        while (step := search.beyond()) is not None:
            last = search.grid[-1]
            tasks.insert(tasks.index(last) + 1 if last in tasks else len(tasks), search.add(step))


def write_selection(out: Path, searches: list[Search]) -> None:
    """selection.md: every seed-0 final loss, the choice in bold once a search is complete."""
    lines = ["# The outer step of each compressor, method and R", "",
             "`python scripts/compress_tuned.py` writes this file: seed 0's final validation loss at every outer "
             "step tried (Nesterov's momentum μ and lr; SparseLoCo's methods: the lr of plain SGD), in the order "
             "tried, the chosen one in bold; seeds 1-3 ran at it.", "", "## Seed 0 of every search", "",
             "| setting | method | R | step: final loss (seed 0) | chosen |", "|---|---|---|---|---|"]
    for search in searches:
        chosen = search.chosen() if search.complete() else None
        cells = []
        for t in search.grid:
            cell = f"{step_name(*t.step)}: {t.final_loss():.4f}" if t.done() else f"{step_name(*t.step)}: to come"
            cells.append(f"**{cell}**" if t is chosen else cell)
        lines.append(f"| {search.setting} | {search.method} | {search.workers} | {'; '.join(cells)} | "
                     f"{step_name(*chosen.step) if chosen else 'to come'} |")
    (out / "selection.md").write_text("\n".join(lines) + "\n")


def lanes(out: Path, default: int) -> int:
    try:
        return max(0, int((out / "lanes").read_text().strip()))
    except (FileNotFoundError, ValueError):
        return default


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
    isoloco = [sys.executable, "-m", "isoloco"]
    if args.dry_run:
        for t in tasks:
            state = "done" if t.done() else "ready" if t.ready() else "waits for its search"
            print(f"{state:21} {t.out.relative_to(out)}  {t.overrides}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    running: dict[Path, subprocess.Popen] = {}
    failed: set[Path] = set()
    while True:
        for folder, proc in list(running.items()):
            if proc.poll() is not None:
                del running[folder]
                if proc.returncode != 0:
                    failed.add(folder)
                    print(f"failed ({proc.returncode}): {folder}", file=sys.stderr, flush=True)
        extend(tasks, searches)
        write_selection(out, searches)
        pending = [t for t in tasks if t.out not in running and t.out not in failed and not t.done()]
        elsewhere = [t for t in pending if t.elsewhere()]
        if not running and not elsewhere and not any(t.ready() for t in pending):
            # nothing left that can start: done, or waiting on a search whose run failed
            return 1 if failed or pending else 0
        for task in pending:
            if len(running) + len(elsewhere) >= lanes(out, args.lanes):
                break
            if task.ready() and task not in elsewhere:
                task.out.mkdir(parents=True, exist_ok=True)
                with open(task.out / "sweep.log", "a") as log:
                    print(f"start: {task.out.relative_to(out)}", flush=True)
                    running[task.out] = subprocess.Popen(task.command(isoloco), stdout=log, stderr=subprocess.STDOUT)
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main())
