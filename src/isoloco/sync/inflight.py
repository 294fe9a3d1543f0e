"""A synchronisation in flight while the next round trains (Streaming DiLoCo's overlap).

With `outer.overlap_steps=τ > 0`, round t's synchronisation (the merge and the outer step that
make θ_{t+1}) starts as round t+1 begins, after round t's own collectives (its losses, metrics, a
stop signal, an evaluation), which would otherwise wait behind its traffic in a slow link's
queue; each worker trains the first τ inner steps of round t+1 from its own weights θ_r. Then the update *lands*: the worker waits for whatever of the
synchronisation is left, and its weights become (1 − α)·θ_{t+1} + α·θ_r (α =
`outer.overlap_alpha`) before its remaining H − τ steps. This is torchft's
`fragment_sync_delay` and `fragment_update_alpha`, for the whole model at once.

No thread runs it. The synchronisation is `Steps` (`isoloco.sync.handles`) whose S stages each
start collectives as async handles; `start` runs the first stage, and the next ones run at
fixed inner steps of the round's first worker, spread over the τ steps by their traffic
(`resume_steps`: a stage that only computes, such as Iso-C's finalize, waits for the landing,
so the transfers before it have the whole window), so every collective is started by the main
thread in one order on every rank, as NCCL requires. Between those steps the transfers proceed on their own (the backend's
threads, the network); on a GPU the stages' kernels run on a side stream.

An error raised by a stage is raised at once, from the inner step that ran it, and nothing
stays in flight. Kept for the landing, it would let this rank train on: its next gradient
all-reduce would meet, on the same island group, its peers' next stage collective (a hang on
NCCL, or wrong numbers). Raised, it ends the run's block in `process_group`, which posts it,
and the peer watchdog stops every other rank naming it (exit 3) before this one posts
another collective.

`InFlight` also holds θ_t, which workers' own weights are rebuilt from: a worker keeps only
Δ_r = θ_t − θ_r between rounds, so θ_r is θ_t − Δ_r again, bit for bit the same in every
layout. Only one synchronisation is ever in flight: the next starts after every local worker
has landed the last.
"""

from __future__ import annotations

import itertools
import math
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from isoloco.sync.handles import Sync


def resume_steps(window: int, sync: Sync) -> list[int]:
    """The inner steps before which stages 2, 3, ... of `sync` run, each waiting for the stage
    before it: stage k + 1 at ⌈τ·(traffic of stages 1..k) / (all its traffic)⌉, so a transfer has
    as much of the window as its share of the traffic. A stage due at τ runs at the landing, and
    a synchronisation that only computes spreads its stages evenly."""
    stages = max(sync.stages, 1)
    traffic = list(sync.traffic) if sync.traffic and sum(sync.traffic) > 0 else [1.0] * stages
    sent = list(itertools.accumulate(traffic))
    return sorted({math.ceil(window * sent[k - 1] / sent[-1]) for k in range(1, stages)} - {0, window})


class InFlight:
    """At most one synchronisation in flight, when its stages run, and θ_t."""

    def __init__(self, base: list[torch.Tensor], global_params: list[torch.Tensor], device: torch.device,
                 window: int) -> None:
        """`base`: where θ_t is kept (host memory when workers are offloaded); `window`: τ, the
        inner steps a synchronisation has before it lands."""
        #: θ_t: the global weights the synchronisation in flight started from.
        self.base = base
        self._global_params = global_params
        self._device = device
        self._window = window
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._steps = None
        self._resume_at: list[int] = []
        self._began = self._ended = 0.0
        #: Seconds the last landed synchronisation ran (start to end), and training spent on it.
        self.ran_s = self.waited_s = 0.0

    @property
    def running(self) -> bool:
        return self._steps is not None

    @torch.no_grad()
    def start(self, sync: Sync) -> None:
        """Snapshot θ_t, then run `sync`'s first stage; θ becomes θ_{t+1} by the landing."""
        assert not self.running, "one synchronisation in flight at a time"
        torch._foreach_copy_(self.base, self._global_params)
        if self._stream is not None:  # the merge reads what the training stream wrote
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._steps = sync.steps
        self._resume_at = resume_steps(self._window, sync)
        self._began, self.waited_s = time.perf_counter(), 0.0
        self._resume()

    def before_step(self, taken: int) -> None:
        """Run the stage due before inner step `taken` of the round's first worker, if any."""
        if self._steps is not None and self._resume_at and taken >= self._resume_at[0]:
            self._resume_at.pop(0)
            self._resume()

    def land(self) -> bool:
        """Run what is left of the synchronisation in flight (if any); True when one was in
        flight (its seconds are then in `ran_s` and `waited_s`)."""
        if not self.running:
            return False
        while self._steps is not None:
            self._resume()
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        self.ran_s = self._ended - self._began
        return True

    def _resume(self) -> None:
        began = time.perf_counter()
        try:
            with self._on_stream():
                next(self._steps)
        except StopIteration:
            self._steps = None
        except BaseException:
            # A generator that raised is finished: nothing stays in flight (module docstring).
            self._steps, self._resume_at = None, []
            raise
        self._ended = time.perf_counter()
        self.waited_s += self._ended - began

    def _on_stream(self) -> AbstractContextManager:
        if self._stream is None:
            return nullcontext()
        return torch.cuda.stream(self._stream)

    def close(self) -> None:
        """Drop the synchronisation in flight, if any, without running the rest of it."""
        if self._steps is not None:
            self._steps.close()
        self._steps, self._resume_at = None, []
