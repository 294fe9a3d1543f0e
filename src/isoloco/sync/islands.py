"""Islands and the collectives between them, the same for processes and for the simulator.

A compressed sum (`isoloco.sync.compressed`, `lowrank`, `topk`) is written once, as the steps
of *one island*: what it encodes, which collective it posts, what it does with the answer. An
`IslandLink` is how an island posts its collectives:

* `CommLink`: a process of a distributed run, over its `Communicator` (the all-to-all and the
  all-gathers of `isoloco.torch_comm`'s peer group, and the all-gather inside the island);
* `PlayedIslands`: every island of a run played in this one process, the simulator's
  islands. Each island's steps run in turn (`isoloco.sync.handles.lockstep`, island order),
  so a collective is complete once the last island has posted it.

Every collective *folds* what arrives from the islands in island order (`Fold`): a sum of the
decoded copies (`SumFold`), or each island's decoded chunk written at its place (`PlaceFold`).
A process folds what its collective received; the played islands fold each island's part the
moment it is posted, so the simulator never holds one encoded copy per island, and memory stays
flat in R. Both run the same `Fold`, on the same bytes, in the same order: the same bits.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, Generic, Sequence, TypeVar

import torch

from isoloco.sync.handles import Pending

if TYPE_CHECKING:
    from isoloco.comm import Communicator

T = TypeVar("T")
#: The decoded parts (one flat float32 tensor per tensor of the bucket) of island `source`'s blob.
Decode = Callable[[int, torch.Tensor], list[torch.Tensor]]


class Fold(abc.ABC, Generic[T]):
    """What a collective makes of the blobs the islands sent, taken in island order."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._taken = 0

    def take(self, source: int, blob: torch.Tensor) -> None:
        if source != self._taken:
            raise RuntimeError(f"island {source}'s part arrived before island {self._taken}'s: folds run in island "
                               f"order, so that every layout adds in one order")
        self._taken += 1
        self._add(source, self._decode(source, blob))

    @abc.abstractmethod
    def _add(self, source: int, parts: list[torch.Tensor]) -> None: ...

    @abc.abstractmethod
    def result(self) -> T: ...


class SumFold(Fold[list[torch.Tensor]]):
    """Per tensor, the sum of every island's decoded part, added in island order."""

    def __init__(self, decode: Decode) -> None:
        super().__init__(decode)
        self._total: list[torch.Tensor] | None = None

    def _add(self, source: int, parts: list[torch.Tensor]) -> None:
        if self._total is None:
            self._total = parts
        else:
            for total, part in zip(self._total, parts):
                total.add_(part)

    def result(self) -> list[torch.Tensor]:
        assert self._total is not None, "a fold needs every island's part"
        return self._total


class PlaceFold(Fold[list[torch.Tensor]]):
    """Per tensor, island i's decoded part written at `places[i][t]` = (start, stop) of a flat
    tensor of `lengths[t]` entries."""

    def __init__(self, decode: Decode, lengths: Sequence[int], places: Sequence[Sequence[tuple[int, int]]]) -> None:
        super().__init__(decode)
        self._lengths, self._places = list(lengths), places
        self._out: list[torch.Tensor] | None = None

    def _add(self, source: int, parts: list[torch.Tensor]) -> None:
        if self._out is None:
            self._out = [torch.empty(length, dtype=part.dtype, device=part.device)
                         for length, part in zip(self._lengths, parts)]
        for out, part, (start, stop) in zip(self._out, parts, self._places[source]):
            out[start:stop].copy_(part)

    def result(self) -> list[torch.Tensor]:
        assert self._out is not None, "a fold needs every island's part"
        return self._out


class IslandLink(abc.ABC):
    """One island's view of the islands: who it is, and the collectives it posts."""

    #: P: the islands of the run.
    islands: int
    #: This island, 0..P−1.
    island: int
    #: (G, j): the island's cross-island traffic is split in G slices; this process carries slice j.
    slices: tuple[int, int]

    @abc.abstractmethod
    def scatter(self, parts: list[torch.Tensor], fold_for: Callable[[int], Fold[T]]) -> Pending[T]:
        """An all-to-all of uint8 blobs: `parts[p]` goes to island p, and island p folds what
        every island sent it with `fold_for(p)` (the same for every island's call)."""

    @abc.abstractmethod
    def gather(self, blob: torch.Tensor, fold: Fold[T]) -> Pending[T]:
        """An all-gather of equally sized uint8 blobs, folded in island order by `fold` (the
        same on every island)."""

    @abc.abstractmethod
    def join(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        """An all-gather inside the island of each process's `part` (equal sizes), in slot order."""


class CommLink(IslandLink):
    """The island of this process, over its communicator."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.islands, self.island, self.slices = comm.islands, comm.island, comm.island_slices

    def scatter(self, parts: list[torch.Tensor], fold_for: Callable[[int], Fold[T]]) -> Pending[T]:
        # What every island sends here is as large as what this island keeps for itself.
        own = parts[self.island].numel()
        handle = self._comm.exchange(torch.cat(parts), [part.numel() for part in parts], [own] * self.islands)
        return Pending([handle], lambda: folded(fold_for(self.island), handle.wait()))

    def gather(self, blob: torch.Tensor, fold: Fold[T]) -> Pending[T]:
        handle = self._comm.gather_peers(blob)
        return Pending([handle], lambda: folded(fold, handle.wait()))

    def join(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        return self._comm.join_island(part)


def folded(fold: Fold[T], blobs: Sequence[torch.Tensor]) -> T:
    """`fold`'s result over `blobs`, island i's blob at index i."""
    for source, blob in enumerate(blobs):
        fold.take(source, blob)
    return fold.result()


class PlayedIslands:
    """P islands of one process each, played in this process: `links[i]` is island i's.

    The islands post their k-th collective in island order; each part is folded as it is
    posted, and every island's handle gives the fold's result once all P have posted."""

    def __init__(self, islands: int) -> None:
        self.links = [_PlayedLink(self, island, islands) for island in range(islands)]
        self._posted = [0] * islands  # collectives each island has posted
        self._open: dict[int, list] = {}  # the k-th collective's folds while islands post it

    def _post(self, island: int, make: Callable[[], list[Fold]], feed: Callable[[list[Fold]], None],
              own: int) -> Pending:
        """Island `island` posts its next collective: `make` builds the collective's folds (the
        first island's call), `feed` hands them this island's part; the handle gives fold `own`."""
        count, self._posted[island] = self._posted[island], self._posted[island] + 1
        folds = self._open.setdefault(count, make())
        feed(folds)
        if island == len(self._posted) - 1:
            del self._open[count]
        return Pending([_Complete(self, count)], folds[own].result)


class _Complete:
    """A played collective's `Work`: waiting for it before every island has posted is a bug."""

    def __init__(self, played: PlayedIslands, count: int) -> None:
        self._played, self._count = played, count

    def wait(self) -> None:
        if min(self._played._posted) <= self._count:
            raise RuntimeError("a played island waited for a collective that not every island has posted")


class _PlayedLink(IslandLink):
    def __init__(self, played: PlayedIslands, island: int, islands: int) -> None:
        self._played = played
        self.islands, self.island, self.slices = islands, island, (1, 0)

    def scatter(self, parts: list[torch.Tensor], fold_for: Callable[[int], Fold[T]]) -> Pending[T]:
        def feed(folds: list[Fold]) -> None:
            for fold, part in zip(folds, parts):
                fold.take(self.island, part)

        return self._played._post(self.island, lambda: [fold_for(p) for p in range(self.islands)], feed,
                                  self.island)

    def gather(self, blob: torch.Tensor, fold: Fold[T]) -> Pending[T]:
        return self._played._post(self.island, lambda: [fold], lambda folds: folds[0].take(self.island, blob), 0)

    def join(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        return Pending.done([part])  # a played island is one process
