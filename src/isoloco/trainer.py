"""The training loop: data-parallel baseline and DiLoCo with K workers in this process.

One compute module holds whichever worker is training; workers differ only in their
optimizer state and, between their turn and the merge, in the pseudo-gradient they hold.
A round is:

    for each local worker r:   weights <- θ ; H inner steps ; Δ_r <- θ - weights
    θ <- OuterStep({Δ_r})      # merge rule, then outer optimizer (SGD / Nesterov / IsoLoCo)

The data-parallel baseline runs the same loop with one model trained on the global batch
and no merge. Evaluation and checkpoints happen at round boundaries, where every worker
equals θ, so a checkpoint needs θ, the outer state and each worker's optimizer state only.

Under torchrun the same loop runs in every process (`isoloco.distributed`): each holds its
island's workers and its share of their batches, averages gradients within its island,
merges across islands, and evaluates a share of the validation set; rank 0 writes metrics.
"""

from __future__ import annotations

import math
import sys
import time
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from isoloco import checkpoint as ckpt
from isoloco import sharded_checkpoint
from isoloco.comm import LocalCommunicator
from isoloco.config import TrainConfig, to_dict
from isoloco.configbase import ConfigError
from isoloco.data import Batches, TokenData, check_run_data, load_token_data, validation_batches
from isoloco.distributed import Distributed
from isoloco.inner import InnerOptimizer
from isoloco.metrics import MetricsLog, NullMetricsLog
from isoloco.model import build_model, count_parameters
from isoloco.merge import NonFiniteDeltaError
from isoloco.outer import OuterStep
from isoloco.rundir import CHECKPOINT_DIR, METRICS_FILE, TENSORBOARD_DIR
from isoloco.stop import GracefulStop, StopRequested


def use_deterministic_kernels() -> None:
    """Deterministic CUDA kernels for this process (`deterministic=true`); the cuBLAS workspace
    setting must be in place before the first matrix product on the GPU."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not available on this machine: use device=cpu or device=auto")
    return device


def load_run_data(cfg: TrainConfig) -> tuple[TokenData, str | None]:
    """The run's data, checked for every problem at once (one DataError, a line each), and the
    notice of a run that repeats it, if it does."""
    data = load_token_data(cfg.data)
    notice = check_run_data(data.train, data.val, cfg.seq_len, cfg.global_batch, cfg.train_steps,
                            cfg.data.val_tokens, cfg.data.allow_repeat)
    return data, notice


def check_resume_layout(checkpoint: Path, state: dict[str, Any], layout: dict[str, int]) -> None:
    """Refuse to resume a checkpoint written by another layout of workers and processes."""
    if state.get("layout") != layout:
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint} was written with layout {state.get('layout')}, this run has {layout}; "
            "resume with the same number of workers and processes and the same gpus_per_worker "
            "(isoloco launch --nproc N -- train --resume DIR starts N processes)")


@dataclass
class Worker:
    """A DiLoCo worker between rounds: its optimizer state and, after its turn, its Δ."""

    index: int  # global worker id, 0..R-1
    optimizer: InnerOptimizer
    delta: list[torch.Tensor]  # Δ = θ − θ_r after the worker's turn (storage device)


class Trainer:

    def __init__(self, cfg: TrainConfig, out_dir: Path, dist: Distributed | None = None,
                 progress: bool = True, say: Callable[[str], None] = print):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.say = say
        self.progress = progress
        self.dist = dist or Distributed(cfg)
        if cfg.deterministic:
            use_deterministic_kernels()
        self.device = self.dist.place(resolve_device(cfg.device))
        self.data, repeat_notice = load_run_data(cfg)
        if repeat_notice and self.dist.is_main:
            print(f"warning: {repeat_notice}", file=sys.stderr)
        self.batches = Batches(self.data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
        self.val = validation_batches(self.data.val, cfg.seq_len, cfg.data.val_tokens, cfg.eval_batch)
        self.model = build_model(cfg.model, self.data.vocab_size, cfg.seq_len, cfg.seed).to(self.device)
        self.num_params = count_parameters(self.model)
        self.named_params = list(self.model.named_parameters())
        self.params = [p for _, p in self.named_params]
        self.comm = self.dist.comm
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self.storage = torch.device("cpu") if cfg.offload_workers else self.device
        self.diloco = cfg.algorithm == "diloco"
        if self.diloco:
            # θ lives apart from the compute module, which is overwritten by each worker's turn.
            self.global_params = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
            self.outer = OuterStep(list(zip([n for n, _ in self.named_params], self.global_params)),
                                   cfg.merge, cfg.outer, self.comm, cfg.seed)
            self.workers = [Worker(w, InnerOptimizer(self.named_params, cfg.inner, cfg.steps),
                                   [torch.zeros_like(p, device=self.storage) for p in self.params])
                            for w in self.comm.local_worker_ids]
        else:
            self.global_params = self.params
            self.workers = [Worker(0, InnerOptimizer(self.named_params, cfg.inner, cfg.steps), [])]
        if cfg.on_bad_worker == "drop" and self.dist.world_size > 1:
            raise ConfigError("on_bad_worker=drop works in a single process only (the simulator); "
                              "use on_bad_worker=error with several processes")
        self.dropped: list[int] = []
        #: Called after each worker's turn with (worker, start, end), before the merge: where a
        #: fault-injection test or a debugging probe looks at (or spoils) a worker's delta.
        self.after_turn: list[Callable[[Worker, int, int], None]] = []
        self.step = 0
        self.elapsed = 0.0
        self.cpu_seconds = 0.0  # this process's CPU time in rounds, summed over resumes
        self.last_val_loss: float | None = None
        # Counts worker steps; `run` replaces it with a visible bar (rounds driven by the
        # benchmarks and the GPU check outside `run` update this silent one).
        self.bar = tqdm(disable=True)

    # -- one step --------------------------------------------------------------------------

    def _forward_backward(self, rows: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over `rows` ([n, seq_len+1]); gradients accumulate in .grad."""
        rows = rows.to(self.device, non_blocking=True)
        chunks = rows.split(self.cfg.micro_batch_size)
        total = torch.zeros((), device=self.device)
        for chunk in chunks:
            loss = self._loss(chunk)
            (loss / len(chunks)).backward()
            total += loss.detach()
        return total / len(chunks)

    def _loss(self, rows: torch.Tensor) -> torch.Tensor:
        with self.autocast, self._attention_kernels():
            logits = self.model(input_ids=rows[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))

    def _attention_kernels(self) -> AbstractContextManager:
        """The math attention kernel when deterministic: the fused ones' backward passes
        accumulate in a nondeterministic order on CUDA."""
        if not self.cfg.deterministic:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    def _worker_rows(self, step: int, worker: Worker) -> torch.Tensor:
        """This process's share of what `worker` (dp: the one model) trains on at `step`."""
        if not self.diloco:
            return self.dist.shard_rows(self.batches.rows(step, 0, self.cfg.global_batch))
        return self.dist.shard_rows(self.batches.worker_batch(step, worker.index, self.cfg.workers))

    # -- one round ---------------------------------------------------------------------------

    def _take_turn(self, worker: Worker, start: int, end: int) -> torch.Tensor:
        losses = self._run_worker(worker, start, end)
        for hook in self.after_turn:
            hook(worker, start, end)
        return losses

    def _run_worker(self, worker: Worker, start: int, end: int) -> torch.Tensor:
        """Train one worker from θ for steps [start, end); return its per-step losses."""
        if self.diloco:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.global_params)
            worker.optimizer.move_state(self.device)
        losses = torch.zeros(end - start, device=self.device)
        for step in range(start, end):
            losses[step - start] = self._forward_backward(self._worker_rows(step, worker))
            self.dist.average_gradients(self.params)
            worker.optimizer.step(step)
            self.bar.update()
        if self.diloco:
            # Δ = θ − θ_r, computed in the compute buffers then kept by the worker until the merge.
            with torch.no_grad():
                torch._foreach_sub_(self.params, self.global_params)
                torch._foreach_neg_(self.params)
                torch._foreach_copy_(worker.delta, self.params)
            worker.optimizer.move_state(self.storage)
        return losses

    def _round(self, start: int, end: int) -> torch.Tensor:
        """One round (or, for dp, one segment); returns the mean loss per step over all workers
        that were merged (see `on_bad_worker`; the dropped ones are left in `self.dropped`)."""
        worker_losses = torch.stack([self._take_turn(w, start, end) for w in self.workers])
        round_index = start // self.cfg.inner_steps
        kept = self.workers
        if self.diloco and self.cfg.on_bad_worker == "drop":
            kept = [w for w, losses in zip(self.workers, worker_losses) if self._healthy(w, losses)]
            if not kept:
                raise NonFiniteDeltaError(f"round {round_index}: every worker's loss or pseudo-gradient is not "
                                          "finite; lower inner.lr or outer.lr")
        self.dropped = [w.index for w in self.workers if w not in kept]
        rows = [i for i, w in enumerate(self.workers) if w in kept]
        losses = self.dist.mean(worker_losses[rows].mean(dim=0))
        if self.diloco:
            names = [n for n, _ in self.named_params]
            # Stored deltas (host memory when offloaded) reach the device a parameter at a time.
            deltas = {name: [w.delta[i] for w in kept]
                      for i, name in enumerate(names)}
            if self.dropped:
                print(f"warning: round {round_index}: dropped worker(s) {self.dropped} (loss or pseudo-gradient "
                      "not finite); merging the others and restarting them from the global model", file=sys.stderr)
                with self.outer.merger.restricted_to(LocalCommunicator(worker_ids=[w.index for w in kept])):
                    self.outer.step(deltas, round=round_index, fetch=self._fetch)
                for worker in self.workers:
                    if worker.index in self.dropped:  # its optimizer state is as poisoned as its weights
                        worker.optimizer = InnerOptimizer(self.named_params, self.cfg.inner, self.cfg.steps)
            else:
                self.outer.step(deltas, round=round_index, fetch=self._fetch)
        return losses

    def _fetch(self, delta: torch.Tensor) -> torch.Tensor:
        return delta.to(self.device, non_blocking=True)

    @staticmethod
    def _healthy(worker: Worker, losses: torch.Tensor) -> bool:
        """Finite losses and a finite pseudo-gradient (one norm per tensor, one sync)."""
        norms = torch.stack(torch._foreach_norm(worker.delta))
        return bool(torch.isfinite(losses).all() and torch.isfinite(norms).all())

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of θ on the fixed held-out windows (token-weighted mean); each
        process scores its share of the batches."""
        if self.diloco:
            torch._foreach_copy_(self.params, self.global_params)
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)  # loss x rows, rows
        for rows in self.val[self.dist.rank::self.dist.world_size]:
            totals[0] += self._loss(rows.to(self.device)).item() * rows.size(0)
            totals[1] += rows.size(0)
        self.model.train()
        total, count = self.dist.sum(totals).tolist()
        return total / count

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint_dir(self) -> Path:
        return self.out_dir / CHECKPOINT_DIR

    def save(self, metrics_offset: int) -> Path:
        """Checkpoint at a round boundary. Rank 0 writes θ and the outer state, which every
        process holds alike; the first process of each island its workers' state."""
        names = [n for n, _ in self.named_params]
        files: dict[str, dict[str, torch.Tensor]] = {}
        scalars: dict[str, Any] = {}
        if self.dist.is_main:
            files["global"] = dict(zip(names, self.global_params))
            if self.diloco:
                files["outer"] = self.outer.state_dict()
        if self.dist.writes_worker_state:
            worker_tensors: dict[str, torch.Tensor] = {}
            for worker in self.workers:
                for j, state in enumerate(worker.optimizer.state_dicts()):
                    tensors, worker_scalars = ckpt.flatten_optimizer_state(state, f"w{worker.index}.opt{j}")
                    worker_tensors.update(tensors)
                    scalars.update(worker_scalars)
            files[self._workers_file()] = worker_tensors
        state = {
            "elapsed_s": self.elapsed,
            "cpu_s": self.cpu_seconds,
            "metrics_offset": metrics_offset,
            "last_val_loss": self.last_val_loss,
            "layout": self.dist.layout.describe(),
            "config": to_dict(self.cfg),
        }
        return sharded_checkpoint.save(self.dist, self._checkpoint_dir(), self.step, files, scalars, state,
                                       self.cfg.keep_checkpoints)

    def _workers_file(self) -> str:
        """The checkpoint file holding the state of this process's island's workers."""
        return f"workers-{self.dist.layout.island}"

    def restore(self) -> int | None:
        """Load the newest valid checkpoint; return the metrics file offset to truncate to."""
        found = sharded_checkpoint.find_latest(self.dist, self._checkpoint_dir(),
                                               warn=lambda message: print(message, file=sys.stderr))
        if found is None:
            return None
        path, state = found
        check_resume_layout(path, state, self.dist.layout.describe())
        global_tensors = ckpt.load_tensors(path, "global", self.device)
        for (name, _), param in zip(self.named_params, self.global_params):
            saved = global_tensors.get(name)
            if saved is None or saved.shape != param.shape:
                found = "missing" if saved is None else f"shaped {tuple(saved.shape)}"
                raise ckpt.CheckpointError(
                    f"checkpoint {path}: {name} is {found}, this model's is {tuple(param.shape)}; it was written "
                    "for another model or vocabulary (tokenizer) than this run's")
        with torch.no_grad():
            for (name, _), param in zip(self.named_params, self.global_params):
                param.copy_(global_tensors[name])
        # On the CPU: torch's load_state_dict moves the moments to their parameters' device and
        # keeps AdamW's scalar `step` where it is, on the CPU as torch expects (on the GPU every
        # foreach step would wait for it).
        worker_tensors = ckpt.load_tensors(path, self._workers_file(), torch.device("cpu"))
        for worker in self.workers:
            templates = worker.optimizer.state_dicts()
            worker.optimizer.load_state_dicts([
                ckpt.unflatten_optimizer_state(t, worker_tensors, state["scalars"], f"w{worker.index}.opt{j}")
                for j, t in enumerate(templates)])
            worker.optimizer.move_state(self.storage)
        if self.diloco:
            self.outer.load_state_dict(ckpt.load_tensors(path, "outer", self.device))
        self.step = state["step"]
        self.elapsed = state["elapsed_s"]
        self.cpu_seconds = state.get("cpu_s", 0.0)  # absent from checkpoints of older versions
        self.last_val_loss = state["last_val_loss"]
        self.say(f"resumed from {path} at step {self.step}")
        return state["metrics_offset"]

    # -- the run -------------------------------------------------------------------------------

    def _due(self, every: int, start: int, end: int) -> bool:
        """Whether a multiple of `every` lies in (start, end]: the event happens at this boundary."""
        return every > 0 and end // every > start // every

    def run(self, resume: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        offset = self.restore() if resume else None
        tokens_per_step = cfg.global_batch * cfg.seq_len
        log = MetricsLog(
            self.out_dir / METRICS_FILE, truncate_to=offset or 0,
            tensorboard_dir=self.out_dir / TENSORBOARD_DIR if cfg.log.tensorboard else None,
            wandb_project=cfg.log.wandb_project if cfg.log.wandb else None,
            run_name=self.out_dir.name, config=to_dict(cfg)) if self.dist.is_main else NullMetricsLog()
        # Workers take their turns one after another: the bar counts each worker's steps.
        workers = len(self.workers)
        self.bar = tqdm(total=cfg.train_steps * workers, initial=self.step * workers, disable=not self.progress,
                        unit="step" if workers == 1 else "worker-step", dynamic_ncols=True)
        stop = GracefulStop()
        try:
            while self.step < cfg.train_steps:
                start = self.step
                end = min((start // cfg.inner_steps + 1) * cfg.inner_steps, cfg.train_steps)
                began, began_cpu = time.perf_counter(), time.process_time()
                losses = self._round(start, end).tolist()
                seconds = time.perf_counter() - began
                self.elapsed += seconds
                self.cpu_seconds += time.process_time() - began_cpu
                self.step = end
                record_extra: dict[str, Any] = {}
                if self.diloco:
                    record_extra["bytes_per_worker"] = self.comm.reset_bytes()
                    record_extra.update(self.dist.link_bytes(self.comm))
                if self.dropped:
                    record_extra["dropped_workers"] = self.dropped
                if self._due(cfg.eval_every, start, end) or end == cfg.train_steps:
                    self.last_val_loss = self.evaluate()
                    record_extra["val_loss"] = self.last_val_loss
                # Steps are timed as a round (workers take turns, then merge): the round's last line
                # carries its wall time and throughput.
                record_extra["wall_time_s"] = self.elapsed
                record_extra["tokens_per_s"] = tokens_per_step * (end - start) / seconds
                for i, step in enumerate(range(start, end)):
                    record = {"step": step + 1, "round": start // cfg.inner_steps, "tokens": (step + 1) * tokens_per_step,
                              "train_loss": losses[i], "lr": self.workers[0].optimizer.lr_at(step)}
                    if step + 1 == end:
                        record.update(record_extra)
                    log.write(record)
                self.bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{record_extra['tokens_per_s']:,.0f}",
                                     **({"val": f"{self.last_val_loss:.3f}"} if "val_loss" in record_extra else {}))
                if not math.isfinite(losses[-1]):
                    raise FloatingPointError(f"training loss became {losses[-1]} at step {end}; "
                                             "lower inner.lr or outer.lr")
                # A signal may reach some processes only: all stop at the same boundary.
                signum = int(self.dist.max(stop.signum or 0))
                if self._due(cfg.checkpoint_every, start, end) or end == cfg.train_steps or signum:
                    self.save(log.flush())
                if signum and end < cfg.train_steps:
                    raise StopRequested(signum, end)
        finally:
            stop.restore()
            self.bar.close()
            log.close()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "final_val_loss": self.last_val_loss,
            "method": cfg.method,
            "algorithm": cfg.algorithm,
            "workers": cfg.workers,
            "inner_steps": cfg.inner_steps,
            "steps": cfg.train_steps,
            "global_batch": cfg.global_batch,
            "seq_len": cfg.seq_len,
            "tokens": cfg.train_steps * cfg.global_batch * cfg.seq_len,
            "params": self.num_params,
            "model": cfg.model,
            "seed": cfg.seed,
            "processes": self.dist.world_size,
            "wall_time_s": self.elapsed,
            "cpu_time_s": self.cpu_seconds,
        }
