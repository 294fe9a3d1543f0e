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

from isoloco.sync.codec import (Quantization, Wire, aligned, dequantize, fold_residuals, pad_aligned, quantize,
                                wire_nbytes)
from isoloco.sync.handles import Steps

#: The largest chunk: indices within a chunk travel as uint16.
MAX_CHUNK = 2**16
#: Bytes of one index.
INDEX_BYTES = 2

#: Gathers one encoded blob per island (a list, island order) from the blobs held here.
IslandGather = Callable[[list[torch.Tensor]], Steps[list[torch.Tensor]]]


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


def encode(flat: torch.Tensor, spec: TopK, quantization: Quantization, first: int, last: int) -> torch.Tensor:
    """Chunks [first, last) of `flat` (float32, 1-D) as uint8 bytes: each chunk's k largest
    entries' indices (uint16, padded to 4 bytes), then their values' wire (`Wire.as_bytes`)."""
    length, chunks, kept = spec.layout(flat.numel())
    padded = torch.nn.functional.pad(flat, (0, chunks * length - flat.numel())).view(chunks, length)[first:last]
    index = padded.abs().topk(kept, dim=1, sorted=False).indices
    # Sorted indices make the bytes a function of the set kept, not of topk's internal order.
    index = index.sort(dim=1).values
    values = padded.gather(1, index).contiguous()
    wire = quantize(values, _per_chunk(quantization))
    # The indices are padded to 4 bytes, so the values' float32 scales after them stay aligned.
    return torch.cat([pad_aligned(index.to(torch.uint16).reshape(-1).view(torch.uint8)), pad_aligned(wire.as_bytes())])


def decode(blob: torch.Tensor, numel: int, spec: TopK, quantization: Quantization, first: int,
           last: int) -> torch.Tensor:
    """The dense float32 entries of chunks [first, last) of a tensor of `numel` entries, from
    `encode`'s bytes (zeros where nothing was kept), flattened and cut at `numel`."""
    length, _, kept = spec.layout(numel)
    count = (last - first) * kept
    split = aligned(INDEX_BYTES * count)
    index = blob[:INDEX_BYTES * count].view(torch.uint16).to(torch.int64).view(last - first, kept)
    values = blob[split:split + wire_nbytes(count, quantization, kept)]
    values = dequantize(Wire.from_bytes(values, _per_chunk(quantization), (last - first, kept)))
    dense = torch.zeros(last - first, length, dtype=torch.float32, device=blob.device).scatter_(1, index, values)
    return dense.reshape(-1)[:spec.entries(numel, first, last)]


def topk_sum(islands: list[list[torch.Tensor]], spec: TopK, quantization: Quantization, gathered: IslandGather,
             chunks: Callable[[int], tuple[int, int]], residuals: list[list[torch.Tensor]] | None = None
             ) -> Steps[list[torch.Tensor]]:
    """The top-k sums over all islands of tensors, as steps: `islands[i][t]` is tensor t of an
    island held here (every island in the simulator, this process's in a distributed run),
    `chunks(numel)` the chunks [first, last) this process carries of a tensor of `numel`
    entries, and `gathered` all-gathers each island's encoded blob. Returns, per tensor, this
    process's chunks of the sum, flattened. With `residuals` (like `islands`), x_i = x_i + e_i
    and e_i is updated in place."""
    islands = fold_residuals(islands, residuals)
    numels = [x.numel() for x in islands[0]]
    blobs = []
    for island in islands:
        parts = []
        for x in island:
            flat = x.reshape(-1)
            parts.append(encode(flat, spec, quantization, *chunks(flat.numel())))
            if residuals is not None:  # what every chunk lost stays, whichever process sends it
                every = (0, spec.layout(flat.numel())[1])
                flat.sub_(decode(encode(flat, spec, quantization, *every), flat.numel(), spec, quantization, *every))
        blobs.append(torch.cat(parts))
    received = yield from gathered(blobs)
    sums = []
    offsets = [0] * len(received)
    for numel in numels:
        first, last = chunks(numel)
        size = spec.nbytes(numel, quantization, last - first)
        total = None
        for index, blob in enumerate(received):
            decoded = decode(blob[offsets[index]:offsets[index] + size], numel, spec, quantization, first, last)
            offsets[index] += size
            total = decoded if total is None else total.add_(decoded)
        sums.append(total)
    return sums
