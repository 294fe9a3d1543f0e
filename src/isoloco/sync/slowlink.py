"""How one process's merges cross the slow link compressed: the islands it plays and their plans.

The merge engine (`isoloco.merge`) knows rules and workers; a `SlowLink` knows islands. A
process of a job plays its own island, all its workers; the simulator plays every island of
the run (`isoloco.sync.islands.PlayedIslands`): each worker an island of its own, or with
`dist.islands = P` (`isoloco.comm.LocalCommunicator.played_islands`) P islands of R/P
consecutive workers, which encode their island's sum as a P-island job does, bit for bit.

The engine hands it each bucket's sum phase (`BucketSum`). It plans the phase once
(`isoloco.sync.phase.PhasePlan`: its stages and bytes come from that plan), hands each island
its side (`Island`) and runs the islands' steps, and a stage's buckets, in lockstep; it keeps
low rank's warm-start factors between rounds (the same on every process, checkpointed by
`isoloco.outer.OuterStep`), and each low-rank sum's basis until Iso-C corrects the sum in its
factors' span (`correct_in_span`). `mean_wire_bytes` is the cost model of a merge by the mean,
from the same plans.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from isoloco.errors import ConfigError
from isoloco.ortho import IsoSettings, iso_correct_in_span
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Steps, lockstep, padded
from isoloco.sync.islands import CommLink, IslandLink, PlayedIslands
from isoloco.sync.lowrank import initial_factor
from isoloco.sync.phase import Compression, Island, PhasePlan, island_phase
from isoloco.sync.plan import buckets

if TYPE_CHECKING:
    from isoloco.comm import Communicator

#: The contribution of the arrived workers among the given local workers (indices), laid end to end.
Contribution = Callable[[list[int]], Callable[[], torch.Tensor]]


@dataclasses.dataclass
class BucketSum:
    """One bucket's sum phase, as the merge engine hands it to the slow link."""

    shapes: Sequence[torch.Size]
    names: Sequence[str]  # the parameters'
    #: The arrived workers' contribution (zeros when none arrived), by `Contribution`.
    contribution: Contribution
    #: Error feedback: island head `head`'s residual per tensor (`SlowLink.heads`); None without it.
    residuals: Callable[[int], Sequence[torch.Tensor]] | None
    #: Where the merge computes (the deltas are fetched to), not where they are stored.
    device: torch.device
    #: Per tensor: whether Iso-C corrects its low-rank sum in its factors' span (`SlowLink.correct_in_span`).
    in_span: Sequence[bool]
    #: Takes each tensor's sum (flat, or a low-rank matrix's P̂ Q'ᵀ) once the islands have it.
    combine: Callable[[list[torch.Tensor]], None]


class SlowLink:
    """The compressed sums of one process's merges (`setting`: the merge's lossy setting, as
    errors name it)."""

    def __init__(self, compression: Compression, comm: Communicator, seed: int, setting: str) -> None:
        self.compression, self.comm, self.seed, self.setting = compression, comm, seed, setting
        #: merge.compress=lowrank: each matrix's Q, by parameter name (`isoloco.sync.lowrank`).
        self.factors: dict[str, torch.Tensor] = {}
        #: P̂ of each low-rank sum Iso-C corrects in its factors' span, until `correct_in_span`.
        self._bases: dict[str, torch.Tensor] = {}

    @property
    def played(self) -> bool:
        """Whether every worker lives here, so this process plays every island (the simulator)."""
        return self.comm.islands == 1 and len(self.comm.local_worker_ids) == self.comm.num_workers

    @property
    def groups(self) -> list[list[int]]:
        """The workers (local indices) of each island this process plays, in island order."""
        if not self.played:
            return [list(range(len(self.comm.local_worker_ids)))]
        islands = self.comm.played_islands
        size = self.comm.num_workers // islands
        return [list(range(island * size, (island + 1) * size)) for island in range(islands)]

    @property
    def heads(self) -> list[int]:
        """The local workers (indices) whose error-feedback residuals are their islands': each
        played island's first."""
        return [group[0] for group in self.groups]

    def plan(self, shapes: Sequence[torch.Size], names: Sequence[str]) -> PhasePlan:
        """The plan of a bucket's sum phase of tensors `shapes` (parameters `names`) over the
        islands this run's slow link joins."""
        islands, slices = ((len(self.groups), 1) if self.played
                           else (self.comm.islands, self.comm.island_slices[0]))
        return PhasePlan.of(shapes, names, self.compression, islands, slices)

    def stages(self, buckets: Sequence[tuple[Sequence[torch.Size], Sequence[str]]]) -> int:
        """How often a stage of the sums of `buckets` (each its tensors' shapes and parameter
        names) waits: as often as its longest bucket's islands do."""
        return max(self.plan(shapes, names).stages for shapes, names in buckets)

    def spans(self, shape: Sequence[int], name: str) -> bool:
        """Whether the sum of parameter `name`'s `shape` travels as low-rank factors, in whose
        span a rule's Iso-C then corrects it (`correct_in_span`)."""
        return self.compression.compress == "lowrank" and self.compression.structured(shape, name)

    def phase(self, sums: Sequence[BucketSum], stages: int, arrived: Callable[[int], bool],
              fetch: Callable[[torch.Tensor], torch.Tensor]) -> Steps[None]:
        """The bucket sums of one stage in lockstep, stretched to `stages` stages (what `stages`
        counts for them). `arrived(index)`: whether local worker `index` arrived."""
        yield from padded(lockstep([self._bucket(bucket, arrived, fetch) for bucket in sums]), stages)

    def _bucket(self, bucket: BucketSum, arrived: Callable[[int], bool],
                fetch: Callable[[torch.Tensor], torch.Tensor]) -> Steps[None]:
        sums = yield from self.sum(bucket.shapes, bucket.names, bucket.contribution, arrived, bucket.residuals, fetch,
                                   bucket.device)
        for (_, basis), name, in_span in zip(sums, bucket.names, bucket.in_span):
            if in_span:  # corrected once every stage has run (`correct_in_span`): its SVD syncs with the host
                self._bases[name] = basis
        bucket.combine([total for total, _ in sums])

    def correct_in_span(self, merged: dict[str, torch.Tensor], names: Sequence[str], settings: IsoSettings) -> None:
        """Iso-C of the low-rank sums of `names` in `merged`, in their factors' span
        (`isoloco.ortho.iso_correct_in_span`), after the last stage: an SVD (a host sync on a
        GPU), so it runs where the synchronisation lands, not inside a stage that an
        overlapped synchronisation runs between inner steps."""
        for name in names:
            merged[name] = iso_correct_in_span(merged[name], self._bases.pop(name), settings)
        self._bases.clear()

    def _links(self) -> list[IslandLink]:
        if self.played:
            return PlayedIslands(len(self.groups)).links
        if self.comm.islands == 1:
            raise ConfigError(f"{self.setting} needs isoloco's own process groups: {type(self.comm).__name__} "
                              f"carries float32 sums only; use {self.setting.split('=')[0]}=none")
        return [CommLink(self.comm)]

    def sum(self, shapes: Sequence[torch.Size], names: Sequence[str], contribution: Contribution,
            arrived: Callable[[int], bool], residuals: Callable[[int], Sequence[torch.Tensor]] | None,
            fetch: Callable[[torch.Tensor], torch.Tensor], device: torch.device
            ) -> Steps[list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """A sum phase of one bucket: every island this process plays runs the same steps, in
        lockstep, and all end with the same sums. `arrived(index)`: whether local worker `index`
        arrived; `residuals(head)`: island head `head`'s residual per tensor (error feedback);
        `device`: where the merge computes (the deltas are fetched to), not where they are stored.
        Returns, per tensor, its sum (flat, or a low-rank matrix's P̂ Q'ᵀ) and low rank's basis P̂
        (None for the others)."""
        plan = self.plan(shapes, names)
        self.comm.bytes_sent_per_worker += plan.payload_bytes
        factors = {index: self._factor(name, shape, device)
                   for index, (name, shape) in enumerate(zip(names, shapes))
                   if self.compression.compress == "lowrank" and self.compression.structured(shape, name)}
        links = self._links()
        islands = [Island(contribution(group), any(arrived(index) for index in group),
                          None if residuals is None else residuals(group[0]), fetch, keep_inputs=len(links) == 1)
                   for group in self.groups]
        results = yield from lockstep([island_phase(link, island, plan, self.compression, factors)
                                       for link, island in zip(links, islands)])
        sums = []
        for index, name in enumerate(names):
            total, basis = results[0][index]
            if basis is not None:
                self.factors[name] = total
                total = basis @ total.T
            sums.append((total, basis))
        return sums

    def _factor(self, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Matrix `name`'s warm-start Q: last round's, or the seeded first one, made on `device`."""
        if name not in self.factors:
            # Made on the CPU (the same bits on every device); a blocking copy from pageable
            # memory would make the host wait for the device inside a stage.
            self.factors[name] = initial_factor(name, shape, self.compression.rank, self.seed).to(device,
                                                                                                    non_blocking=True)
        return self.factors[name]

    @property
    def clamped(self) -> dict[str, int]:
        """merge.compress=lowrank: the rank of each matrix merged so far whose smaller side is
        below merge.compress_rank."""
        return {name: factor.shape[1] for name, factor in self.factors.items()
                if factor.shape[1] < self.compression.rank}


def mean_wire_bytes(shapes: Sequence[torch.Size], compression: Compression | None, bucket_bytes: int, islands: int,
                    names: Sequence[str] | None = None, slices: int = 1) -> float:
    """The slow-link bytes one process puts on the link in a merge by the mean of tensors of
    `shapes` (float32, in buckets of `bucket_bytes`; their parameter `names`, for
    merge.compress_exclude) under `compression` (None: float32 sums), over `islands` islands of
    `slices` processes each, averaged over an island's processes: what the metrics'
    `wire_bytes_cross_island` counts. A compressed sum's bytes are its plan's
    (`isoloco.sync.phase.PhasePlan`, the plan the merge runs); float32's are each process's
    all-reduce of its slice of a bucket (`isoloco.torch_comm`), by the cost model
    (`isoloco.sync.cost`)."""
    total = 0.0
    names = list(names) if names is not None else [""] * len(shapes)
    for bucket in buckets([(4 * math.prod(shape), torch.float32) for shape in shapes], bucket_bytes):
        chosen = [shapes[index] for index in bucket]
        if compression is None:
            total += wire_bytes("all_reduce", 4 * -(-sum(math.prod(shape) for shape in chosen) // slices), islands)
        else:
            total += PhasePlan.of(chosen, [names[index] for index in bucket], compression, islands,
                                  slices).wire_bytes()
    return total
