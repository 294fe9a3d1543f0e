"""A sum of tensors sent as their largest entries (top-k per chunk, as in SparseLoCo and DeMo).

Each island cuts its flattened tensor x_i (its workers' sum, plus its error-feedback residual)
into chunks of c = min(`chunk`, n) entries (the last zero-padded) and keeps the
k = max(1, ⌈density·c⌉) entries of largest magnitude in each: k indices in the chunk (uint16)
and k values, sent under `merge.quantize` (the k values of a chunk share one scale, whatever
`merge.quantize_scales` says, so that chunks encode independently). Every island all-gathers
every island's entries, decodes them and adds them in island order, so every island ends with
the same bits:

    Σ_i deq(topk(x_i))        (in island order)

A sum of sparse tensors is not sparse at the same k, so there is no owner to re-encode it as
the dense compressed sum has: the bytes a process sends grow with the number of islands P,
(P − 1)·(2k + w(k))·n/c per tensor (w the values' wire bytes), where the dense codecs stay flat
in P. That is the price of keeping each island's own entries; docs/architecture.md compares.

With error feedback island i keeps e_i = x_i − deq(topk(x_i)): every entry left out, and what
the kept values lost to rounding, joins the next round. Ties in magnitude are broken by
`torch.topk`, whose choice among equal entries may differ between CPU and GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from isoloco.sync.codec import Quantization, Wire, aligned, dequantize, pad_aligned, quantize, shard_ranges, wire_nbytes
from isoloco.sync.compressed import Keep, concat, join_slices
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Steps
from isoloco.sync.islands import IslandLink, SumFold

#: The largest chunk: indices within a chunk travel as uint16.
MAX_CHUNK = 2**16
#: Bytes of one index.
INDEX_BYTES = 2

@dataclasses.dataclass(frozen=True)
class TopK:
    """Which entries of a tensor of `numel` entries cross the link."""

    density: float  # fraction of each chunk's entries kept, in (0, 1]
    chunk: int  # entries per chunk (at most MAX_CHUNK)

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(chunk length c, chunks, kept entries per chunk k) of a tensor of `numel` entries."""
        length = max(1, min(self.chunk, numel))
        return length, math.ceil(numel / length), max(1, math.ceil(self.density * length))

    def entries(self, numel: int, first: int, last: int) -> int:
        """Entries of a tensor of `numel` entries that chunks [first, last) cover."""
        length = self.layout(numel)[0]
        return max(0, min(numel, last * length) - first * length)

    def nbytes(self, numel: int, quantization: Quantization, chunks: int | None = None) -> int:
        """Bytes on the wire for `chunks` chunks (default: all) of a tensor of `numel` entries,
        the indices and the values each padded to a multiple of 4 bytes."""
        _, every, kept = self.layout(numel)
        count = (every if chunks is None else chunks) * kept
        return aligned(INDEX_BYTES * count) + aligned(wire_nbytes(count, quantization, kept))


def _per_chunk(quantization: Quantization) -> Quantization:
    """The values' codec: one scale per chunk's k values (a row of the chunks × k values)."""
    return dataclasses.replace(quantization, scales="row")


def select(flat: torch.Tensor, spec: TopK, quantization: Quantization) -> tuple[torch.Tensor, Wire]:
    """Every chunk's k largest entries of `flat` (float32, 1-D): their indices in the chunk
    (chunks × k, ascending) and their values' wire (one scale per chunk)."""
    length, chunks, kept = spec.layout(flat.numel())
    padded = torch.nn.functional.pad(flat, (0, chunks * length - flat.numel())).view(chunks, length)
    # Sorted indices make the bytes a function of the set kept, not of topk's internal order.
    index = padded.abs().topk(kept, dim=1, sorted=False).indices.sort(dim=1).values
    return index, quantize(padded.gather(1, index).contiguous(), _per_chunk(quantization), check=False)


def encode(index: torch.Tensor, wire: Wire, first: int, last: int) -> torch.Tensor:
    """Chunks [first, last) of `select`'s entries as uint8 bytes: the indices (uint16, padded
    to 4 bytes, so the values' float32 scales after them stay aligned), then the values' wire."""
    kept = index.shape[1]
    indices = index[first:last].to(torch.uint16).reshape(-1).view(torch.uint8)
    return torch.cat([pad_aligned(indices), pad_aligned(wire.slice(first * kept, last * kept).as_bytes())])


def scatter(index: torch.Tensor, values: torch.Tensor, numel: int, spec: TopK, first: int) -> torch.Tensor:
    """The dense float32 entries of the chunks from `first` on that `index` and `values` (chunks ×
    k) cover: zeros where nothing was kept, flattened and cut at the tensor's `numel`."""
    length = spec.layout(numel)[0]
    dense = torch.zeros(index.shape[0], length, dtype=torch.float32, device=values.device).scatter_(1, index, values)
    return dense.reshape(-1)[:spec.entries(numel, first, first + index.shape[0])]


def decode(blob: torch.Tensor, numel: int, spec: TopK, quantization: Quantization, first: int,
           last: int) -> torch.Tensor:
    """The dense float32 entries of chunks [first, last) of a tensor of `numel` entries, from
    `encode`'s bytes (zeros where nothing was kept), flattened and cut at `numel`."""
    kept = spec.layout(numel)[2]
    count = (last - first) * kept
    split = aligned(INDEX_BYTES * count)
    index = blob[:INDEX_BYTES * count].view(torch.uint16).to(torch.int64).view(last - first, kept)
    values = blob[split:split + wire_nbytes(count, quantization, kept)]
    values = dequantize(Wire.from_bytes(values, _per_chunk(quantization), (last - first, kept)))
    return scatter(index, values, numel, spec, first)


def carried(spec: TopK, numel: int, slices: int) -> list[tuple[int, int]]:
    """The chunks [first, last) of a tensor of `numel` entries that each of an island's `slices`
    processes carries across islands."""
    return shard_ranges(spec.layout(numel)[1], 1, slices)


@dataclasses.dataclass(frozen=True)
class TopKPlan:
    """The plan of one bucket's top-k sum: the chunks each process of an island carries, the
    collectives that carry them, one per stage, and the bytes those put on the link."""

    numels: tuple[int, ...]
    spec: TopK
    quantization: Quantization
    islands: int  # P
    slices: int  # G: processes per island that split its traffic

    @property
    def collectives(self) -> tuple[str, ...]:
        """Every island's entries all-gathered, then with G > 1 the island's slices joined."""
        return ("all_gather",) + (("island all_gather",) if self.slices > 1 else ())

    @property
    def stages(self) -> int:
        return len(self.collectives)

    def spans(self, tensor: int) -> list[tuple[int, int]]:
        """The chunks [first, last) of tensor `tensor` each process of an island carries."""
        return carried(self.spec, self.numels[tensor], self.slices)

    def sizes(self, slot: int) -> list[int]:
        """Bytes of each tensor's chunks that process `slot` of an island sends."""
        return [self.spec.nbytes(numel, self.quantization, last - first)
                for numel, (first, last) in zip(self.numels, (self.spans(t)[slot] for t in range(len(self.numels))))]

    @property
    def payload_bytes(self) -> int:
        """Bytes of every tensor's entries, whole: what an island hands to the sum."""
        return sum(self.spec.nbytes(numel, self.quantization) for numel in self.numels)

    def wire_bytes(self) -> float:
        """The slow-link bytes of the sum, averaged over the processes of an island."""
        return sum(wire_bytes("all_gather", sum(self.sizes(slot)), self.islands)
                   for slot in range(self.slices)) / self.slices


def topk_island_sum(link: IslandLink, plan: TopKPlan, inputs: Callable[[], list[torch.Tensor]],
                    keep: Keep | None = None) -> Steps[list[torch.Tensor]]:
    """One island's steps of the top-k sum over every island of a bucket's tensors, as `plan`
    says: `inputs()` (called once, in the first stage) gives this island's flat float32 tensors;
    each is selected and encoded once, `keep` sees what its selection delivers (error feedback:
    every entry left out and what the kept values lost to rounding), and this process sends its
    slice of the chunks. Returns every tensor's sum, flat."""
    spec, quantization, numels = plan.spec, plan.quantization, plan.numels
    slices, slot = link.slices
    blob = _encoded(inputs, plan, slot, keep)
    spans = [plan.spans(tensor) for tensor in range(len(numels))]
    sizes = plan.sizes(slot)

    def decoded(source: int, blob: torch.Tensor) -> list[torch.Tensor]:
        pieces = torch.split(blob, sizes)
        return [decode(piece, numel, spec, quantization, *span[slot]) for piece, numel, span in zip(pieces, numels, spans)]

    handle = link.gather(blob, SumFold(decoded))
    del blob
    yield [handle]
    lengths = [[spec.entries(numel, *span[s]) for numel, span in zip(numels, spans)] for s in range(slices)]
    joined = yield from join_slices(link, handle.wait(), lengths)
    return [concat(pieces) for pieces in zip(*joined)]


def _encoded(inputs: Callable[[], list[torch.Tensor]], plan: TopKPlan, slot: int, keep: Keep | None) -> torch.Tensor:
    """This process's blob of every input's carried chunks."""
    parts = []
    for tensor, flat in enumerate(inputs()):
        index, wire = select(flat, plan.spec, plan.quantization)
        if keep is not None:
            keep(tensor, scatter(index, dequantize(wire), flat.numel(), plan.spec, 0))
        parts.append(encode(index, wire, *plan.spans(tensor)[slot]))
    return torch.cat(parts)
