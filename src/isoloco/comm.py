"""Communicators: the only way merge rules see workers other than their own.

A run has R = world_size x K workers: K simulated workers live in each process. Merge
rules receive the K local deltas of one parameter and a communicator, and reach the other
processes' workers only through the collectives below. Writing each rule once against this
interface lets the same code serve the one-process simulator and a `torch.distributed` job,
and lets each rule pick the cheapest collective that is still exact.

Every collective also has a start-now, wait-later form (`sum_async`, `gather_async`,
`shard_map_async`, and the compressed sum's `exchange`, `gather_peers` and `join_island`),
which returns a `Pending` handle (`isoloco.sync.handles`): the sync layer starts a stage's
collectives, lets training run, and waits when it needs the results.

Two kinds of count are kept. `bytes_sent_per_worker` is what a rule hands to its collectives
per worker, the same in every layout. The link counts (`LINK_COUNTS`) are this process's
traffic over each kind of link: the bytes it hands to collectives, the bytes the collectives'
algorithms put on the link for it (`wire_bytes`), and its number of collective calls; the
figures a user with slow links between islands plans with, and zero when every worker lives
in one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from isoloco.sync.handles import Pending


class Communicator(ABC):
    """Collectives over all R workers of a run, seen from one process holding K of them."""

    def __init__(self) -> None:
        #: Bytes one worker sends during the current accounting period (see `reset_bytes`).
        self.bytes_sent_per_worker = 0
        #: This process's traffic in the current period, per link (see `reset_link_bytes`).
        self._links = dict.fromkeys(LINK_COUNTS, 0.0)

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """R: the number of workers in the whole run."""

    @property
    @abstractmethod
    def local_worker_ids(self) -> list[int]:
        """Global indices (0..R-1) of the workers held by this process, in order."""

    @abstractmethod
    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of one tensor over processes; identity with one process."""

    @abstractmethod
    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-gather of equally shaped per-worker tensors, ordered by global worker id."""

    @property
    def islands(self) -> int:
        """P: the islands whose processes exchange over the slow link (1: everything is local)."""
        return 1

    @property
    def island(self) -> int:
        """This process's island, 0..P−1."""
        return 0

    @property
    def played_islands(self) -> int:
        """With every worker in this process (the simulator): the islands it plays, each of
        num_workers / played_islands consecutive workers (`isoloco.sync.slowlink`)."""
        return self.num_workers

    @property
    def island_slices(self) -> tuple[int, int]:
        """(G, j): the island's traffic across islands is split in G slices, and this process
        carries slice j (processes of one island hold the same sums)."""
        return 1, 0

    def sum(self, local_total: torch.Tensor) -> torch.Tensor:
        """Sum over all processes of this process's sum of its workers' tensors (one
        all-reduce); may write into `local_total`."""
        return self.sum_async(local_total).wait()

    def sum_async(self, local_total: torch.Tensor) -> Pending[torch.Tensor]:
        """`sum`, started now and waited for later."""
        self._count(local_total)
        return self._start_sum(local_total)

    def sum_in_order_async(self, build: Callable[[torch.Tensor | None], torch.Tensor | None],
                           zeros: Callable[[], torch.Tensor], started: Callable[[int], bool]) -> Pending[torch.Tensor]:
        """`sum_async` with every worker's term added in global worker order, whatever the
        layout: the bits of one process adding all R terms one after another.

        `build(onto)` adds this process's arrived workers' terms, in order, onto `onto` (None:
        into a new buffer) and returns the result (None when there was nothing to add to);
        `zeros()` is a zero buffer of the sum's size; `started(worker)` says whether any worker
        with a global id below `worker` arrived. This default adds this process's terms, then
        sums across processes as `sum_async` does, which keeps the order when every worker
        lives in this process; `isoloco.torch_comm` passes a running sum from island to island.
        """
        total = build(None)
        return self.sum_async(total if total is not None else zeros())

    def gather(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every worker's tensor, ordered by global worker id (an all-gather).

        Meant for small tensors (low-rank factors); all workers' tensors must share a shape.
        """
        return self.gather_async(local).wait()

    def gather_async(self, local: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        """`gather`, started now and waited for later."""
        self._count(local[0])
        return self._start_gather(local)

    def _start_sum(self, tensor: torch.Tensor) -> Pending[torch.Tensor]:
        return Pending.done(self._sum_across_processes(tensor))

    def _start_gather(self, tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        return Pending.done(self._gather_across_processes(tensors))

    def shard_map(self, fn: Callable[[torch.Tensor], torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`[fn(t) for t in tensors]` for a pure, shape- and dtype-keeping `fn` (e.g. Iso-C's
        orthogonalisation of merged matrices that every process holds).

        With several processes each computes its share of the results and sends them to the
        others, so the time falls with the number of processes; every process must call it
        with the same tensors, in the same order.
        """
        return self.shard_map_async(fn, tensors).wait()

    def shard_map_async(self, fn: Callable[[torch.Tensor], torch.Tensor],
                        tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        """`shard_map`: this process's share computed now, the others' results waited for later."""
        return Pending.done([fn(tensor) for tensor in tensors])

    # The compressed sum's collectives over the peer group (process j of every island); only
    # communicators with several islands have them (`isoloco.sync.compressed`).

    def exchange(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Pending[list[torch.Tensor]]:
        """All-to-all of uint8 blobs: `send`'s part p (of `send_sizes[p]` bytes) goes to island
        p; the result is what each island sent this one, in island order."""
        raise NotImplementedError(f"{type(self).__name__} has one island: nothing to exchange")

    def gather_peers(self, blob: torch.Tensor) -> Pending[list[torch.Tensor]]:
        """All-gather of equally sized uint8 blobs over the islands, in island order."""
        raise NotImplementedError(f"{type(self).__name__} has one island: nothing to gather")

    def join_island(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        """All-gather inside the island of each process's `part` (its slice, padded to the
        island's widest), in slot order."""
        raise NotImplementedError(f"{type(self).__name__} does not split an island's traffic")

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes_sent_per_worker += nbytes(tensor)

    def reset_bytes(self) -> int:
        """Return the bytes per worker counted since the last reset, and start a new period."""
        sent, self.bytes_sent_per_worker = self.bytes_sent_per_worker, 0
        return sent

    def record(self, link: str, handed: int, wire: float, calls: int = 1) -> None:
        """Count `calls` collective calls of this process over `link` ("cross_island": the
        slow link between islands; "in_island": the fast one): `handed` bytes it gave them and
        `wire` bytes they put on that link for it (see `wire_bytes`)."""
        self._links[f"bytes_{link}"] += handed
        self._links[f"wire_bytes_{link}"] += wire
        self._links["collectives"] += calls
        self._links[f"collectives_{link}"] += calls

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives inside the block are left out of every count: they measure, they are no
        part of the merge whose traffic the counts report."""
        saved = self.bytes_sent_per_worker, dict(self._links)
        try:
            yield
        finally:
            self.bytes_sent_per_worker, self._links = saved

    def reset_link_bytes(self) -> torch.Tensor:
        """This process's counts since the last reset, in the order of `LINK_COUNTS`, and
        start a new period. A float64 tensor, so a job can average it over its processes
        with one all-reduce."""
        counts = torch.tensor([self._links[key] for key in LINK_COUNTS], dtype=torch.float64)
        self._links = dict.fromkeys(LINK_COUNTS, 0.0)
        return counts


#: What `Communicator.reset_link_bytes` returns, in order. `bytes_*`: what the process hands
#: to collectives (an all-reduce its tensor, an all-gather its own block, a broadcast its
#: tensor at the source only); `wire_bytes_*`: what the algorithm puts on the link for it
#: (`wire_bytes`); `collectives`: its collective calls, in all and over each link.
LINK_COUNTS = ("bytes_cross_island", "bytes_in_island", "wire_bytes_cross_island", "wire_bytes_in_island",
               "collectives", "collectives_cross_island", "collectives_in_island")


def nbytes(tensor: torch.Tensor) -> int:
    """The size of a tensor's data in bytes."""
    return tensor.numel() * tensor.element_size()


def played_islands(workers: int, islands: int) -> int:
    """The islands the simulator plays with `dist.islands=islands` (0: each worker an island)."""
    return islands or workers


class LocalCommunicator(Communicator):
    """All R workers live in this process: collectives are local reductions."""

    def __init__(self, num_workers: int | None = None, worker_ids: list[int] | None = None,
                 islands: int = 0) -> None:
        """Workers 0..num_workers-1, or exactly the global ids `worker_ids` (e.g. the workers
        left in a round after dropping a diverged one), played as `islands` islands of
        consecutive workers (0: each worker an island of its own)."""
        super().__init__()
        if worker_ids is None:
            if num_workers is None or num_workers < 1:
                raise ValueError(f"num_workers must be >= 1, got {num_workers}")
            worker_ids = list(range(num_workers))
        if not worker_ids:
            raise ValueError("a communicator needs at least one worker")
        self._worker_ids = list(worker_ids)
        if islands and len(worker_ids) % islands:
            raise ValueError(f"{len(worker_ids)} workers do not split into {islands} islands of equal size")
        self._islands = played_islands(len(worker_ids), islands)

    @property
    def num_workers(self) -> int:
        return len(self._worker_ids)

    @property
    def local_worker_ids(self) -> list[int]:
        return list(self._worker_ids)

    @property
    def played_islands(self) -> int:
        return self._islands

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)
