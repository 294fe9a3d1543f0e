"""The compressed merge at many islands: seconds per merge of the simulator against R.

The simulator plays every worker as an island of its own (`isoloco.sync.islands.PlayedIslands`),
so a compressed merge at R workers runs R islands' steps in one process. Each island encodes its
own sum, so the work grows as R at least; the table shows that it grows no faster: its aim is
R = 128 at most 20× R = 8 (16× is linear). Each case merges the same `tensors` matrices of
`shape` from R random deltas, with `Merger.merge_all` through a `LocalCommunicator`; the R values
of a case are timed in interleaved repeats, on the CPU on this process's CPU clock
(`time.process_time`), which another process on a shared machine does not add to.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.comm import LocalCommunicator
from isoloco.merge import Merger

#: The compressed merges timed: int8 with error feedback, and both structured compressors.
from isoloco.merge_config import MergeConfig
CASES = {"int8 + error feedback": {"quantize": "int8", "error_feedback": True},
         "low rank 4 + error feedback": {"compress": "lowrank", "compress_rank": 4, "error_feedback": True},
         "top-k 3% + error feedback": {"compress": "topk", "compress_density": 0.03, "error_feedback": True}}
FULL = {"workers": (8, 32, 128), "tensors": 40, "shape": (64, 64)}
QUICK = {"workers": (8, 32), "tensors": 10, "shape": (64, 64)}
#: The aim: the merge at the most workers costs at most this many times the merge at the fewest (8 → 128).
AIM = 20.0


def merge_scale_seconds(keys: dict, workers: tuple[int, ...], tensors: int, shape: tuple[int, int],
                        repeats: int, device: str = "cpu") -> dict[int, float]:
    """Median seconds of one compressed merge (`keys`: its `merge.*` settings) at each R of
    `workers`, of `tensors` matrices of `shape` on `device`, every R timed in the same
    interleaved repeats."""
    def case(count: int):
        g = torch.Generator().manual_seed(count)
        deltas = {f"m{index}": [torch.randn(shape, generator=g).to(device) for _ in range(count)]
                  for index in range(tensors)}
        residuals = {name: [torch.zeros_like(delta) for delta in ds] for name, ds in deltas.items()}
        merger = Merger(MergeConfig(**keys), LocalCommunicator(count), seed=0)
        rounds = iter(range(repeats + 2))
        return lambda: merger.merge_all(deltas, next(rounds), residuals=residuals)

    clock = time.process_time if torch.device(device).type == "cpu" else time.perf_counter
    timings = interleaved({count: case(count) for count in workers}, repeats, clock=clock)
    return {count: timings[count].median for count in workers}


def merge_scale_table(workers: tuple[int, ...], tensors: int, shape: tuple[int, int], repeats: int,
                      device: str = "cpu") -> Table:
    fewest = workers[0]
    table = Table("Compressed merge at many islands: seconds per merge in the simulator",
                  ["merge", *(f"R = {count}" for count in workers), *(f"{count} / {fewest}" for count in workers[1:])])
    for name, keys in CASES.items():
        seconds = merge_scale_seconds(keys, workers, tensors, shape, repeats, device)
        table.add(name, *(f"{seconds[count]:.3f} s" for count in workers),
                  *(ratio(seconds[count] / seconds[fewest]) for count in workers[1:]))
    table.notes.append(
        f"{tensors} matrices of {shape[0]}×{shape[1]} on {device}, every worker an island (`PlayedIslands`); the "
        f"median of {repeats} interleaved repeats after a warm-up. Linear in R is {workers[-1] // fewest}× at "
        f"R = {workers[-1]}; the aim is at most {AIM:g}× R = 8's at R = 128.")
    return table


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    setting = QUICK if quick else FULL
    yield merge_scale_table(setting["workers"], setting["tensors"], setting["shape"], repeats, device)
