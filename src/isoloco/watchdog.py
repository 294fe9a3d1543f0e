"""Peer watchdog: when one process of a run dies or hangs, every other one stops, naming it.

A collective with a dead peer fails at once (gloo: "connection closed by peer"), but says
only an address; a hung peer blocks it until the backend's timeout; and a process busy
with its inner steps between synchronisations notices nothing at all. So every process runs
a daemon thread that, every `interval`, bumps its own heartbeat counter in the rendezvous
store and reads every peer's counter and failure note in one round trip:

* a peer that posted a failure note (it raised) stops this process at once, quoting it;
* a peer whose counter has not moved for `silence_s` (`dist.peer_silence_s`: dead, hung, or
  its node gone) stops this process, naming its rank.

The heartbeat is this thread's, not the training loop's: a long inner step or a checkpoint
write (I/O and C code that let the thread run) is not silence. So `silence_s` can be far
shorter than `dist.timeout_s`, the collectives' timeout, which must cover such waits.

Stopping is `os._exit(EXIT_PEER_LOST)` after one line on stderr: the main thread may be
blocked inside a collective that would never return. The last complete checkpoint is safe
(checkpoints are published by an atomic rename). Counters rather than timestamps, because
the clocks of different nodes need not agree. The watchdog talks to the store over its own
connection so it never queues behind a store wait of the main thread.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time

import torch.distributed as dist

from isoloco.errors import EXIT_PEER_LOST, first_line

logger = logging.getLogger(__name__)

_DONE = b"done"


class PeerWatchdog:
    """Heartbeats of the `world_size` processes of a run, kept in a torch.distributed store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, silence_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.silence_s = silence_s
        self.interval = max(0.05, min(1.0, silence_s / 10))
        self._store = store
        self._keys = [f"beat/{r}" for r in range(world_size)] + [f"failed/{r}" for r in range(world_size)]
        self._last: dict[int, tuple[bytes, float]] = {}  # peer -> (last counter seen, when it changed)
        self._notes: dict[int, str] = {}  # peer -> failure note it posted
        self._failing = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="isoloco-peer-watchdog", daemon=True)

    @classmethod
    def connect(cls, rank: int, world_size: int, silence_s: float) -> PeerWatchdog:
        """A watchdog on its own connection to the store at MASTER_ADDR:MASTER_PORT (torchrun's);
        a store that does not answer within `silence_s` is lost too."""
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = datetime.timedelta(seconds=silence_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        # A torchrun restart reuses the store: keep each attempt's heartbeats apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"isoloco/watchdog/{attempt}/", store), rank, world_size, silence_s)

    def register(self) -> None:
        """Create this process's keys; every process must register before any `start`s
        (reading a key that does not exist yet would block)."""
        self._store.set(f"beat/{self.rank}", b"0")
        self._store.set(f"failed/{self.rank}", b"")

    def start(self) -> None:
        now = time.monotonic()
        self._last = {peer: (b"", now) for peer in range(self.world_size) if peer != self.rank}
        self._thread.start()

    def stop(self, done: bool) -> None:
        """Stop watching; with `done`, tell the peers this process finished (it is not lost)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        if done:
            self._store.set(f"beat/{self.rank}", _DONE)

    def report_failure(self, note: str, second_hand: bool = False) -> None:
        """Post why this process is stopping, so that its peers stop now and say why;
        `second_hand`: because of another process, which `note` describes."""
        self._failing = True
        note = f"rank {self.rank} stopped because {note}" if second_hand else f"rank {self.rank} failed: {note}"
        try:
            self._store.set(f"failed/{self.rank}", note.encode())
        except (RuntimeError, OSError):
            pass  # the store is gone too: the peers will notice the silence instead

    def diagnose(self) -> str | None:
        """After a collective failed here: describe the peer that failed or fell silent (for
        a few heartbeats), waiting a few heartbeats for it; None if every peer seems healthy."""
        deadline = time.monotonic() + 5 * self.interval
        while True:
            if self._notes:
                return self._describe_notes()
            silent = self._silent_peers(3 * self.interval)
            if silent or time.monotonic() >= deadline or not self._thread.is_alive():
                return self._describe_silent(silent, 3 * self.interval) if silent else None
            time.sleep(self.interval)

    # -- the thread ------------------------------------------------------------------------

    def _watch(self) -> None:
        beat = 0
        while not self._stopped.wait(self.interval):
            beat += 1
            try:
                self._store.set(f"beat/{self.rank}", str(beat).encode())
                values = self._store.multi_get(self._keys)
            except (RuntimeError, OSError) as err:
                if self._stopped.is_set():
                    return
                self._stop_process(f"lost the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                                   f"{os.environ.get('MASTER_PORT')} ({first_line(err)}); the process that "
                                   "hosts it (rank 0, or the torchrun agent of node 0) is gone")
                return
            now = time.monotonic()
            beats, notes = values[: self.world_size], values[self.world_size:]
            for peer in self._last:
                if notes[peer]:
                    self._notes[peer] = notes[peer].decode(errors="replace")
                elif beats[peer] != self._last[peer][0]:
                    self._last[peer] = (beats[peer], now)
            if self._notes:
                self._stop_process(self._describe_notes())
                return
            silent = self._silent_peers(self.silence_s)
            if silent:
                self._stop_process(self._describe_silent(silent, self.silence_s) + " (dist.peer_silence_s)")
                return

    def _describe_notes(self) -> str:
        """The peers' failure notes, first-hand ones only when there are any (a peer that
        stopped because of another one repeats that one's note)."""
        first_hand = [note for note in self._notes.values() if " stopped because " not in note]
        return "; ".join(first_hand or self._notes.values())

    def _silent_peers(self, seconds: float) -> list[int]:
        now = time.monotonic()
        return sorted(peer for peer, (value, since) in self._last.items()
                      if value != _DONE and now - since > seconds)

    def _describe_silent(self, peers: list[int], seconds: float) -> str:
        which = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {', '.join(map(str, peers))}"
        return f"{which} stopped answering (no heartbeat for {seconds:.1f}s): it died or hung"

    def _stop_process(self, reason: str) -> None:
        if self._failing or self._stopped.is_set():
            return  # the main thread is already reporting its own failure
        # Logging's stderr handlers flush every record: the line is out before the exit.
        logger.error("%s; stopping this process", reason)  # other ranks are marked by the formatter
        self.report_failure(reason, second_hand=True)
        os._exit(EXIT_PEER_LOST)

