"""Tuned grids: an outer step chosen on seed 0, then evaluation seeds at the choice.

A `Search` trains seed 0 of one setting (method, R, overrides) at every outer step of a grid
and keeps the lowest final validation loss (a tie keeps the earlier point; a diverged run counts
as the worst). Where the best lr is the smallest or largest tried at its momentum, the next lr
of `LR_LADDER` beyond it is tried as well, until the best lies inside the range tried (and, for a
search given `momenta`, the same for the momentum at the best lr). A `Task`
is one `isoloco sweep` call: a seed-0 grid point, or the evaluation seeds at a search's choice,
which waits until the search is complete. `drive` starts the tasks a few at a time, resumably:
finished runs are skipped, a run another process holds counts as running, and the file
`OUT/lanes`, when present, sets how many runs go at once (read before each start), so a grid
can give a core back while the machine is needed for something else.

The scripts that lay out a grid (`scripts/compress_tuned.py`, `scripts/wide_r.py`) build their
searches and tasks from these pieces.
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
from typing import Callable

from isoloco.sweep import claim, release, run_name

#: Nesterov's outer step, (lr, momentum): the grid DiLoCo's and IsoLoCo's searches start from.
NESTEROV_STEPS = [(lr, mu) for mu in (0.3, 0.6) for lr in (0.7, 1.0, 1.5)]
#: Where a search's best lr is the smallest or largest tried at its momentum, the next of these
#: beyond it is tried too, until the best is inside the range or the list ends.
LR_LADDER = (0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def step_overrides(lr: float, mu: float) -> str:
    """The outer step as overrides: Nesterov with momentum mu, or plain SGD where mu is 0."""
    if mu == 0.0:
        return f"outer.optimizer=sgd outer.lr={lr}"
    return f"outer.optimizer=nesterov outer.momentum={mu} outer.lr={lr}"


def step_name(lr: float, mu: float) -> str:
    return f"sgd-lr{lr}" if mu == 0.0 else f"mu{mu}-lr{lr}"


@dataclass
class Task:
    """One `isoloco sweep` call: a seed-0 grid point (`step`), or evaluation seeds at a search's choice."""
    out: Path
    method: str
    workers: int
    seeds: str
    overrides: str
    preset: str
    step: tuple[float, float] | None = None
    #: the search whose choice this task runs at (None: the step is in overrides)
    search: Search | None = None
    inner_steps: int = 30
    #: earlier searches whose choices this task also takes (an inner lr chosen before the outer step)
    needs: tuple[Search, ...] = ()

    def runs(self) -> list[Path]:
        return [self.out / run_name(self.method, self.workers, self.inner_steps, int(s)) for s in self.seeds.split(",")]

    def done(self) -> bool:
        return all((run / "summary.json").exists() for run in self.runs())

    def taken_from(self) -> list[Search]:
        return [*self.needs, *([self.search] if self.search is not None else [])]

    def ready(self) -> bool:
        return all(search.complete() for search in self.taken_from())

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
        overrides = " ".join([*(search.render(*search.chosen().step) for search in self.taken_from()), self.overrides])
        return [*isoloco, "sweep", self.preset, *overrides.split(), "--methods", self.method,
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
    preset: str
    grid: list[Task] = field(default_factory=list)
    #: a step as overrides (an outer step by default; dp's inner lr, say)
    render: Callable[[float, float], str] = step_overrides
    #: a step's name in folder names and tables
    label: Callable[[float, float], str] = step_name
    #: the lrs tried beyond an edge
    ladder: tuple[float, ...] = LR_LADDER
    #: the momenta tried beyond an edge, at the best lr (none: the grid's momenta are the range)
    momenta: tuple[float, ...] = ()
    #: earlier searches whose choices every point of this one takes
    needs: tuple[Search, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.method}-{self.setting}-R{self.workers}" if self.setting else f"{self.method}-R{self.workers}"

    def add(self, step: tuple[float, float]) -> Task:
        task = Task(self.folder / f"{self.name}-{self.label(*step)}", self.method, self.workers, "0",
                    f"{self.render(*step)} {self.overrides}".strip(), self.preset, step=step, needs=self.needs)
        self.grid.append(task)
        return task

    def chosen(self) -> Task:
        """The lowest final loss; a tie keeps the earlier point."""
        return min(self.grid, key=Task.final_loss)

    def beyond(self) -> tuple[float, float] | None:
        """The step to try next, once every point so far finished: the ladder's next lr past the
        best one where the best is the smallest or largest lr tried at its momentum; then the
        next of `momenta` past the best momentum where it is the smallest or largest tried at
        its lr."""
        if not self.grid or not all(t.done() for t in self.grid):
            return None
        lr, mu = self.chosen().step
        steps = [t.step for t in self.grid]
        past_lr = _past_edge(lr, sorted(step[0] for step in steps if step[1] == mu), self.ladder)
        if past_lr is not None:
            return past_lr, mu
        past_mu = _past_edge(mu, sorted(step[1] for step in steps if step[0] == lr), self.momenta)
        return None if past_mu is None else (lr, past_mu)

    def complete(self) -> bool:
        return all(t.done() for t in self.grid) and self.beyond() is None


def _past_edge(best: float, tried: list[float], ladder: tuple[float, ...]) -> float | None:
    """The value of `ladder` just past `best` where `best` is the smallest or largest of `tried`
    (sorted), None where it lies inside or the ladder ends."""
    lower = [v for v in ladder if v < tried[0]]
    higher = [v for v in ladder if v > tried[-1]]
    if best == tried[0] and lower:
        return lower[-1]
    if best == tried[-1] and higher:
        return higher[0]
    return None


def extend(tasks: list[Task], searches: list[Search]) -> None:
    """Add the next step of every search whose best sits at its edge, right after its grid. The
    steps follow from the finished losses alone, so a new process finds the same ones again."""
    for search in searches:
        while (step := search.beyond()) is not None:
            last = search.grid[-1]
            tasks.insert(tasks.index(last) + 1 if last in tasks else len(tasks), search.add(step))


def selection_rows(searches: list[Search], label: Callable[[Search], str]) -> list[str]:
    """A markdown row per search: `label` cells, every seed-0 loss in the order tried (the
    choice in bold once the search is complete), and the choice."""
    rows = []
    for search in searches:
        chosen = search.chosen() if search.complete() else None
        cells = []
        for t in search.grid:
            cell = f"{search.label(*t.step)}: {t.final_loss():.4f}" if t.done() else f"{search.label(*t.step)}: to come"
            cells.append(f"**{cell}**" if t is chosen else cell)
        rows.append(f"| {label(search)} | {'; '.join(cells)} | {search.label(*chosen.step) if chosen else 'to come'} |")
    return rows


def lanes(out: Path, default: int) -> int:
    try:
        return max(0, int((out / "lanes").read_text().strip()))
    except (FileNotFoundError, ValueError):
        return default


def dry_run(out: Path, tasks: list[Task]) -> None:
    for t in tasks:
        state = "done" if t.done() else "ready" if t.ready() else "waits for its search"
        # a task may read runs another grid trained (a search's shared point): name those in full
        where = t.out.relative_to(out) if t.out.is_relative_to(out) else t.out
        print(f"{state:21} {where}  seeds {t.seeds}  {t.overrides}")


def drive(out: Path, tasks: list[Task], searches: list[Search], default_lanes: int,
          write_selection: Callable[[], None],
          replan: Callable[[], tuple[list[Task], list[Search]]] | None = None) -> int:
    """Train every task, `lanes` runs at once, until none is left that can start; 0 when all
    finished, 1 when a run failed or a task waits on a search whose run failed. With `replan`,
    the tasks and searches are laid out afresh from the finished runs before each start, so a
    task that a search's choice calls for joins as soon as the search completes."""
    isoloco = [sys.executable, "-m", "isoloco"]
    out.mkdir(parents=True, exist_ok=True)
    running: dict[Path, subprocess.Popen] = {}
    failed: set[Path] = set()
    written: set[Path] | None = None  # the finished runs write_selection last saw
    while True:
        for folder, proc in list(running.items()):
            if proc.poll() is not None:
                del running[folder]
                if proc.returncode != 0:
                    failed.add(folder)
                    print(f"failed ({proc.returncode}): {folder}", file=sys.stderr, flush=True)
        if replan is not None:
            tasks[:], searches[:] = replan()  # in place: write_selection reads `searches`
        else:
            extend(tasks, searches)
        finished = {run for task in tasks for run in task.runs() if (run / "summary.json").exists()}
        if finished != written:  # after every finished run, not every poll: the writing draws plots
            write_selection()
            written = finished
        pending = [t for t in tasks if t.out not in running and t.out not in failed and not t.done()]
        elsewhere = [t for t in pending if t.elsewhere()]
        if not running and not elsewhere and not any(t.ready() for t in pending):
            # nothing left that can start: done, or waiting on a search whose run failed
            return 1 if failed or pending else 0
        for task in pending:
            if len(running) + len(elsewhere) >= lanes(out, default_lanes):
                break
            if task.ready() and task not in elsewhere:
                task.out.mkdir(parents=True, exist_ok=True)
                with open(task.out / "sweep.log", "a") as log:
                    print(f"start: {task.out.relative_to(out)}", flush=True)
                    running[task.out] = subprocess.Popen(task.command(isoloco), stdout=log, stderr=subprocess.STDOUT)
        time.sleep(5)


def grid_main(doc: str, default_out: Path, plan: Callable[[Path], tuple[list[Task], list[Search]]],
              write_selection: Callable[[Path, list[Search]], None]) -> int:
    """The command line of a grid script: `--out`, `--lanes`, `--dry-run`; lays the grid out with
    `plan(out)` and drives it, `write_selection(out, searches)` after every finished run."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--lanes", type=int, default=2, help="runs at once (overridden by the file OUT/lanes)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run next and stop")
    args = ap.parse_args()
    out = args.out.resolve()

    def layout() -> tuple[list[Task], list[Search]]:
        tasks, searches = plan(out)
        extend(tasks, searches)
        return tasks, searches

    tasks, searches = layout()
    if args.dry_run:
        dry_run(out, tasks)
        return 0
    return drive(out, tasks, searches, args.lanes, lambda: write_selection(out, searches), replan=layout)
