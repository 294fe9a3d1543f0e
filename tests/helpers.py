"""Helpers shared by test modules: the tiny run most tests train, and comparisons of results."""

import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file

from isoloco import checkpoint as ckpt
from isoloco.comm import Communicator, nbytes
from isoloco.sync.cost import wire_bytes
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


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block, as the processes a test starts run (a LAPACK or
    matmul call on more threads may round differently)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: How long a test waits at most for a run it started to reach a point (a checkpoint, a step):
#: a cap against a run that hangs, far above any loaded machine's time; a run that ends first
#: fails the wait at once.
EVENT_CAP_S = 1800.0


def wait_for(reached: Callable[[], bool], proc: subprocess.Popen, what: str, cap_s: float = EVENT_CAP_S) -> None:
    """Wait until `reached()` holds while `proc` runs: on the event, not the clock, so a slow
    machine only waits longer. Fails, saying `what` was awaited, if `proc` ends first (with its
    exit status) or after `cap_s` seconds."""
    deadline = time.monotonic() + cap_s
    while not reached():
        status = proc.poll()
        if status is not None:
            if reached():  # the event, then the exit, between two looks
                return
            raise AssertionError(f"the run ended (exit status {status}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the run was still going after {cap_s:.0f} s without {what}")
        time.sleep(0.05)


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


def run_threads(fn, count: int) -> None:
    """fn(rank) for rank 0..count−1, each on a thread of its own (simulated processes); the first
    error any of them raised fails the caller."""
    errors: list = []

    def run(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as error:  # noqa: BLE001 — reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


class ProcessGroup:
    """Processes simulated by threads that exchange tensors through shared slots."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=60)

    def communicators(self, workers_per_process: int, slices: int = 1) -> list["ThreadCommunicator"]:
        """One per simulated process: islands of `slices` consecutive processes, each island
        holding `workers_per_process` workers (its processes are replicas that split its traffic)."""
        return [ThreadCommunicator(self, rank, workers_per_process, slices) for rank in range(self.world_size)]

    def exchange(self, rank: int, item) -> list:
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return items


class ThreadCommunicator(Communicator):
    """One simulated process of island rank // slices, carrying slice rank % slices of its
    cross-island traffic; every process takes part in every exchange (they run in lockstep)."""

    def __init__(self, group: ProcessGroup, rank: int, workers_per_process: int, slices: int = 1) -> None:
        super().__init__()
        self.group, self.rank, self.workers_per_process, self.slices = group, rank, workers_per_process, slices

    @property
    def num_workers(self) -> int:
        return self.islands * self.workers_per_process

    @property
    def local_worker_ids(self) -> list[int]:
        start = self.island * self.workers_per_process
        return list(range(start, start + self.workers_per_process))

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.slices == 1, "float32 sums are simulated for islands of one process"
        parts = self.group.exchange(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.slices == 1, "float32 gathers are simulated for islands of one process"
        return [t for part in self.group.exchange(self.rank, list(tensors)) for t in part]

    # The compressed sum's collectives: peers are the processes of the same slot in every island.

    @property
    def islands(self) -> int:
        return self.group.world_size // self.slices

    @property
    def island(self) -> int:
        return self.rank // self.slices

    @property
    def island_slices(self) -> tuple[int, int]:
        return self.slices, self.rank % self.slices

    def _peers(self) -> list[int]:
        return [island * self.slices + self.rank % self.slices for island in range(self.islands)]

    def _cross(self, kind: str, size: int, handed: int) -> None:
        """Count a collective across islands as `isoloco.torch_comm` measures it: the bytes
        it puts on the link for this process by the cost model."""
        self.record("cross_island", handed, wire_bytes(kind, size, self.islands))

    def exchange(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Pending:
        self._cross("all_to_all", nbytes(send) - send_sizes[self.island] * send.element_size(), nbytes(send))
        everyone = self.group.exchange(self.rank, list(torch.split(send, send_sizes)))
        received = [everyone[peer][self.island].clone() for peer in self._peers()]
        assert [r.numel() for r in received] == receive_sizes
        return Pending.done(received)

    def gather_peers(self, blob: torch.Tensor) -> Pending:
        self._cross("all_gather", nbytes(blob), nbytes(blob))
        everyone = self.group.exchange(self.rank, blob)
        return Pending.done([everyone[peer].clone() for peer in self._peers()])

    def join_island(self, part: torch.Tensor) -> Pending:
        everyone = self.group.exchange(self.rank, part)
        return Pending.done([everyone[self.island * self.slices + slot].clone() for slot in range(self.slices)])


def reference_sum(inputs: list[torch.Tensor], quantization, route: str,
                  residuals: list[torch.Tensor] | None = None, arrived: list[int] | None = None) -> torch.Tensor:
    """The compressed sum's semantics as a plain loop, written apart from the sync layer: each
    island's input rounded through the codec, added in island order, and on the exchange route
    the total rounded again. With `residuals` (one per island, updated in place) an island that
    arrived (all, unless `arrived` names them) sends x_i + e_i and keeps what its rounding lost;
    and island p keeps what the re-encoding of chunk p (whole groups, `shard_ranges` over the P
    islands) lost, whether it arrived or not."""
    from isoloco.sync.codec import dequantize, quantize, shard_ranges

    total = None
    for index, x in enumerate(inputs):
        feeds = residuals is not None and (arrived is None or index in arrived)
        sent = residuals[index].add_(x) if feeds else x
        decoded = dequantize(quantize(sent, quantization))
        if feeds:
            residuals[index].sub_(decoded)
        total = decoded.clone() if total is None else total.add_(decoded)
    if route == "gather":
        return total
    delivered = dequantize(quantize(total, quantization))
    if residuals is not None:
        lost = (total - delivered).reshape(-1)
        group = quantization.group_size(total.shape)
        for owner, (start, stop) in enumerate(shard_ranges(total.numel(), group, len(inputs))):
            residuals[owner].view(-1)[start:stop].add_(lost[start:stop])
    return delivered
