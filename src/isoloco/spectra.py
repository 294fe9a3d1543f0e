"""The interference made visible (`log.spectra=true`): what each outer step does to each matrix.

Per 2-D parameter and per synchronisation, the outer step measures

* ``stable_rank``: ‖M‖_F²/σ_max² of the merged pseudo-gradient M the outer optimizer
  receives: 1 when one direction dominates, the rank when the spectrum is flat;
* ``sigma_ratio``: σ_max/σ_mean over M's nonzero spectrum: 1 for an isotropic update (what
  Iso-C makes), large when a few directions carry it;
* ``disagreement``: the mean pairwise cosine of the workers' deltas Δ_r (1: they agree,
  0: orthogonal, negative: they pull apart), over every worker of the run;
* ``update_norm``: ‖M‖_F; ``step_norm``: ‖θ_after − θ_before‖_F, the change the step made.

`SpectraProbe` takes these around the outer optimizer step (`OuterStep`); the trainer writes
them as a ``spectra`` entry of the round's last metrics line and the seconds they cost as
``spectra_s`` in summary.json. `write_spectra_plots` draws them for `isoloco report`: a
layers × rounds heatmap per run, and the disagreement against R (and H).
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from isoloco.comm import Communicator
from isoloco.rundir import METRICS_FILE

if TYPE_CHECKING:
    from isoloco.report import RunResult

#: The metrics line's key of a round's measurements, and summary.json's key of their seconds.
SPECTRA_KEY = "spectra"
SECONDS_KEY = "spectra_s"
#: The report's table of every run's spectra (`spectra_markdown`).
SPECTRA_FILE = "spectra.md"

#: What each matrix's record holds, in order.
QUANTITIES = ("stable_rank", "sigma_ratio", "disagreement", "update_norm", "step_norm")

Record = dict[str, float | None]

# ---------------------------------------------------------------------------------------
# The measurements


def nonzero_singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """The singular values of `matrix` in float32, largest first, without those below the rank
    tolerance σ_max·max(m, n)·ε of `torch.linalg.matrix_rank`: round-off is no direction."""
    if matrix.ndim != 2:
        raise ValueError(f"singular values need a matrix, got a tensor of shape {tuple(matrix.shape)}")
    sigma = torch.linalg.svdvals(matrix.detach().float())
    tolerance = sigma[0] * max(matrix.shape) * torch.finfo(torch.float32).eps
    return sigma[sigma > tolerance]


def stable_rank(sigma: torch.Tensor) -> float | None:
    """‖M‖_F²/σ_max² = Σσ²/σ_max² of the nonzero spectrum `sigma` (largest first); None for M = 0."""
    if sigma.numel() == 0:
        return None
    return float(sigma.square().sum() / sigma[0].square())


def sigma_ratio(sigma: torch.Tensor) -> float | None:
    """σ_max/σ_mean of the nonzero spectrum `sigma` (largest first); None for M = 0."""
    if sigma.numel() == 0:
        return None
    return float(sigma[0] / sigma.mean())


def unit_sum(deltas: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_r Δ_r/‖Δ_r‖ in float32 over the nonzero deltas, and how many they are (a 0-d
    tensor), holding one delta at a time. A zero delta has no direction and is not counted.
    Nothing waits for the device: the count stays a tensor."""
    total = count = None
    for delta in deltas:
        delta = delta.detach().float()
        if total is None:
            total, count = torch.zeros_like(delta), torch.zeros((), device=delta.device)
        norm = torch.linalg.vector_norm(delta)
        moved = norm > 0
        total.add_(delta * torch.where(moved, norm.reciprocal(), 0.0))
        count += moved
    if total is None:
        raise ValueError("the disagreement of no deltas is undefined: give at least one")
    return total, count


def mean_pairwise_cosine(unit_total: torch.Tensor, count: float | torch.Tensor) -> float | None:
    """mean_{i<j} cos(Δ_i, Δ_j) of `count` = K deltas from the sum s of their unit vectors
    (`unit_sum`): ‖s‖² = K + 2·Σ_{i<j} cos, so the mean is (‖s‖² − K)/(K(K − 1)). None
    below two deltas, which have no pair."""
    workers = round(float(count))
    if workers < 2:
        return None
    squared = float(torch.linalg.vector_norm(unit_total.double()).square())
    return (squared - workers) / (workers * (workers - 1))


def disagreements(local_deltas: Sequence[Sequence[torch.Tensor]], comm: Communicator,
                  fetch: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> list[float | None]:
    """The mean pairwise cosine of each parameter's deltas over every worker of the run:
    `local_deltas[i]` holds parameter i's deltas of this process's workers. The unit sums and
    counts of all parameters are summed over processes in one collective, so every process
    gets the same numbers."""
    sizes = [deltas[0].numel() for deltas in local_deltas]
    width = sum(sizes)
    packed = torch.zeros(width + len(sizes), device=device)
    totals, counts = packed[:width].split(sizes), packed[width:]
    for i, deltas in enumerate(local_deltas):
        total, count = unit_sum(fetch(delta) for delta in deltas)
        totals[i].copy_(total.reshape(-1))
        counts[i] = count
    with comm.uncounted():
        packed = comm.sum(packed)
    totals, counts = packed[:width].split(sizes), packed[width:].tolist()
    return [mean_pairwise_cosine(total, count) for total, count in zip(totals, counts)]


class SpectraProbe:
    """Measures every outer step it `observe`s; `take_records` hands the last one's records
    (parameter name -> `QUANTITIES`), `seconds` is the time all measurements took."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.seconds = 0.0
        self._records: dict[str, Record] = {}

    @contextmanager
    def observe(self, matrices: Sequence[tuple[str, torch.Tensor]],
                local_deltas: Mapping[str, Sequence[torch.Tensor]],
                fetch: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[None]:
        """Around the outer optimizer step of `matrices` (name, θ), whose ``.grad`` holds the
        merged pseudo-gradient; `local_deltas` and `fetch` as `OuterStep.step` receives them.
        Only reads: the step computes the same bits with or without it."""
        began = time.perf_counter()
        updates = [param.grad for _, param in matrices]
        spectra = [nonzero_singular_values(update) for update in updates]
        deltas = [local_deltas[name] for name, _ in matrices]
        # One column per quantity, in the order of QUANTITIES; step_norm after the step.
        columns = [[stable_rank(sigma) for sigma in spectra], [sigma_ratio(sigma) for sigma in spectra],
                   disagreements(deltas, self.comm, fetch or (lambda delta: delta), updates[0].device) if deltas else [],
                   [float(torch.linalg.vector_norm(update.float())) for update in updates]]
        before = [param.detach().clone() for _, param in matrices]
        self.seconds += time.perf_counter() - began
        yield
        began = time.perf_counter()
        columns.append([float(torch.linalg.vector_norm(param.detach().float() - old.float()))
                        for (_, param), old in zip(matrices, before)])
        self._records = {name: dict(zip(QUANTITIES, values)) for (name, _), values in zip(matrices, zip(*columns))}
        self.seconds += time.perf_counter() - began

    def take_records(self) -> dict[str, Record]:
        """The last observed step's records, once: a round without a step has none."""
        records, self._records = self._records, {}
        return records


# ---------------------------------------------------------------------------------------
# The report


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
