"""Async collective handles, and the steps of a synchronisation that wait on them.

A collective starts as a `Pending` (torch.distributed's `Work` objects, or nothing for a local
one) and gives its result at `wait`. With an emulated slow link the result is also held back
until the moment the link would have delivered it, so training can run while it "travels".

A synchronisation is written as `Steps`: a generator that starts its collectives, yields
their handles, and waits on them when resumed. Whoever drives it decides *when* each resume
happens: `run_to_end` at once (a blocking synchronisation), `InFlight` at fixed inner steps
(an overlapped one). Either way every collective is started from the thread that drives it,
in the generator's order, the same on every rank.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Generator, Generic, Sequence, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """One collective on its way: `wait` blocks until it is done and returns its result."""

    def __init__(self, works: Sequence[Any] = (), finish: Callable[[], T] | None = None, ready_at: float = 0.0,
                 value: T | None = None) -> None:
        """`works`: torch.distributed `Work` objects to wait on; `finish`: computes the result
        once they are done; `ready_at`: `time.perf_counter()` before which an emulated link has
        not delivered it; `value`: the result of a collective that is already done."""
        self._works = list(works)
        self._finish = finish
        self._ready_at = ready_at
        self._value = value
        self._done = finish is None

    @classmethod
    def done(cls, value: T) -> Pending[T]:
        """A handle whose result is already there (a local collective)."""
        return cls(value=value)

    def wait(self) -> T:
        if not self._done:
            for work in self._works:
                work.wait()
            delay = self._ready_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self._value, self._done, self._works = self._finish(), True, []
        return self._value


#: A synchronisation: yields the handles of the collectives it started at each stage, and
#: returns its result when driven to the end.
Steps = Generator[Sequence[Pending], None, T]


@dataclasses.dataclass
class Sync(Generic[T]):
    """A synchronisation ready to run: its steps and how many stages (yields) it has, which
    every rank knows alike before it starts (an overlapped run spreads them over inner steps)."""

    steps: Steps[T]
    stages: int
    #: Each stage's share of the link's traffic (the collectives it starts; 0 for a stage that
    #: only computes), alike on every rank: an overlapped run gives each stage's transfers inner
    #: steps in proportion to it before the next stage waits for them. None: equal shares.
    traffic: tuple[float, ...] | None = None


def run_to_end(steps: Steps[T]) -> T:
    """Drive `steps` without pause (each stage waits for its collectives) and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def lockstep(all_steps: Sequence[Steps[T]]) -> Steps[list[T]]:
    """Several synchronisations' steps as one: each stage starts every one's collectives
    before any waits (they must have the same number of stages), then their results in order."""
    results: list[T | None] = [None] * len(all_steps)
    running = list(range(len(all_steps)))
    while running:
        handles: list[Pending] = []
        still = []
        for index in running:
            try:
                handles.extend(next(all_steps[index]))
                still.append(index)
            except StopIteration as end:
                results[index] = end.value
        running = still
        if running:
            yield handles
    return results


def padded(steps: Steps[T], stages: int) -> Steps[T]:
    """`steps` stretched to `stages` stages: stages with nothing to wait for follow its own, so
    that syntheses of unequal length run in `lockstep`."""
    count = 0
    while True:
        try:
            handles = next(steps)
        except StopIteration as end:
            result = end.value
            break
        count += 1
        if count > stages:
            raise RuntimeError(f"a synchronisation planned for {stages} stages waited more often: the plan's stage "
                               f"count and the steps disagree")
        yield handles
    for _ in range(stages - count):
        yield []
    return result
