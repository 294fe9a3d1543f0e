"""Stored tensors that a merge updates, written back without stopping the host.

Offloaded from a GPU (`offload_workers=true`), an island's error-feedback residuals and
SparseLoCo's accumulators live in pinned host memory: a stage fetches one to the GPU, updates it
there and stores it back. A blocking device-to-host copy would make the host wait for the stage's
stream at every store, inside a stage, which an overlapped synchronisation must never do. So a
store into pinned host memory from a GPU copies with ``non_blocking=True`` and records an event on
the current stream, and:

* `fetched`, the next fetch of that stored tensor to the device, first makes the stream it runs
  on wait for the event (on the device: the host does not wait), whatever stream it runs on;
* `settle` waits on the host for every copy still on its way, before the host reads stored
  tensors itself (a checkpoint writing them, a finiteness check).

Everywhere else (the CPU, storage on the device, memory that is not pinned) a store is the
plain copy it always was, and nothing is recorded.
"""

from __future__ import annotations

from typing import Callable

import torch

#: The event of the last copy still on its way into each stored tensor (by its address), and
#: the device it was recorded on. Process-wide, as the memory it describes is.
_pending: dict[int, tuple[torch.cuda.Event, torch.device]] = {}


def _asynchronous(stored: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether storing `value` in `stored` is a device-to-host copy that can run on its own."""
    return value.device.type == "cuda" and stored.device.type == "cpu" and stored.is_pinned()


def store(stored: torch.Tensor, value: torch.Tensor) -> None:
    """Write `value` (of `stored`'s size) into `stored`, where it is kept between merges."""
    if value is stored:
        return
    value = value.view_as(stored)
    if not _asynchronous(stored, value):
        stored.copy_(value)
        return
    stored.copy_(value, non_blocking=True)
    _pending[stored.data_ptr()] = (torch.cuda.current_stream(value.device).record_event(), value.device)


def fetched(stored: torch.Tensor, fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fetch(stored)`, once the last copy `store` started into `stored` has landed (the current
    stream of the device it came from waits for it; the host does not)."""
    pending = _pending.get(stored.data_ptr())
    if pending is not None:
        event, device = pending
        torch.cuda.current_stream(device).wait_event(event)
    return fetch(stored)


def settle() -> None:
    """Wait, on the host, for every copy `store` started: stored tensors may then be read there."""
    while _pending:
        event, _ = _pending.popitem()[1]
        event.synchronize()
