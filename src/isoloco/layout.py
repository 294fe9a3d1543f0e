"""Where the workers of a multi-process run live: islands of processes (pure arithmetic).

A run of R DiLoCo workers launched by torchrun on W processes groups the processes into
W/G *islands* of G consecutive ranks (G = `dist.gpus_per_worker`). Island i holds the
K = R·G/W workers [i·K, (i+1)·K), trained one after another as in the one-process
trainer. The G processes of an island are data parallel: each takes 1/G of every worker's
micro-batch and they average gradients every inner step, so one worker spans G GPUs.
Islands talk only at synchronisations: process j of every island merges slice j of every
tensor with process j of every other island (its *peer group* of W/G processes), and the
island all-gathers its G slices, so one copy per island crosses the slow link
(`isoloco.torch_comm`). Consecutive ranks form an island so that with G = GPUs per node an
island is a node, and only the merge crosses the network.
The data-parallel baseline is one island of all W processes holding its single model.

Every worker keeps its global id (0..R-1), so it reads the same batches and draws the same
DARE masks in every layout: 2 processes x 2 workers train exactly what 1 x 4 trains.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from isoloco.errors import ConfigError

if TYPE_CHECKING:
    from isoloco.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Which workers and which share of their batch one process holds (pure arithmetic)."""

    world_size: int
    rank: int
    group_size: int  # processes per island: G for DiLoCo, all of them for data parallel
    workers: int  # R (1 for data parallel)

    @classmethod
    def for_run(cls, cfg: TrainConfig, world_size: int, rank: int) -> ProcessLayout:
        """The layout of `cfg` on `world_size` processes; a ConfigError says what to change."""
        workers, batch = cfg.num_workers, cfg.global_batch
        if cfg.algorithm == "dp":
            group = world_size
            if batch % world_size:
                raise ConfigError(
                    f"global_batch={batch} does not split over the {world_size} processes of this data-parallel "
                    f"run; set global_batch to a multiple of {world_size}")
        else:
            group = cfg.dist.gpus_per_worker
            if world_size % group:
                raise ConfigError(
                    f"dist.gpus_per_worker={group} does not divide the {world_size} processes of this run: each "
                    f"worker is {group} processes; launch a multiple of {group} processes (isoloco launch --nproc "
                    f"N) or change gpus_per_worker")
            islands = world_size // group
            if workers % islands:
                raise ConfigError(
                    f"workers={workers} cannot be spread over the {islands} worker groups ({world_size} processes "
                    f"/ gpus_per_worker {group}): every group holds the same number of workers; set workers to a "
                    f"multiple of {islands}")
            if world_size > 1 and cfg.dist.islands not in (0, islands):
                raise ConfigError(
                    f"dist.islands={cfg.dist.islands} does not match this job's {islands} islands ({world_size} "
                    f"processes / gpus_per_worker {group}): a job's islands are its processes; launch "
                    f"{cfg.dist.islands * group} processes (isoloco launch --nproc {cfg.dist.islands * group}) or "
                    f"drop dist.islands")
            if (batch // workers) % group:
                raise ConfigError(
                    f"global_batch={batch} gives each of the {workers} workers {batch // workers} sequences per "
                    f"step, which its {group} processes cannot split evenly; set global_batch to a multiple of "
                    f"{workers * group}")
        layout = cls(world_size, rank, group, workers)
        cfg.check_micro_batch(layout.rows_per_process(batch), "each process")
        return layout

    @property
    def islands(self) -> int:
        return self.world_size // self.group_size

    @property
    def island(self) -> int:
        return self.rank // self.group_size

    @property
    def island_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def workers_per_island(self) -> int:
        return self.workers // self.islands

    @property
    def local_worker_ids(self) -> list[int]:
        first = self.island * self.workers_per_island
        return list(range(first, first + self.workers_per_island))

    def island_ranks(self, island: int) -> list[int]:
        return list(range(island * self.group_size, (island + 1) * self.group_size))

    def peer_ranks(self, island_rank: int) -> list[int]:
        """Process `island_rank` of every island, ordered by island: the group that merges."""
        return [island * self.group_size + island_rank for island in range(self.islands)]

    def rows_per_process(self, global_batch: int) -> int:
        return global_batch // self.workers // self.group_size

    def describe(self) -> dict[str, int]:
        """What a checkpoint records: resuming needs the same."""
        return {"workers": self.workers, "processes": self.world_size, "processes_per_worker": self.group_size}

    @staticmethod
    def in_words(described: dict[str, int] | None) -> str:
        """A layout as `describe` records it, said for a message: "4 workers on 2 processes, 2
        workers per process", or "2 workers on 4 processes, 2 processes per worker" (None: a
        checkpoint that recorded none)."""
        if not described:
            return "an unrecorded layout"

        def count(n: int, noun: str) -> str:
            return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"

        workers, processes, split = (described[key] for key in ("workers", "processes", "processes_per_worker"))
        share = (f"{count(split, 'process')} per worker" if split > 1
                 else f"{count(workers // processes, 'worker')} per process")
        return f"{count(workers, 'worker')} on {count(processes, 'process')}, {share}"
