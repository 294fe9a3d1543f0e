"""The spectra `log.spectra` logged (`isoloco.spectra`), for `isoloco report`: `spectra.md`, a
table of every run's means, a layers × rounds heatmap per run, and the workers' disagreement
against R (and H).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isoloco.rundir import METRICS_FILE
from isoloco.spectra import QUANTITIES, SPECTRA_KEY, Record

if TYPE_CHECKING:
    from isoloco.report import RunResult

#: The report's table of every run's spectra (`spectra_markdown`).
SPECTRA_FILE = "spectra.md"


def read_spectra(metrics: Path) -> list[tuple[int, dict[str, Record]]]:
    """(round, records) of every line of a metrics.jsonl with spectra; a torn last line of a
    run in progress is skipped, and so is a missing file."""
    if not metrics.is_file():
        return []
    rounds = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if SPECTRA_KEY in record:
            rounds.append((int(record["round"]), record[SPECTRA_KEY]))
    return rounds


def spectra_grid(rounds: list[tuple[int, dict[str, Record]]], quantity: str) -> tuple[list[str], list[float]]:
    """The matrices in the order the run logged them, and `quantity` as rows of a matrices ×
    rounds grid (flattened row by row; NaN where it is undefined)."""
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown spectra quantity {quantity!r}: expected one of {', '.join(QUANTITIES)}")
    names = list(dict.fromkeys(name for _, records in rounds for name in records))
    nan = float("nan")
    values = [value if (value := records.get(name, {}).get(quantity)) is not None else nan
              for name in names for _, records in rounds]
    return names, values


def mean_disagreement(rounds: list[tuple[int, dict[str, Record]]]) -> float | None:
    """The disagreement averaged over a run's matrices and rounds; None where it has none (R = 1)."""
    values = [record["disagreement"] for _, records in rounds for record in records.values()
              if record.get("disagreement") is not None]
    return statistics.fmean(values) if values else None


def round_means(rounds: list[tuple[int, dict[str, Record]]], quantity: str) -> list[float | None]:
    """`quantity` averaged over the matrices that have it, round by round."""
    means = []
    for _, records in rounds:
        values = [record[quantity] for record in records.values() if record.get(quantity) is not None]
        means.append(statistics.fmean(values) if values else None)
    return means


def spectra_markdown(measured: list[tuple[RunResult, list[tuple[int, dict[str, Record]]]]]) -> str:
    """One row per run that logged spectra: each quantity averaged over its matrices, in its
    first and last synchronisation and over all of them."""
    def cell(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    rows = []
    for run, rounds in sorted(measured, key=lambda item: (item[0].method, item[0].workers or 0,
                                                          item[0].inner_steps or 0, item[0].seed)):
        cells = [run.name, run.method, str(run.workers), str(run.inner_steps), str(len(rounds))]
        for quantity in ("disagreement", "stable_rank", "sigma_ratio"):
            per_round = [v for v in round_means(rounds, quantity) if v is not None]
            cells += [cell(per_round[0] if per_round else None), cell(per_round[-1] if per_round else None),
                      cell(statistics.fmean(per_round) if per_round else None)]
        rows.append("| " + " | ".join(cells) + " |")
    header = ["run", "method", "R", "H", "synchronisations"] + [
        f"{q}: {when}" for q in ("disagreement", "stable rank", "σ_max/σ_mean") for when in ("first", "last", "mean")]
    return "\n".join(["# Spectra", "", "Means over each run's matrices (2-D parameters) of what `log.spectra` "
                      "logged: the workers' disagreement (mean pairwise cosine of their deltas), and the stable "
                      "rank and σ_max/σ_mean of the merged pseudo-gradient, in the first and last "
                      "synchronisation and over all of them.", "", "## Per run", "",
                      "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]) + "\n"


def _short(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


#: Beyond this many matrices a heatmap labels every n-th only, so the labels stay legible.
LABELLED_MATRICES = 40


def _heatmaps(run: str, rounds: list[tuple[int, dict[str, Record]]]) -> Any:
    """Stable rank and disagreement of one run, matrices × rounds, side by side."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    numbers = [r for r, _ in rounds]
    names, _ = spectra_grid(rounds, "stable_rank")
    fig = Figure(figsize=(11, 1.5 + 0.16 * min(len(names), 3 * LABELLED_MATRICES)), layout="constrained")
    every = -(-len(names) // LABELLED_MATRICES)
    for ax, quantity, title, cmap in zip(fig.subplots(1, 2, sharey=True), ("stable_rank", "disagreement"),
                                         ("stable rank of the merged update", "disagreement (mean pairwise cosine)"),
                                         ("viridis", "coolwarm")):
        _, values = spectra_grid(rounds, quantity)
        grid = np.array(values, dtype=float).reshape(len(names), len(numbers))
        # Cosines centred on 0 (white: orthogonal), scaled to the run's largest so small ones show.
        largest = float(np.nanmax(np.abs(grid), initial=0.0)) or 1.0
        limits = dict(vmin=-largest, vmax=largest) if quantity == "disagreement" else {}
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, **limits,
                          extent=(numbers[0] - 0.5, numbers[-1] + 0.5, len(names) - 0.5, -0.5))
        fig.colorbar(image, ax=ax, shrink=0.9)
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks(range(0, len(names), every), [_short(n) for n in names[::every]], fontsize="x-small")
    fig.suptitle(run)
    return fig


#: Axes the disagreement is drawn against: run attribute -> its short name.
AXES = {"workers": "R", "inner_steps": "H"}


def _disagreement_against(runs: list[tuple[RunResult, float]], axis: str) -> Any:
    """Mean disagreement (over matrices, rounds and seeds) against `axis` on a log2 axis: a
    line per run label and value of each other axis that varies."""
    from matplotlib.figure import Figure

    others = {attr: short for attr, short in {**AXES, "tokens": "tokens"}.items()
              if attr != axis and len({getattr(run, attr) for run, _ in runs}) > 1}
    series: dict[str, dict[int, list[float]]] = {}
    for run, value in runs:
        label = run.label + "".join(f" {short}={getattr(run, attr)}" for attr, short in others.items())
        series.setdefault(label, {}).setdefault(getattr(run, axis), []).append(value)
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", label=label)
    values = sorted({getattr(run, axis) for run, _ in runs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel("mean pairwise cosine of the workers' deltas")
    ax.set_title(f"Workers' disagreement vs {AXES[axis]}")
    ax.grid(True, alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")
    return fig


def write_spectra_plots(directory: Path, runs: list[RunResult], folder: Path) -> list[tuple[str, str]]:
    """For `isoloco report`: of the runs under `directory` that logged spectra, a heatmap per
    run, and the mean disagreement against R (and H, when several) where runs of several
    workers have it; the (file name, caption) pairs written to `folder`, none when no run
    has spectra."""
    import matplotlib.style

    measured = [(run, rounds) for run in runs if (rounds := read_spectra(directory / run.name / METRICS_FILE))]
    if not measured:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, str]] = []

    def save(fig: Any, file: str, caption: str) -> None:
        # As the report's own plots: no Software metadata (the one field that varies), so a
        # rerun writes the same bytes.
        fig.savefig(folder / file, dpi=110, metadata={"Software": None})
        written.append((file, caption))

    (directory / SPECTRA_FILE).write_text(spectra_markdown(measured))
    with matplotlib.style.context("default"):
        for run, rounds in measured:
            save(_heatmaps(run.name, rounds), f"spectra_{run.name}.png",
                 f"Stable rank and disagreement per matrix and round: {run.name}")
        means = [(run, mean) for run, rounds in measured if (mean := mean_disagreement(rounds)) is not None]
        for axis, short in AXES.items():
            if means and (axis == "workers" or len({getattr(run, axis) for run, _ in means}) > 1):
                save(_disagreement_against(means, axis), f"disagreement_vs_{short}.png",
                     f"Workers' disagreement vs {short}")
    return written
