"""Metrics: one JSON line per step in `metrics.jsonl`, written as each round ends, optionally mirrored
to TensorBoard / W&B.

The file is append-only; a resumed run first truncates it to the length recorded in the
checkpoint, so a crash never leaves duplicated or orphaned lines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path, truncate_to: int | None = None, tensorboard_dir: Path | None = None,
                 wandb_project: str | None = None, run_name: str = "", config: dict | None = None):
        self.path = path
        if truncate_to is not None and path.exists():
            with open(path, "r+b") as handle:
                handle.truncate(truncate_to)
        self._file = open(path, "a")
        self._tensorboard = None
        self._wandb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("log.tensorboard=true needs TensorBoard: pip install 'isoloco[tensorboard]'") from err
            self._tensorboard = SummaryWriter(str(tensorboard_dir))
        if wandb_project is not None:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError("log.wandb=true needs Weights & Biases: pip install 'isoloco[wandb]'") from err
            # Offline unless the user asked otherwise: a run must not fail for lack of network.
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(path.parent))

    def write(self, record: dict[str, Any]) -> None:
        # Flushed line by line (not synced: a checkpoint syncs), so the file shows a run's progress.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def flush(self) -> int:
        """Flush to disk and return the file length (what a checkpoint records)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


class NullMetricsLog:
    """Stands in for `MetricsLog` on every process but rank 0: metrics are computed (their
    reductions are collectives every process joins) but written once."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def flush(self) -> int:
        return 0

    def close(self) -> None:
        pass
