"""SparseLoCo's transport: each worker's error-feedback accumulator, sent as the top-k entries of
2-D tiles with 2-bit values, all-gathered, clipped to the median worker and averaged.

The reference is the deployed recipe of tplr-ai/templar (`src/tplr/compress.py`,
`src/tplr/neurons.py`: `prepare_gradient_dict` and `outer_step`); docs/fidelity.md lists where
this differs. Per worker r and tensor, each round:

    e_r ← β·e_r + Δ_r
    send C(e_r): the k entries of largest magnitude of every tile of e_r, values in 2 bits
    e_r ← e_r − deq(C(e_r))

A matrix of m×n is cut into tiles of h×w, h and w the largest divisors of m and n at most
`Tiling.tile`; a vector into runs of w entries. k = min(topk, tile entries), rounded down to
even, at least 2 (the reference's rule; here never more than the tile holds).

A tensor's values travel as 2-bit codes of a 4-bin lookup table (the reference's statistical
quantisation): shift = mean(v), c = v − shift, σ = ‖c‖/√(n − 1), s = 6σ/4,
code = clamp(round(c/s + 2), 0, 3), and bin b decodes to the mean of the c that fell in it,
plus the shift. Every worker's tensor is then scaled by min(1, median/(‖v_r‖ + 10⁻⁸)), the
median (the lower one, as `torch.median`) over the workers of the norms of their decoded
values, and each entry is the mean over the workers that sent it (zero where none did).

One tensor's wire (`nbytes`): 5 float32 (the shift, then the table), the indices within their
tiles in 12 bits (two in 3 bytes, as the reference packs them), the codes four to a byte,
padded to 4 bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Collection, Mapping, Sequence

import torch

from isoloco.comm import Communicator
from isoloco.sync import offload
from isoloco.sync.codec import aligned
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Steps

#: The largest tile side: a tile of 64×64 holds 4096 entries, whose indices fit 12 bits.
MAX_TILE = 64
#: Value bins (2-bit codes) and the range they span, in standard deviations.
BINS = 4
RANGE_SIGMAS = 6
#: Float32 numbers before the indices: the shift, then the lookup table.
HEADER_FLOATS = 1 + BINS
#: Added to a worker's norm before the median clip divides by it.
NORM_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Which entries of a tensor SparseLoCo sends."""

    tile: int  # target tile side, at most MAX_TILE
    topk: int  # entries sent per tile, before the even rounding

    def __post_init__(self) -> None:
        if not (1 <= self.tile <= MAX_TILE and self.topk >= 1):
            raise ValueError(f"tile={self.tile} must be in [1, {MAX_TILE}] (indices travel as 12 bits) and "
                             f"topk={self.topk} at least 1")

    def layout(self, shape: Sequence[int]) -> Layout:
        if len(shape) == 2:
            return Layout(tuple(shape), tile_side(shape[0], self.tile), tile_side(shape[1], self.tile), self.topk)
        if len(shape) == 1:
            return Layout(tuple(shape), 1, tile_side(shape[0], self.tile), self.topk)
        raise ValueError(f"SparseLoCo tiles vectors and matrices, not a tensor of shape {tuple(shape)}")


def tile_side(length: int, target: int) -> int:
    """The largest divisor of `length` that is at most `target`."""
    return max(d for d in range(1, min(length, target) + 1) if length % d == 0)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A tensor of `shape` cut into tiles of `rows`×`cols` (a vector: 1×cols)."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    topk: int

    @property
    def entries(self) -> int:
        """Entries per tile."""
        return self.rows * self.cols

    @property
    def tiles(self) -> int:
        return math.prod(self.shape) // self.entries

    @property
    def kept(self) -> int:
        """k, entries sent per tile: the reference's even rounding, never above the tile."""
        k = max(2, min(self.topk, self.entries))
        return min(k - k % 2, self.entries)

    @property
    def count(self) -> int:
        """Entries sent of the whole tensor."""
        return self.tiles * self.kept

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's wire: header, 12-bit indices, 2-bit codes, padded to 4 bytes."""
        return aligned(4 * HEADER_FLOATS + 3 * math.ceil(self.count / 2) + math.ceil(self.count / 4))

    def to_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as one row per tile (tile (i, j) of a matrix is row i·(n/w) + j, its entries row-major)."""
        if len(self.shape) == 1:
            return x.reshape(self.tiles, self.cols)
        m, n = self.shape
        return x.reshape(m // self.rows, self.rows, n // self.cols, self.cols).transpose(1, 2).reshape(
            self.tiles, self.entries)

    def from_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_tiles`."""
        if len(self.shape) == 1:
            return tiles.reshape(self.shape)
        m, n = self.shape
        return tiles.reshape(m // self.rows, n // self.cols, self.rows, self.cols).transpose(1, 2).reshape(m, n)


# --------------------------------------------------------------------------- the codec


def quantize_values(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes (uint8 in 0..3) of float32 `values` and their table [shift, lookup of each bin]."""
    shift = values.mean()
    centered = values - shift
    if values.numel() > 1:
        # A zero or non-finite scale becomes 1, chosen on the device: no host sync inside a stage.
        scale = RANGE_SIGMAS * (centered.norm() / math.sqrt(values.numel() - 1)) / BINS
        scale = torch.where(torch.isfinite(scale) & (scale != 0), scale, 1.0)
    else:
        scale = torch.ones((), dtype=values.dtype, device=values.device)
    codes = (centered / scale + BINS // 2).round().clamp(0, BINS - 1).to(torch.uint8)
    # One reduction per bin (not scatter_add's atomics), so every device adds in one order.
    members = codes.reshape(1, -1) == torch.arange(BINS, dtype=torch.uint8, device=values.device)[:, None]
    sums = torch.where(members, centered.reshape(1, -1), 0).sum(dim=1)
    counts = members.sum(dim=1).to(values.dtype)
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), 0)
    return codes, torch.cat([shift.reshape(1), lookup])


def dequantize_values(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[1:][codes.long()] + table[0]


def pack_indices(indices: torch.Tensor) -> torch.Tensor:
    """12-bit indices (< 4096), two in 3 bytes: the first in byte 0 and the low nibble of byte 1,
    the second in its high nibble and byte 2; an odd count is padded with a 0."""
    flat = torch.nn.functional.pad(indices.reshape(-1), (0, indices.numel() % 2))
    first, second = flat[0::2], flat[1::2]
    return torch.stack([first & 0xFF, (first >> 8) | ((second & 0x0F) << 4), second >> 4], dim=1).reshape(-1).to(
        torch.uint8)


def unpack_indices(packed: torch.Tensor, count: int) -> torch.Tensor:
    triples = packed.reshape(-1, 3).to(torch.int64)
    first = triples[:, 0] | ((triples[:, 1] & 0x0F) << 8)
    second = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([first, second], dim=1).reshape(-1)[:count]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes four to a byte, code i in bits 2·(i mod 4)."""
    quads = torch.nn.functional.pad(codes.reshape(-1), (0, -codes.numel() % 4)).reshape(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_codes(packed: torch.Tensor, count: int) -> torch.Tensor:
    return torch.stack([(packed >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)[:count]


def encode(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`x` (float32, of `layout.shape`) as its wire: `layout.nbytes` uint8 bytes."""
    tiles = layout.to_tiles(x)
    # Sorted indices make the bytes a function of the set kept, not of topk's internal order.
    index = tiles.abs().topk(layout.kept, dim=1, sorted=False).indices.sort(dim=1).values
    codes, table = quantize_values(tiles.gather(1, index).reshape(-1))
    blob = torch.cat([table.view(torch.uint8), pack_indices(index), pack_codes(codes)])
    return torch.nn.functional.pad(blob, (0, layout.nbytes - blob.numel()))


def decode(blob: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The (indices within their tiles, float32 values), each tiles × k, that `blob` carries."""
    count, start = layout.count, 4 * HEADER_FLOATS
    table = blob[:start].view(torch.float32)
    indices = unpack_indices(blob[start:start + 3 * math.ceil(count / 2)], count)
    start += 3 * math.ceil(count / 2)
    codes = unpack_codes(blob[start:start + math.ceil(count / 4)], count)
    shape = (layout.tiles, layout.kept)
    return indices.reshape(shape), dequantize_values(codes, table).reshape(shape)


def densify(indices: torch.Tensor, values: torch.Tensor, layout: Layout) -> torch.Tensor:
    tiles = torch.zeros(layout.tiles, layout.entries, dtype=values.dtype, device=values.device)
    return layout.from_tiles(tiles.scatter_(1, indices, values))


def compress_with_decay(accumulator: torch.Tensor, delta: torch.Tensor, decay: float, layout: Layout) -> torch.Tensor:
    """e ← decay·e + Δ, send C(e), e ← e − deq(C(e)), with `accumulator` e updated in place;
    returns the wire of C(e)."""
    accumulator.mul_(decay).add_(delta)
    blob = encode(accumulator, layout)
    accumulator.sub_(densify(*decode(blob, layout), layout))
    return blob


def clipped_mean(decoded: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: Layout) -> torch.Tensor:
    """The tensor the workers' `decoded` (indices, values) send together: each worker's values
    clipped to the median of their norms, then each entry the mean over the workers that sent it."""
    norms = torch.stack([values.norm() for _, values in decoded])
    median = norms.median()
    values = decoded[0][1]
    sums = torch.zeros(layout.tiles, layout.entries, dtype=values.dtype, device=values.device)
    counts = torch.zeros_like(sums)
    for (index, values), norm in zip(decoded, norms):
        # A worker's indices are distinct within a tile: no two of its entries land in one place.
        sums.scatter_add_(1, index, values * (median / (norm + NORM_EPS)).clamp(max=1))
        counts.scatter_add_(1, index, torch.ones_like(values))
    return layout.from_tiles(torch.where(counts > 0, sums / counts.clamp(min=1), 0))


# ------------------------------------------------------------------------ the exchange


def sparseloco_mean(comm: Communicator, deltas: Mapping[str, Sequence[torch.Tensor]],
                    accumulators: Mapping[str, Sequence[torch.Tensor]], tiling: Tiling, decay: float,
                    arrived: Collection[int] | None = None, fetch: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> Steps[dict[str, torch.Tensor]]:
    """SparseLoCo's merge of every tensor, as one stage of steps: `deltas[name]` and
    `accumulators[name]` hold one tensor per local worker, in the communicator's order (the
    accumulators, stored, are updated in place); each worker's wires of all tensors travel as
    one blob in one all-gather. `arrived`: the global ids of the workers merged (None: all);
    the others neither send nor touch their accumulators. `fetch` brings a stored tensor to
    where the merge computes."""
    fetch = fetch or (lambda stored: stored)
    names = list(deltas)
    layouts = [tiling.layout(deltas[name][0].shape) for name in names]
    size = sum(layout.nbytes for layout in layouts)
    blobs = []
    for index, worker in enumerate(comm.local_worker_ids):
        if arrived is not None and worker not in arrived:
            where = fetch(deltas[names[0]][index].reshape(-1)[:0])
            blobs.append(torch.zeros(size, dtype=torch.uint8, device=where.device))
            continue
        parts = []
        for name, layout in zip(names, layouts):
            stored = accumulators[name][index]
            accumulator = offload.fetched(stored, fetch)
            parts.append(compress_with_decay(accumulator, fetch(deltas[name][index]), decay, layout))
            offload.store(stored, accumulator)  # offloaded from a GPU: the host does not wait for it
        blobs.append(torch.cat(parts))
    handle = comm.gather_async(blobs)
    yield [handle]
    gathered = [blob for worker, blob in enumerate(handle.wait()) if arrived is None or worker in arrived]
    merged, offset = {}, 0
    for name, layout in zip(names, layouts):
        merged[name] = clipped_mean([decode(blob[offset:offset + layout.nbytes], layout) for blob in gathered],
                                    layout)
        offset += layout.nbytes
    return merged


def sparseloco_wire_bytes(shapes: Sequence[Sequence[int]], tiling: Tiling, islands: int,
                          workers_per_island: int = 1) -> float:
    """The slow-link bytes one process puts on the link in one SparseLoCo merge of tensors of
    `shapes` over `islands` islands of one process each (the cost model's all-gather of its
    workers' blobs): what the metrics' `wire_bytes_cross_island` counts."""
    blob = sum(tiling.layout(shape).nbytes for shape in shapes)
    return wire_bytes("all_gather", workers_per_island * blob, islands)
