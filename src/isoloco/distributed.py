"""The process runtime of a multi-process run: joining the job, its groups, the loop's collectives.

`process_group` joins the torchrun job (and starts the peer watchdog); `Distributed` holds
one run's layout (`isoloco.layout`), process groups, communicator (`isoloco.torch_comm`) and
the few collectives the training loop needs besides the merge: gradient averaging inside an
island, metrics, agreements, objects. `DistConfig` is how the processes are arranged and
talk. With one process every collective is a local no-op.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from isoloco.comm import LINK_COUNTS, Communicator, LocalCommunicator, nbytes
from isoloco.configbase import check_at_least, check_choices, check_positive, option
from isoloco.errors import CollectiveError, ConfigError, PeerLostError
from isoloco.layout import ProcessLayout
from isoloco.sync.plan import buckets
from isoloco.torch_comm import EmulatedLink, TorchCommunicator, collective
from isoloco.watchdog import PeerWatchdog

if TYPE_CHECKING:
    from isoloco.train_config import TrainConfig

BACKENDS = ("auto", "nccl", "gloo")
#: The named dimensions of a run's DeviceMesh: islands (its groups are the peer groups that
#: merge across the slow link) by the processes of one island (the fast link).
MESH_DIMS = ("islands", "island")


@dataclasses.dataclass
class DistConfig:
    """How the processes of a torchrun job are arranged and how they talk."""

    gpus_per_worker: int = option(
        1, "G: processes (GPUs) forming one DiLoCo worker; they split its batch and average gradients every "
           "inner step, and talk to other workers only at synchronisations (also settable as gpus_per_worker=G)")
    backend: str = option("auto", "torch.distributed backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo", BACKENDS)
    timeout_s: float = option(
        600.0, "seconds a collective waits for the other processes before it fails (the run then stops naming "
               "the lost rank); must exceed the longest legitimate wait inside one (a checkpoint write, an "
               "uneven round)")
    peer_silence_s: float = option(
        45.0, "seconds without a heartbeat from another process before it counts as dead or hung and the run "
              "stops naming it; heartbeats come from a thread of their own, so long inner steps and checkpoint "
              "writes do not count as silence")

    islands: int = option(
        0, "P: the islands of workers/P consecutive workers that a one-process run (the simulator) plays: a "
           "compressed merge (merge.quantize, merge.compress) then encodes each island's sum, the bits of a "
           "P-island job, and the slow link is modelled for P islands; 0: every worker an island of its own. A "
           "job's islands are its processes (processes / gpus_per_worker), and a nonzero value must name as many "
           "(also settable as islands=P)")

    emulate_link: str = option(
        "", "for measurements on one machine: GBPS,MS makes every collective between islands take as long as "
            "on a link of GBPS Gbit/s and MS ms latency (its wire bytes at that rate, plus the latency for each "
            "latency-bound step of its ring algorithm: 2(P−1) for an all-reduce over P islands, P−1 for the others); "
            "an emulation on top of loopback, not a network; empty: off")

    def validate(self) -> None:
        check_at_least("dist.gpus_per_worker", self.gpus_per_worker, 1)
        check_at_least("dist.islands", self.islands, 0)
        check_choices("dist", self)
        check_positive("dist.timeout_s", self.timeout_s)
        check_positive("dist.peer_silence_s", self.peer_silence_s)
        self.link()

    def link(self) -> EmulatedLink | None:
        """The emulated slow link `emulate_link` describes, or None."""
        if not self.emulate_link:
            return None
        try:
            gbps, latency_ms = (float(part) for part in str(self.emulate_link).split(","))
        except ValueError:
            gbps = latency_ms = -1.0
        if not (gbps > 0 and latency_ms >= 0):
            raise ConfigError(f"dist.emulate_link={self.emulate_link!r} is not allowed: write GBPS,MS with a "
                              f"bandwidth > 0 in Gbit/s and a latency >= 0 in ms, e.g. dist.emulate_link=0.1,20")
        return EmulatedLink(gbps, latency_ms)


#: Gradients at least this large are all-reduced in place; smaller ones share buckets of it.
GRADIENT_BUCKET_BYTES = 25 * 2**20


# ------------------------------------------------------------------------ process group


def backend_for(cfg: TrainConfig) -> str:
    if cfg.dist.backend != "auto":
        return cfg.dist.backend
    wants_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    return "nccl" if wants_cuda else "gloo"


def launched_world_size() -> int:
    """The number of processes torchrun started (1 for a plain `isoloco train`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_gpu(device: str, world_size: int) -> torch.device:
    """The GPU of this process in a multi-process CUDA run: cuda:LOCAL_RANK.

    Checked before anything touches CUDA, so a misfit is one clear line instead of CUDA's
    "invalid device ordinal": an explicit `cuda:N` would put every process on one GPU, and a
    LOCAL_RANK beyond the visible GPUs has none.
    """
    if device.startswith("cuda:") and world_size > 1:
        raise ConfigError(
            f"device={device} names one GPU, but this run has {world_size} processes: use device=cuda (or auto), "
            f"and each process takes the GPU of its LOCAL_RANK; choose GPUs with CUDA_VISIBLE_DEVICES")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ConfigError(
            f"process LOCAL_RANK={local_rank} has no GPU of its own ({visible} visible): launch at most one process "
            f"per GPU (isoloco launch --nproc N), or train on device=cpu")
    return torch.device("cuda", local_rank)


@contextmanager
def process_group(cfg: TrainConfig) -> Iterator[None]:
    """Join the torchrun job described by the environment for the duration of the block.

    A plain one-process run joins nothing. Otherwise the default process group uses the
    configured backend and `dist.timeout_s` (a collective waiting longer fails), and a
    `PeerWatchdog` stops this process when another dies or stays silent for
    `dist.peer_silence_s`. When the block raises, this process posts why (so its peers stop at
    once); when a collective failed, the block's error becomes a `PeerLostError` naming the
    lost rank when one is found.
    """
    world_size = launched_world_size()
    if world_size <= 1:
        yield
        return
    layout = ProcessLayout.for_run(cfg, world_size, int(os.environ["RANK"]))  # a misfit fails before joining
    backend = backend_for(cfg)
    device = None
    if backend == "nccl":
        device = process_gpu(cfg.device, world_size)
        torch.cuda.set_device(device)
        # NCCL reports a failed collective from its own watchdog thread; CleanUpOnly (2) aborts
        # the communicators and makes the waiting call raise, so a lost peer ends here as on
        # gloo (CollectiveError, then PeerLostError naming it) instead of tearing the process down.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    with collective(f"joining the {world_size} processes at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}"):
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist.timeout_s), device_id=device)
        watchdog = PeerWatchdog.connect(dist.get_rank(), world_size, cfg.dist.peer_silence_s, layout.group_size)
        watchdog.register()
        dist.barrier()
    watchdog.start()
    try:
        yield
    except CollectiveError as err:
        lost = watchdog.diagnose()
        if lost:
            watchdog.report_failure(lost, second_hand=True)
            raise PeerLostError(f"{lost}; {err}") from err
        watchdog.report_failure(str(err))
        raise
    except BaseException as err:
        watchdog.report_failure(f"{type(err).__name__}: {err}")
        raise
    watchdog.stop(done=True)
    with collective("shut-down barrier"):
        dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- one run


class Distributed:
    """One run's layout, process groups, communicator, and the loop's collectives.

    Built from the state of torch.distributed: inside `process_group` with several
    processes it creates the island and peer groups (every process must construct it, in
    the same order); otherwise everything is local and the communicator is a
    `LocalCommunicator`. Raises ConfigError when the run does not fit the processes.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        joined = dist.is_available() and dist.is_initialized()
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if joined else (1, 0)
        self.layout = ProcessLayout.for_run(cfg, world_size, rank)
        self._island: dist.ProcessGroup | None = None
        #: The processes as a DeviceMesh (`MESH_DIMS`); None in one process.
        self.mesh: DeviceMesh | None = None
        #: This process's peer group (process j of every island); None with one island.
        self.peers: dist.ProcessGroup | None = None
        self.comm: Communicator = LocalCommunicator(self.layout.workers, islands=cfg.dist.islands)
        if world_size > 1:
            layout = self.layout
            with collective("process group creation"):
                # Ranks i·G .. i·G + G − 1 form island i: the mesh's rows are islands, its columns
                # the peer groups that cross the slow link.
                self.mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu",
                                             (layout.islands, layout.group_size), mesh_dim_names=MESH_DIMS)
            if layout.group_size > 1:
                self._island = self.mesh.get_group("island")
            if layout.islands > 1:
                self.peers = self.mesh.get_group("islands")
            self.comm = TorchCommunicator(layout, self.peers, self._island, cfg.dist.link())
        # Small collectives (metrics, flags, objects) run where the backend wants tensors.
        self._device = torch.device("cpu")
        if joined and dist.get_backend() == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run's files (metrics, summary, the global checkpoint state)."""
        return self.layout.rank == 0

    @property
    def writes_worker_state(self) -> bool:
        """The first process of each island saves its workers' state (the others hold copies)."""
        return self.layout.island_rank == 0

    def place(self, device: torch.device) -> torch.device:
        """With several processes, `cuda` means this process's GPU (LOCAL_RANK)."""
        if device.type == "cuda" and self.world_size > 1:
            device = process_gpu(str(device), self.world_size)
            torch.cuda.set_device(device)
        return device

    def shard_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This process's contiguous 1/G share of a worker's (or, for dp, the global) batch."""
        share = rows.size(0) // self.layout.group_size
        return rows[self.layout.island_rank * share:(self.layout.island_rank + 1) * share]

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average `.grad` over the island, as if one process had computed the gradient of the
        whole batch. Gradients of at least `GRADIENT_BUCKET_BYTES` are reduced in place; smaller
        ones are packed into buckets of that size (one collective for many norm gains), so the
        extra memory is one bucket, not a copy of every gradient."""
        if self._island is None:
            return
        grads = [p.grad for p in params]
        with collective("gradient all-reduce"):
            pending = []
            for indices in buckets([(nbytes(grad), grad.dtype) for grad in grads], GRADIENT_BUCKET_BYTES):
                bucket = [grads[i] for i in indices]
                flat = bucket[0] if len(bucket) == 1 else _flatten_dense_tensors(bucket)
                pending.append((bucket, flat, dist.all_reduce(flat, group=self._island, async_op=True)))
            for bucket, flat, work in pending:
                work.wait()
                flat.div_(self.layout.group_size)
                if len(bucket) > 1:
                    for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        grad.copy_(averaged)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over all processes (metrics and evaluation; not merge traffic)."""
        if self.world_size == 1:
            return tensor
        total = tensor.to(self._device, copy=True)
        with collective("metrics all-reduce"):
            dist.all_reduce(total)
        return total.to(tensor.device)

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over all processes: every process holds an equal share of the workers' data."""
        return self.sum(tensor) / self.world_size

    def link_bytes(self, comm: Communicator) -> dict[str, float]:
        """`comm`'s link counts (`LINK_COUNTS`) since its last `reset_link_bytes` (which this
        calls), averaged over all processes: `shard_map`'s broadcasts leave each process a
        different share of the bytes. A collective: every process must call it."""
        return self.mean_link_counts(comm.reset_link_bytes())

    def mean_link_counts(self, counts: torch.Tensor) -> dict[str, float]:
        """Link counts (`LINK_COUNTS` order) averaged over all processes, by name. A collective."""
        return dict(zip(LINK_COUNTS, self.mean(counts).tolist()))

    def max(self, value: float) -> float:
        """The largest `value` of all processes: decisions every process must take together."""
        if self.world_size == 1:
            return value
        largest = torch.tensor([float(value)], device=self._device)
        with collective("agreement all-reduce"):
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return largest.item()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (picklable, small)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with collective("object broadcast"):
            dist.broadcast_object_list(box, src=0, device=self._device)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj`, by rank."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        with collective("object all-gather"):
            dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            with collective("barrier"):
                dist.barrier()
