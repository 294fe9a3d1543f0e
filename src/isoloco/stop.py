"""Graceful stop on SIGINT/SIGTERM: finish the round, write a checkpoint, exit cleanly.

Mid-round state (workers part-way through their inner steps) is not checkpointed, so the
first signal asks the loop to stop at the next synchronisation, where a checkpoint is
complete; a second signal stops at once (losing only the work since the last checkpoint).
Before the loop starts (a run's start-up) there is no round to finish: `StopAtOnce` makes
SIGTERM stop at once there, as Ctrl-C does, so that the command can say so.
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


class Interrupted(KeyboardInterrupt):
    """A stop signal acted on at once (`StopAtOnce`), as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopAtOnce:
    """Until `restore` (or the end of a `with` block): SIGTERM raises `Interrupted` in the main
    thread, where its default would end the process without a word. A `GracefulStop` made
    meanwhile takes over, and gives it back when restored."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                self._previous[signum] = signal.signal(signum, self._handle)

    @staticmethod
    def _handle(signum: int, _frame) -> None:
        raise Interrupted(signum)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> "StopAtOnce":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
