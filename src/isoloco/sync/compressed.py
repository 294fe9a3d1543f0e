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
    """How the tensors of one bucket are cut into P·G chunks of whole scale groups: chunk
    j·P + p of every tensor is what process j of each island sends to island p."""

    numels: tuple[int, ...]
    groups: tuple[int, ...]  # entries per scale of each tensor
    quantization: Quantization
    islands: int  # P
    slices: int  # G: processes per island that split its traffic

    @classmethod
    def of(cls, shapes: Sequence[torch.Size], quantization: Quantization, islands: int, slices: int) -> ChunkPlan:
        return cls(tuple(math.prod(s) for s in shapes), tuple(quantization.group_size(s) for s in shapes),
                   quantization, islands, slices)

    def ranges(self, tensor: int) -> list[tuple[int, int]]:
        """Entry ranges of the P·G chunks of tensor `tensor`."""
        return shard_ranges(self.numels[tensor], self.groups[tensor], self.islands * self.slices)

    def length(self, tensor: int, chunk: int) -> int:
        """Entries of chunk `chunk` of tensor `tensor`."""
        start, stop = self.ranges(tensor)[chunk]
        return stop - start

    def blob_size(self, chunk: int) -> int:
        """Bytes of chunk `chunk` of every tensor, encoded and laid end to end."""
        return sum(aligned(wire_nbytes(stop - start, self.quantization, group))
                   for tensor, group in enumerate(self.groups)
                   for start, stop in [self.ranges(tensor)[chunk]])

    def sent_bytes(self, route: str, slot: int) -> dict[str, float]:
        """Wire bytes process `slot` of an island puts on the slow link per collective kind,
        averaged over the islands (each keeps its own chunk of the all-to-all)."""
        first = slot * self.islands
        sizes = [self.blob_size(first + p) for p in range(self.islands)]
        if route == "gather":
            return {"all_gather": wire_bytes("all_gather", sum(sizes), self.islands)}
        return {"all_to_all": wire_bytes("all_to_all", sum(sizes) - sum(sizes) / self.islands, self.islands),
                "all_gather": wire_bytes("all_gather", max(sizes), self.islands)}


def wire_bytes_per_process(shapes: Sequence[torch.Size], quantization: Quantization, islands: int,
                           slices: int = 1) -> float:
    """The slow-link bytes of one compressed sum of tensors of `shapes` (one bucket), averaged
    over the processes of an island: what the metrics' `wire_bytes_cross_island` counts."""
    plan = ChunkPlan.of(shapes, quantization, islands, slices)
    route = choose_route(islands)
    return sum(sum(plan.sent_bytes(route, slot).values()) for slot in range(slices)) / slices



def sum_stages(islands: int, slices: int) -> int:
    """The stages (yields) of one compressed sum: one collective on the ``gather`` route, two on
    the ``exchange`` route, and one more to join an island's slices (G > 1)."""
    return (1 if choose_route(islands) == "gather" else 2) + (slices > 1)


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
    route = choose_route(link.islands)
    handle = _post_encoded(link, plan, route, inputs, keep)
    yield [handle]
    mine, rounding = handle.wait(), None
    if route == "exchange":
        handle, rounding = _post_reencoded(link, plan, mine, feedback)
        yield [handle]
        mine = handle.wait()
    slices, slot = link.slices
    owned = [link.island + s * link.islands for s in range(slices)]
    lengths = [[_span(plan, t, s * link.islands, link.islands) for t in range(len(plan.numels))]
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


def _span(plan: ChunkPlan, tensor: int, first: int, count: int) -> int:
    """Entries of chunks first .. first + count − 1 of `tensor` (they are consecutive)."""
    return plan.ranges(tensor)[first + count - 1][1] - plan.ranges(tensor)[first][0]


def _post_encoded(link: IslandLink, plan: ChunkPlan, route: str, inputs: Callable[[], list[torch.Tensor]],
                  keep: Keep | None) -> Pending:
    """Encode each input once, slice its wire into this process's P chunks, post them."""
    first = link.slices[1] * link.islands
    parts: list[list[torch.Tensor]] = [[] for _ in range(link.islands)]
    for tensor, flat in enumerate(inputs()):
        wire = quantize(flat, plan.quantization, plan.groups[tensor], check=False)
        if keep is not None:
            keep(tensor, dequantize(wire))
        for p, (start, stop) in enumerate(plan.ranges(tensor)[first:first + link.islands]):
            parts[p].append(pad_aligned(wire.slice(start, stop).as_bytes()))
    blobs = [torch.cat(chunk) for chunk in parts]
    if route == "gather":
        return link.gather(torch.cat(blobs), SumFold(lambda source, blob: _decode_run(plan, first, link.islands, blob)))
    return link.scatter(blobs, lambda p: SumFold(lambda source, blob: _decode(plan, first + p, blob)))


def _post_reencoded(link: IslandLink, plan: ChunkPlan, totals: list[torch.Tensor],
                    feedback: bool) -> tuple[Pending, list[torch.Tensor] | None]:
    """The owner's step: encode the island total of its chunk again and post it to every
    island; with `feedback`, also what that rounding lost."""
    islands, first = link.islands, link.slices[1] * link.islands
    wires = [quantize(total, plan.quantization, group, check=False) for total, group in zip(totals, plan.groups)]
    blob = torch.cat([pad_aligned(wire.as_bytes()) for wire in wires])
    sizes = [plan.blob_size(first + p) for p in range(islands)]
    blob = F.pad(blob, (0, max(sizes) - blob.numel()))
    rounding = [total.sub_(dequantize(wire)) for total, wire in zip(totals, wires)] if feedback else None
    counts = range(len(plan.numels))
    base = [plan.ranges(t)[first][0] for t in counts]
    places = [[(plan.ranges(t)[first + p][0] - base[t], plan.ranges(t)[first + p][1] - base[t]) for t in counts]
              for p in range(islands)]
    fold = PlaceFold(lambda source, raw: _decode(plan, first + source, raw[:sizes[source]]),
                     [_span(plan, t, first, islands) for t in counts], places)
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
