"""Restore: the peak host memory of resuming a run, against the state the resume loads.

`restore_peak_ratio` measures it in two fresh processes, one after the other:

1. a run of R workers (DiLoCo, AdamW inner optimizers, H = 1, one step) trains its round
   and writes its checkpoint at the end, as `isoloco train` does;
2. a new process builds the same run's trainer (model, data, optimizers without state),
   resets the kernel's high-water mark of its resident memory (/proc/self/clear_refs),
   notes its resident memory, and calls `Trainer.restore`, the code path of
   `isoloco train --resume`: finding and verifying the checkpoint (every file hashed), θ, the
   workers' inner optimizer state and the outer momentum.

The figure is (high-water mark after the restore − resident memory before it) ÷ the bytes of
state the restore adds to host memory: the workers' optimizer state (host memory on the CPU,
and on a GPU with `offload_workers=true`, which this run sets) and, on the CPU, the outer
momentum. θ is not counted: it is copied into parameters the trainer already holds, so it
adds no memory, and counting it would make the ratio look better than it is. The peak is the
kernel's, so it counts what torch, the allocator and safetensors really hold, including
memory freed but not yet returned and the pages of any memory-mapped file; 1.0 is the state
itself and anything above it is what the restore costs on top (the target is at most 1.2).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from isoloco import checkpoint as ckpt
from isoloco.algorithms import OUTER_FILE
from isoloco.bench.memory import in_fresh_processes, peak, start_span
from isoloco.config import resolve
from isoloco.rundir import CHECKPOINT_DIR
from isoloco.trainer import Trainer

HOST = torch.device("cpu")


def run_config(workers: int, preset: str, device: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """One round of one step per worker, a row of the batch each, checkpointed at its end."""
    return {"method": "diloco", "model": preset, "workers": workers, "global_batch": workers, "seq_len": 32,
            "inner_steps": 1, "steps": 1, "eval_batch": 8, "data.val_tokens": 1024, "offload_workers": True,
            "device": device, **(overrides or {})}


def _train(config: dict[str, Any], out: Path) -> None:
    Trainer(resolve(None, config), out, progress=False).run()


def _restore(config: dict[str, Any], out: Path) -> tuple[int, int]:
    """(peak growth of resident memory over `Trainer.restore`, bytes of state it adds to host memory)."""
    trainer = Trainer(resolve(None, config), out, progress=False)
    before = start_span(HOST)
    if trainer.restore() is None:
        raise RuntimeError(f"no checkpoint to restore in {out}")
    growth = peak(HOST) - before
    path = ckpt.latest_checkpoint(out / CHECKPOINT_DIR)
    stems = [file.stem for file in path.glob("workers-*.safetensors")]
    stems += [OUTER_FILE] if trainer.device.type == "cpu" else []
    loaded = 0
    for stem in stems:
        with ckpt.open_tensors(path, stem) as saved:
            loaded += saved.nbytes()
    return growth, loaded


def restore_peak_ratio(workers: int = 16, preset: str = "tiny", device: str = "cpu",
                       overrides: dict[str, Any] | None = None) -> float:
    """Peak host memory of restoring an R-worker run ÷ the state it loads (see the module's
    docstring for what each side counts). `overrides` go to the run config, e.g. a smaller
    vocabulary (`data.vocab_size`) or another inner optimizer."""
    config = run_config(workers, preset, device, overrides)
    with tempfile.TemporaryDirectory(prefix="isoloco-restore-") as tmp:
        out = Path(tmp) / "run"
        out.mkdir()
        _, (growth, loaded) = in_fresh_processes([(_train, (config, out)), (_restore, (config, out))])
    return growth / loaded
