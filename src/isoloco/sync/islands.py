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

The played islands share one fold per collective, and each island's part of the all-to-all
(`scatter_sum`) enters it once, decoded whole, not as P chunks: every island's P parts would be
P² decodes and adds in all, and the simulator's merge would cost O(P²). What every island
computes alike from the same delivered bits (low rank's basis P̂) is computed once (`shared`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

import torch

from isoloco.sync.handles import Pending

if TYPE_CHECKING:
    from isoloco.comm import Communicator

T = TypeVar("T")
#: The decoded parts (one flat float32 tensor per tensor of the bucket) of island `source`'s blob.
Decode = Callable[[int, torch.Tensor], list[torch.Tensor]]
#: Island p's share of the sums of whole tensors (`IslandLink.scatter_sum`).
Cut = Callable[[int, list[torch.Tensor]], list[torch.Tensor]]


class Fold(abc.ABC, Generic[T]):
    """What a collective makes of the blobs the islands sent, taken in island order."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._taken = 0

    def take(self, source: int, blob: torch.Tensor) -> None:
        self.add(source, self._decode(source, blob))

    def add(self, source: int, parts: list[torch.Tensor]) -> None:
        """Island `source`'s part, already decoded."""
        if source != self._taken:
            raise RuntimeError(f"island {source}'s part arrived before island {self._taken}'s: folds run in island "
                               f"order, so that every layout adds in one order")
        self._taken += 1
        self._add(source, parts)

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
    def scatter_sum(self, parts: Callable[[], list[torch.Tensor]], decode: Decode,
                    whole: Callable[[], list[torch.Tensor]], cut: Cut) -> Pending[list[torch.Tensor]]:
        """An all-to-all of uint8 blobs, summed: `parts()[p]` goes to island p, which adds what
        every island sent it, decoded by `decode` (its own chunk), in island order (`SumFold`).
        `whole()` is this island's parts already decoded, each tensor's laid end to end (the bits
        `decode` gives each part), and `cut(p, sums)` island p's share of such whole tensors:
        played islands add wholes, and never encode the parts."""

    @abc.abstractmethod
    def shared(self, make: Callable[[], T]) -> T:
        """`make()`, which every island computes alike from what its collectives delivered
        (called at the same point of every island's steps)."""

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

    def scatter_sum(self, parts: Callable[[], list[torch.Tensor]], decode: Decode,
                    whole: Callable[[], list[torch.Tensor]], cut: Cut) -> Pending[list[torch.Tensor]]:
        blobs = parts()
        # What every island sends here is as large as what this island keeps for itself.
        own = blobs[self.island].numel()
        handle = self._comm.exchange(torch.cat(blobs), [blob.numel() for blob in blobs], [own] * self.islands)
        return Pending([handle], lambda: folded(SumFold(decode), handle.wait()))

    def shared(self, make: Callable[[], T]) -> T:
        return make()

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

    The islands post their k-th collective in island order into one fold, which each part
    enters as it is posted; every island's handle gives its share of the fold's result once all
    P have posted."""

    def __init__(self, islands: int) -> None:
        self.links = [_PlayedLink(self, island, islands) for island in range(islands)]
        self._posted = [0] * islands  # collectives each island has posted
        self._open: dict[int, Any] = {}  # the k-th collective's fold while islands post it
        self._asked = [0] * islands  # `shared` values each island has asked for
        self._kept: dict[int, Any] = {}  # the k-th shared value while islands ask for it

    def _post(self, island: int, make: Callable[[], Fold[T]], feed: Callable[[Fold[T]], None],
              share: Callable[[T], T]) -> Pending[T]:
        """Island `island` posts its next collective: `make` builds the collective's fold (the
        first island's call), `feed` hands it this island's part; the handle gives `share` of
        the fold's result."""
        count, fold = self._joint(self._posted, self._open, island, make)
        feed(fold)
        return Pending([_Complete(self, count)], lambda: share(fold.result()))

    def _shared(self, island: int, make: Callable[[], T]) -> T:
        return self._joint(self._asked, self._kept, island, make)[1]

    def _joint(self, calls: list[int], kept: dict[int, Any], island: int, make: Callable[[], T]) -> tuple[int, T]:
        """(k, the k-th object of such calls), for island `island`'s k-th call (`calls` counts
        each island's): the first island's call makes it, the last island's lets it go."""
        count, calls[island] = calls[island], calls[island] + 1
        if count not in kept:
            kept[count] = make()
        value = kept[count]
        if island == len(calls) - 1:
            del kept[count]
        return count, value


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

    def scatter_sum(self, parts: Callable[[], list[torch.Tensor]], decode: Decode,
                    whole: Callable[[], list[torch.Tensor]], cut: Cut) -> Pending[list[torch.Tensor]]:
        return self._played._post(self.island, lambda: SumFold(decode), lambda fold: fold.add(self.island, whole()),
                                  lambda sums: cut(self.island, sums))

    def gather(self, blob: torch.Tensor, fold: Fold[T]) -> Pending[T]:
        return self._played._post(self.island, lambda: fold, lambda first: first.take(self.island, blob),
                                  lambda result: result)

    def shared(self, make: Callable[[], T]) -> T:
        return self._played._shared(self.island, make)

    def join(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        return Pending.done([part])  # a played island is one process
