"""Claim 2 past R = 16, settled: the runs behind the pre-registered test on docs/claims/claims-1-3.md
("Claim 2 past R = 16: the test, written before its runs").

    OMP_NUM_THREADS=1 python scripts/claim2_settle.py [--out DIR] [--lanes N] [--dry-run]

On the repro-cpu-r128 preset, in the order they start:
1. The inner lr at this batch: seed 0 of DiLoCo and IsoLoCo at R = 128, each at its searched outer
   step, over inner lr 0.008, 0.016 and 0.032 and the ladder past an edge. Their 0.016 points are
   the R-to-128 grid's own seed-0 runs (results/claims/r128/select), the same config, so they are
   read from there, not trained again. dp's search is the grid's (0.008, 0.016, 0.032); it gains
   the ladder's next points outward while a method's search holds more points than it.
2. The step swap: DiLoCo at R = 32 with R = 128's step (mu 0.6, lr 0.7) and at R = 64 with R = 16's
   (mu 0.6, lr 1.0), seeds 1-3, 480 steps, so the grid's R = 32 -> 64 change is also seen with
   DiLoCo's step held fixed.
3. Twice the rounds: DiLoCo and IsoLoCo at R = 16 and R = 128 at their searched outer steps,
   steps=960 (32 synchronisations at H = 30, the schedule over 960), seeds 1-5, seed by seed.
Items 2 and 3 run at each method's inner lr chosen in item 1 (`needs`). Where a method chooses an
inner lr other than the grid's 0.016, the pre-registration runs its grid cells at R = 32 and 64
(the grid's own outer steps there) at that inner lr too, seeds 1-3, so that each R = 32 -> 64
contrast compares runs at one inner lr; they join the layout once the method's search completes.

Layout under DIR: `select/<search>-<lr>/` (seed 0), `swap/<method>-R<R>-<step>/` (seeds 1-3),
`long/<method>-R<R>/` (seeds 1-5), `selection.md`, `swap/swap.md`: the R = 32 -> 64 change with
DiLoCo's step held at each value and its pre-registered reading, and `long/contrast.md`: the
pre-registered contrast at every evaluation of the seeds whose four runs have reached it, drawn
against step in `long/contrast.png`, and once every seed has finished, its outcome and the test's
row (with its p unrounded, which scripts/claim_reports.py --tests adjusts with the page's tests).
Finished runs are skipped, so rerunning continues; the file `DIR/lanes`, if present, holds how
many runs go at once.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from isoloco.report import load_runs
from isoloco.report.compare import format_p
from isoloco.report.plots import save_png
from isoloco.report.stats import mean_ci, paired_p
from isoloco.sweep import run_name
from isoloco.tuned import Search, Task, extend, grid_main, selection_rows, step_name, step_overrides

PRESET = "repro-cpu-r128"
GRID = Path(__file__).resolve().parents[1] / "results/claims/r128"
#: each method's outer step chosen on seed 0 (results/claims/r128/selection.md), (lr, momentum)
SEARCHED_STEP = {("diloco", 16): (1.0, 0.6), ("diloco", 128): (0.7, 0.6),
                 ("isoloco", 16): (1.5, 0.6), ("isoloco", 128): (1.5, 0.6)}
INNER_LRS = (0.008, 0.016, 0.032)
INNER_LADDER = (0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128)
#: the grid's own inner lr, whose seed-0 runs exist already
GRID_INNER_LR = 0.016
LONG_STEPS = 960
LONG_SEEDS = "1,2,3,4,5"
SWAP_SEEDS = "1,2,3"
#: DiLoCo's step swapped between R = 32 and R = 64: each R at the other's step
SWAP = ((32, (0.7, 0.6)), (64, (1.0, 0.6)))
#: The pre-registered equivalence margin of the contrast, in final validation loss.
MARGIN = 0.05
#: The swap's change is called when its paired t-test's two-sided p is below this (95%).
SWAP_ALPHA = 0.05
#: The contrast's four cells, each with its sign: (IsoLoCo − DiLoCo at R = 128) − (the same at R = 16).
CONTRAST = ((("isoloco", 128), 1), (("diloco", 128), -1), (("isoloco", 16), -1), (("diloco", 16), 1))


def grid_step(method: str, workers: int) -> tuple[float, float]:
    """The outer step the R-to-128 grid ran `method` at: R = 16's choice up to R = 32, R = 128's from 64."""
    return SEARCHED_STEP[method, 16 if workers <= 32 else 128]


def inner_label(lr: float, _: float) -> str:
    return f"lr{lr}"


def inner_search(select: Path, method: str) -> Search:
    """Seed 0 of `method` at R = 128 over the inner lr, its outer step fixed at R = 128's choice."""
    outer = step_overrides(*SEARCHED_STEP[method, 128])
    search = Search(select, "inner", method, 128, outer, PRESET, render=lambda lr, _: f"inner.lr={lr}",
                    label=inner_label, ladder=INNER_LADDER)
    for lr in INNER_LRS:
        task = search.add((lr, 0.0))
        if lr == GRID_INNER_LR:
            # the grid trained this very config on seed 0: read it where it lies
            task.out = GRID / "select" / f"{method}-R128-{step_name(*SEARCHED_STEP[method, 128])}"
    return search


def dp_search(select: Path, methods: list[Search]) -> Search:
    """dp's inner-lr search is the grid's; while a method's search holds more points, the ladder's
    next lr outward (below, then above, alternately) joins it."""
    search = Search(GRID / "select", "inner", "dp", 1, "", PRESET, render=lambda lr, _: f"inner.lr={lr}",
                    label=inner_label, ladder=INNER_LADDER)
    for lr in INNER_LRS:
        search.add((lr, 0.0))
    wanted = max(len(m.grid) for m in methods)
    below = [lr for lr in INNER_LADDER if lr < min(INNER_LRS)][::-1]
    above = [lr for lr in INNER_LADDER if lr > max(INNER_LRS)]
    extra = [lr for pair in zip(below, above) for lr in pair]
    for lr in extra[:max(0, wanted - len(search.grid))]:
        task = search.add((lr, 0.0))
        task.out = select / task.out.name
    return search


def plan(out: Path) -> tuple[list[Task], list[Search]]:
    select = out / "select"
    inner = {method: inner_search(select, method) for method in ("diloco", "isoloco")}
    extend([], list(inner.values()))
    dp = dp_search(select, list(inner.values()))
    tasks = [task for search in (*inner.values(), dp) for task in search.grid]
    for workers, step in SWAP:
        tasks.append(Task(out / "swap" / f"diloco-R{workers}-{step_name(*step)}", "diloco", workers, SWAP_SEEDS,
                          step_overrides(*step), PRESET, needs=(inner["diloco"],)))
    for method, search in inner.items():
        if search.complete() and search.chosen().step[0] != GRID_INNER_LR:
            for workers in (32, 64):
                step = grid_step(method, workers)
                tasks.append(Task(out / "swap" / f"{method}-R{workers}-{step_name(*step)}", method, workers,
                                  SWAP_SEEDS, step_overrides(*step), PRESET, needs=(search,)))
    # Seed by seed: each seed's four runs, which its contrast needs, finish before the next seed's
    # start, so the contrast at every evaluation grows one seed at a time. A folder's seeds never
    # train at once (the driver runs one task per folder).
    for seed in LONG_SEEDS.split(","):
        for workers in (16, 128):
            for method in ("diloco", "isoloco"):
                tasks.append(Task(out / "long" / f"{method}-R{workers}", method, workers, seed,
                                  f"{step_overrides(*SEARCHED_STEP[method, workers])} steps={LONG_STEPS}", PRESET,
                                  needs=(inner[method],)))
    return tasks, [*inner.values(), dp]


def write_selection(out: Path, searches: list[Search]) -> None:
    lines = ["# The inner lr chosen on seed 0 at a batch of 128", "",
             "`python scripts/claim2_settle.py` writes this file: seed 0's final validation loss at every inner lr "
             "tried, in the order tried, the chosen one in bold. DiLoCo and IsoLoCo at R = 128 at their searched "
             "outer steps; dp's search is the R-to-128 grid's, with as many points as the larger method search.", "",
             "| method | R | inner lr: final loss (seed 0) | chosen |", "|---|---|---|---|"]
    lines += selection_rows(searches, lambda search: f"{search.method} | {search.workers}")
    (out / "selection.md").write_text("\n".join(lines) + "\n")
    write_swap(out)
    write_contrast(out)


def final_losses(cell: Path, method: str, workers: int) -> dict[int, float]:
    """seed -> final validation loss of the swap seeds of `cell` that have finished."""
    losses = {}
    for seed in map(int, SWAP_SEEDS.split(",")):
        summary = cell / run_name(method, workers, Task.inner_steps, seed) / "summary.json"
        if summary.is_file():
            losses[seed] = json.loads(summary.read_text()).get("final_val_loss", math.nan)
    return losses


def swap_change(swap: Path, diloco_steps: dict[int, tuple[float, float]]) -> dict[int, float]:
    """seed -> the change of IsoLoCo − DiLoCo from R = 32 to 64 in final loss, DiLoCo at
    `diloco_steps[R]` and IsoLoCo at its grid step, for the seeds whose four runs have finished."""
    cells = []
    for workers, sign in ((64, 1), (32, -1)):
        for method, step in (("isoloco", grid_step("isoloco", workers)), ("diloco", diloco_steps[workers])):
            losses = final_losses(swap / f"{method}-R{workers}-{step_name(*step)}", method, workers)
            cells.append((sign if method == "isoloco" else -sign, losses))
    seeds = set.intersection(*(set(losses) for _, losses in cells))
    return {seed: sum(sign * losses[seed] for sign, losses in cells) for seed in sorted(seeds)}


def swap_reading(called: dict[str, bool]) -> str:
    """What the pre-registration says the two held-step tests mean together."""
    if all(called.values()):
        return "the change is called with DiLoCo's step held at either value: the step switch is not its cause."
    if not any(called.values()):
        return "the change is called at neither held step: the grid's change is not shown apart from the step switch."
    held = next(name for name, yes in called.items() if yes)
    return f"the change is called only with DiLoCo's step held at {held}."


def write_swap(out: Path) -> None:
    """swap/swap.md: the change of IsoLoCo − DiLoCo from R = 32 to 64 with DiLoCo's step held at
    lr 1.0 and at lr 0.7, each a paired t-test over seeds 1-3, and the grid's own pairing (the step
    switching with R) at the same inner lr, beside them; the reading once every run has finished."""
    swap = out / "swap"
    low, high = grid_step("diloco", 32), grid_step("diloco", 64)  # lr 1.0 and lr 0.7
    pairings = {f"lr {low[0]} at both R": {32: low, 64: low}, f"lr {high[0]} at both R": {32: high, 64: high},
                f"the grid's: lr {low[0]} at R = 32, {high[0]} at R = 64": {32: low, 64: high}}
    rows, called = [], {}
    for name, steps in pairings.items():
        changes = swap_change(swap, steps)
        values = list(changes.values())
        if len(values) < 2:
            rows.append(f"| {name} | {len(values)} | — | — | — | to come |")
            continue
        mean, half = mean_ci(values, 95)
        p = paired_p(values) if all(map(math.isfinite, values)) else math.nan
        done = len(values) == len(SWAP_SEEDS.split(","))
        verdict = ("called" if p < SWAP_ALPHA else "not called") if done else "to come"
        if done and "both" in name:
            called[f"lr {steps[32][0]}"] = p < SWAP_ALPHA
        per_seed = ", ".join(f"{v:+.4f}" for v in values)
        rows.append(f"| {name} | {len(values)} ({per_seed}) | {mean:+.4f} | [{mean - half:+.4f}, {mean + half:+.4f}] "
                    f"| {p:.3g} | {verdict} |")
    reading = (f"**Reading** (the pre-registered rule): {swap_reading(called)}" if len(called) == 2
               else "Reading: to come, once both held-step tests have every seed.")
    lines = ["# The step swap: the change from R = 32 to 64 with DiLoCo's step held", "",
             "`python scripts/claim2_settle.py` writes this file. Per seed, the change = (IsoLoCo − DiLoCo at R = 64) "
             "− (IsoLoCo − DiLoCo at R = 32) in final validation loss at step 480, every run at the inner lr its "
             "method's search chose at R = 128, IsoLoCo at μ 0.6 lr 1.5. Positive: IsoLoCo's lead is smaller at "
             f"R = 64. Paired t-test over the seeds, two-sided, called at p < {SWAP_ALPHA}; the grid's pairing "
             "is shown beside the two held steps and is not one of the pre-registered tests.", "",
             "## The change from R = 32 to 64", "",
             "| DiLoCo's step | seeds (per seed) | change | 95% interval | p | verdict |", "|---|---|---|---|---|---|",
             *rows, "", reading]
    (swap / "swap.md").write_text("\n".join(lines) + "\n")


def evaluations(run: Path) -> dict[int, float]:
    """A run's validation loss at each evaluation step (none before it starts)."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return {record["step"]: record["val_loss"] for record in map(json.loads, lines) if "val_loss" in record}


def contrast_by_step(long: Path) -> dict[int, dict[int, float]]:
    """step -> {seed: d_s}, d_s = (L_IsoLoCo,128 − L_DiLoCo,128) − (L_IsoLoCo,16 − L_DiLoCo,16), for
    the seeds whose four runs have all been evaluated at that step."""
    by_step: dict[int, dict[int, float]] = {}
    for seed in map(int, LONG_SEEDS.split(",")):
        cells = [(sign, evaluations(long / f"{method}-R{workers}" / run_name(method, workers, Task.inner_steps, seed)))
                 for (method, workers), sign in CONTRAST]
        for step in set.intersection(*(set(losses) for _, losses in cells)):
            by_step.setdefault(step, {})[seed] = sum(sign * losses[step] for sign, losses in cells)
    return by_step


def outcome(values: list[float]) -> str:
    """The pre-registered outcome of the contrast's per-seed values (docs/claims/claims-1-3.md)."""
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return "not shown"
    mean, half95 = mean_ci(values, 95)
    _, half90 = mean_ci(values, 90)
    inside = -MARGIN < mean - half90 and mean + half90 < MARGIN
    if mean + half95 < 0:
        return "grows, by less than the margin" if inside else "grows"
    if mean - half95 > 0:
        return "shrinks"
    return "level" if inside else "not shown"


#: What the test's row calls each outcome: a call (`isoloco.report.is_call`) where the contrast
#: differs from 0, so that the page-wide adjustment counts it like a compare table's.
CALLS = {"grows": "IsoLoCo's lead grows as R grows", "shrinks": "IsoLoCo's lead shrinks as R grows",
         "grows, by less than the margin": "IsoLoCo's lead grows, by less than the margin, as R grows",
         "level": f"level (within ±{MARGIN})", "not shown": "not shown"}


def preregistered_table(values: list[float]) -> list[str]:
    """The pre-registered test over the per-seed contrasts at the last step, as one row in a
    compare table's shape, with its p unrounded beside the printed one: the page-wide adjustment
    (scripts/claim_reports.py --tests) reads the row from the page's marker and starts from that p."""
    mean, half95 = mean_ci(values, 95)
    _, half90 = mean_ci(values, 90)
    finite = all(map(math.isfinite, values))
    p = paired_p(values) if finite else math.nan
    return ["| A − B | R | H | seeds | C (final loss) | 90% interval | p | p (unrounded) | call |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| (isoloco − diloco at R = 128) − (isoloco − diloco at R = 16) | 16, 128 | {Task.inner_steps} | "
            f"{len(values)} | {mean:+.4f} ± {half95:.4f} | [{mean - half90:+.4f}, {mean + half90:+.4f}] | "
            f"{format_p(p) if finite else '—'} | {p!r} | {CALLS[outcome(values)]} |"]


def draw_contrast(path: Path, by_step: dict[int, dict[int, float]]) -> bool:
    """The contrast against step, with its 95% and 90% t-bands and the margin, at the evaluations
    two seeds or more have reached, as a PNG at `path`; False (nothing drawn) where none has."""
    import matplotlib.style
    from matplotlib.figure import Figure

    steps = [step for step in sorted(by_step) if len(by_step[step]) > 1]
    if not steps:
        return False
    values = [list(by_step[step].values()) for step in steps]
    means = [mean_ci(v)[0] for v in values]
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for confidence, alpha in ((95, 0.15), (90, 0.3)):
            halves = [mean_ci(v, confidence)[1] for v in values]
            ax.fill_between(steps, [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)],
                            color="C0", alpha=alpha, linewidth=0, label=f"{confidence}% interval")
        ax.plot(steps, means, color="C0", marker="o", label="C, the mean over seeds")
        for step, mean, seeds in zip(steps, means, values):
            ax.annotate(f"n={len(seeds)}", (step, mean), textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize=7)
        ax.axhline(0.0, color="black", linewidth=1)
        for sign in (-1, 1):
            ax.axhline(sign * MARGIN, color="gray", linestyle=":", label=f"margin ±{MARGIN}" if sign > 0 else None)
        ax.set_title("IsoLoCo − DiLoCo at R = 128 minus the same at R = 16")
        ax.set_xlabel("step")
        ax.set_ylabel("C, validation loss (negative: the lead grows)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save_png(fig, path)
    return True


def unigram_line(long: Path) -> str:
    """Which finished runs of the contrast were above their unigram baseline at an evaluation, and
    which of them after their first (a divergence, not the warm-up's): the verdict rests on them."""
    finished = [run for cell in sorted(long.iterdir()) if cell.is_dir() for run in load_runs(cell)
                if run.final_val_loss is not None]
    above = [run for run in finished if run.rose_above_unigram]
    later = [run.name for run in above if run.above_after_first]
    return (f"Of the {len(finished)} finished runs, {len(above)} were above their unigram baseline at an evaluation, "
            f"{len(later)} of them after their first evaluation{': ' + ', '.join(later) if later else ''}.")


def write_contrast(out: Path) -> None:
    """long/contrast.md: the contrast at every evaluation reached, with its 95% and 90% t-intervals
    over the seeds, and the outcome at the last step once every seed has finished; beside it
    long/contrast.png, the same against step."""
    long = out / "long"
    by_step = contrast_by_step(long)
    if not by_step:
        return
    seeds = LONG_SEEDS.split(",")
    rows = []
    for step, values in sorted(by_step.items()):
        mean, half95 = mean_ci(list(values.values()), 95)
        _, half90 = mean_ci(list(values.values()), 90)
        interval = lambda half: "—" if half is None else f"[{mean - half:+.4f}, {mean + half:+.4f}]"
        rows.append(f"| {step} | {len(values)} | {mean:+.4f} | {interval(half95)} | {interval(half90)} |")
    last = by_step.get(LONG_STEPS, {})
    if len(last) == len(seeds):
        verdict = [f"**Outcome at step {LONG_STEPS}** (the pre-registered test, margin ±{MARGIN}): "
                   f"{outcome(list(last.values()))}.", "",
                   f"## The pre-registered test at step {LONG_STEPS}", "", *preregistered_table(list(last.values()))]
    else:
        verdict = [f"Outcome at step {LONG_STEPS}: to come ({len(last)} of {len(seeds)} seeds there)."]
    lines = ["# Claim 2 past R = 16: the contrast at every evaluation", "",
             "`python scripts/claim2_settle.py` writes this file. Per seed, d = (IsoLoCo − DiLoCo at R = 128) − "
             "(IsoLoCo − DiLoCo at R = 16) in validation loss at each evaluation its four runs have reached; C is "
             "the mean over those seeds, with its t-intervals. Negative: IsoLoCo's lead is larger at R = 128.", "",
             "## The contrast at every evaluation", "",
             "| step | seeds | C | 95% interval | 90% interval |", "|---|---|---|---|---|", *rows, "", *verdict]
    lines += ["", unigram_line(long)]
    if draw_contrast(long / "contrast.png", by_step):
        lines += ["", "![The contrast C against step, with its 95% and 90% intervals and the margin](contrast.png)"]
    (long / "contrast.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    return grid_main(__doc__, Path("results/claims/claim2-settle"), plan, write_selection)


if __name__ == "__main__":
    sys.exit(main())
