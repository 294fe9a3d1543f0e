"""What one process computes for a compressed sum, as the islands and slices multiply.

A process of island layout (P islands, G processes per island) encodes its island's bucket,
cuts the wire into P·G chunks, decodes what the others send it, re-encodes its owned chunk
and decodes the result. All of it runs on the training thread (on a GPU, on a side stream
the thread must not wait for), so its time per bucket should not grow with the chunk count
P·G. This benchmark times one process's steps of `isoloco.sync.compressed.island_sum` with the
link taken out (`LoopbackLink`: every island is taken to send what this one sent), on the same
bucket at P·G = 1 and P·G = 64, int8 with error feedback. `python -m isoloco.bench.island_compute`
prints the table alone; the link benchmark prints it too.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

import torch

from isoloco.bench.table import Table, ratio
from isoloco.sync.codec import Quantization
from isoloco.sync.compressed import ChunkPlan, island_sum
from isoloco.sync.handles import Pending, run_to_end
from isoloco.sync.islands import Fold, IslandLink, folded

T = TypeVar("T")
#: (P, G) layouts timed on the same bucket: one chunk, and 64 chunks per tensor.
LAYOUTS = ((1, 1), (8, 8))
#: A bucket of about 21 MB: a few of the 178M model's matrices and a vector.
BUCKET = ((1024, 2688), (2688, 1024), (1024,))


class LoopbackLink(IslandLink):
    """Island 0, slot 0 of `islands` islands of `slices` processes, whose peers are taken to
    send exactly what it sends: the collectives cost nothing, the folding and decoding all
    that a real process does."""

    def __init__(self, islands: int, slices: int) -> None:
        self.islands, self.island, self.slices = islands, 0, (slices, 0)

    def scatter(self, parts: list[torch.Tensor], fold_for: Callable[[int], Fold[T]]) -> Pending[T]:
        return self.gather(parts[0], fold_for(0))

    def gather(self, blob: torch.Tensor, fold: Fold[T]) -> Pending[T]:
        return Pending.done(folded(fold, [blob] * self.islands))

    def join(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        return Pending.done([part] * self.slices[0])


def bucket_seconds(islands: int, slices: int, repeats: int, quantize: str = "int8") -> list[float]:
    """Seconds of one process's compressed sum of `BUCKET` (int8 by default, with error feedback)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [torch.Size(shape) for shape in BUCKET]
    inputs = [torch.randn(shape, generator=generator).reshape(-1) for shape in shapes]
    residuals = [torch.zeros_like(x) for x in inputs]
    plan = ChunkPlan.of(shapes, Quantization(quantize), islands, slices)

    def sent() -> list[torch.Tensor]:
        return [residual.add_(x) for residual, x in zip(residuals, inputs)]

    def keep(tensor: int, decoded: torch.Tensor) -> None:
        residuals[tensor].sub_(decoded)

    times = []
    for _ in range(repeats + 1):  # the first run loads the code paths
        began = time.perf_counter()
        run_to_end(island_sum(LoopbackLink(islands, slices), plan, sent, keep, feedback=True))
        times.append(time.perf_counter() - began)
    return times[1:]


def table(repeats: int) -> Table:
    megabytes = sum(torch.Size(shape).numel() for shape in BUCKET) * 4 / 1e6
    result = Table(f"The compressed sum's compute per bucket ({megabytes:.0f} MB, int8 with error feedback) as "
                   f"chunks multiply", ["P × G", "seconds (median)", "÷ P·G = 1"])
    medians = [statistics.median(bucket_seconds(p, g, repeats)) for p, g in LAYOUTS]
    for (p, g), seconds in zip(LAYOUTS, medians):
        result.add(f"{p} × {g} = {p * g}", f"{seconds:.4f}", ratio(seconds / medians[0]))
    result.notes.append(
        f"One process's steps of the compressed sum with the link taken out (every island sends what this one "
        f"sends): encode once and slice into P·G chunks, decode and add the P copies, re-encode the owned chunk, "
        f"decode the result; median of {repeats} runs after one warm-up, this machine's CPU, one thread.")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table(repeats=7).markdown())
