"""A sum phase of one bucket across the slow link, compressed, as one island's steps.

The merge engine (`isoloco.merge`) hands each island its side of the phase (`Island`: its
workers' contributions, its error-feedback residuals) and an `IslandLink`; `island_phase`
runs the bucket's tensors through their compressed sums: vectors, and every tensor without
`merge.compress`, through the dense sum (`isoloco.sync.compressed`); matrices with it through
low rank (`isoloco.sync.lowrank`) or top-k (`isoloco.sync.topk`), all in lockstep. A process
of a distributed run plays its own island; the simulator plays every island in turn
(`isoloco.sync.islands.PlayedIslands`), through these same steps.

**Error feedback** (`merge.error_feedback`) compensates every rounding on the way, so that over
T rounds Σ delivered = Σ meant − Σ_i e_i(T), the islands' residuals now:

* each island's encode: e_i = X_i − what its wire delivers (X_i = its sum + e_i; for low rank
  X_i − P̂ q(X_iᵀ P̂)ᵀ, which also keeps what the rank-k projection leaves out);
* each owner's re-encode of a chunk of the total (the ``exchange`` route): its island adds what
  that lost to its own residual, on that chunk (for low rank, P̂ Oᵀ).

**An island none of whose workers arrived** sends zeros and keeps its residual for its next
merge (it adds nothing of its own), but as the owner of a chunk it still keeps that chunk's
rounding. Residuals live with each island's first worker, and are fetched and stored back one
island at a time (offloaded from a GPU, stored without the host waiting: `isoloco.sync.offload`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from isoloco.configbase import name_matches
from isoloco.sync import offload
from isoloco.sync.codec import Quantization
from isoloco.sync.compressed import ChunkPlan, Rounding, island_sum
from isoloco.sync.handles import Steps, lockstep, padded
from isoloco.sync.islands import IslandLink
from isoloco.sync.lowrank import LowRankPlan, lowrank_island_sum
from isoloco.sync.topk import TopK, TopKPlan, topk_island_sum


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a sum crosses the slow link (`merge.quantize`, `merge.compress`, `merge.error_feedback`)."""

    quantization: Quantization
    compress: str  # "none", "lowrank" or "topk"
    topk: TopK
    feedback: bool
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names whose matrices skip `compress`
    rank: int = 4  # compress="lowrank": the factors' rank k, before each matrix's clamp

    def structured(self, shape: Sequence[int], name: str = "") -> bool:
        """Whether a sum of parameter `name`'s `shape` travels through `compress` (matrices
        only, and not those `exclude` names; vectors stay whole)."""
        return (self.compress != "none" and len(shape) == 2
                and not name_matches(name, self.exclude))


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """The plan of one bucket's compressed sum phase over `islands` islands of `slices`
    processes each: which tensors take which sum, each sum's own plan, and from those alone the
    phase's stages (its longest sum's) and bytes (theirs added up). `island_phase` runs it, the
    slow link counts its stages and bytes with it, and the cost model
    (`isoloco.sync.slowlink.mean_wire_bytes`) adds up its bytes: one plan for all three."""

    shapes: tuple[torch.Size, ...]
    #: (tensor indices, their sum's plan): the dense sum, then the structured one (low rank or top-k).
    sums: tuple[tuple[tuple[int, ...], ChunkPlan | LowRankPlan | TopKPlan], ...]

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], names: Sequence[str], compression: Compression, islands: int,
           slices: int) -> PhasePlan:
        shapes = tuple(torch.Size(shape) for shape in shapes)
        structured = tuple(index for index, (shape, name) in enumerate(zip(shapes, names))
                           if compression.structured(shape, name))
        dense = tuple(index for index in range(len(shapes)) if index not in structured)
        quantization = compression.quantization
        sums: list[tuple[tuple[int, ...], ChunkPlan | LowRankPlan | TopKPlan]] = []
        if dense:
            sums.append((dense, ChunkPlan.of([shapes[index] for index in dense], quantization, islands, slices)))
        if structured and compression.compress == "topk":
            sums.append((structured, TopKPlan(tuple(math.prod(shapes[index]) for index in structured),
                                              compression.topk, quantization, islands, slices)))
        elif structured:
            sums.append((structured, LowRankPlan.of([shapes[index] for index in structured], compression.rank,
                                                    quantization, islands, slices)))
        return cls(shapes, tuple(sums))

    @property
    def stages(self) -> int:
        return max(plan.stages for _, plan in self.sums)

    @property
    def payload_bytes(self) -> int:
        """What one island hands to the phase's sums, before the routes' fan-out: the same in
        every layout (`Communicator.bytes_sent_per_worker`)."""
        return sum(plan.payload_bytes for _, plan in self.sums)

    def wire_bytes(self) -> float:
        """The slow-link bytes of the phase, averaged over the processes of an island."""
        return sum(plan.wire_bytes() for _, plan in self.sums)


@dataclasses.dataclass
class Island:
    """One island's side of a compressed sum phase."""

    #: Its arrived workers' contributions to the bucket, laid end to end (zeros when none arrived).
    contribution: Callable[[], torch.Tensor]
    #: Whether any of its workers arrived.
    arrived: bool
    #: Error feedback: its residual per tensor of the bucket (stored with its first worker), or None.
    residuals: Sequence[torch.Tensor] | None
    #: Brings a stored tensor to where the merge computes (a copy for offloaded workers).
    fetch: Callable[[torch.Tensor], torch.Tensor]
    #: Hold the contribution between stages (a process: one island), or build it again when a
    #: sum needs it twice (played islands, so that the simulator holds one island's at a time).
    keep_inputs: bool

    def load(self, tensor: int) -> torch.Tensor:
        return offload.fetched(self.residuals[tensor], self.fetch)

    def store(self, tensor: int, value: torch.Tensor) -> None:
        # Offloaded from a GPU: a copy to pinned host memory that the host does not wait for.
        offload.store(self.residuals[tensor], value)


def island_phase(link: IslandLink, island: Island, plan: PhasePlan, compression: Compression,
                 factors: dict[int, torch.Tensor]) -> Steps[dict[int, tuple[torch.Tensor, torch.Tensor | None]]]:
    """One island's steps of a compressed sum phase as `plan` says (`factors`: the low-rank warm
    starts, by tensor index). Returns, by tensor index, (its sum, None), or for low rank
    (Q', P̂): the sum is P̂ Q'ᵀ, formed once by the caller."""
    sizes = [math.prod(shape) for shape in plan.shapes]
    memo: list[list[torch.Tensor]] = []

    def contributions() -> list[torch.Tensor]:
        if not memo:
            memo.append(list(torch.split(island.contribution(), sizes)))
        return memo[0]

    def run(indices: tuple[int, ...], sum_plan: ChunkPlan | LowRankPlan | TopKPlan) -> Steps[list]:
        if isinstance(sum_plan, LowRankPlan):
            return _lowrank(link, island, indices, plan.shapes, contributions, compression, sum_plan, factors)
        return _summed(link, island, indices, contributions, compression, sum_plan)

    steps = lockstep([padded(run(indices, sum_plan), plan.stages) for indices, sum_plan in plan.sums])
    while True:
        try:
            handles = next(steps)
        except StopIteration as end:
            results = end.value
            break
        if not island.keep_inputs:
            memo.clear()
        yield handles
    return {index: value for (indices, _), result in zip(plan.sums, results) for index, value in zip(indices, result)}


def _summed(link: IslandLink, island: Island, indices: Sequence[int], contributions: Callable[[], list[torch.Tensor]],
            compression: Compression, plan: ChunkPlan | TopKPlan) -> Steps[list[tuple[torch.Tensor, None]]]:
    """The dense (or top-k) sums of tensors `indices`, with error feedback on the island's
    residuals: X_i = x_i + e_i is what is sent, and e_i becomes what the wire did not deliver."""
    feedback = compression.feedback
    held: list[torch.Tensor | None] = []

    def inputs() -> list[torch.Tensor]:
        xs = [contributions()[index].reshape(-1) for index in indices]
        if not (feedback and island.arrived):
            return xs
        held[:] = [island.load(index) for index in indices]
        for residual, x in zip(held, xs):
            residual.view(-1).add_(x)
        return [residual.reshape(-1) for residual in held]

    def keep(position: int, decoded: torch.Tensor) -> None:
        residual, held[position] = held[position], None
        residual.view(-1).sub_(decoded)
        island.store(indices[position], residual)

    keeps = keep if feedback and island.arrived else None
    if isinstance(plan, TopKPlan):
        sums = yield from topk_island_sum(link, plan, inputs, keeps)
        roundings: list[Rounding] = []
    else:
        sums, roundings = yield from island_sum(link, plan, inputs, keeps, feedback)
    for rounding in roundings:
        residual = island.load(indices[rounding.tensor])
        residual.view(-1)[rounding.start:rounding.stop].add_(rounding.error)
        island.store(indices[rounding.tensor], residual)
    return [(total, None) for total in sums]


def _lowrank(link: IslandLink, island: Island, indices: Sequence[int], shapes: Sequence[torch.Size],
             contributions: Callable[[], list[torch.Tensor]], compression: Compression, plan: LowRankPlan,
             factors: dict[int, torch.Tensor]) -> Steps[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The rank-k sums of matrices `indices`: X_i = x_i + e_i (x_i alone without error
    feedback, or when none of the island's workers arrived)."""
    matrices = [shapes[index] for index in indices]
    feedback = compression.feedback and island.arrived

    def inputs() -> list[torch.Tensor]:
        xs = [contributions()[index].view(shape) for index, shape in zip(indices, matrices)]
        return [x + island.load(index) for x, index in zip(xs, indices)] if feedback else xs

    def store(position: int, residual: torch.Tensor) -> None:
        island.store(indices[position], residual)

    warm, bases, roundings = yield from lowrank_island_sum(
        link, plan, matrices, [factors[index] for index in indices], inputs, compression.feedback,
        store if feedback else None)
    for rounding in roundings:
        position = rounding.tensor
        lost = torch.zeros_like(warm[position])
        lost.view(-1)[rounding.start:rounding.stop] = rounding.error
        residual = island.load(indices[position])
        residual.add_(bases[position] @ lost.T)
        island.store(indices[position], residual)
    return list(zip(warm, bases))
