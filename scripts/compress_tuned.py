"""The tuned-per-compressor grid behind "Compression that merging survives" (docs/claims.md).

For every compressor x method x R, the outer step is chosen on seed 0 from a small grid and
then evaluated on seeds 1-3, on repro-cpu:

    OMP_NUM_THREADS=1 python scripts/compress_tuned.py [--out DIR] [--lanes N] [--only NAME,..]

Nesterov methods (DiLoCo, IsoLoCo) search lr x momentum; SparseLoCo's methods search the lr of
their plain SGD step (SparseLoCo's error feedback plays momentum's role). The choice is the
lowest final validation loss on seed 0; a tie keeps the earlier grid point. Two settings
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
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    """One `isoloco sweep` call: a seed-0 grid point, or seeds 1-3 at a choice."""
    out: Path
    method: str
    workers: int
    seeds: str
    overrides: str
    #: the selection tasks whose losses pick this task's step (empty: the step is in overrides)
    chooses_from: list[Task] = field(default_factory=list)
    step: tuple[float, float] | None = None

    def runs(self) -> list[Path]:
        return [self.out / f"{self.method}-R{self.workers}-H30-s{s}" for s in self.seeds.split(",")]

    def done(self) -> bool:
        return all((run / "summary.json").exists() for run in self.runs())

    def ready(self) -> bool:
        return all(t.done() for t in self.chooses_from)

    def final_loss(self) -> float:
        loss = json.loads((self.runs()[0] / "summary.json").read_text()).get("final_val_loss")
        return loss if loss is not None and math.isfinite(loss) else math.inf

    def chosen_step(self) -> tuple[float, float]:
        best = min(self.chooses_from, key=Task.final_loss)
        return best.step

    def command(self, isoloco: list[str]) -> list[str]:
        overrides = self.overrides
        if self.chooses_from:
            overrides = f"{step_overrides(*self.chosen_step())} {overrides}"
        return [*isoloco, "sweep", "repro-cpu", *overrides.split(), "--methods", self.method,
                "--workers", str(self.workers), "--seeds", self.seeds, "--jobs", "1", "--no-report",
                "--out", str(self.out)]


def plan(out: Path, only: set[str] | None) -> tuple[list[Task], dict[tuple[str, str, int], list[Task]]]:
    """Every task in the order they start (a task waits for the selection it depends on)."""
    tasks: list[Task] = []
    selections: dict[tuple[str, str, int], list[Task]] = {}

    def search_and_evaluate(setting: str, workers: int) -> tuple[list[Task], list[Task]]:
        methods, overrides = SETTINGS[setting]
        searches, evaluations = [], []
        for method in methods:
            grid = [Task(out / "select" / f"{method}-{setting}-R{workers}-{step_name(*s)}", method, workers, "0",
                         f"{step_overrides(*s)} {overrides}", step=s) for s in steps_for(method)]
            selections[(setting, method, workers)] = grid
            searches += grid
            evaluations.append(Task(out / f"{method}-{setting}-R{workers}", method, workers, EVAL_SEEDS, overrides,
                                    chooses_from=grid))
        return searches, evaluations

    # the settings that answer the question first, the hidden-matrices variant last
    for group in (("lowrank4", "sparseloco"), ("lowrank4-hidden",)):
        for workers in WORKERS:
            for setting in group:
                if not only or setting in only:
                    searches, evaluations = search_and_evaluate(setting, workers)
                    tasks += searches
                    tasks += evaluations
        for setting, (overrides, searched, workers) in BORROWED.items():
            if (only and setting not in only) or searched not in group:
                continue
            if not any(k[0] == searched and k[2] == workers for k in selections):
                search_and_evaluate(searched, workers)  # its search, to read the choice from
            for method in SETTINGS[searched][0]:
                tasks.append(Task(out / f"{method}-{setting}-R{workers}", method, workers, EVAL_SEEDS, overrides,
                                  chooses_from=selections[(searched, method, workers)]))
    return tasks, selections


def write_selection(out: Path, selections: dict[tuple[str, str, int], list[Task]]) -> None:
    """selection.md: every seed-0 final loss, the choice in bold once a search is complete."""
    lines = ["| setting | method | R | " + " | ".join(["step: final loss (seed 0)"]) + " | chosen |",
             "|---|---|---|---|---|"]
    for (setting, method, workers), grid in selections.items():
        cells, complete = [], all(t.done() for t in grid)
        chosen = min(grid, key=Task.final_loss).step if complete else None
        for t in grid:
            loss = f"{t.final_loss():.4f}" if t.done() else "running or to run"
            cells.append(f"**{step_name(*t.step)}: {loss}**" if t.step == chosen else f"{step_name(*t.step)}: {loss}")
        lines.append(f"| {setting} | {method} | {workers} | {'; '.join(cells)} | "
                     f"{step_name(*chosen) if chosen else 'search incomplete'} |")
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
    tasks, selections = plan(out, only)
    isoloco = [sys.executable, "-m", "isoloco"]
    if args.dry_run:
        for t in tasks:
            state = "done" if t.done() else "ready" if t.ready() else "waits for its selection"
            print(f"{state:24} {t.out.relative_to(out)}  {t.overrides}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    running: dict[int, tuple[Task, subprocess.Popen]] = {}
    failed: set[int] = set()
    while True:
        for i, (task, proc) in list(running.items()):
            if proc.poll() is not None:
                del running[i]
                if proc.returncode != 0:
                    failed.add(i)
                    print(f"failed ({proc.returncode}): {task.out}", file=sys.stderr, flush=True)
        write_selection(out, selections)
        pending = [i for i, t in enumerate(tasks) if i not in running and i not in failed and not t.done()]
        if not running and not any(tasks[i].ready() for i in pending):
            # nothing left that can start: done, or waiting on a search whose run failed
            return 1 if failed or pending else 0
        for i in pending:
            if len(running) >= lanes(out, args.lanes):
                break
            if tasks[i].ready():
                task = tasks[i]
                task.out.mkdir(parents=True, exist_ok=True)
                log = open(task.out / "sweep.log", "a")
                print(f"start: {task.out.relative_to(out)}", flush=True)
                running[i] = (task, subprocess.Popen(task.command(isoloco), stdout=log, stderr=subprocess.STDOUT))
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main())
