"""Graceful stop on SIGINT/SIGTERM: finish the round, write a checkpoint, exit cleanly.

Mid-round state (workers part-way through their inner steps) is not checkpointed, so the
first signal asks the loop to stop at the next synchronisation, where a checkpoint is
complete; a second signal stops at once (losing only the work since the last checkpoint).
"""

from __future__ import annotations

import signal
import threading


class StopRequested(Exception):
    """Raised by the training loop after it checkpointed in answer to a signal."""

    def __init__(self, signum: int, step: int):
        self.signum = signum
        self.step = step
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step} after writing a checkpoint")


class GracefulStop:
    """Install handlers for SIGINT and SIGTERM until `restore` (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # second signal: stop now
        self.signum = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
