"""Small file helpers shared by checkpoints, data preparation and the commands' outputs."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks (shards and checkpoints can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def output_dir_problem(folder: Path) -> str | None:
    """Why a command could not write directory `folder` (made if missing), in words, or None.

    Tried by making and removing an empty folder where the writes would go: permission bits do
    not tell (root ignores them, and /proc or /sys refuse whatever they say)."""
    existing = folder
    try:
        if folder.exists() and not folder.is_dir():
            return "is a file, not a directory"
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            return f"cannot be made: {existing} is a file, not a directory"
        os.rmdir(tempfile.mkdtemp(prefix=".isoloco-probe-", dir=existing))
    except OSError as err:
        return f"cannot be written: {existing} refuses new folders ({err.strerror})"
    return None
