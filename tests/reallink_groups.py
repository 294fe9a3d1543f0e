"""One torchft replica group inside an island's network namespace, for tests/test_reallink.py.

    python tests/reallink_groups.py SETTINGS.json REPLICA

SETTINGS.json holds `out` (a folder both islands see), `host` (this island's address), `overrides`
(of torchft_groups' tiny run), `lighthouse` (its address, http://HOST:PORT), `pace_s` (seconds each
inner step is made to last, so the test can act between synchronisations; `linger_s` while the
file `out/linger` exists) and `timeout_s` (torchft's timeouts). Replica 0 also starts the lighthouse there, in its own namespace. Each group
waits for the other before its first step (so both are in the first quorum), records every
synchronisation (`torchft_groups.record_synchronisations`), writes its last step to `out/step-R`,
and leaves its run in `out/group-R`; replica 0 keeps the lighthouse up until replica 1 is done.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from torchft_groups import HEARTBEAT_MS, config, record_synchronisations

WAIT_S = 300  # a cap on waiting for the other group; a test fails long before


def _await(path: Path) -> None:
    end = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"{path} never came")
        time.sleep(0.05)


def main(settings_path: str, replica: int) -> None:
    from isoloco.torchft.replica import run_replica_group, start_lighthouse

    torch.set_num_threads(1)
    settings = json.loads(Path(settings_path).read_text())
    out = Path(settings["out"])
    server = None
    if replica == 0:
        bind = settings["lighthouse"].removeprefix("http://")
        # min_replicas=1: a quorum of the survivor alone forms once the cut group has missed its
        # heartbeats for a second.
        server, _ = start_lighthouse(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS, bind=bind)
        (out / "lighthouse-up").touch()
    else:
        _await(out / "lighthouse-up")

    def on_step(step: int, loss: float, model: torch.nn.Module) -> None:
        if step == 0:
            (out / f"started-{replica}").touch()
            _await(out / f"started-{1 - replica}")
        (out / f"step-{replica}.tmp").write_text(str(step))
        (out / f"step-{replica}.tmp").replace(out / f"step-{replica}")
        time.sleep(settings["linger_s"] if (out / "linger").exists() else settings["pace_s"])

    record_synchronisations(out / f"group-{replica}")
    try:
        run = run_replica_group(config(**settings["overrides"]), replica, settings["lighthouse"],
                                host=settings["host"], timeout=timedelta(seconds=settings["timeout_s"]),
                                on_step=on_step)
        run.save(out / f"group-{replica}")
        (out / f"done-{replica}").touch()
        if server is not None:
            _await(out / "done-1")
    finally:
        if server is not None:
            server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
