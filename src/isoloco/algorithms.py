"""The two training algorithms behind the one interface the training loop calls.

`Trainer` runs rounds: every local worker takes its turn (H inner steps on its rows), then
the algorithm synchronises. What differs between the algorithms lives here:

* `DataParallel`: one model trained on the global batch; its "worker" is the model itself,
  a synchronisation does nothing, and θ is the compute model's weights.
* `DiLoCo`: R workers that start every round from θ, hand back Δ_r = θ − θ_r, and are merged
  by `OuterStep`; a worker whose loss or Δ is not finite stops the run or, with
  `on_bad_worker=drop`, is left out of the round and restarted from θ. With
  `outer.overlap_steps=τ` the synchronisation runs while the next round's first τ steps
  train from each worker's own weights (`isoloco.sync.inflight`). With `faults.late_rate`,
  workers that miss a round's deadline (drawn from the seed) are left out of its merge, their
  deltas lost or carried to the next round they arrive in (`faults.late`); with
  `merge.weighting=tokens` the merge weighs each worker by the steps it took (`worker_speeds`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from isoloco import checkpoint as ckpt
from isoloco.comm import LINK_COUNTS
from isoloco.train_config import TrainConfig
from isoloco.data import Batches
from isoloco.distributed import Distributed
from isoloco.errors import CheckpointError, ConfigError, NonFiniteDeltaError
from isoloco.inner import InnerOptimizer, pinned_zeros_like
from isoloco.merge import finite_each
from isoloco.merge_config import Participation
from isoloco.rules import RULES
from isoloco.factors import FACTOR_PATHS
from isoloco.outer import OuterStep
from isoloco.sync import offload, sparseloco
from isoloco.sync.handles import Steps, Sync, run_to_end
from isoloco.sync.inflight import InFlight
from isoloco.sync.slowlink import mean_wire_bytes

logger = logging.getLogger(__name__)

#: The checkpoint file holding DiLoCo's outer optimizer state.
OUTER_FILE = "outer"
#: The checkpoint file holding θ_t, which the workers' deltas point from, while a
#: synchronisation is in flight (`outer.overlap_steps`).
OVERLAP_FILE = "overlap"


@dataclass
class Worker:
    """A worker between rounds: its optimizer state and, after its turn, its Δ (DiLoCo)."""

    index: int  # global worker id, 0..R-1
    optimizer: InnerOptimizer
    delta: list[torch.Tensor]  # Δ = θ − θ_r after the worker's turn (storage device); dp: empty
    #: With `merge.error_feedback`: what compressing its deltas has lost so far, per parameter;
    #: with outer.transport=sparseloco, its accumulator (storage device; checkpointed with the
    #: worker); otherwise empty.
    residual: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: With `faults.late=carry`: its deltas that missed their rounds, down-weighted, waiting for
    #: the next round it arrives in (storage device; checkpointed with the worker); otherwise empty.
    carry: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class SlowLinkModel:
    """What one synchronisation puts on the slow link per process by the cost model: the run's
    own (`isoloco.sync.slowlink.mean_wire_bytes`, or SparseLoCo's `isoloco.sync.sparseloco.sparseloco_wire_bytes`), and
    float32's mean for the same model and layout, of the parameters `names` shaped `shapes` (the
    names say which matrices merge.compress_exclude keeps whole), over `islands` islands whose
    processes each carry one of `slices` equal slices. The merge's model is the mean's
    collectives, which the rules of one sum share (the mean, Iso-C, DARE); for the others (TIES's
    two sums, TSV's and Iso-CTS's gathers) both are None."""

    bytes: float | None
    float32: float | None

    @classmethod
    def of(cls, cfg: TrainConfig, names: list[str], shapes: list[torch.Size], islands: int,
           slices: int) -> "SlowLinkModel":
        merge, tiling = cfg.merge, cfg.outer.tiling
        float32 = mean_wire_bytes(shapes, None, merge.bucket_bytes, islands, slices=slices)
        if tiling is not None:
            return cls(sparseloco.sparseloco_wire_bytes(shapes, tiling, islands, cfg.workers // islands) / slices,
                       float32)
        if [phase.collective for phase in RULES[merge.rule].phases((256, 256), 2, merge.knobs)] != ["sum"]:
            return cls(None, None)
        return cls(mean_wire_bytes(shapes, merge.lossy_compression, merge.bucket_bytes, islands, names, slices),
                   float32)


class Algorithm(ABC):
    """What the loop calls around each worker's turn and at each synchronisation."""

    #: This process's workers, in the order they take their turns.
    workers: list[Worker]
    #: θ, the global model's parameters (what is evaluated and checkpointed).
    global_params: list[torch.nn.Parameter]

    def __init__(self, cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], dist: Distributed,
                 batches: Batches) -> None:
        self.cfg = cfg
        self.named_params = named_params
        self.params = [p for _, p in named_params]
        self.dist = dist
        self.batches = batches

    def new_optimizer(self) -> InnerOptimizer:
        return InnerOptimizer(self.named_params, self.cfg.inner, self.cfg.steps)

    @abstractmethod
    def rows(self, step: int, worker: Worker) -> torch.Tensor:
        """This process's share of what `worker` trains on at `step`."""

    def begin_turn(self, worker: Worker) -> None:
        """Make the compute model `worker`'s, before its inner steps."""

    def before_step(self, worker: Worker, taken: int) -> None:
        """Called before each inner step of `worker`'s turn, `taken` steps into it."""

    def end_turn(self, worker: Worker) -> None:
        """Keep what `worker`'s inner steps produced, after them."""

    @abstractmethod
    def synchronise(self, worker_losses: torch.Tensor, round: int) -> list[int]:
        """End the round whose per-worker, per-step losses are `worker_losses` ([K, steps]; 0
        where a worker took no step); return the local indices of the workers whose losses
        count (all but those dropped as diverged)."""

    def round_metrics(self) -> dict[str, Any]:
        """What the round's last metrics line adds (e.g. bytes sent)."""
        return {}

    def use_global_weights(self) -> None:
        """Put θ in the compute model (before an evaluation)."""

    def checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """State beyond θ and the workers' optimizers that rank 0 writes, by file name."""
        return {}

    def worker_tensors(self, worker: Worker) -> dict[str, torch.Tensor]:
        """What `worker` carries between rounds besides its optimizer state, by checkpoint key
        (the tensors themselves: a restore copies into them)."""
        return {}

    def settle(self) -> None:
        """Finish whatever of the last synchronisation is still running (every process, before a checkpoint)."""

    def start_pending(self) -> None:
        """Start the synchronisation the last round ended with, where it overlaps this round
        (called as a round begins)."""

    def period_state(self) -> dict[str, Any]:
        """The counts of the round in progress, for a checkpoint (a collective: every process
        calls it), so a synchronisation drained before a checkpoint is reported after a resume too."""
        return {}

    def load_period_state(self, state: Mapping[str, Any]) -> None:
        """Restore `period_state`."""

    def close(self) -> None:
        """Release what the algorithm holds between rounds (a synchronisation in flight), on every exit path."""

    def load_checkpoint_files(self, load: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
        """Restore what `checkpoint_files` wrote; `load(file)` opens one file, whose tensors are
        read as they are asked for."""


class DataParallel(Algorithm):
    """One model trained on the global batch: the baseline DiLoCo is measured against."""

    def __init__(self, cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], dist: Distributed,
                 batches: Batches) -> None:
        super().__init__(cfg, named_params, dist, batches)
        self.global_params = self.params
        self.workers = [Worker(0, self.new_optimizer(), [])]

    def rows(self, step: int, worker: Worker) -> torch.Tensor:
        return self.dist.shard_rows(self.batches.rows(step, 0, self.cfg.global_batch))

    def synchronise(self, worker_losses: torch.Tensor, round: int) -> list[int]:
        return [0]


class DiLoCo(Algorithm):
    """R workers that train H steps from θ, then merge their pseudo-gradients (`OuterStep`)."""

    def __init__(self, cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], dist: Distributed,
                 batches: Batches, device: torch.device, storage: torch.device) -> None:
        super().__init__(cfg, named_params, dist, batches)
        self.device = device
        self.storage = storage
        # θ lives apart from the compute module, which each worker's turn overwrites.
        self.global_params = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.names = [name for name, _ in named_params]
        self.outer = OuterStep(list(zip(self.names, self.global_params)), cfg.merge, cfg.outer, dist.comm, cfg.seed)
        # Offloaded from a GPU, the workers' state lives in pinned host memory and the next
        # worker's moments are copied to the GPU while the current one trains (`begin_turn`).
        self.overlaps = storage.type == "cpu" and device.type == "cuda"
        self.carries = cfg.faults.late_rate > 0 and cfg.faults.late == "carry"
        # SparseLoCo's accumulators live where error feedback's residuals do (and are checkpointed so).
        self.feedback = cfg.merge.error_feedback or cfg.outer.transport == "sparseloco"
        # Error feedback's residuals are an island's, read from its first worker only; SparseLoCo
        # keeps an accumulator per worker.
        keeps = (range(len(dist.comm.local_worker_ids)) if cfg.outer.transport == "sparseloco"
                 else self.outer.merger.island_heads if self.feedback else ())
        self.workers = [Worker(w, self.new_optimizer(), self._buffers(),
                               self._buffers() if local in keeps else [],
                               self._buffers() if self.carries else [])
                        for local, w in enumerate(dist.comm.local_worker_ids)]
        self.dropped: list[int] = []  # the workers left out of the last round as diverged
        #: The last round's steps of every worker of the run, by global id, and how many it merged.
        self.worker_steps: list[int] = []
        self.workers_merged = 0
        #: The last round's late workers, and those of its merged workers whose carried deltas joined (global ids).
        self.late: list[int] = []
        self.carried_joined: list[int] = []
        # The simulator's slow link is modelled as its merge's bits are: the islands it plays
        # (`dist.islands`); a job's is measured, and float32's modelled for its layout.
        layout = dist.layout
        self.slow_link = SlowLinkModel.of(cfg, self.names, [p.shape for p in self.params],
                                          *((dist.comm.played_islands, 1) if dist.world_size == 1
                                            else (layout.islands, layout.group_size)))
        self.in_flight = (InFlight(self._buffers(), self.global_params, device, cfg.outer.overlap_steps)
                          if cfg.outer.overlap_steps else None)
        #: Local workers whose next turn starts from their own weights and lands the update in flight.
        self.unlanded: set[int] = set()
        #: With overlap, the synchronisation the last round ended with, until the next round starts it.
        self._pending: Sync[None] | None = None
        self._new_period()

    def _new_period(self) -> None:
        """Start counting a round's synchronisation: seconds it ran and training waited for
        it, and its traffic, taken from the communicator when it ends (`_ended`)."""
        self.sync_s = self.sync_exposed_s = 0.0
        self.bytes_per_worker = 0
        self.synchronisations = 0
        self.link_counts = torch.zeros(len(LINK_COUNTS), dtype=torch.float64)

    def _ended(self, ran_s: float, waited_s: float) -> None:
        self.sync_s += ran_s
        self.sync_exposed_s += waited_s
        self.synchronisations += 1
        self.bytes_per_worker += self.dist.comm.reset_bytes()
        self.link_counts += self.dist.comm.reset_link_bytes()

    def _buffers(self) -> list[torch.Tensor]:
        """Zeros shaped like the parameters, where a worker keeps its state between turns."""
        return [pinned_zeros_like(p, self) if self.overlaps else torch.zeros_like(p, device=self.storage)
                for p in self.params]

    def rows(self, step: int, worker: Worker) -> torch.Tensor:
        return self.dist.shard_rows(self.batches.worker_batch(step, worker.index, self.cfg.workers))

    def begin_turn(self, worker: Worker) -> None:
        if worker.index in self.unlanded:
            self._own_weights(worker)
        else:
            self.use_global_weights()
        worker.optimizer.move_state(self.device)
        # Never across a merge, which may give a dropped worker a fresh optimizer.
        following = self.workers.index(worker) + 1
        if self.overlaps and following < len(self.workers):
            self.workers[following].optimizer.prefetch(self.device)

    @torch.no_grad()
    def _own_weights(self, worker: Worker) -> None:
        """θ_r = θ_t − Δ_r in the compute model: the weights `worker` ended its last turn with
        (θ_t and Δ_r may be in host memory)."""
        torch._foreach_copy_(self.params, self.in_flight.base)
        for param, delta in zip(self.params, worker.delta):
            param.sub_(self._fetch(delta))

    def before_step(self, worker: Worker, taken: int) -> None:
        if worker.index not in self.unlanded:
            return
        if taken == self.cfg.outer.overlap_steps:
            self._land(worker)
        else:
            self.in_flight.before_step(taken)

    @torch.no_grad()
    def _land(self, worker: Worker) -> None:
        """Apply the synchronisation in flight to `worker`'s weights: θ_r ← (1 − α)·θ + α·θ_r."""
        self.settle()
        alpha = self.cfg.outer.overlap_alpha
        if alpha == 0:
            torch._foreach_copy_(self.params, self.global_params)
        else:
            torch._foreach_lerp_(self.params, self.global_params, 1 - alpha)
        self.unlanded.discard(worker.index)

    def start_pending(self) -> None:
        if self._pending is not None:
            sync, self._pending = self._pending, None
            self.in_flight.start(sync)
            self.unlanded = {worker.index for worker in self.workers}

    def settle(self) -> None:
        """Land the synchronisation in flight, if any (θ is then θ_{t+1}); one not yet started
        runs whole."""
        self.start_pending()
        if self.in_flight is not None and self.in_flight.land():
            self._ended(self.in_flight.ran_s, self.in_flight.waited_s)

    @torch.no_grad()
    def end_turn(self, worker: Worker) -> None:
        if worker.index in self.unlanded:  # a turn of at most τ steps: the update lands at its end
            self._land(worker)
        # Δ = θ − θ_r, computed in the compute buffers, then kept by the worker until the merge.
        torch._foreach_sub_(self.params, self.global_params)
        torch._foreach_neg_(self.params)
        torch._foreach_copy_(worker.delta, self.params)
        worker.optimizer.move_state(self.storage)

    def synchronise(self, worker_losses: torch.Tensor, round: int) -> list[int]:
        counted = self._kept(worker_losses, round)
        participation = self._participation(round, steps=worker_losses.shape[1])
        if participation is None:
            return counted
        last = (round + 1) * self.cfg.inner_steps >= self.cfg.train_steps
        if self.in_flight is not None and not last:
            # It starts when the next round does (`start_pending`), after this round's own
            # collectives (losses, link counts, a stop signal, an evaluation): started now, its
            # traffic would fill a slow link's queue first, and each of them would wait behind it.
            assert self._pending is None, "the last round's synchronisation was never started"
            self._pending = self._merge(participation, round)
            return counted
        began = time.perf_counter()
        run_to_end(self._merge(participation, round).steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock must see the merge's kernels end
        seconds = time.perf_counter() - began
        self._ended(seconds, seconds)  # training waits for the whole synchronisation
        return counted

    def _kept(self, worker_losses: torch.Tensor, round: int) -> list[int]:
        """The local indices of the workers whose deltas are fit to merge (see `on_bad_worker`)."""
        kept = list(range(len(self.workers)))
        if self.cfg.on_bad_worker == "drop":
            kept = [i for i in kept if self._healthy(self.workers[i], worker_losses[i])]
            if not kept:
                raise NonFiniteDeltaError(f"round {round}: every worker's loss or pseudo-gradient is not "
                                          "finite; lower inner.lr or outer.lr")
        self.dropped = [w.index for i, w in enumerate(self.workers) if i not in kept]
        if self.dropped:
            logger.warning("round %d: dropped worker(s) %s (loss or pseudo-gradient not finite); merging the "
                           "others and restarting them from the global model", round, self.dropped)
        return kept

    def _participation(self, round: int, steps: int) -> Participation | None:
        """Who this round merges, and with which weights: every worker of the run that is neither
        late (`faults`, drawn alike by every process) nor dropped. None when nobody arrived:
        θ stays as it is. Carried deltas are folded in or set aside here (`faults.late=carry`)."""
        workers, faults, seed = range(self.cfg.workers), self.cfg.faults, self.cfg.seed
        self.worker_steps = [self.cfg.steps_taken(worker, steps) for worker in workers]
        self.late = [worker for worker in workers if faults.is_late(seed, round, worker)]
        arrived = tuple(worker for worker in workers if worker not in self.dropped and worker not in self.late)
        self.workers_merged = len(arrived)
        # A worker carries a delta exactly when it was late the round before (arriving empties the carry).
        self.carried_joined = [worker for worker in arrived if self.carries and round > 0
                               and faults.is_late(seed, round - 1, worker)]
        self._carry(arrived)
        if not arrived:
            logger.warning("round %d: no worker arrived before the deadline (faults.late_rate=%g); the global model "
                           "is unchanged", round, self.cfg.faults.late_rate)
            return None
        tokens = self.cfg.merge.weighting == "tokens"
        return Participation(arrived, tuple(float(self.worker_steps[worker]) for worker in arrived) if tokens else None)

    @torch.no_grad()
    def _carry(self, arrived: tuple[int, ...]) -> None:
        """`faults.late=carry`: a worker that arrives merges its carried deltas with its own; a
        late one adds its delta to what it carries, all of it down-weighted once more."""
        for worker in self.workers:
            if not worker.carry:
                continue
            if worker.index in arrived:
                torch._foreach_add_(worker.delta, worker.carry)
                torch._foreach_zero_(worker.carry)
            else:
                torch._foreach_add_(worker.carry, worker.delta)
                torch._foreach_mul_(worker.carry, self.cfg.faults.stale_weight)

    def _merge(self, participation: Participation, round: int) -> Sync[None]:
        """Merge the deltas of the workers that arrived and take the outer step (θ_t → θ_{t+1}), as steps."""
        # Stored deltas (host memory when offloaded) reach the device a parameter at a time.
        deltas = {name: [w.delta[i] for w in self.workers] for i, name in enumerate(self.names)}
        residuals = ({name: {local: w.residual[i] for local, w in enumerate(self.workers) if w.residual}
                      for i, name in enumerate(self.names)} if self.feedback else None)
        step = self.outer.start(deltas, round=round, fetch=self._fetch, participation=participation,
                                residuals=residuals)
        return Sync(self._after_merge(step.steps), step.stages, step.traffic)

    def _after_merge(self, step: Steps[None]) -> Steps[None]:
        yield from step
        for worker in self.workers:
            if worker.index in self.dropped:  # its optimizer state is as poisoned as its weights
                worker.optimizer = self.new_optimizer()
                self._keep_residuals(worker)

    def _keep_residuals(self, worker: Worker) -> None:
        """A dropped worker's residuals (its island's error feedback, or SparseLoCo's accumulators)
        stay: it sent nothing, so its delta never reached them, and they hold what earlier rounds'
        compression lost and this round's owner roundings. Only a residual that is itself not
        finite is zeroed (one sync per worker; drop runs without overlap)."""
        if not worker.residual:
            return
        offload.settle()  # copies back to host memory, read here
        finite = finite_each(worker.residual).tolist()  # by their extremes: a norm may overflow
        for residual, ok in zip(worker.residual, finite):
            if not ok:
                logger.warning("worker %d's error-feedback residual is not finite: zeroed", worker.index)
                residual.zero_()

    def _fetch(self, delta: torch.Tensor) -> torch.Tensor:
        return delta.to(self.device, non_blocking=True)

    @staticmethod
    def _healthy(worker: Worker, losses: torch.Tensor) -> bool:
        """Finite losses and a finite pseudo-gradient (one norm per tensor, one sync)."""
        norms = torch.stack(torch._foreach_norm(worker.delta))
        return bool(torch.isfinite(losses).all() and torch.isfinite(norms).all())

    def round_metrics(self) -> dict[str, Any]:
        # With overlap, the synchronisation in flight at a round's end is counted in the round
        # it lands in. Link counts differ between processes (shard_map): averaged over them.
        links = self.dist.mean_link_counts(self.link_counts)
        metrics: dict[str, Any] = {"bytes_per_worker": self.bytes_per_worker,
                                   # What the merged workers handed to the collectives, together.
                                   "bytes_sent": self.bytes_per_worker * self.workers_merged,
                                   **links, **self._slow_link(links["wire_bytes_cross_island"]),
                                   "synchronisations": self.synchronisations,
                                   "sync_s": self.sync_s, "sync_exposed_s": self.sync_exposed_s}
        if self.dropped:
            metrics["dropped_workers"] = self.dropped
        metrics.update(worker_steps=self.worker_steps, workers_merged=self.workers_merged)
        if self.cfg.faults.late_rate:
            metrics["late_workers"] = self.late
        if self.carries:
            metrics["carried_joined"] = self.carried_joined
        if self.outer.merger.clamped:
            metrics["compress_rank_clamped"] = self.outer.merger.clamped
        if RULES[self.outer.merger.cfg.rule].factored:  # how `merge.factors` got them (processes count their own workers)
            paths = self.outer.merger.factor_paths
            counts = self.dist.sum(torch.tensor([float(paths[path]) for path in FACTOR_PATHS], dtype=torch.float64))
            metrics["factor_paths"] = {path: int(count) for path, count in zip(FACTOR_PATHS, counts.tolist())}
            paths.clear()
        self._new_period()
        return metrics

    def _slow_link(self, measured: float) -> dict[str, float]:
        """The round's bytes on the slow link per process (`slow_link_bytes`: a job's `measured`
        ones, the simulator's modelled) and float32's for the same model and layout; nothing where
        the cost model does not cover the rule (`SlowLinkModel`) in the simulator."""
        model, syncs = self.slow_link, self.synchronisations
        if self.dist.world_size > 1:
            lossless = self.cfg.merge.lossy_setting is None and self.cfg.outer.tiling is None
            float32 = measured if lossless else syncs * model.float32
            return {"slow_link_bytes": measured, "slow_link_float32_bytes": float32}
        if model.bytes is None:
            return {}
        return {"slow_link_bytes": syncs * model.bytes, "slow_link_float32_bytes": syncs * model.float32}

    @torch.no_grad()
    def use_global_weights(self) -> None:
        self.settle()
        torch._foreach_copy_(self.params, self.global_params)

    def checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        self.settle()
        files = {OUTER_FILE: self.outer.state_dict()}
        if self.in_flight is not None:
            files[OVERLAP_FILE] = dict(zip(self.names, self.in_flight.base))
        return files

    def worker_tensors(self, worker: Worker) -> dict[str, torch.Tensor]:
        offload.settle()  # residuals copied back to host memory are read by the checkpoint's writer
        tensors = dict(zip((_residual_key(worker.index, name) for name in self.names), worker.residual))
        tensors.update(zip((f"w{worker.index}.carry.{name}" for name in self.names), worker.carry))
        if self.in_flight is not None:  # its Δ_r still makes its own weights (`_own_weights`)
            tensors.update(zip((f"w{worker.index}.delta.{name}" for name in self.names), worker.delta))
        return tensors

    def period_state(self) -> dict[str, Any]:
        # Link counts differ between processes: their mean, which round_metrics would report.
        return {"bytes_per_worker": self.bytes_per_worker, "sync_s": self.sync_s,
                "sync_exposed_s": self.sync_exposed_s, "synchronisations": self.synchronisations,
                "links": self.dist.mean_link_counts(self.link_counts)}

    def load_period_state(self, state: Mapping[str, Any]) -> None:
        self.bytes_per_worker, self.sync_s = state["bytes_per_worker"], state["sync_s"]
        self.sync_exposed_s = state["sync_exposed_s"]
        self.synchronisations = state.get("synchronisations", 0)  # absent from checkpoints of older versions
        self.link_counts = torch.tensor([state["links"][key] for key in LINK_COUNTS], dtype=torch.float64)

    def close(self) -> None:
        if self._pending is not None:
            self._pending.steps.close()
            self._pending = None
        if self.in_flight is not None:
            self.in_flight.close()

    def load_checkpoint_files(self, load: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
        self.outer.load_state_dict(load(OUTER_FILE))
        if self.feedback:
            self._check_unread_residuals(load(ckpt.workers_file(self.dist.layout.island)))
        if self.in_flight is not None:
            # Checkpoints follow a synchronisation: with overlap, every worker has yet to land it.
            saved = load(OVERLAP_FILE)
            with torch.no_grad():
                for name, base in zip(self.names, self.in_flight.base):
                    base.copy_(saved[name])
            self.unlanded = {worker.index for worker in self.workers}

    def _check_unread_residuals(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Checkpoints written while every local worker had a residual hold one for each; only
        the island heads' were ever read, so the others are zeros and a resume leaves them. A
        nonzero one is compression error this run would silently lose."""
        for worker in self.workers:
            for name in self.names if not worker.residual else ():
                key = _residual_key(worker.index, name)
                if key in saved and saved[key].any():
                    raise CheckpointError(
                        f"the checkpoint's {key} is not zero, but worker {worker.index} is not its island's first "
                        f"worker, whose residual is the island's: this checkpoint was not written by isoloco's own "
                        f"error feedback in this layout")


def _residual_key(worker: int, name: str) -> str:
    return f"w{worker}.residual.{name}"


def build_algorithm(cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], dist: Distributed,
                    batches: Batches, device: torch.device, storage: torch.device) -> Algorithm:
    """The run's algorithm (`cfg.algorithm`), for the workers this process holds."""
    if cfg.on_bad_worker == "drop" and dist.world_size > 1:
        raise ConfigError("on_bad_worker=drop works in a single process only (the simulator); "
                          "use on_bad_worker=error with several processes")
    if cfg.algorithm == "dp":
        return DataParallel(cfg, named_params, dist, batches)
    return DiLoCo(cfg, named_params, dist, batches, device, storage)
