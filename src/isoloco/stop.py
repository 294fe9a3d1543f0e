"""Graceful stop on SIGINT/SIGTERM: finish the round, write a checkpoint, exit cleanly.

Mid-round state (workers part-way through their inner steps) is not checkpointed, so the
first signal asks the loop to stop at the next synchronisation, where a checkpoint is
complete; a second signal stops at once (losing only the work since the last checkpoint).
Before the loop starts (a run's start-up) there is no round to finish: `StopAtOnce` makes a
signal stop at once there, so that the command can say so; once the loop has begun, it keeps
a signal that arrives after the loop for the command to acknowledge.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable


class StopRequested(Exception):
    """Raised by the training loop after it checkpointed in answer to a signal."""

    def __init__(self, signum: int, step: int):
        self.signum = signum
        self.step = step
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step} after writing a checkpoint")


class SecondSignal(KeyboardInterrupt):
    """A second stop signal, acted on at once: the work since the last checkpoint is lost."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class GracefulStop:
    """Install handlers for SIGINT and SIGTERM until `restore` (main thread only): the first
    signal is kept (`signum`) and handed to `said`, the second raises `SecondSignal`."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, said: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self._said = said
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = previous = signal.signal(signum, self._handle)
                # Taking over from a command's StopAtOnce: the loop has begun, so once these
                # handlers are given back, a signal is no longer a start-up stop.
                starting = getattr(previous, "__self__", None)
                if isinstance(starting, StopAtOnce):
                    starting.began = True

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            raise SecondSignal(signum)
        self.signum = signum
        if self._said is not None:
            self._said(signum)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> "GracefulStop":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


class Interrupted(KeyboardInterrupt):
    """A stop signal acted on at once (`StopAtOnce`), as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopAtOnce(GracefulStop):
    """A command's handlers for SIGINT and SIGTERM until `restore` (or the end of a `with`
    block). Until a training loop begins, a signal raises `Interrupted` in the main thread (where
    SIGTERM's default would end the process without a word). A `GracefulStop` made meanwhile (the
    loop's) takes over and marks that the loop began; when it gives the signals back, the run
    has checkpointed or is ending, so a signal from then on is kept, as `GracefulStop` keeps it,
    for the command to acknowledge once it is done."""

    def __init__(self) -> None:
        self.began = False
        super().__init__()

    def _handle(self, signum: int, frame) -> None:
        if not self.began:
            raise Interrupted(signum)
        super()._handle(signum, frame)
