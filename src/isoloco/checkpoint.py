"""Checkpoints: safetensors for tensors, JSON for the rest, written atomically and verified.

A checkpoint is a directory `OUT/checkpoints/step_XXXXXXXX/`. It is written under a
temporary name and renamed into place only once every file is complete and synced, so a
run killed at any moment leaves either the previous checkpoints alone or a finished new
one. `state.json` records a SHA-256 per tensor file; loading checks them, so a damaged
checkpoint is reported (and skipped for the previous one) instead of resuming from garbage.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from isoloco.errors import CheckpointError
from isoloco.fileutil import file_sha256

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a synced temporary file and a rename."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True))


#: torch dtypes by their safetensors names.
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` in the safetensors format one tensor at a time.

    safetensors' own `save_file` first turns every tensor into bytes in memory and refuses
    tensors that share storage (so callers clone them): two extra copies of the state at save
    time. Here a CPU tensor is written from its own memory and a GPU tensor is copied to the
    CPU alone, so a checkpoint costs at most one tensor of extra memory. `load_file` reads it.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in sorted(tensors.items()):
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name, tensor in sorted(tensors.items()):
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            handle.write(memoryview(data.view(torch.uint8).numpy()))


# Writing a checkpoint: stage a directory, write the tensor files into it (several processes
# may each write their own), publish it with state.json and a rename, prune old ones; on an OS
# error abandon it, keeping the previous checkpoints (`isoloco.sharded_checkpoint.save`).


def stage_checkpoint(root: Path, step: int) -> Path:
    """Create the empty temporary directory that checkpoint `step` is written into."""
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{_TMP_PREFIX}{_PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def write_tensor_file(staging: Path, stem: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write and sync `stem.safetensors` in `staging`; return {file name: SHA-256}."""
    path = staging / f"{stem}.safetensors"
    write_safetensors(path, tensors)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return {path.name: file_sha256(path)}


def publish_checkpoint(root: Path, staging: Path, step: int, checksums: dict[str, str],
                       state: dict[str, Any]) -> Path:
    """Write state.json (last: it makes the files a checkpoint) and rename `staging` into place."""
    payload = {"format_version": FORMAT_VERSION, "step": step, "checksums": checksums, **state}
    write_json_atomic(staging / STATE_FILE, payload)
    _fsync_dir(staging)
    final = root / f"{_PREFIX}{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    return final


def abandon_checkpoint(root: Path, staging: Path | None, step: int, reason: str) -> CheckpointError:
    """Remove a partial checkpoint; return the error to raise, saying what survived."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    previous = latest_checkpoint(root)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"could not write checkpoint at step {step} ({reason}); {kept}")


def prune_checkpoints(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints."""
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (temporary ones are ignored)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def remove_partial(root: Path) -> None:
    """Delete temporary directories left by a run killed while writing a checkpoint."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def verify(path: Path) -> dict[str, Any]:
    """Read a checkpoint's state.json and check every tensor file's checksum."""
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}")
    try:
        state = json.loads(state_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is damaged ({err})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {state.get('format_version')}, expected {FORMAT_VERSION}")
    for name, expected in state["checksums"].items():
        file = path / name
        if not file.is_file() or file_sha256(file) != expected:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or its checksum does not match")
    return state


def load_latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back to older ones with a warning."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path)
        except CheckpointError as err:
            logger.warning("%s; trying an earlier checkpoint", err)
    return None


def load_tensors(path: Path, stem: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return load_file(str(path / f"{stem}.safetensors"), device=str(device))


def flatten_optimizer_state(state_dict: dict, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer's per-parameter state into tensors and JSON scalars.

    Hyper-parameters (param_groups) are not saved: they are rebuilt from the config and the
    learning rate is recomputed from the step, so only the per-parameter state matters.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, entry in state_dict["state"].items():
        for key, value in entry.items():
            name = f"{prefix}.{index}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = value
            else:
                scalars[name] = value
    return tensors, scalars


def unflatten_optimizer_state(template: dict, tensors: dict[str, torch.Tensor], scalars: dict[str, Any],
                              prefix: str) -> dict:
    """Rebuild a state_dict for `optimizer.load_state_dict` from `flatten_optimizer_state` output."""
    state: dict[int, dict[str, Any]] = {}
    marker = f"{prefix}."
    for source in (tensors, scalars):
        for name, value in source.items():
            if name.startswith(marker):
                index, key = name[len(marker):].split(".", 1)
                state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": template["param_groups"]}
