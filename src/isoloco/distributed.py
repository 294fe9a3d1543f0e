"""Multi-process runs on torch.distributed: where the workers live and how processes talk.

A run of R DiLoCo workers launched by torchrun on W processes groups the processes into
W/G *islands* of G consecutive ranks (G = `dist.gpus_per_worker`). Island i holds the
K = R·G/W workers [i·K, (i+1)·K), trained one after another as in the one-process
trainer. The G processes of an island are data parallel: each takes 1/G of every worker's
micro-batch and they average gradients every inner step, so one worker spans G GPUs.
Islands talk only at synchronisations: process j of every island merges slice j of every
tensor with process j of every other island (its *peer group* of W/G processes), and the
island all-gathers its G slices, so one copy per island crosses the slow link (see
`TorchCommunicator`). Consecutive ranks form an island so that with G = GPUs per node an
island is a node, and only the merge crosses the network.
The data-parallel baseline is one island of all W processes holding its single model.

Every worker keeps its global id (0..R-1), so it reads the same batches and draws the same
DARE masks in every layout: 2 processes x 2 workers train exactly what 1 x 4 trains.

`process_group` joins the job (and starts the peer watchdog); `Distributed` holds one
run's layout, process groups, communicator and the few collectives the training loop needs
besides the merge. With one process every collective is a local no-op.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from isoloco.comm import LINK_COUNTS, Communicator, LocalCommunicator, nbytes
from isoloco.configbase import check_at_least, check_choices, check_positive, option
from isoloco.errors import CollectiveError, ConfigError, PeerLostError, first_line
from isoloco.sync.cost import Link, wire_bytes
from isoloco.sync.handles import Pending
from isoloco.sync.plan import buckets
from isoloco.watchdog import PeerWatchdog

if TYPE_CHECKING:
    from isoloco.config import TrainConfig

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

    emulate_link: str = option(
        "", "for measurements on one machine: GBPS,MS makes every collective between islands take as long as "
            "on a link of GBPS Gbit/s and MS ms latency (its wire bytes at that rate, plus the latency); an "
            "emulation on top of loopback, not a network; empty: off")

    def validate(self) -> None:
        check_at_least("dist.gpus_per_worker", self.gpus_per_worker, 1)
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


class EmulatedLink:
    """A slow link between islands, emulated on one machine: a collective's result is held
    back until the link, busy with the collectives before it, would have delivered it (one
    latency per collective plus its wire bytes at the link's rate)."""

    def __init__(self, gbps: float, latency_ms: float) -> None:
        self.link = Link(bandwidth=gbps * 1e9 / 8, latency=latency_ms / 1000)
        self._free_at = 0.0

    def deliver_at(self, wire: float) -> float:
        """When a collective putting `wire` bytes on the link, started now, is delivered."""
        begins = max(time.perf_counter(), self._free_at)
        self._free_at = begins + self.link.transfer_seconds(wire)
        return self._free_at


# ------------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Which workers and which share of their batch one process holds (pure arithmetic)."""

    world_size: int
    rank: int
    group_size: int  # processes per island: G for DiLoCo, all of them for data parallel
    workers: int  # R (1 for data parallel)

    @classmethod
    def for_run(cls, cfg: TrainConfig, world_size: int, rank: int) -> ProcessLayout:
        """The layout of `cfg` on `world_size` processes; a ConfigError says what to change."""
        workers, batch = cfg.num_workers, cfg.global_batch
        if cfg.algorithm == "dp":
            group = world_size
            if batch % world_size:
                raise ConfigError(
                    f"global_batch={batch} does not split over the {world_size} processes of this data-parallel "
                    f"run; set global_batch to a multiple of {world_size}")
        else:
            group = cfg.dist.gpus_per_worker
            if world_size % group:
                raise ConfigError(
                    f"dist.gpus_per_worker={group} does not divide the {world_size} processes of this run: each "
                    f"worker is {group} processes; launch a multiple of {group} processes (isoloco launch --nproc "
                    f"N) or change gpus_per_worker")
            islands = world_size // group
            if workers % islands:
                raise ConfigError(
                    f"workers={workers} cannot be spread over the {islands} worker groups ({world_size} processes "
                    f"/ gpus_per_worker {group}): every group holds the same number of workers; set workers to a "
                    f"multiple of {islands}")
            if (batch // workers) % group:
                raise ConfigError(
                    f"global_batch={batch} gives each of the {workers} workers {batch // workers} sequences per "
                    f"step, which its {group} processes cannot split evenly; set global_batch to a multiple of "
                    f"{workers * group}")
        layout = cls(world_size, rank, group, workers)
        cfg.check_micro_batch(layout.rows_per_process(batch), "each process")
        return layout

    @property
    def islands(self) -> int:
        return self.world_size // self.group_size

    @property
    def island(self) -> int:
        return self.rank // self.group_size

    @property
    def island_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def workers_per_island(self) -> int:
        return self.workers // self.islands

    @property
    def local_worker_ids(self) -> list[int]:
        first = self.island * self.workers_per_island
        return list(range(first, first + self.workers_per_island))

    def island_ranks(self, island: int) -> list[int]:
        return list(range(island * self.group_size, (island + 1) * self.group_size))

    def peer_ranks(self, island_rank: int) -> list[int]:
        """Process `island_rank` of every island, ordered by island: the group that merges."""
        return [island * self.group_size + island_rank for island in range(self.islands)]

    def rows_per_process(self, global_batch: int) -> int:
        return global_batch // self.workers // self.group_size

    def describe(self) -> dict[str, int]:
        """What a checkpoint records: resuming needs the same."""
        return {"workers": self.workers, "processes": self.world_size, "processes_per_worker": self.group_size}

    @staticmethod
    def in_words(described: dict[str, int] | None) -> str:
        """A layout as `describe` records it, said for a message: "4 workers on 2 processes, 1
        process per worker" (None: a checkpoint that recorded none)."""
        if not described:
            return "an unrecorded layout"

        def count(n: int, noun: str) -> str:
            return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"

        return (f"{count(described['workers'], 'worker')} on {count(described['processes'], 'process')}, "
                f"{count(described['processes_per_worker'], 'process')} per worker")


# ------------------------------------------------------------------------- communicator


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Mark the torch.distributed calls inside as one collective, so a failure says what it
    was doing and is recognised as a possible lost peer (see `process_group`)."""
    try:
        yield
    except RuntimeError as err:  # backend errors (gloo, NCCL, store) are RuntimeErrors
        if isinstance(err, CollectiveError):
            raise
        raise CollectiveError(f"{what} failed: {first_line(err)}") from err


def assign_owners(costs: list[float], processes: int) -> list[int]:
    """Owner process of each job: largest jobs first, each to the least loaded process.

    Deterministic (ties go to the lower index), so every process computes the same plan.
    """
    load = [0.0] * processes
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: -costs[j]):
        owner = min(range(processes), key=lambda p: load[p])
        owners[job] = owner
        load[owner] += costs[job]
    return owners


def _orthogonalisation_cost(tensor: torch.Tensor) -> float:
    """Relative cost of an SVD / Newton–Schulz of `tensor`: m·n·min(m, n) for a matrix."""
    return tensor.numel() * (min(tensor.shape) if tensor.ndim == 2 else 1)


class TorchCommunicator(Communicator):
    """The merge collectives of one process over torch.distributed.

    Only the merge crosses islands, so its cross-island traffic is split among the island's
    G processes (the hierarchical pattern of HSDP's replica groups): process j of every
    island exchanges slice j of each tensor with its peer group, then the island all-gathers
    the G results over its fast link. HSDP needs a reduce-scatter inside the island first;
    here the island's processes are data-parallel replicas holding the same deltas, so each
    already has the island's sum and takes its slice without communicating. Each island
    thereby sends one copy of what it merges across islands (sums: one model; gathers: its
    workers' factors), not G copies.

    `shard_map` spreads pure per-tensor work (Iso-C's orthogonalisations) over the island's
    processes and broadcasts each result from its owner inside the island; across islands
    each island computes its own, so no result crosses the slow link.
    """

    def __init__(self, layout: ProcessLayout, peers: dist.ProcessGroup | None,
                 island: dist.ProcessGroup | None, link: EmulatedLink | None = None) -> None:
        """`peers`: this process's peer group (None with one island). `island`: its island's
        group, over whose fast link the cross-island traffic is split; None sends every
        tensor whole across islands from each process (G = 1, or how isoloco merged islands
        of G > 1 before the split: the communication benchmark's "before")."""
        super().__init__()
        self._layout = layout
        self._peers = peers
        self._island = island
        self._link = link  # an emulated slow link between islands, or None
        # Slice `_slot` of `_slices` is this process's share of the cross-island traffic.
        self._slices = layout.group_size if island is not None else 1
        self._slot = layout.island_rank if island is not None else 0

    @property
    def num_workers(self) -> int:
        return self._layout.workers

    @property
    def local_worker_ids(self) -> list[int]:
        return self._layout.local_worker_ids

    @property
    def islands(self) -> int:
        return self._layout.islands if self._peers is not None else 1

    @property
    def island(self) -> int:
        return self._layout.island if self._peers is not None else 0

    @property
    def island_slices(self) -> tuple[int, int]:
        return self._slices, self._slot

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._start_sum(tensor).wait()

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._start_gather(tensors).wait()

    def _start_sum(self, tensor: torch.Tensor) -> Pending[torch.Tensor]:
        if self._peers is None:
            return Pending.done(tensor)
        part = self._slice(tensor)
        wire = self._cross("all_reduce", nbytes(part))
        with collective("merge all-reduce"):
            work = dist.all_reduce(part, group=self._peers, async_op=True)
        return Pending([_Labelled(work, "merge all-reduce")],
                       lambda: self._joined(part, tensor.numel()).view_as(tensor), self._delivery(wire))

    def _start_gather(self, tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        if self._peers is None:
            return Pending.done(list(tensors))
        local = torch.stack(tensors)
        part = self._slice(local)
        wire = self._cross("all_gather", nbytes(part))
        blocks = [torch.empty_like(part) for _ in range(self._layout.islands)]
        with collective("merge all-gather"):
            work = dist.all_gather(blocks, part, group=self._peers, async_op=True)

        def finish() -> list[torch.Tensor]:
            # Island i's block holds its workers' tensors, so the rows come in global worker order.
            gathered = self._joined(torch.stack(blocks), local.numel())
            return list(gathered.reshape(-1, *local.shape[1:]).unbind(0))

        return Pending([_Labelled(work, "merge all-gather")], finish, self._delivery(wire))

    def exchange(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Pending[list[torch.Tensor]]:
        received = torch.empty(sum(receive_sizes), dtype=send.dtype, device=send.device)
        wire = self._cross("all_to_all", nbytes(send) - send_sizes[self.island] * send.element_size(),
                           handed=nbytes(send))
        with collective("compressed-sum all-to-all"):
            work = dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self._peers,
                                          async_op=True)
        return Pending([_Labelled(work, "compressed-sum all-to-all")],
                       lambda: list(torch.split(received, receive_sizes)), self._delivery(wire))

    def gather_peers(self, blob: torch.Tensor) -> Pending[list[torch.Tensor]]:
        wire = self._cross("all_gather", nbytes(blob))
        blocks = [torch.empty_like(blob) for _ in range(self._layout.islands)]
        with collective("compressed-sum all-gather"):
            work = dist.all_gather(blocks, blob, group=self._peers, async_op=True)
        return Pending([_Labelled(work, "compressed-sum all-gather")], lambda: blocks, self._delivery(wire))

    def join_island(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        if self._slices == 1:
            return Pending.done([part])
        self.record("in_island", nbytes(part), wire_bytes("all_gather", nbytes(part), self._slices))
        blocks = [torch.empty_like(part) for _ in range(self._slices)]
        with collective("island all-gather"):
            work = dist.all_gather(blocks, part, group=self._island, async_op=True)
        return Pending([_Labelled(work, "island all-gather")], lambda: blocks)

    def _slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of `tensor` flattened (equal slices, the last zero-padded), so
        that the island's all-gather can join them."""
        flat = tensor.reshape(-1)
        width = -(-flat.numel() // self._slices)
        if self._slices > 1:
            flat = torch.nn.functional.pad(flat, (0, width * self._slices - flat.numel()))
        return flat[self._slot * width:(self._slot + 1) * width]

    def _joined(self, exchanged: torch.Tensor, numel: int) -> torch.Tensor:
        """The island's slices of a cross-island result joined over its fast link: shape
        (..., numel), the leading dimensions being those the exchange added."""
        if self._slices == 1:
            return exchanged
        self.record("in_island", nbytes(exchanged), wire_bytes("all_gather", nbytes(exchanged), self._slices))
        blocks = [torch.empty_like(exchanged) for _ in range(self._slices)]
        with collective("island all-gather"):
            dist.all_gather(blocks, exchanged, group=self._island)
        return torch.cat(blocks, dim=-1)[..., :numel]

    def _cross(self, kind: str, size: int, handed: int | None = None) -> float:
        """Count one collective of `kind` across islands sending `size` bytes (`handed` given
        to it, by default `size`); returns its wire bytes."""
        wire = wire_bytes(kind, size, self._layout.islands)
        self.record("cross_island", size if handed is None else handed, wire)
        return wire

    def _delivery(self, wire: float) -> float:
        """When an emulated slow link delivers a collective of `wire` bytes started now (0: no emulation)."""
        return self._link.deliver_at(wire) if self._link is not None else 0.0

    def shard_map_async(self, fn: Callable[[torch.Tensor], torch.Tensor],
                        tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        # Shared out inside the island only, over its fast link: across islands every island
        # computes its own, so no result crosses the slow link. An island of one process has
        # nobody to share with.
        if self._island is None:
            return Pending.done([fn(tensor) for tensor in tensors])
        ranks = self._layout.island_ranks(self._layout.island)
        owners = [ranks[owner] for owner in assign_owners([_orthogonalisation_cost(t) for t in tensors], len(ranks))]
        results, handed = [], 0
        for owner, tensor in zip(owners, tensors):
            if owner == self._layout.rank:
                result = fn(tensor)
                assert result.shape == tensor.shape and result.dtype == tensor.dtype, \
                    "shard_map needs a shape-keeping fn"
                results.append(result.contiguous())
                handed += nbytes(result)
            else:
                results.append(torch.empty_like(tensor))
        # Every process joins every broadcast; the owner sends its results to the others.
        self.record("in_island", handed, wire_bytes("broadcast", handed, len(ranks)), calls=len(results))
        with collective("broadcast of orthogonalised matrices"):
            works = [dist.broadcast(result, src=owner, group=self._island, async_op=True)
                     for owner, result in zip(owners, results)]
        return Pending([_Labelled(work, "broadcast of orthogonalised matrices") for work in works], lambda: results)


class _Labelled:
    """A torch.distributed `Work` whose failure says which collective it was (`collective`)."""

    def __init__(self, work: Any, what: str) -> None:
        self._work, self._what = work, what

    def wait(self) -> None:
        with collective(self._what):
            self._work.wait()


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
    ProcessLayout.for_run(cfg, world_size, int(os.environ["RANK"]))  # a misfit fails before joining
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
        watchdog = PeerWatchdog.connect(dist.get_rank(), world_size, cfg.dist.peer_silence_s)
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
        self.comm: Communicator = LocalCommunicator(self.layout.workers)
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
