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

so a run gives the same numbers whatever the number of processes per island G, and
`reference_sum` computes them in one process. Runs with other island counts differ by at most
the rounding bound: Σ_i s_i/2 (+ s_r/2 for the exchange), s the scale of an entry's group in
each wire (`isoloco.sync.codec.error_bound`). With G > 1 processes per island, process j of an
island carries its slice j of the chunks (the island's processes hold the same sum) and the
island all-gathers the decoded slices over its fast link.

Error feedback: the island keeps x_i − deq(q(x_i)) and adds it to its next sum; the owner's
re-encoding of the total (``exchange``) has no residual of its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from isoloco.sync.codec import Quantization, Wire, aligned, dequantize, pad_aligned, quantize, shard_ranges, wire_nbytes
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Steps

if TYPE_CHECKING:
    from isoloco.comm import Communicator

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


def reference_sum(inputs: Sequence[torch.Tensor], quantization: Quantization, route: str,
                  residuals: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The compressed sum of one tensor over islands, in one process: `inputs[i]` is island
    i's float32 sum. With `residuals` (one per island) each island sends x_i + e_i and e_i is
    updated in place to what that lost. What every island of a distributed run ends with."""
    total = None
    for index, x in enumerate(inputs):
        if residuals is not None:
            residuals[index].add_(x)
            x = residuals[index]
        decoded = dequantize(quantize(x, quantization))
        if residuals is not None:
            residuals[index].sub_(decoded)
        total = decoded if total is None else total.add_(decoded)
    return dequantize(quantize(total, quantization)) if route == "exchange" else total


def distributed_sum(comm: Communicator, inputs: list[torch.Tensor], quantization: Quantization,
                    residuals: list[torch.Tensor] | None = None) -> Steps[list[torch.Tensor]]:
    """The compressed sum over the islands of `comm` of this island's tensors `inputs`
    (float32; laid out as one bucket), as steps (see `isoloco.sync.handles`): every process of
    the island passes the same inputs and gets the same sums back. `residuals` (one per input,
    same shapes; every process of the island holds the same) are updated in place."""
    islands, (slices, slot) = comm.islands, comm.island_slices
    route = choose_route(islands)
    plan = ChunkPlan.of([x.shape for x in inputs], quantization, islands, slices)
    first = slot * islands
    flats = [x.reshape(-1) for x in inputs]
    if residuals is not None:
        for flat, residual in zip(flats, residuals):
            residual.add_(flat.view_as(residual))
        flats = [residual.reshape(-1) for residual in residuals]
    blobs = []
    for chunk in range(islands * slices):
        parts = []
        for tensor, flat in enumerate(flats):
            start, stop = plan.ranges(tensor)[chunk]
            wire = quantize(flat[start:stop], quantization, plan.groups[tensor])
            if residuals is not None:  # every process of the island keeps the whole residual
                flat[start:stop].sub_(dequantize(wire))
            if first <= chunk < first + islands:
                raw = wire.as_bytes()
                parts.append(pad_aligned(raw))
        if parts:
            blobs.append(torch.cat(parts))
    if route == "gather":
        handle = comm.gather_peers(torch.cat(blobs))
        yield [handle]
        received = handle.wait()
        # Island i's blob holds its chunks first .. first + P − 1; each is summed over islands in order.
        decoded = [[_decode(plan, first + p, blob) for p, blob in enumerate(_split(plan, first, whole))]
                   for whole in received]
        chunks = [_sum([decoded[i][p] for i in range(islands)]) for p in range(islands)]
    else:
        sizes = [plan.blob_size(first + p) for p in range(islands)]
        own = plan.blob_size(first + comm.island)
        handle = comm.exchange(torch.cat(blobs), sizes, [own] * islands)
        yield [handle]
        copies = [_decode(plan, first + comm.island, blob) for blob in handle.wait()]
        total = _sum(copies)
        reencoded = torch.cat([_encode(chunk, quantization, group) for chunk, group in zip(total, plan.groups)])
        handle = comm.gather_peers(F.pad(reencoded, (0, max(sizes) - reencoded.numel())))
        yield [handle]
        chunks = [_decode(plan, first + p, blob[:sizes[p]]) for p, blob in enumerate(handle.wait())]
    # This process's slot: per tensor, its chunks first .. first + P − 1 in order.
    mine = [torch.cat([chunks[p][tensor] for p in range(islands)]) for tensor in range(len(inputs))]
    lengths = [[sum(stop - start for start, stop in plan.ranges(t)[s * islands:(s + 1) * islands])
                for t in range(len(inputs))] for s in range(slices)]
    whole = yield from join_slices(comm, mine, lengths)
    return [flat.view(x.shape) for flat, x in zip(whole, inputs)]


def join_slices(comm: Communicator, mine: list[torch.Tensor], lengths: list[list[int]]) -> Steps[list[torch.Tensor]]:
    """Whole flat tensors from the slices the processes of an island carried: `mine[t]` is
    this process's consecutive slice of tensor t, `lengths[s][t]` slot s's length of it. One
    all-gather inside the island (over its fast link); nothing with one process per island."""
    if len(lengths) == 1:
        return mine
    joined = torch.cat(mine)
    handle = comm.join_island(F.pad(joined, (0, max(map(sum, lengths)) - joined.numel())))
    yield [handle]
    slots = handle.wait()
    pieces = [list(torch.split(slots[s][:sum(lengths[s])], lengths[s])) for s in range(len(lengths))]
    return [torch.cat([pieces[s][t] for s in range(len(lengths))]) for t in range(len(mine))]


def _encode(chunk: torch.Tensor, quantization: Quantization, group: int) -> torch.Tensor:
    raw = quantize(chunk, quantization, group).as_bytes()
    return pad_aligned(raw)


def _split(plan: ChunkPlan, first: int, blob: torch.Tensor) -> list[torch.Tensor]:
    """A gathered blob of chunks first .. first + P − 1 cut into its chunks."""
    return list(torch.split(blob, [plan.blob_size(first + p) for p in range(plan.islands)]))


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


def _sum(copies: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per tensor, the copies added in order (the first copied)."""
    sums = []
    for terms in zip(*copies):
        total = terms[0].clone()
        for term in terms[1:]:
            total.add_(term)
        sums.append(total)
    return sums
