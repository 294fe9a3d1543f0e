"""A synchronisation in flight while the next round trains (Streaming DiLoCo's overlap).

With `outer.overlap_steps=τ > 0`, round t's synchronisation (the merge and the outer step
that make θ_{t+1}) runs on a background thread while each worker trains the first τ inner
steps of round t+1 from its own weights θ_r. Then the update *lands*: the worker waits for
the synchronisation if it has not ended, and its weights become (1 − α)·θ_{t+1} + α·θ_r
(α = `outer.overlap_alpha`) before its remaining H − τ steps. This is torchft's
`fragment_sync_delay` and `fragment_update_alpha`, for the whole model at once.

`InFlight` owns the thread (and, on a GPU, the side stream the synchronisation's kernels
run on) and the snapshot θ_t that workers' own weights are rebuilt from: a worker keeps
only Δ_r = θ_t − θ_r between rounds, so θ_r is θ_t − Δ_r again, bit for bit the same in
every layout. Only one synchronisation is ever in flight: the next starts after every
local worker has landed the last.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class InFlight:
    """At most one background synchronisation, and what workers need until it lands."""

    def __init__(self, global_params: list[torch.Tensor], device: torch.device) -> None:
        #: θ_t: the global weights the in-flight synchronisation started from.
        self.base = [torch.empty_like(p) for p in global_params]
        self._global_params = global_params
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isoloco-sync")
        self._future: Future[float] | None = None
        #: Seconds the last finished synchronisation ran, and training waited for it.
        self.ran_s = self.waited_s = 0.0

    @torch.no_grad()
    def start(self, synchronise: Callable[[], None]) -> None:
        """Snapshot θ_t, then run `synchronise` (which updates θ in place) in the background."""
        assert self._future is None, "one synchronisation in flight at a time"
        torch._foreach_copy_(self.base, self._global_params)
        if self._stream is not None:  # the merge reads what the training stream wrote
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._future = self._executor.submit(self._timed, synchronise)

    def _timed(self, synchronise: Callable[[], None]) -> float:
        began = time.perf_counter()
        if self._stream is None:
            synchronise()
        else:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                synchronise()
                self._stream.synchronize()
        return time.perf_counter() - began

    @property
    def running(self) -> bool:
        return self._future is not None

    def wait(self) -> bool:
        """Block until the synchronisation in flight (if any) has ended, re-raising its error;
        True when one had been in flight (its seconds are then in `ran_s` and `waited_s`)."""
        if self._future is None:
            return False
        began = time.perf_counter()
        future, self._future = self._future, None
        self.ran_s = future.result()
        self.waited_s = time.perf_counter() - began
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return True

    def close(self) -> None:
        """Stop the thread (after the synchronisation in flight, whose error is not raised)."""
        self._executor.shutdown(wait=True)
