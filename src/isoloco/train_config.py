"""The run configuration: its typed sections (`TrainConfig` and the sections it holds) and the
checks each makes of its own fields, before any work starts.

How a config is resolved from presets, files and `key=value` overrides is `isoloco.config`;
what is checked against the model and said before and after a run, `isoloco.config_checks`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
from dataclasses import dataclass

from isoloco.configbase import check_at_least, check_choices, check_range, option
from isoloco.errors import ConfigError
from isoloco.data import DataConfig
from isoloco.distributed import DistConfig
from isoloco.inner import InnerConfig
from isoloco.merge_config import MergeConfig
from isoloco.methods import METHODS
from isoloco.model import MODEL_PRESETS
from isoloco.outer import OuterConfig, validate_combination

ALGORITHMS = ("diloco", "dp")
BAD_WORKER_POLICIES = ("error", "drop")
LATE_POLICIES = ("drop", "carry")


@dataclass
class LogConfig:
    tensorboard: bool = option(False, "also write TensorBoard event files to OUT/tensorboard (needs the tensorboard extra)")
    wandb: bool = option(False, "also log to Weights & Biases (needs the wandb extra; offline unless WANDB_MODE says otherwise)")
    wandb_project: str = option("isoloco", "Weights & Biases project name")
    spectra: bool = option(False, "diloco: log each matrix's merged update spectrum (stable rank, σ_max/σ_mean), norms "
                           "and the workers' disagreement per round in metrics.jsonl, their cost in summary.json")

    def check_installed(self) -> None:
        """Refuse a logger whose extra is not installed, before a run starts (not at import:
        a saved config naming one stays readable, e.g. for `isoloco export`)."""
        for key, module, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
            if getattr(self, key) and not _installed(module):
                raise ConfigError(f"log.{key}=true needs the {module} package, which is not installed: "
                                  f"pip install 'isoloco[{extra}]', or set log.{key}=false")


@dataclass
class FaultsConfig:
    """Simulated stragglers: workers that miss a round's deadline, drawn alike in every layout."""

    late_rate: float = option(0.0, "diloco: the probability that a worker misses a round's deadline, drawn "
                              "independently for each round and worker from (seed, round, worker), so the same in "
                              "every process layout; in [0, 1)")
    late: str = option("drop", "a late worker's pseudo-gradient: drop loses it (the worker starts the next round from "
                       "the new θ and keeps its inner optimizer state, as torchft keeps a replica that fails its "
                       "commit); carry merges it in the next round the worker arrives, added to its fresh one",
                       LATE_POLICIES)
    stale_weight: float = option(0.5, "faults.late=carry: a carried pseudo-gradient is multiplied by this for each "
                                 "round it waits (staleness-aware down-weighting; docs/fidelity.md); in [0, 1]")

    def validate(self) -> None:
        check_choices("faults", self)
        check_range("faults.late_rate", self.late_rate, 0, 1, low_open=False, high_open=True)
        check_range("faults.stale_weight", self.stale_weight, 0, 1, low_open=False, high_open=False)

    def is_late(self, seed: int, round: int, worker: int) -> bool:
        """Whether global worker `worker` misses round `round`'s deadline: a hash of (seed, round,
        worker) against `late_rate`, so every process, layout and resume draws the same."""
        if not self.late_rate:
            return False
        digest = hashlib.blake2b(f"isoloco.faults.late:{seed}:{round}:{worker}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.late_rate * 2**64


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules maps it to None: importing it is blocked
        return False


@dataclass
class TrainConfig:
    method: str = option("isoloco", "named method whose values fill in the defaults below", METHODS)
    algorithm: str = option("diloco", "dp: one model on the global batch (baseline); diloco: R workers syncing every H steps", ALGORITHMS)
    model: str = option("tiny", "model preset", MODEL_PRESETS)
    workers: int = option(4, "R: number of DiLoCo workers (dp trains one model: its config records 1)")
    inner_steps: int = option(30, "H: inner steps between synchronisations")
    global_batch: int = option(32, "sequences per inner step across all workers (each worker takes global_batch/R)")
    seq_len: int = option(128, "tokens per training sequence")
    micro_batch: int = option(0, "at most this many sequences per forward/backward (gradient accumulation); 0 = a worker's whole batch at once")
    steps: int = option(300, "total inner steps (each worker runs this many) and the length of the learning-rate schedule")
    whole_rounds: bool = option(False, "diloco: train only whole rounds, floor(steps/H)*H steps, while the schedule still "
                                "spans steps (the paper's code sizes both from the token budget); false: a last "
                                "partial round syncs at steps")
    seed: int = option(0, "seed of model initialisation, data order and random merge rules")
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    deterministic: bool = option(False, "CUDA: deterministic kernels (torch deterministic algorithms, a fixed cuBLAS "
                                 "workspace, the math attention kernel), so reruns and resumes on the same GPU "
                                 "model and software give the same bits; slower. CPU runs are bit-exact without it")
    offload_workers: bool = option(False, "keep idle workers' parameters and optimizer state in CPU memory (GPU runs with many workers)")
    compile: bool = option(False, "torch.compile the model (inductor): fused forward and backward kernels, without the "
                           "per-operation overhead every worker's small batch pays at large R; other last bits than "
                           "eager, and a compile of about a minute when the run starts (CPU: needs a C++ compiler)")
    eval_every: int = option(60, "evaluate the global model every this many steps (at the next synchronisation) and at "
                             "the end; 0 = only at the end")
    eval_batch: int = option(16, "sequences per evaluation forward pass")
    checkpoint_every: int = option(150, "checkpoint every this many steps (at the next synchronisation) and at the end; 0 = only at the end")
    keep_checkpoints: int = option(2, "how many recent checkpoints to keep")
    on_bad_worker: str = option("error", "a worker whose loss or pseudo-gradient is not finite: error stops the run "
                                "(last checkpoint intact); drop merges the others and restarts it from θ",
                                BAD_WORKER_POLICIES)
    worker_speeds: list[float] = option(
        [], "diloco: relative speeds, cycled over the workers (e.g. 1,0.5): in each round worker r takes the first "
            "H_r = max(1, round(H·s_r / max s)) of its H inner steps (its own micro-batches and the schedule's "
            "learning rates of those steps) and skips the rest; empty: every worker takes all H")
    data: DataConfig = dataclasses.field(default_factory=DataConfig, metadata={"doc": "data section"})
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig, metadata={"doc": "inner optimizer section"})
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig, metadata={"doc": "outer optimizer section"})
    merge: MergeConfig = dataclasses.field(default_factory=MergeConfig, metadata={"doc": "merge rule section"})
    faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig, metadata={"doc": "simulated stragglers section"})
    log: LogConfig = dataclasses.field(default_factory=LogConfig, metadata={"doc": "logging section"})
    dist: DistConfig = dataclasses.field(default_factory=DistConfig, metadata={"doc": "multi-process (torchrun) section"})

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward pass: micro_batch, capped by what one worker takes per step."""
        per_worker = self.global_batch // self.num_workers
        return min(self.micro_batch, per_worker) if self.micro_batch else per_worker

    @property
    def train_steps(self) -> int:
        """Inner steps actually trained: `steps`, or its last whole round with `whole_rounds`."""
        if self.whole_rounds and self.algorithm == "diloco":
            return self.steps // self.inner_steps * self.inner_steps
        return self.steps

    @property
    def num_workers(self) -> int:
        """Workers that actually train: dp trains one model on the global batch."""
        return 1 if self.algorithm == "dp" else self.workers

    def steps_taken(self, worker: int, steps: int) -> int:
        """H_r: how many of a round's `steps` inner steps global worker `worker` takes (the
        round lasts the fastest worker's `steps`; `worker_speeds`, rounded half to even)."""
        if not self.worker_speeds:
            return steps
        speeds = self.worker_speeds
        fastest = max(speeds[w % len(speeds)] for w in range(self.num_workers))
        return max(1, round(steps * speeds[worker % len(speeds)] / fastest))

    def tokens_trained(self, steps: int, taken: int) -> int:
        """Tokens every worker together trains in the first `taken` inner steps of a round of
        `steps` (the steps a slow worker skips train none)."""
        per_step = self.global_batch // self.num_workers * self.seq_len
        return per_step * sum(min(taken, self.steps_taken(worker, steps)) for worker in range(self.num_workers))

    def check_micro_batch(self, sequences: int, holder: str) -> None:
        """Refuse a micro_batch that does not divide the `sequences` that `holder` (each worker,
        or each process of a multi-process run) takes per step."""
        if self.micro_batch and sequences % min(self.micro_batch, sequences):
            raise ConfigError(
                f"micro_batch={self.micro_batch} does not divide the {sequences} sequences {holder} takes per "
                f"step; use a divisor of {sequences} or 0")

    def validate(self) -> None:
        check_choices("", self)
        check_at_least("workers", self.workers, 1)
        check_at_least("inner_steps", self.inner_steps, 1)
        check_at_least("global_batch", self.global_batch, 1)
        check_at_least("seq_len", self.seq_len, 2)
        check_at_least("micro_batch", self.micro_batch, 0)
        check_at_least("steps", self.steps, 1)
        if self.train_steps == 0:
            raise ConfigError(f"whole_rounds=true with steps={self.steps} < inner_steps={self.inner_steps} trains "
                              "no round: raise steps or set whole_rounds=false")
        check_at_least("eval_every", self.eval_every, 0)
        check_at_least("eval_batch", self.eval_batch, 1)
        check_at_least("checkpoint_every", self.checkpoint_every, 0)
        check_at_least("keep_checkpoints", self.keep_checkpoints, 1)
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device={self.device!r} is not allowed: use auto, cpu, cuda or cuda:N")
        if self.global_batch % self.num_workers:
            raise ConfigError(
                f"global_batch={self.global_batch} is not divisible by workers={self.workers}: each worker takes "
                f"global_batch/workers sequences per step; pick a global_batch that is a multiple of {self.workers}")
        self.check_micro_batch(self.global_batch // self.num_workers, "each worker")
        if self.outer.transport == "sparseloco" and self.merge.error_feedback:
            # Before merge's own check, whose fix (a merge.quantize or merge.compress) SparseLoCo refuses.
            raise ConfigError("merge.error_feedback=true is not allowed with outer.transport=sparseloco: SparseLoCo "
                              "keeps its own error feedback (each worker's accumulator, decayed by "
                              "outer.sparse_decay) and takes no merge.quantize or merge.compress; drop "
                              "merge.error_feedback (or set merge.error_feedback=false)")
        for section in (self.data, self.inner, self.outer, self.merge, self.faults, self.dist):
            section.validate()
        validate_combination(self.merge, self.outer)
        self._check_stragglers()
        self._check_islands()
        overlap = self.outer.overlap_steps
        if overlap >= self.inner_steps:
            raise ConfigError(f"outer.overlap_steps={overlap} is not allowed with inner_steps={self.inner_steps}: a "
                              f"synchronisation must land within the next round; use 0 <= overlap_steps < "
                              f"{self.inner_steps}")
        if overlap and self.on_bad_worker == "drop":
            raise ConfigError(f"on_bad_worker=drop is not allowed with outer.overlap_steps={overlap}: a dropped "
                              "worker has no weights of its own to train from while the synchronisation is in "
                              "flight; set on_bad_worker=error or outer.overlap_steps=0")
        if overlap and self.log.spectra:
            # A synchronisation in flight ends during a later round: its line would be ambiguous.
            raise ConfigError(f"log.spectra=true is not allowed with outer.overlap_steps={overlap}: set "
                              "outer.overlap_steps=0 to measure the spectra, or log.spectra=false")


    def _check_islands(self) -> None:
        islands = self.dist.islands
        if islands and self.algorithm == "dp":
            raise ConfigError(f"dist.islands={islands} is not allowed with algorithm=dp: the data-parallel baseline "
                              "trains one model, not islands of workers; drop dist.islands or choose a DiLoCo method "
                              "(e.g. method=diloco)")
        if islands and self.workers % islands:
            raise ConfigError(f"dist.islands={islands} does not divide workers={self.workers}: every island holds "
                              f"the same number of consecutive workers; set dist.islands to a divisor of "
                              f"{self.workers}")

    def _check_stragglers(self) -> None:
        """Refuse `worker_speeds` and `faults` where they cannot apply."""
        speeds, late = self.worker_speeds, self.faults.late_rate
        shown = ",".join(f"{speed:g}" for speed in speeds)
        if any(not (math.isfinite(speed) and speed > 0) for speed in speeds):
            raise ConfigError(f"worker_speeds={shown} is not allowed: every speed must be a number > 0 (relative "
                              "speeds, e.g. worker_speeds=1,0.5)")
        if len(speeds) > self.workers:
            raise ConfigError(f"worker_speeds={shown} lists {len(speeds)} speeds for workers={self.workers}, and the "
                              f"speeds after the first {self.workers} would be ignored: give at most {self.workers} "
                              "(they cycle over the workers: worker_speeds=1,0.5 alternates two speeds)")
        overlap = self.outer.overlap_steps
        slowest = min(self.steps_taken(worker, self.inner_steps) for worker in range(self.num_workers))
        if speeds and overlap and slowest <= overlap:
            # Its whole turn would train from its own weights and end by landing θ_{t+1}: its Δ
            # would hold no progress of its own, yet count in the merge.
            raise ConfigError(f"worker_speeds={shown} is not allowed with outer.overlap_steps={overlap}: the slowest "
                              f"worker takes {slowest} of inner_steps={self.inner_steps} steps, so the update in "
                              "flight lands only as its turn ends and its pseudo-gradient holds nothing of its own; "
                              f"use outer.overlap_steps < {slowest} or raise the slowest speed")
        for key, value, active in (("worker_speeds", shown, speeds),
                                   ("faults.late_rate", late, late)):
            if active and self.algorithm == "dp":
                raise ConfigError(f"{key}={value} is not allowed with algorithm=dp: the data-parallel baseline "
                                  f"trains one model with no workers to slow down or lose; drop {key} or choose a "
                                  "DiLoCo method (e.g. method=diloco)")
        if self.faults.late == "carry" and self.on_bad_worker == "drop":
            raise ConfigError("faults.late=carry is not allowed with on_bad_worker=drop: a dropped worker restarts "
                              "with a fresh optimizer and has nothing to carry; set on_bad_worker=error or "
                              "faults.late=drop")
        for key, value, clash in (("outer.overlap_steps", self.outer.overlap_steps, "a late worker's delta is "
                                   "also what its own weights are rebuilt from while a synchronisation is in "
                                   "flight; set outer.overlap_steps=0"),
                                  ("log.spectra", self.log.spectra, "a process none of whose workers arrived "
                                   "has no deltas to measure; set log.spectra=false")):
            if late and value:
                raise ConfigError(f"faults.late_rate={late} is not allowed with {key}={value}: {clash}, or "
                                  "faults.late_rate=0")
