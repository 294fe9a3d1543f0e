"""Helpers shared by test modules: the tiny run most tests train, and comparisons of results."""

import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from isoloco import checkpoint as ckpt
from isoloco.comm import Communicator
from isoloco.sync.handles import Pending

#: Where device-agnostic training tests run (see conftest.py).
TEST_DEVICE = os.environ.get("ISOLOCO_TEST_DEVICE", "cpu")

#: The smallest run worth training: the tiny model, 32-token sequences, a 512-token vocabulary.
#: Tests add steps, workers, H and the method.
SMALL = {"model": "tiny", "seq_len": 32, "global_batch": 8, "eval_batch": 8, "data.vocab_size": 512,
         "data.val_tokens": 1024, "checkpoint_every": 0, "device": TEST_DEVICE}

#: The same as `isoloco train` arguments, on the CPU (tests that start processes).
SMALL_ARGS = ["model=tiny", "seq_len=32", "global_batch=8", "data.vocab_size=512", "data.val_tokens=1024",
              "device=cpu"]

#: The environment of a training process started by a test: one thread, as `make test` runs.
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def final_params(run: Path) -> dict[str, torch.Tensor]:
    """θ of a run directory's newest checkpoint."""
    return load_file(str(ckpt.latest_checkpoint(run / "checkpoints") / "global.safetensors"))


def assert_close_relative(ours: list[torch.Tensor], reference: list[torch.Tensor], rtol: float,
                          names: list[str] | None = None) -> None:
    """Relative error per tensor, ||x - y|| / ||y|| (Frobenius), at most `rtol`."""
    names = names or [str(i) for i in range(len(reference))]
    for name, x, y in zip(names, ours, reference, strict=True):
        error = (torch.linalg.norm(x - y) / torch.linalg.norm(y)).item()
        assert error <= rtol, f"{name}: relative error {error:.2e}"


class ProcessGroup:
    """Processes simulated by threads that exchange tensors through shared slots."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=60)

    def communicators(self, workers_per_process: int) -> list["ThreadCommunicator"]:
        return [ThreadCommunicator(self, rank, workers_per_process) for rank in range(self.world_size)]

    def exchange(self, rank: int, item) -> list:
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return items


class ThreadCommunicator(Communicator):
    """One simulated process holding `workers_per_process` consecutive workers."""

    def __init__(self, group: ProcessGroup, rank: int, workers_per_process: int) -> None:
        super().__init__()
        self.group, self.rank, self.workers_per_process = group, rank, workers_per_process

    @property
    def num_workers(self) -> int:
        return self.group.world_size * self.workers_per_process

    @property
    def local_worker_ids(self) -> list[int]:
        start = self.rank * self.workers_per_process
        return list(range(start, start + self.workers_per_process))

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t for part in self.group.exchange(self.rank, list(tensors)) for t in part]

    # Every simulated process is an island of its own: the compressed sum's collectives.

    @property
    def islands(self) -> int:
        return self.group.world_size

    @property
    def island(self) -> int:
        return self.rank

    def exchange(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Pending:
        everyone = self.group.exchange(self.rank, list(torch.split(send, send_sizes)))
        received = [parts[self.rank].clone() for parts in everyone]
        assert [r.numel() for r in received] == receive_sizes
        return Pending.done(received)

    def gather_peers(self, blob: torch.Tensor) -> Pending:
        return Pending.done([b.clone() for b in self.group.exchange(self.rank, blob)])
