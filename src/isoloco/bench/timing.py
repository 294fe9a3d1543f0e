"""Timing that survives a noisy machine: interleaved repeats, medians, ratios.

The machines this project runs on are shared; their speed drifts by tens of percent within
a minute. A bare time therefore says little, but the ratio of two things timed in turns
does: each repeat runs every case once, so a slow spell slows all of them alike; every
other repeat runs them in reverse order, so no case always follows the same other one
(caches, a drifting clock); and the median of the repeats ignores the odd outlier.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import torch


@dataclass(frozen=True)
class Timing:
    """The median seconds of one case, the seconds of each repeat in order, and what its last
    call returned."""

    median: float
    result: Any
    samples: tuple[float, ...] = ()


def interleaved(cases: Mapping[Hashable, Callable[[], Any]], repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[Hashable, Timing]:
    """Time every case `repeats` times, in turns (forwards, then backwards, ...), after
    `warmup` untimed rounds, on `clock` (wall seconds by default; `time.process_time` counts
    this process's CPU seconds, which another process on the machine does not add to).

    The warm-up absorbs first-call costs (allocations, kernel selection, lazy optimizer
    state) that a steady-state figure should not include. CUDA work is asynchronous, so the
    device is synchronised before the clock starts and before it stops.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed: it must be >= 1")
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    samples: dict[Hashable, list[float]] = {name: [] for name in cases}
    results: dict[Hashable, Any] = {}
    for repeat in range(repeats):
        order = list(cases.items())
        for name, fn in order if repeat % 2 == 0 else reversed(order):
            synchronize()
            began = clock()
            results[name] = fn()
            synchronize()
            samples[name].append(clock() - began)
    return {name: Timing(statistics.median(samples[name]), results[name], tuple(samples[name])) for name in cases}


def synchronize() -> None:
    """Wait for queued CUDA work (nothing to wait for on a CPU-only run)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
