"""Peer watchdog: when one process of a run dies or hangs, every other one stops, naming it.

A collective with a dead peer fails at once (gloo: "connection closed by peer"), but says
only an address; a hung peer blocks it until the backend's timeout; and a process busy
with its inner steps between synchronisations notices nothing at all. So every process runs
a daemon thread that, every `interval`, bumps its own heartbeat counter in the rendezvous
store and reads every peer's counter and failure note in one round trip, and a second one
that judges what the first has read:

* a peer that posted a failure note (it raised) stops this process at once, quoting it;
* a peer whose counter has not moved for `silence_s` (`dist.peer_silence_s`: dead, hung, or
  its node gone) stops this process, naming its rank and its island;
* a store that has not answered for `silence_s` stops this process, naming the island that
  hosts it (island 0). A store request over a link that went down does not fail: torch's
  client waits for the reply without a deadline (after its own timeout it asks the store to
  stop waiting, and waits for that reply too), holding the store connection's lock, so the
  judge never waits on the store itself, and a failure note is posted with a deadline.

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

    def __init__(self, store: dist.Store, rank: int, world_size: int, silence_s: float,
                 island_size: int | None = None) -> None:
        """`island_size`: the processes of an island (islands are consecutive ranks), so that
        messages name a lost rank's island; None: name ranks only."""
        self.rank = rank
        self.world_size = world_size
        self.silence_s = silence_s
        self.island_size = island_size
        self.interval = max(0.05, min(1.0, silence_s / 10))
        self._store = store
        self._keys = [f"beat/{r}" for r in range(world_size)] + [f"failed/{r}" for r in range(world_size)]
        self._last: dict[int, tuple[bytes, float]] = {}  # peer -> (last counter seen, when it changed)
        self._notes: dict[int, str] = {}  # peer -> failure note it posted
        self._contact = 0.0  # when the store last answered a round trip
        self._lost_store: str | None = None  # why a store request failed
        self._failing = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="isoloco-peer-watchdog", daemon=True)
        self._heartbeat = threading.Thread(target=self._beat, name="isoloco-peer-heartbeat", daemon=True)

    @classmethod
    def connect(cls, rank: int, world_size: int, silence_s: float, island_size: int | None = None) -> PeerWatchdog:
        """A watchdog on its own connection to the store at MASTER_ADDR:MASTER_PORT (torchrun's);
        a store that does not answer within `silence_s` is lost too."""
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = datetime.timedelta(seconds=silence_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        # A torchrun restart reuses the store: keep each attempt's heartbeats apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"isoloco/watchdog/{attempt}/", store), rank, world_size, silence_s, island_size)

    def register(self) -> None:
        """Create this process's keys; every process must register before any `start`s
        (reading a key that does not exist yet would block)."""
        self._store.set(f"beat/{self.rank}", b"0")
        self._store.set(f"failed/{self.rank}", b"")

    def start(self) -> None:
        now = time.monotonic()
        self._last = {peer: (b"", now) for peer in range(self.world_size) if peer != self.rank}
        self._contact = now
        self._heartbeat.start()
        self._thread.start()

    def stop(self, done: bool) -> None:
        """Stop watching; with `done`, tell the peers this process finished (it is not lost)."""
        self._stopped.set()
        for thread in (self._thread, self._heartbeat):
            if thread.is_alive():
                thread.join()
        if done:
            self._store.set(f"beat/{self.rank}", _DONE)

    def report_failure(self, note: str, second_hand: bool = False) -> None:
        """Post why this process is stopping, so that its peers stop now and say why;
        `second_hand`: because of another process, which `note` describes. Waits for the store
        a few heartbeats at most: over a link that is down it would wait for ever."""
        self._failing = True
        note = f"rank {self.rank} stopped because {note}" if second_hand else f"rank {self.rank} failed: {note}"
        if self._store_loss(self.silence_s):
            return  # the store is lost: the peers will notice the silence instead

        def post() -> None:
            try:
                self._store.set(f"failed/{self.rank}", note.encode())
            except (RuntimeError, OSError):
                pass  # the store is gone too: the peers will notice the silence instead

        posting = threading.Thread(target=post, name="isoloco-failure-note", daemon=True)
        posting.start()
        posting.join(max(1.0, 5 * self.interval))

    def diagnose(self) -> str | None:
        """After a collective failed here: describe the peer that failed or fell silent (for
        a few heartbeats), waiting a few heartbeats for it; None if every peer seems healthy."""
        deadline = time.monotonic() + 5 * self.interval
        while True:
            if self._notes:
                return self._describe_notes()
            silent = self._silent_peers(3 * self.interval)
            lost = self._store_loss(3 * self.interval)
            if silent or lost or time.monotonic() >= deadline or not self._thread.is_alive():
                return lost or (self._describe_silent(silent, 3 * self.interval) if silent else None)
            time.sleep(self.interval)

    # -- the thread ------------------------------------------------------------------------

    def _beat(self) -> None:
        """The heartbeat thread: bump this process's counter and read the peers' every interval.
        A round trip may block for ever (a link down); `_watch` judges without it."""
        beat = 0
        while not self._stopped.wait(self.interval):
            beat += 1
            try:
                self._store.set(f"beat/{self.rank}", str(beat).encode())
                values = self._store.multi_get(self._keys)
            except (RuntimeError, OSError) as err:
                self._lost_store = first_line(err)
                return
            now = time.monotonic()
            beats, notes = values[: self.world_size], values[self.world_size:]
            for peer in self._last:
                if notes[peer]:
                    self._notes[peer] = notes[peer].decode(errors="replace")
                elif beats[peer] != self._last[peer][0]:
                    self._last[peer] = (beats[peer], now)
            self._contact = now

    def _watch(self) -> None:
        """The judge: every interval, what the heartbeat thread last read, and how long ago."""
        while not self._stopped.wait(self.interval):
            lost = self._store_loss(self.silence_s)
            if lost:
                self._stop_process(lost)
                return
            if self._notes:
                self._stop_process(self._describe_notes())
                return
            silent = self._silent_peers(self.silence_s)
            if silent:
                self._stop_process(self._describe_silent(silent, self.silence_s) + " (dist.peer_silence_s)")
                return

    def _store_loss(self, seconds: float) -> str | None:
        """Why the store counts as lost (a request failed, or none answered for `seconds`), or None."""
        if self._lost_store is None and time.monotonic() - self._contact <= seconds:
            return None
        why = self._lost_store or f"no answer for {seconds:.1f}s"
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if self._island(0) is None:
            return (f"lost the rendezvous store at {where} ({why}); the process that hosts it (rank 0, or the "
                    "torchrun agent of node 0) is gone")
        return (f"lost the rendezvous store at {where} ({why}); island 0, whose node hosts it (rank 0, or the "
                "torchrun agent of node 0), is gone, or the link to island 0 is down")

    def _island(self, rank: int) -> int | None:
        """The island of `rank`, where the run has several and this watchdog knows them."""
        if self.island_size is None or self.world_size // self.island_size < 2:
            return None
        return rank // self.island_size

    def _describe_notes(self) -> str:
        """The peers' failure notes, first-hand ones only when there are any (a peer that
        stopped because of another one repeats that one's note)."""
        notes = list(self._notes.values())  # the heartbeat thread may add one meanwhile
        first_hand = [note for note in notes if " stopped because " not in note]
        return "; ".join(first_hand or notes)

    def _silent_peers(self, seconds: float) -> list[int]:
        """The peers whose counter had not moved for `seconds` when the store last answered
        (what the store has not said since is the store's silence, not theirs)."""
        return sorted(peer for peer, (value, since) in self._last.items()
                      if value != _DONE and self._contact - since > seconds)

    def _describe_silent(self, peers: list[int], seconds: float) -> str:
        which = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {', '.join(map(str, peers))}"
        text = f"{which} stopped answering (no heartbeat for {seconds:.1f}s): it died or hung"
        islands = sorted({self._island(peer) for peer in peers} - {None})
        if islands:
            named = f"island {islands[0]}" if len(islands) == 1 else f"islands {', '.join(map(str, islands))}"
            text += f", or the link to {named} is down"
        return text

    def _stop_process(self, reason: str) -> None:
        if self._failing or self._stopped.is_set():
            return  # the main thread is already reporting its own failure
        # Logging's stderr handlers flush every record: the line is out before the exit.
        logger.error("%s; stopping this process", reason)  # other ranks are marked by the formatter
        self.report_failure(reason, second_hand=True)
        os._exit(EXIT_PEER_LOST)

