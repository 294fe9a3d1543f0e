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
``spectra_s`` in summary.json. `isoloco.report.spectra` reads them back for `isoloco report`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from isoloco.comm import Communicator

#: The metrics line's key of a round's measurements, and summary.json's key of their seconds.
SPECTRA_KEY = "spectra"
SECONDS_KEY = "spectra_s"

#: What each matrix's record holds, in order.
QUANTITIES = ("stable_rank", "sigma_ratio", "disagreement", "update_norm", "step_norm")

Record = dict[str, float | None]


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
