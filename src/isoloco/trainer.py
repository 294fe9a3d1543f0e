"""The training loop: rounds of every local worker's turn, then a synchronisation.

One compute module holds whichever worker is training; workers differ only in their
optimizer state and, between their turn and the merge, in the pseudo-gradient they hold.
A round is:

    for each local worker r:   begin turn ; H inner steps ; end turn
    synchronise                # DiLoCo: merge rule, then outer optimizer; dp: nothing

What the turns and the synchronisation do is the algorithm's (`isoloco.algorithms`: the
data-parallel baseline or DiLoCo); the loop itself is round → evaluate → log → checkpoint →
stop. Evaluation and checkpoints happen at round boundaries, where every worker equals θ,
so a checkpoint needs θ, the algorithm's state and each worker's optimizer state only.

Under torchrun the same loop runs in every process (`isoloco.distributed`): each holds its
island's workers and its share of their batches, averages gradients within its island,
merges across islands, and evaluates a share of the validation set; rank 0 writes metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from isoloco import checkpoint as ckpt
from isoloco import logs, sharded_checkpoint
from isoloco.algorithms import Algorithm, Worker, build_algorithm
from isoloco.config import to_dict
from isoloco.config_checks import divergence_causes
from isoloco.train_config import TrainConfig
from isoloco.data import Batches, TokenData, check_run_data, load_token_data, validation_batches
from isoloco.distributed import Distributed
from isoloco.errors import CheckpointError, ConfigError
from isoloco.inner import forward_backward, mixed_precision, next_token_loss
from isoloco.metrics import MetricsLog, NullMetricsLog
from isoloco.layout import ProcessLayout
from isoloco.model import build_model, count_parameters
from isoloco.rundir import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR
from isoloco.spectra import SECONDS_KEY, SPECTRA_KEY, SpectraProbe
from isoloco.stop import GracefulStop, StopRequested

logger = logging.getLogger(__name__)

#: summary.json, metrics.jsonl and a checkpoint's state: `merge.finder_dtype` as it resolved here.
FINDER_DTYPE_KEY = "merge_finder_dtype"
#: Where no terminal draws the progress bar, a plain line inside a round at most this often
#: (the round's own line comes at its end, which a slow round may keep waiting).
PROGRESS_EVERY_S = 30.0


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


def hardware(device: torch.device) -> dict[str, str]:
    """What a run computed on, for its summary: the kernels torch picks from it (the CPU's
    vector instructions, the GPU) move a result's last bits, so a committed run retrains bit for
    bit only on hardware that reports the same."""
    found = {"device": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "torch": torch.__version__}
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
    return found


def load_run_data(cfg: TrainConfig) -> tuple[TokenData, str | None]:
    """The run's data, checked for every problem at once (one DataError, a line each), and the
    notice of a run that repeats it, if it does."""
    data = load_token_data(cfg.data)
    notice = check_run_data(data.train, data.val, cfg.seq_len, cfg.global_batch, cfg.train_steps,
                            cfg.data.val_tokens, cfg.data.allow_repeat)
    return data, notice


def check_resume_layout(checkpoint: Path, state: dict[str, Any], layout: dict[str, int]) -> None:
    """Refuse to resume a checkpoint written by another layout of workers and processes."""
    saved = state.get("layout")
    if saved != layout:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by {ProcessLayout.in_words(saved)}, and this run has "
            f"{ProcessLayout.in_words(layout)}; resume with the same number of workers and processes and the "
            "same gpus_per_worker (isoloco launch --nproc N -- train --resume DIR starts N processes)")



@dataclasses.dataclass
class SlowLinkTotals:
    """A run's slow link over its rounds and resumes, per process: the bytes its synchronisations
    put there (measured in a job, modelled in the simulator: `algorithms.SlowLinkModel`) and
    float32's for the same model and layout, from the metrics' `slow_link_bytes` and
    `slow_link_float32_bytes`; zero synchronisations where no round recorded them."""

    bytes: float = 0.0
    float32: float = 0.0
    synchronisations: int = 0

    def add(self, extra: dict[str, Any]) -> None:
        if "slow_link_bytes" in extra:
            self.bytes += extra["slow_link_bytes"]
            self.float32 += extra["slow_link_float32_bytes"]
            self.synchronisations += extra["synchronisations"]

    def summary(self, source: str) -> dict[str, Any]:
        """summary.json's keys: bytes per process per round (a synchronisation), float32's, how
        many times fewer (None without a slow link), and whether `source` measured or modelled them."""
        if not self.synchronisations:
            return {}
        return {"slow_link_bytes_per_round": self.bytes / self.synchronisations,
                "slow_link_float32_bytes_per_round": self.float32 / self.synchronisations,
                "slow_link_fewer_than_float32": self.float32 / self.bytes if self.bytes else None,
                "slow_link_bytes_source": source}


def spectra_probe(cfg: TrainConfig, algorithm: Algorithm) -> SpectraProbe | None:
    """The measurement of DiLoCo's outer steps with `log.spectra`; None when off, and for dp,
    which has no pseudo-gradients to measure."""
    outer = getattr(algorithm, "outer", None)
    if not cfg.log.spectra or outer is None:
        return None
    return outer.measure_spectra()


class Trainer:

    def __init__(self, cfg: TrainConfig, out_dir: Path, dist: Distributed | None = None, progress: bool = True):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.dist = dist or Distributed(cfg)
        if cfg.deterministic:
            use_deterministic_kernels()
        self.device = self.dist.place(resolve_device(cfg.device))
        self.data, repeat_notice = load_run_data(cfg)
        if repeat_notice and self.dist.is_main:
            logger.warning(repeat_notice)
        self.batches = Batches(self.data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
        self.val = validation_batches(self.data.val, cfg.seq_len, cfg.data.val_tokens, cfg.eval_batch)
        self.model = build_model(cfg.model, self.data.vocab_size, cfg.seq_len, cfg.seed).to(self.device)
        if cfg.compile:
            self.model.compile()  # in place: the parameters, their names and the algorithm's views stay the same
        self.num_params = count_parameters(self.model)
        self.named_params = list(self.model.named_parameters())
        self.params = [p for _, p in self.named_params]
        self.autocast = mixed_precision(self.device)
        self.storage = torch.device("cpu") if cfg.offload_workers else self.device
        self.algorithm = build_algorithm(cfg, self.named_params, self.dist, self.batches, self.device, self.storage)
        self.workers = self.algorithm.workers
        self.global_params = self.algorithm.global_params
        self.spectra = spectra_probe(cfg, self.algorithm)
        # The range finder's precision on this device, recorded: `auto` may resolve differently elsewhere.
        self.finder_dtype = cfg.merge.finder_precision(self.device)
        #: Called after each worker's turn with (worker, start, end), before the merge: where a
        #: fault-injection test or a debugging probe looks at (or spoils) a worker's delta.
        self.after_turn: list[Callable[[Worker, int, int], None]] = []
        self.step = 0
        self.elapsed = 0.0
        self.cpu_seconds = 0.0  # this process's CPU time in rounds, summed over resumes
        self.compute_s = 0.0  # wall seconds of the round's inner steps, without synchronisation
        # Wall seconds the round's closing loss sum waited for the slowest process: where the
        # processes' compute differs, no blocking synchronisation absorbs that wait with overlap on.
        self.peer_wait_s = 0.0
        # The run's slow link, summed over rounds and resumes for summary.json (`_count_sync`).
        self.cross_island_wire_bytes = 0.0
        self.exposed_sync_s = 0.0
        self.slow_link = SlowLinkTotals()
        self.tokens_trained = 0  # by every worker together, over rounds and resumes
        self.last_val_loss: float | None = None
        #: (step, validation loss) of the first evaluation that found the run above its unigram
        #: baseline where a learning model is not (`_check_baseline`); None while it has not been.
        self.above_unigram: tuple[int, float] | None = None
        # Counts worker steps; `run` replaces it with a visible bar (rounds driven by the
        # benchmarks and the GPU check outside `run` update this silent one).
        self.bar = tqdm(disable=True)
        self._progress_at = time.perf_counter()

    # -- one step --------------------------------------------------------------------------

    def _forward_backward(self, rows: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over `rows` ([n, seq_len+1]); gradients accumulate in .grad."""
        return forward_backward(self.model, rows.to(self.device, non_blocking=True), self.cfg.micro_batch_size,
                                self.autocast, self.cfg.deterministic)

    def _loss(self, rows: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.model, rows, self.autocast, self.cfg.deterministic)

    # -- one round ---------------------------------------------------------------------------

    def take_turn(self, worker: Worker, start: int, end: int) -> torch.Tensor:
        """Train one worker for its share of steps [start, end): the first H_r of them
        (`worker_speeds`), at their learning rates and on its rows of their batches; return
        its per-step losses (H_r of them)."""
        self.algorithm.begin_turn(worker)
        losses = torch.zeros(self.cfg.steps_taken(worker.index, end - start), device=self.device)
        for step in range(start, start + len(losses)):
            self.algorithm.before_step(worker, step - start)
            began = time.perf_counter()
            losses[step - start] = self._forward_backward(self.algorithm.rows(step, worker))
            self.dist.average_gradients(self.params)
            worker.optimizer.step(step)
            self.compute_s += time.perf_counter() - began
            self.bar.update()
            self._step_progress(worker, step)
        self.algorithm.end_turn(worker)
        for hook in self.after_turn:
            hook(worker, start, end)
        return losses

    def _step_progress(self, worker: Worker, step: int) -> None:
        """Where no terminal draws the bar, say how far a round has come, every
        `PROGRESS_EVERY_S` seconds at most."""
        if not (self.progress and self.bar.disable):
            return
        now = time.perf_counter()
        if now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        where = f", worker {worker.index + 1} of {self.cfg.num_workers}" if self.cfg.num_workers > 1 else ""
        logger.info("step %d/%d%s", step + 1, self.cfg.train_steps, where)

    def train_round(self, start: int, end: int) -> torch.Tensor:
        """One round (dp: one segment of H steps); the mean loss per step over the workers that
        count (see `on_bad_worker`) and took that step, across processes. With overlap, the
        synchronisation the last round ended with starts first."""
        self.algorithm.start_pending()
        worker_losses = torch.zeros(len(self.workers), end - start, device=self.device)
        taken = torch.zeros_like(worker_losses)  # 1 where the worker took the step
        for losses, took, worker in zip(worker_losses, taken, self.workers):
            own = self.take_turn(worker, start, end)
            losses[:len(own)], took[:len(own)] = own, 1
        counted = self.algorithm.synchronise(worker_losses, round=start // self.cfg.inner_steps)
        began = time.perf_counter()
        totals = self.dist.sum(torch.stack([(worker_losses[counted] * taken[counted]).sum(dim=0),
                                            taken[counted].sum(dim=0)]))
        self.peer_wait_s = time.perf_counter() - began
        return totals[0] / totals[1]

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of θ on the fixed held-out windows (token-weighted mean); each
        process scores its share of the batches."""
        self.algorithm.use_global_weights()
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
        # Every process lands a synchronisation in flight here, in step, before anything is written.
        self.algorithm.settle()
        period = self.algorithm.period_state()
        names = [n for n, _ in self.named_params]
        files: dict[str, dict[str, torch.Tensor]] = {}
        scalars: dict[str, Any] = {}
        if self.dist.is_main:
            files["global"] = dict(zip(names, self.global_params))
            files.update(self.algorithm.checkpoint_files())
        if self.dist.writes_worker_state:
            worker_tensors: dict[str, torch.Tensor] = {}
            for worker in self.workers:
                for j, state in enumerate(worker.optimizer.state_dicts()):
                    tensors, worker_scalars = ckpt.flatten_optimizer_state(state, f"w{worker.index}.opt{j}")
                    worker_tensors.update(tensors)
                    scalars.update(worker_scalars)
                worker_tensors.update(self.algorithm.worker_tensors(worker))
            files[self._workers_file()] = worker_tensors
        state = {
            "elapsed_s": self.elapsed,
            "cpu_s": self.cpu_seconds,
            "cross_island_wire_bytes": self.cross_island_wire_bytes,
            "exposed_sync_s": self.exposed_sync_s,
            "slow_link": dataclasses.asdict(self.slow_link),
            "tokens_trained": self.tokens_trained,
            "above_unigram": self.above_unigram,
            "metrics_offset": metrics_offset,
            "last_val_loss": self.last_val_loss,
            "layout": self.dist.layout.describe(),
            "config": to_dict(self.cfg),
            "sync_period": period,
            FINDER_DTYPE_KEY: self.finder_dtype,
        }
        return sharded_checkpoint.save(self.dist, self._checkpoint_dir(), self.step, files, scalars, state,
                                       self.cfg.keep_checkpoints)

    def _workers_file(self) -> str:
        """The checkpoint file holding the state of this process's island's workers."""
        return ckpt.workers_file(self.dist.layout.island)

    def restore(self) -> int | None:
        """Load the newest valid checkpoint; return the metrics file offset to truncate to."""
        found = sharded_checkpoint.find_latest(self.dist, self._checkpoint_dir())
        if found is None:
            return None
        path, state = found
        check_resume_layout(path, state, self.dist.layout.describe())
        # Every file is read a tensor at a time, straight into where the tensor lives.
        with ckpt.open_tensors(path, "global") as saved:
            for (name, _), param in zip(self.named_params, self.global_params):
                shape = saved.shape(name) if name in saved else None
                if shape != tuple(param.shape):
                    found = "missing" if shape is None else f"shaped {shape}"
                    raise CheckpointError(
                        f"checkpoint {path}: {name} is {found}, this model's is {tuple(param.shape)}; it was written "
                        "for another model or vocabulary (tokenizer) than this run's")
            with torch.no_grad():
                for (name, _), param in zip(self.named_params, self.global_params):
                    param.copy_(saved[name])
        with ckpt.open_tensors(path, self._workers_file()) as saved:
            for worker in self.workers:
                worker.optimizer.load_state(saved, state["scalars"], f"w{worker.index}", self.storage)
                for key, tensor in self.algorithm.worker_tensors(worker).items():
                    if key not in saved:
                        raise CheckpointError(f"checkpoint {path} holds no {key}: it was written with other "
                                              "merge.error_feedback or outer.overlap_steps settings; resume with "
                                              "the settings it was written with")
                    tensor.copy_(saved[key])
        with ExitStack() as files:
            self.algorithm.load_checkpoint_files(
                lambda file: files.enter_context(ckpt.open_tensors(path, file)))
        self.step = state["step"]
        self.elapsed = state["elapsed_s"]
        # Absent from checkpoints of older versions: their totals then start at the resume.
        self.cpu_seconds = state.get("cpu_s", 0.0)
        self.cross_island_wire_bytes = state.get("cross_island_wire_bytes", 0.0)
        self.exposed_sync_s = state.get("exposed_sync_s", 0.0)
        self.slow_link = SlowLinkTotals(**state.get("slow_link", {}))
        self.tokens_trained = state.get("tokens_trained", self.step * self.cfg.global_batch * self.cfg.seq_len)
        self.above_unigram = tuple(state["above_unigram"]) if state.get("above_unigram") else None
        self.last_val_loss = state["last_val_loss"]
        if state.get("sync_period"):  # absent from checkpoints of older versions
            self.algorithm.load_period_state(state["sync_period"])
        earlier = state.get(FINDER_DTYPE_KEY)
        if earlier and self.finder_dtype and earlier != self.finder_dtype and self.dist.is_main:
            logger.warning("the merge's range finder ran its early iterations in %s before this resume and runs them "
                           "in %s on this device (merge.finder_dtype=%s), so TSV's and Iso-CTS's numbers will differ "
                           "from an uninterrupted run's; to keep %s, set merge.finder_dtype: %s in %s",
                           earlier, self.finder_dtype, self.cfg.merge.finder_dtype, earlier, earlier,
                           self.out_dir / CONFIG_FILE)
        logger.info("resumed from %s at step %d", path, self.step)
        return state["metrics_offset"]

    # -- the run -------------------------------------------------------------------------------

    def _due(self, every: int, start: int, end: int) -> bool:
        """Whether a multiple of `every` lies in (start, end]: the event happens at this boundary."""
        return every > 0 and end // every > start // every

    def run(self, resume: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        offset = self.restore() if resume else None
        if self.step >= cfg.train_steps:
            # A resumed run that had ended: its results stand, and nothing is trained or logged.
            logger.log(logs.NOTICE, "%s is already finished (its last checkpoint is at step %d of %d): nothing "
                       "to train; start a new run with --out to train longer", self.out_dir, self.step,
                       cfg.train_steps)
            return self.summary()
        log = MetricsLog(
            self.out_dir / METRICS_FILE, truncate_to=offset or 0,
            tensorboard_dir=self.out_dir / TENSORBOARD_DIR if cfg.log.tensorboard else None,
            wandb_project=cfg.log.wandb_project if cfg.log.wandb else None,
            run_name=self.out_dir.name, config=to_dict(cfg)) if self.dist.is_main else NullMetricsLog()
        # Workers take their turns one after another: the bar counts each worker's steps. Where
        # no terminal redraws it, each round is one plain line instead (`_log_round`).
        workers = len(self.workers)
        self.bar = tqdm(total=cfg.train_steps * workers, initial=self.step * workers,
                        disable=not (self.progress and logs.interactive()),
                        unit="step" if workers == 1 else "worker-step", dynamic_ncols=True)
        stop = GracefulStop(said=self._stopping)
        signum = 0
        try:
            while self.step < cfg.train_steps:
                start = self.step
                end = min((start // cfg.inner_steps + 1) * cfg.inner_steps, cfg.train_steps)
                losses, seconds = self._timed_round(start, end)
                self.step = end
                extra = self.algorithm.round_metrics()
                self._count_sync(extra)
                if self.finder_dtype:
                    extra[FINDER_DTYPE_KEY] = self.finder_dtype
                if self._due(cfg.eval_every, start, end) or end == cfg.train_steps:
                    self.last_val_loss = extra["val_loss"] = self.evaluate()
                    self._check_baseline(start, end)
                self._log_round(log, start, end, losses, seconds, extra)
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
            self.algorithm.close()
            self.bar.close()
            log.close()
        signum = signum or stop.signum or 0
        if signum:  # in the last round, or after it: there was no round left to stop before
            logger.log(logs.NOTICE, "%s arrived during the last round: the run finished it and wrote its final "
                       "checkpoint, so it is complete (nothing to resume)", signal.Signals(signum).name)
        return self.summary()

    def _stopping(self, signum: int) -> None:
        """Acknowledge a first stop signal at once: finishing the round may take a while."""
        logger.log(logs.NOTICE, "%s: finishing the round, then writing a checkpoint and stopping; a second signal "
                   "(Ctrl-C again) stops at once, losing the work since the last checkpoint",
                   signal.Signals(signum).name)

    def _timed_round(self, start: int, end: int) -> tuple[list[float], float]:
        """Train one round; its per-step losses and wall seconds (CPU time is summed too)."""
        began, began_cpu = time.perf_counter(), time.process_time()
        self.compute_s = 0.0
        losses = self.train_round(start, end).tolist()
        seconds = time.perf_counter() - began
        self.elapsed += seconds
        self.cpu_seconds += time.process_time() - began_cpu
        return losses, seconds

    def _count_sync(self, extra: dict[str, Any]) -> None:
        """Add a round's slow link to the run's totals: the cross-island wire bytes of every
        process (a metrics line holds their mean over processes, so times the processes), the
        seconds training waited for the synchronisation (rank 0's, as its lines), and the bytes
        per process beside float32's (`SlowLinkTotals`)."""
        self.cross_island_wire_bytes += extra.get("wire_bytes_cross_island", 0.0) * self.dist.world_size
        self.exposed_sync_s += extra.get("sync_exposed_s", 0.0)
        self.slow_link.add(extra)

    def _check_baseline(self, start: int, end: int) -> None:
        """Warn, once, when the evaluation at `end` finds θ above the unigram baseline (it knows
        less than the token frequencies) where a learning model is not: at any evaluation but a
        first one mid-run, which may come before the model has learnt them, unless that one is
        above even a uniform guess (ln V), where no model starts."""
        unigram, loss, uniform = self.data.unigram_loss, self.last_val_loss, math.log(self.data.vocab_size)
        early = ((not self.cfg.eval_every or start < self.cfg.eval_every) and end < self.cfg.train_steps
                 and loss < uniform)
        if self.above_unigram or loss <= unigram or early:
            return
        self.above_unigram = (end, loss)
        verdict = (f"above even a uniform guess (ln {self.data.vocab_size} = {uniform:.4f}): the run diverged"
                   if loss > uniform else "the run diverged, or has not learnt the frequencies yet")
        if self.dist.is_main:
            logger.warning("step %d: validation loss %.4f is above the unigram baseline %.4f (predicting each token by "
                           "its frequency), %s; %s", end, loss, unigram, verdict, divergence_causes(self.cfg))

    def _log_round(self, log: MetricsLog | NullMetricsLog, start: int, end: int, losses: list[float],
                   seconds: float, extra: dict[str, Any]) -> None:
        """One metrics line per step; the round's last carries `extra`, its wall time and its
        throughput (steps are timed as a round: workers take turns, then merge)."""
        trained = self.cfg.tokens_trained(end - start, end - start)
        extra = {**extra, "wall_time_s": self.elapsed, "compute_s": self.compute_s, "peer_wait_s": self.peer_wait_s,
                 "tokens_per_s": trained / seconds}
        if self.spectra is not None:
            extra[SPECTRA_KEY] = self.spectra.take_records()
        for i, step in enumerate(range(start, end)):
            record = {"step": step + 1, "round": start // self.cfg.inner_steps,
                      "tokens": self.tokens_trained + self.cfg.tokens_trained(end - start, i + 1),
                      "train_loss": losses[i], "lr": self.workers[0].optimizer.lr_at(step)}
            log.write({**record, **extra} if step + 1 == end else record)
        self.tokens_trained += trained
        shown = {"loss": f"{losses[-1]:.3f}", "tok_s": f"{extra['tokens_per_s']:,.0f}"}
        if extra.get("synchronisations"):  # on a slow link, what the round waited for it
            shown["sync_s"] = f"{extra['sync_exposed_s']:.2f}"
        if "val_loss" in extra:
            shown["val"] = f"{self.last_val_loss:.3f}"
        if self.progress and self.bar.disable:  # no terminal to draw the bar on
            logger.info("step %d/%d: %s", end, self.cfg.train_steps,
                        ", ".join(f"{key} {value}" for key, value in shown.items()))
            self._progress_at = time.perf_counter()
        self.bar.set_postfix(**shown)

    def summary(self) -> dict[str, Any]:
        cfg = self.cfg
        above = {} if self.above_unigram is None else {"above_unigram_baseline_at_step": self.above_unigram[0],
                                                       "above_unigram_baseline_val_loss": self.above_unigram[1]}
        return {
            "final_val_loss": self.last_val_loss,
            "method": cfg.method,
            "algorithm": cfg.algorithm,
            "workers": cfg.workers,
            "inner_steps": cfg.inner_steps,
            "steps": cfg.train_steps,
            "global_batch": cfg.global_batch,
            "seq_len": cfg.seq_len,
            "tokens": self.tokens_trained,
            "tokens_scheduled": cfg.train_steps * cfg.global_batch * cfg.seq_len,
            "params": self.num_params,
            "model": cfg.model,
            "seed": cfg.seed,
            "processes": self.dist.world_size,
            "wall_time_s": self.elapsed,
            "cpu_time_s": self.cpu_seconds,
            "cross_island_wire_bytes": round(self.cross_island_wire_bytes),
            "exposed_sync_seconds": self.exposed_sync_s,
            **self.slow_link.summary("modelled" if self.dist.world_size == 1 else "measured"),
            **above,
            **({SECONDS_KEY: self.spectra.seconds} if self.spectra is not None else {}),
            **({FINDER_DTYPE_KEY: self.finder_dtype} if self.finder_dtype else {}),
            "hardware": hardware(self.device),
        }
