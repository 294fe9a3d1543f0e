"""A sum that crosses the slow link compressed, with bytes per process flat in R and P.

Each *island* (the workers one process group holds; in the one-process simulator, each worker)
first adds up its workers' contributions in float32, plus its error-feedback residual, so
nothing per worker crosses the link. Then one of two routes, chosen by `choose_route` from the
number of islands P with the one cost model (`isoloco.sync.cost`):

* ``exchange`` (P ≥ 3): every island cuts its sum into P chunks of whole scale groups and
  sends chunk p, encoded, to island p (an all-to-all); island p decodes the P copies of its
  chunk, adds them in island order, re-encodes the sum and sends it to every island (an
  all-gather). About 2·(P−1)/P·w bytes per entry and process, w the format's bytes per entry:
  float32's ring all-reduce with w = 4, whatever P and R. This is the ring of Prime Intellect's
  and PCCL's quantised all-reduce and of torchft's `allreduce_quantized`.
* ``gather`` (P ≤ 2): every island's encoded sum goes to every island (an all-gather), which
  decodes and adds them in island order. (P−1)·w bytes per entry: no more than the exchange
  at P = 2, in one collective instead of two, with one rounding instead of two.

Either way every island ends with the same bits, and they do not depend on how the chunks are
cut (every step works on whole scale groups):

    exchange: deq(q(Σ_i deq(q(x_i))))        gather: Σ_i deq(q(x_i))        (sums in island order)

so a run gives the same numbers whatever the number of processes per island G, and the
simulator, which plays every island in one process through these same steps
(`isoloco.sync.islands.PlayedIslands`), gives a distributed run's bits. The number of islands,
not of workers that arrived, picks the route. Runs with other island counts differ by at most
the rounding bound: Σ_i s_i/2 (+ s_r/2 for the exchange), s the scale of an entry's group in
each wire (`isoloco.sync.codec.error_bound`). With G > 1 processes per island, process j of an
island carries its slice j of the chunks (the island's processes hold the same sum) and the
island all-gathers the decoded slices over its fast link.

Each tensor is encoded once and its wire sliced into chunks (`Wire.slice`), and nothing here
reads a tensor on the host, so a stage can overlap training on a GPU's side stream.

Error feedback (`island_sum`'s `keep` and `Rounding`): the island keeps x_i − deq(q(x_i)) and
adds it to its next sum, and on the ``exchange`` route the owner of chunk p keeps what its
re-encoding of the total lost there (every process of the island learns it when the island
joins its slices), so no rounding is lost for good (`isoloco.sync.phase`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from isoloco.sync.codec import Quantization, Wire, aligned, dequantize, pad_aligned, quantize, shard_ranges, wire_nbytes
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Pending, Steps
from isoloco.sync.islands import IslandLink, PlaceFold, SumFold

ROUTES = ("gather", "exchange")


def choose_route(islands: int) -> str:
    """``gather`` where an all-gather of every island's codes puts no more bytes on the link
    than the exchange's all-to-all and all-gather (P ≤ 2), else ``exchange``. The format
    scales both alike, and R does not enter: islands combine their workers first."""
    gather = wire_bytes("all_gather", 1.0, islands)
    exchange = wire_bytes("all_to_all", (islands - 1) / islands, islands) + wire_bytes("all_gather", 1 / islands,
                                                                                         islands)
    return "gather" if gather <= exchange else "exchange"


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The plan of one compressed sum of a bucket's tensors: how they are cut into P·G chunks of
    whole scale groups (chunk j·P + p of every tensor is what process j of each island sends to
    island p), the collectives that carry them, one per stage, and the bytes those put on the
    link. `island_sum` runs it; stage counts and byte counts are read from it alone."""

    numels: tuple[int, ...]
    groups: tuple[int, ...]  # entries per scale of each tensor
    quantization: Quantization
    islands: int  # P
    slices: int  # G: processes per island that split its traffic

    @classmethod
    def of(cls, shapes: Sequence[torch.Size], quantization: Quantization, islands: int, slices: int) -> ChunkPlan:
        return cls(tuple(math.prod(s) for s in shapes), tuple(quantization.group_size(s) for s in shapes),
                   quantization, islands, slices)

    @property
    def route(self) -> str:
        return choose_route(self.islands)

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives of the sum, one per stage: the route's across islands (the
        exchange's all-to-all, then the owners' all-gather), then with G > 1 the island's
        all-gather of its slices (`join_slices`)."""
        across = ("all_gather",) if self.route == "gather" else ("all_to_all", "all_gather")
        return across + (("island all_gather",) if self.slices > 1 else ())

    @property
    def stages(self) -> int:
        return len(self.collectives)

    # Computed once per plan, which every island shares: each island reads every chunk's range
    # and size, so computing them per call costs O(P²) per island.
    @functools.cached_property
    def _ranges(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        return tuple(tuple(shard_ranges(numel, group, self.islands * self.slices))
                     for numel, group in zip(self.numels, self.groups))

    @functools.cached_property
    def _blob_sizes(self) -> tuple[int, ...]:
        return tuple(sum(aligned(wire_nbytes(stop - start, self.quantization, group))
                         for group, ranges in zip(self.groups, self._ranges) for start, stop in [ranges[chunk]])
                     for chunk in range(self.islands * self.slices))

    def ranges(self, tensor: int) -> tuple[tuple[int, int], ...]:
        """Entry ranges of the P·G chunks of tensor `tensor`."""
        return self._ranges[tensor]

    def length(self, tensor: int, chunk: int) -> int:
        """Entries of chunk `chunk` of tensor `tensor`."""
        start, stop = self.ranges(tensor)[chunk]
        return stop - start

    def span(self, tensor: int, first: int, count: int) -> tuple[int, int]:
        """The entry range of chunks first .. first + count − 1 of `tensor` (they are consecutive)."""
        return self.ranges(tensor)[first][0], self.ranges(tensor)[first + count - 1][1]

    def blob_size(self, chunk: int) -> int:
        """Bytes of chunk `chunk` of every tensor, encoded and laid end to end."""
        return self._blob_sizes[chunk]

    def places(self, slot: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per island p and tensor, the entry range of chunk slot·P + p within the run of process
        `slot`'s chunks (where the owners' all-gather writes it)."""
        return self._places[slot]

    @functools.cached_property
    def _places(self) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
        def of(first: int) -> tuple[tuple[tuple[int, int], ...], ...]:
            starts = [ranges[first][0] for ranges in self._ranges]
            return tuple(tuple((ranges[first + p][0] - start, ranges[first + p][1] - start)
                               for ranges, start in zip(self._ranges, starts)) for p in range(self.islands))

        return tuple(of(slot * self.islands) for slot in range(self.slices))

    @property
    def payload_bytes(self) -> int:
        """Bytes of every tensor's wire, whole: what an island hands to the sum, before the
        route's fan-out (the same in every layout)."""
        return sum(wire_nbytes(numel, self.quantization, group) for numel, group in zip(self.numels, self.groups))

    def sent_bytes(self, slot: int) -> dict[str, float]:
        """Wire bytes process `slot` of an island puts on the slow link per collective kind,
        averaged over the islands (each keeps its own chunk of the all-to-all)."""
        first = slot * self.islands
        sizes = [self.blob_size(first + p) for p in range(self.islands)]
        if self.route == "gather":
            return {"all_gather": wire_bytes("all_gather", sum(sizes), self.islands)}
        return {"all_to_all": wire_bytes("all_to_all", sum(sizes) - sum(sizes) / self.islands, self.islands),
                "all_gather": wire_bytes("all_gather", max(sizes), self.islands)}

    def wire_bytes(self) -> float:
        """The slow-link bytes of the sum, averaged over the processes of an island: what the
        metrics' `wire_bytes_cross_island` counts."""
        return sum(sum(self.sent_bytes(slot).values()) for slot in range(self.slices)) / self.slices


@dataclasses.dataclass(frozen=True)
class Rounding:
    """What the owner's re-encoding of chunk [start, stop) of tensor `tensor` lost (``exchange``):
    with error feedback the owner's island keeps it, so nothing is lost for good."""

    tensor: int
    start: int
    stop: int
    error: torch.Tensor


#: Receives tensor t's decoded wire (what this island's encode delivered), right after encoding it.
Keep = Callable[[int, torch.Tensor], None]


def island_sum(link: IslandLink, plan: ChunkPlan, inputs: Callable[[], list[torch.Tensor]],
               keep: Keep | None = None, feedback: bool = False) -> Steps[tuple[list[torch.Tensor], list[Rounding]]]:
    """One island's steps of the compressed sum of a bucket's tensors over every island.

    `inputs()` (called once, in the first stage) gives this island's flat float32 tensors; each
    is encoded once, and `keep` sees what its encode delivered (error feedback). Returns every
    tensor's sum, flat, and, with `feedback` on the ``exchange`` route, the owner roundings this
    island keeps (for every process of the island, whichever of them owned the chunk)."""
    route = plan.route
    handle = _post_encoded(link, plan, route, inputs, keep)
    yield [handle]
    mine, rounding = handle.wait(), None
    if route == "exchange":
        handle, rounding = _post_reencoded(link, plan, mine, feedback)
        yield [handle]
        mine = handle.wait()
    slices, slot = link.slices
    owned = [link.island + s * link.islands for s in range(slices)]
    lengths = [[_entries(plan.span(t, s * link.islands, link.islands)) for t in range(len(plan.numels))]
               + ([plan.length(t, owned[s]) for t in range(len(plan.numels))] if rounding is not None else [])
               for s in range(slices)]
    joined = yield from join_slices(link, mine + (rounding or []), lengths)
    count = len(plan.numels)
    sums = [concat(parts) for parts in zip(*(pieces[:count] for pieces in joined))]
    roundings = [Rounding(t, *plan.ranges(t)[owned[s]], pieces[count + t])
                 for s, pieces in enumerate(joined) if rounding is not None for t in range(count)]
    return sums, roundings


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`parts` joined end to end; a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def _entries(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _post_encoded(link: IslandLink, plan: ChunkPlan, route: str, inputs: Callable[[], list[torch.Tensor]],
                  keep: Keep | None) -> Pending:
    """Encode each input once and post this process's P chunks of its wire."""
    islands, slot = link.islands, link.slices[1]
    first = slot * islands
    wires = []
    for tensor, flat in enumerate(inputs()):
        wires.append(quantize(flat, plan.quantization, plan.groups[tensor], check=False))
        if keep is not None:
            keep(tensor, dequantize(wires[-1]))

    def parts() -> list[torch.Tensor]:
        """Island p's blob: chunk first + p of every wire, laid end to end."""
        return [torch.cat([pad_aligned(wire.slice(*plan.ranges(tensor)[first + p]).as_bytes())
                           for tensor, wire in enumerate(wires)]) for p in range(islands)]

    if route == "gather":
        return link.gather(torch.cat(parts()), SumFold(lambda source, blob: _decode_run(plan, first, islands, blob)))

    def whole() -> list[torch.Tensor]:
        # A chunk's decode is its entries' codes times their group's scale, and chunks hold
        # whole groups: slicing the decoded wire gives the bits of decoding each chunk.
        return [dequantize(wire).reshape(-1)[slice(*plan.span(tensor, first, islands))]
                for tensor, wire in enumerate(wires)]

    def cut(p: int, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        return [total[start:stop] for total, (start, stop) in zip(sums, plan.places(slot)[p])]

    return link.scatter_sum(parts, lambda source, blob: _decode(plan, first + link.island, blob), whole, cut)


def _post_reencoded(link: IslandLink, plan: ChunkPlan, totals: list[torch.Tensor],
                    feedback: bool) -> tuple[Pending, list[torch.Tensor] | None]:
    """The owner's step: encode the island total of its chunk again and post it to every
    island; with `feedback`, also what that rounding lost."""
    islands, slot = link.islands, link.slices[1]
    first = slot * islands
    wires = [quantize(total, plan.quantization, group, check=False) for total, group in zip(totals, plan.groups)]
    blob = torch.cat([pad_aligned(wire.as_bytes()) for wire in wires])
    sizes = [plan.blob_size(first + p) for p in range(islands)]
    blob = F.pad(blob, (0, max(sizes) - blob.numel()))
    rounding = [total.sub_(dequantize(wire)) for total, wire in zip(totals, wires)] if feedback else None
    fold = PlaceFold(lambda source, raw: _decode(plan, first + source, raw[:sizes[source]]),
                     [_entries(plan.span(t, first, islands)) for t in range(len(plan.numels))], plan.places(slot))
    return link.gather(blob, fold), rounding


def join_slices(link: IslandLink, mine: list[torch.Tensor], lengths: list[list[int]]) -> Steps[list[list[torch.Tensor]]]:
    """Every slot's flat tensors, from the slices the processes of an island carried: `mine` is
    this process's, `lengths[s][t]` slot s's length of tensor t. One all-gather inside the
    island (over its fast link); nothing to join with one process per island."""
    if len(lengths) == 1:
        return [mine]
    joined = torch.cat(mine)
    handle = link.join(F.pad(joined, (0, max(map(sum, lengths)) - joined.numel())))
    yield [handle]
    slots = handle.wait()
    return [list(torch.split(slots[s][:sum(lengths[s])], lengths[s])) for s in range(len(lengths))]


def _decode_run(plan: ChunkPlan, first: int, count: int, blob: torch.Tensor) -> list[torch.Tensor]:
    """Chunks first .. first + count − 1 of every tensor, decoded from their blobs laid end to
    end, each tensor's chunks joined."""
    chunks = torch.split(blob, [plan.blob_size(first + p) for p in range(count)])
    decoded = [_decode(plan, first + p, chunk) for p, chunk in enumerate(chunks)]
    return [torch.cat(parts) for parts in zip(*decoded)]


def _decode(plan: ChunkPlan, chunk: int, blob: torch.Tensor) -> list[torch.Tensor]:
    """Chunk `chunk` of every tensor, decoded from its blob."""
    decoded, offset = [], 0
    for tensor, group in enumerate(plan.groups):
        start, stop = plan.ranges(tensor)[chunk]
        size = wire_nbytes(stop - start, plan.quantization, group)
        wire = Wire.from_bytes(blob[offset:offset + size], plan.quantization, (stop - start,), group)
        decoded.append(dequantize(wire))
        offset += aligned(size)
    return decoded
