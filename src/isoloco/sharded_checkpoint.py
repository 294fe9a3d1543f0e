"""Checkpoints written by several processes: each writes its part, rank 0 publishes the whole.

State that every process holds alike (θ, the outer optimizer) is written once, by rank 0;
state only some processes hold (each island's workers' inner optimizers)
is written by those processes. All parts go into one staging directory, and rank 0 writes
`state.json` — with every part's checksum — and renames the directory into place only after
every process reported its part complete. So, as with one process (`isoloco.checkpoint`),
a checkpoint is whole or absent, whichever process dies when. Every process learns the
outcome, so a failed write raises the same `CheckpointError` everywhere instead of leaving
some processes waiting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from isoloco import checkpoint as ckpt
from isoloco.distributed import Distributed


def save(group: Distributed, root: Path, step: int, files: dict[str, dict[str, torch.Tensor]],
         scalars: dict[str, Any], state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step`; every process calls this with its own `files`.

    `files` (file stem -> tensors) and `scalars` (JSON values) are this process's part; stems
    and scalar keys must be unique across processes. `scalars` of all processes are merged
    into state.json's "scalars"; `state` (rank 0's) holds the rest of state.json.
    """
    staging, error = None, None
    if group.is_main:
        try:
            staging = ckpt.stage_checkpoint(root, step)
        except OSError as err:
            error = str(ckpt.abandon_checkpoint(root, None, step, err.strerror or str(err)))
    staging, error = group.broadcast_object((staging, error))
    if error:
        raise ckpt.CheckpointError(error)

    checksums, failure = {}, None
    try:
        for stem, tensors in files.items():
            checksums.update(ckpt.write_tensor_file(staging, stem, tensors))
    except OSError as err:
        failure = f"rank {group.rank}: {err.strerror or err}"
    reports = group.all_gather_object((checksums, scalars, failure))

    outcome = None
    if group.is_main:
        outcome = _publish(root, staging, step, reports, state, keep)
    final, error = group.broadcast_object(outcome)
    if error:
        raise ckpt.CheckpointError(error)
    return Path(final)


def _publish(root: Path, staging: Path, step: int, reports: list[tuple], state: dict[str, Any],
             keep: int) -> tuple[str | None, str | None]:
    """Rank 0: state.json and the rename, or the removal of the partial checkpoint."""
    failures = [failure for _, _, failure in reports if failure]
    if failures:
        return None, str(ckpt.abandon_checkpoint(root, staging, step, "; ".join(failures)))
    checksums, scalars = {}, {}
    for part_checksums, part_scalars, _ in reports:
        checksums.update(part_checksums)
        scalars.update(part_scalars)
    try:
        final = ckpt.publish_checkpoint(root, staging, step, checksums, {**state, "scalars": scalars})
    except OSError as err:
        return None, str(ckpt.abandon_checkpoint(root, staging, step, err.strerror or str(err)))
    ckpt.prune_checkpoints(root, keep)
    return str(final), None


def find_latest(group: Distributed, root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, as rank 0 finds it, with its state, on every
    process (so all resume from the same one); None when none was written yet. Rank 0 first
    removes partial checkpoints. When every checkpoint is damaged, every process raises: a
    resume must not quietly become a new run."""
    found, error = None, None
    if group.is_main:
        ckpt.remove_partial(root)
        try:
            found = ckpt.latest_to_resume(root)
        except ckpt.CheckpointError as err:
            error = str(err)
    found, error = group.broadcast_object((found, error))
    if error:
        raise ckpt.CheckpointError(error)
    return found
