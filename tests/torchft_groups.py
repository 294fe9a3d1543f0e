"""What the torchft test modules share: their tiny run, the rules merged in the quorum,
replica-group processes started and joined with a deadline, and a recorder of what torchft's
DiLoCo does at each synchronisation (also used by the torchtitan tests)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from isoloco.config import resolve
from isoloco.train_config import TrainConfig
from isoloco.torchft import internals

import helpers

# The simulator tests' tiny setting (tests/test_trainer.py): 2 workers, 3 outer steps.
TINY = {**helpers.SMALL, "steps": 6, "inner_steps": 2, "workers": 2, "eval_every": 6, "device": "cpu"}

SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 300  # every process here finishes in well under a minute; this only bounds a hang
#: The lighthouse's heartbeat timeout here. A group whose run ended still counts as heartbeating
#: until it passes, and a quorum waits for half of those: with torchft's 5 s, each run that
#: follows another on one lighthouse would wait 5 s first.
HEARTBEAT_MS = 1000


def config(**overrides) -> TrainConfig:
    return resolve(None, {**TINY, **overrides})


def join_groups(processes: list, deadline_s: float = JOIN_S) -> None:
    """Wait for every process; kill any still running at the deadline and fail."""
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    assert not hung, f"replica group process(es) {hung} did not finish within {deadline_s} s"


def whole(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `tensor`, the whole tensor where it is a DTensor (a parameter under FSDP) or
    this process's shard of DTensor parameter `like` (torchft keeps θ and the pseudo-gradient as
    shards); every process of the group must call it."""
    if isinstance(like, DTensor) and not isinstance(tensor, DTensor):
        tensor = DTensor.from_local(tensor.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                                    stride=like.stride())
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def first_process() -> bool:
    """Whether this process writes what its replica group recorded: the group's first, where
    torch.distributed runs inside the group (torchtitan's FSDP), else its only one."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def record_synchronisations(prefix: Path) -> None:
    """Have torchft's fragments in this process write each synchronisation they commit or not
    as `prefix`-sync<round>: θ before it, the pseudo-gradient torchft has just taken (before any
    merge reads it), θ after it, the number of groups in the quorum and whether it committed."""
    from torchft.local_sgd import _StreamingDiLoCoFragment as Fragment

    take, synchronise = Fragment._save_grads, Fragment.perform_sync
    taken: dict = {}

    def save_grads(fragment) -> None:
        take(fragment)
        manager = internals.fragment_manager(fragment)
        params = dict(internals.fragment_model(fragment).named_parameters())
        taken.update(round=manager.current_step(), participants=manager.num_participants(), tensors={
            **{f"delta.{n}": whole(g, params[n]) for n, g in internals.pseudo_gradients(fragment).items()},
            **{f"before.{n}": whole(p, params[n]) for n, p in fragment.original_parameters.items()}})

    def perform_sync(fragment) -> bool:
        committed = synchronise(fragment)
        path = f"{prefix}-sync{taken['round']}"
        tensors = {**taken.pop("tensors"), **{f"after.{n}": whole(p)
                                              for n, p in internals.fragment_model(fragment).named_parameters()}}
        if first_process():
            save_file(tensors, f"{path}.safetensors")
            Path(f"{path}.json").write_text(json.dumps({**taken, "committed": committed}))
        return committed

    Fragment._save_grads, Fragment.perform_sync = save_grads, perform_sync
