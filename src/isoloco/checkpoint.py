"""Checkpoints: safetensors for tensors, JSON for the rest, written atomically and verified.

A checkpoint is a directory `OUT/checkpoints/step_XXXXXXXX/`. It is written under a
temporary name and renamed into place only once every file is complete and synced, so a
run killed at any moment leaves either the previous checkpoints alone or a finished new
one. `state.json` records a SHA-256 per tensor file; loading checks them (reading each file
in blocks), so a damaged checkpoint is reported (and skipped for the previous one) instead of
resuming from garbage. Nothing is ever unpickled.

A restore streams: a tensor file is opened lazily (`open_tensors`) and each tensor is read
when its destination asks for it, so restoring costs the state it loads plus one tensor.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from isoloco.errors import CheckpointError
from isoloco.fileutil import file_sha256

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


def workers_file(island: int) -> str:
    """The checkpoint file holding the state of island `island`'s workers."""
    return f"workers-{island}"


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
    CPU alone, so a checkpoint costs at most one tensor of extra memory. safetensors reads it.
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
    # Every bad file is named, so a message about a damaged checkpoint lists all it lost.
    bad = [name for name, expected in state["checksums"].items()
           if not (path / name).is_file() or file_sha256(path / name) != expected]
    if len(bad) == 1:
        raise CheckpointError(f"checkpoint {path}: {bad[0]} is missing or its checksum does not match")
    if bad:
        raise CheckpointError(f"checkpoint {path}: {', '.join(bad)} are missing or their checksums do not match")
    return state


def load_latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, with a warning for each newer one that does not;
    None when `root` holds no checkpoint. When every checkpoint is damaged, a CheckpointError
    names them all: a caller must not mistake that for a run with nothing saved yet."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            state = verify(path)
        except CheckpointError as err:
            damaged.append(str(err))
            continue
        for problem in damaged:
            logger.warning("%s; using the earlier %s", problem, path)
        return path, state
    if damaged:
        raise CheckpointError(f"every checkpoint in {root} is damaged ({'; '.join(damaged)})")
    return None


def latest_to_resume(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """`load_latest` for a resume, whose refusal when every checkpoint is damaged also says how
    to start over deliberately."""
    try:
        return load_latest(root)
    except CheckpointError as err:
        raise CheckpointError(f"{err}: nothing was resumed; to start over from step 0, delete {root} or train into "
                              "a new --out") from None


_ELEMENT_SIZES = {name: dtype.itemsize for dtype, name in _SAFETENSORS_DTYPES.items()}


class TensorFile(Mapping[str, torch.Tensor]):
    """An open tensor file as a mapping whose tensors are read only when asked for.

    Each tensor is read with `pread` into host memory of its own, not viewed through a memory
    map: the pages of a mapped file stay in the process's resident memory while it is open (a
    second copy of everything read), and a tensor viewing them would keep a pruned
    checkpoint's file on disk. Names and shapes come from the header alone. The caller puts
    each tensor where it lives (`param.copy_(saved[name])` on any device).
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._names = handle.offset_keys()  # in file order: a pass over them reads front to back
        self._known = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._handle.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(name).get_shape())

    def nbytes(self) -> int:
        """Bytes of all the file's tensors (from the header)."""
        total = 0
        for name in self._names:
            info = self._handle.get_slice(name)
            total += _ELEMENT_SIZES[info.get_dtype()] * int(torch.Size(info.get_shape()).numel())
        return total


@contextmanager
def open_tensors(path: Path, stem: str) -> Iterator[TensorFile]:
    """Checkpoint `path`'s file `stem`, open for reading tensor by tensor."""
    with safe_open(str(path / f"{stem}.safetensors"), framework="pt", backend="pread") as handle:
        yield TensorFile(handle)


def load_tensors(path: Path, stem: str) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint `path`'s file `stem`."""
    with open_tensors(path, stem) as saved:
        return dict(saved)


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


def saved_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, torch.Tensor],
                          scalars: Mapping[str, Any], prefix: str) -> Iterator[tuple[torch.Tensor, str, Any]]:
    """What `flatten_optimizer_state` saved under `prefix`, as (parameter, key, value) for
    `optimizer`, whose parameters are numbered as its `state_dict` numbers them.

    Each tensor is read from `saved` only when its turn comes, so a caller that places it
    before asking for the next holds one tensor beyond the state.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    marker = f"{prefix}."
    for source in (saved, scalars):
        for name in source:
            if not name.startswith(marker):
                continue
            index, key = name[len(marker):].split(".", 1)
            if int(index) >= len(params):
                raise CheckpointError(f"checkpoint entry {name} names parameter {index}, but this optimizer has "
                                      f"{len(params)}: it was written for another model or inner optimizer")
            param, value = params[int(index)], source[name]
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != param.shape:
                raise CheckpointError(f"checkpoint entry {name} is shaped {tuple(value.shape)}, its parameter "
                                      f"{tuple(param.shape)}: it was written for another model or inner optimizer")
            yield param, key, value
