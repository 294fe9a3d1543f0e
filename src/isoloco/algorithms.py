"""The two training algorithms behind the one interface the training loop calls.

`Trainer` runs rounds: every local worker takes its turn (H inner steps on its rows), then
the algorithm synchronises. What differs between the algorithms lives here:

* `DataParallel`: one model trained on the global batch; its "worker" is the model itself,
  a synchronisation does nothing, and θ is the compute model's weights.
* `DiLoCo`: R workers that start every round from θ, hand back Δ_r = θ − θ_r, and are merged
  by `OuterStep`; a worker whose loss or Δ is not finite stops the run or, with
  `on_bad_worker=drop`, is left out of the round and restarted from θ.
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

from isoloco.config import TrainConfig
from isoloco.data import Batches
from isoloco.distributed import Distributed
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.inner import InnerOptimizer, pinned_zeros_like
from isoloco.outer import OuterStep

logger = logging.getLogger(__name__)

#: The checkpoint file holding DiLoCo's outer optimizer state.
OUTER_FILE = "outer"


@dataclass
class Worker:
    """A worker between rounds: its optimizer state and, after its turn, its Δ (DiLoCo)."""

    index: int  # global worker id, 0..R-1
    optimizer: InnerOptimizer
    delta: list[torch.Tensor]  # Δ = θ − θ_r after the worker's turn (storage device); dp: empty
    #: With `merge.error_feedback`: what compressing its deltas has lost so far, per parameter
    #: (storage device; checkpointed with the worker); otherwise empty.
    residual: list[torch.Tensor] = dataclasses.field(default_factory=list)


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

    def end_turn(self, worker: Worker) -> None:
        """Keep what `worker`'s inner steps produced, after them."""

    @abstractmethod
    def synchronise(self, worker_losses: torch.Tensor, round: int) -> torch.Tensor:
        """End the round whose per-worker, per-step losses are `worker_losses` ([K, steps]);
        return the per-step losses of the workers that count (those merged)."""

    def round_metrics(self) -> dict[str, Any]:
        """What the round's last metrics line adds (e.g. bytes sent)."""
        return {}

    def use_global_weights(self) -> None:
        """Put θ in the compute model (before an evaluation)."""

    def checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """State beyond θ and the workers' optimizers that rank 0 writes, by file name."""
        return {}

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

    def synchronise(self, worker_losses: torch.Tensor, round: int) -> torch.Tensor:
        return worker_losses.mean(dim=0)


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
        self.workers = [Worker(w, self.new_optimizer(), self._buffers(),
                               self._buffers() if cfg.merge.error_feedback else [])
                        for w in dist.comm.local_worker_ids]
        self.dropped: list[int] = []  # the workers left out of the last round
        #: Seconds of the last synchronisation, and of it that training waited for.
        self.sync_s = self.sync_exposed_s = 0.0

    def _buffers(self) -> list[torch.Tensor]:
        """Zeros shaped like the parameters, where a worker keeps its state between turns."""
        return [pinned_zeros_like(p, self) if self.overlaps else torch.zeros_like(p, device=self.storage)
                for p in self.params]

    def rows(self, step: int, worker: Worker) -> torch.Tensor:
        return self.dist.shard_rows(self.batches.worker_batch(step, worker.index, self.cfg.workers))

    def begin_turn(self, worker: Worker) -> None:
        self.use_global_weights()
        worker.optimizer.move_state(self.device)
        # Never across a merge, which may give a dropped worker a fresh optimizer.
        following = self.workers.index(worker) + 1
        if self.overlaps and following < len(self.workers):
            self.workers[following].optimizer.prefetch(self.device)

    @torch.no_grad()
    def end_turn(self, worker: Worker) -> None:
        # Δ = θ − θ_r, computed in the compute buffers, then kept by the worker until the merge.
        torch._foreach_sub_(self.params, self.global_params)
        torch._foreach_neg_(self.params)
        torch._foreach_copy_(worker.delta, self.params)
        worker.optimizer.move_state(self.storage)

    def synchronise(self, worker_losses: torch.Tensor, round: int) -> torch.Tensor:
        began = time.perf_counter()
        merged_losses = self._merge_round(worker_losses, round)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock must see the merge's kernels end
        # Training waits for the whole synchronisation: nothing overlaps it yet.
        self.sync_s = self.sync_exposed_s = time.perf_counter() - began
        return merged_losses

    def _merge_round(self, worker_losses: torch.Tensor, round: int) -> torch.Tensor:
        kept = list(range(len(self.workers)))
        if self.cfg.on_bad_worker == "drop":
            kept = [i for i in kept if self._healthy(self.workers[i], worker_losses[i])]
            if not kept:
                raise NonFiniteDeltaError(f"round {round}: every worker's loss or pseudo-gradient is not "
                                          "finite; lower inner.lr or outer.lr")
        merged = [self.workers[i] for i in kept]
        self.dropped = [w.index for w in self.workers if w not in merged]
        if self.dropped:
            logger.warning("round %d: dropped worker(s) %s (loss or pseudo-gradient not finite); merging the "
                           "others and restarting them from the global model", round, self.dropped)
        # Stored deltas (host memory when offloaded) reach the device a parameter at a time.
        deltas = {name: [w.delta[i] for w in merged] for i, name in enumerate(self.names)}
        residuals = ({name: [w.residual[i] for w in merged] for i, name in enumerate(self.names)}
                     if self.cfg.merge.error_feedback else None)
        self.outer.step(deltas, round=round, fetch=self._fetch,
                        workers=[w.index for w in merged] if self.dropped else None, residuals=residuals)
        for worker in self.workers:
            if worker.index in self.dropped:  # its optimizer state is as poisoned as its weights
                worker.optimizer = self.new_optimizer()
                for residual in worker.residual:
                    residual.zero_()
        return worker_losses[kept].mean(dim=0)

    def _fetch(self, delta: torch.Tensor) -> torch.Tensor:
        return delta.to(self.device, non_blocking=True)

    @staticmethod
    def _healthy(worker: Worker, losses: torch.Tensor) -> bool:
        """Finite losses and a finite pseudo-gradient (one norm per tensor, one sync)."""
        norms = torch.stack(torch._foreach_norm(worker.delta))
        return bool(torch.isfinite(losses).all() and torch.isfinite(norms).all())

    def round_metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {"bytes_per_worker": self.dist.comm.reset_bytes(),
                                   **self.dist.link_bytes(self.dist.comm),
                                   "sync_s": self.sync_s, "sync_exposed_s": self.sync_exposed_s}
        if self.dropped:
            metrics["dropped_workers"] = self.dropped
        return metrics

    @torch.no_grad()
    def use_global_weights(self) -> None:
        torch._foreach_copy_(self.params, self.global_params)

    def checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        return {OUTER_FILE: self.outer.state_dict()}

    def load_checkpoint_files(self, load: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
        self.outer.load_state_dict(load(OUTER_FILE))


def build_algorithm(cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], dist: Distributed,
                    batches: Batches, device: torch.device, storage: torch.device) -> Algorithm:
    """The run's algorithm (`cfg.algorithm`), for the workers this process holds."""
    if cfg.on_bad_worker == "drop" and dist.world_size > 1:
        raise ConfigError("on_bad_worker=drop works in a single process only (the simulator); "
                          "use on_bad_worker=error with several processes")
    if cfg.algorithm == "dp":
        return DataParallel(cfg, named_params, dist, batches)
    return DiLoCo(cfg, named_params, dist, batches, device, storage)
