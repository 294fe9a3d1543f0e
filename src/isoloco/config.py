"""The run configuration: typed sections, presets as YAML files, `key=value` overrides.

Resolution order (later wins): field defaults, the method's values (`isoloco.methods`),
the preset's keys, its `per_method.<method>` keys; for a YAML file, the same of the file on
top of the shipped preset it names with `preset:` (`quick` when it names none, as for
key=value items alone); command-line overrides. Every value is validated before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import hashlib
import importlib.util
import math
import re
import typing
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from isoloco.configbase import check_at_least, check_choice, check_choices, check_range, option
from isoloco.errors import ConfigError
from isoloco.data import DataConfig
from isoloco.distributed import DistConfig
from isoloco.inner import InnerConfig
from isoloco.merge_config import MergeConfig
from isoloco.methods import METHODS
from isoloco.model import MODEL_PRESETS, llama_config
from isoloco.outer import OuterConfig, validate_combination
from isoloco.rules import RULES

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


#: The largest share of a round τ/H (outer.overlap_steps/inner_steps) the docs measured as
#: harmless: τ = 5 of H = 30 left IsoLoCo's final loss equivalent within ±1% to τ = 0 at R = 8
#: and DiLoCo's not distinguishable from it (docs/claims/slow-link.md), while τ = 5 of
#: H = 10 ended above the unigram baseline and the loss worsened steadily with τ/H (a user's report).
SAFE_OVERLAP = Fraction(1, 6)


def run_warnings(cfg: TrainConfig, islands: int) -> list[str]:
    """One line for each setting a run on `islands` islands allows but that probably wastes it
    or does nothing, said before it starts."""
    lines = []
    if cfg.algorithm == "diloco" and cfg.inner_steps > cfg.steps:
        lines.append(f"inner_steps={cfg.inner_steps} is more than steps={cfg.steps}: the workers train every step "
                     "apart and synchronise once, at the end; set inner_steps <= steps for more than one round")
    overlap = Fraction(cfg.outer.overlap_steps, cfg.inner_steps)
    if overlap > SAFE_OVERLAP:
        lines.append(f"outer.overlap_steps={cfg.outer.overlap_steps} with inner_steps={cfg.inner_steps} overlaps "
                     f"{float(overlap):.2f} of each round, more than the {SAFE_OVERLAP} measured as harmless "
                     f"(τ = 5 of H = 30); the loss worsens with τ/H and τ = 5 of H = 10 ended above the unigram "
                     f"baseline: use outer.overlap_steps <= {math.floor(cfg.inner_steps * SAFE_OVERLAP)}")
    if cfg.dist.emulate_link and islands == 1:
        lines.append(f"dist.emulate_link={cfg.dist.emulate_link} does nothing in this run: it delays the collectives "
                     "between islands, and this run is one island; launch several (e.g. isoloco launch --nproc 2 "
                     "-- train ...) or drop it")
    return lines


#: The outer lr chosen on seed 0 for SparseLoCo's methods on the tiny model, by R (docs/slow-link.md's
#: compressor table; results/claims/compress-tuned/selection.md).
SPARSELOCO_TUNED_LR = {"sparseloco": {8: 0.5, 16: 0.3}, "sparseloco_isoc": {8: 2.0, 16: 1.5}}


def divergence_causes(cfg: TrainConfig) -> str:
    """What is known to drive a run of `cfg` above the unigram baseline, for the warning that
    says it went there: the run's settings measured to, then the learning rates."""
    causes = []
    if cfg.merge.compress != "none" and cfg.algorithm == "diloco":
        causes.append(f"merge.compress={cfg.merge.compress} (low rank and top-k each ended above it in runs on the "
                      "tiny model; docs/claims/compression.md)")
    if cfg.outer.transport == "sparseloco" and cfg.algorithm == "diloco":
        tuned = SPARSELOCO_TUNED_LR.get(cfg.method)
        if tuned:
            said = ", ".join(f"{lr:g} at R = {workers}" for workers, lr in tuned.items())
            step = (f"its step tuned on the tiny model is outer.lr={said} (docs/slow-link.md's compressor table; "
                    "results/claims/compress-tuned/selection.md)")
        else:
            step = "the tuned SparseLoCo rows of docs/slow-link.md's compressor table lower outer.lr"
        causes.append(f"SparseLoCo (outer.transport=sparseloco) at outer.lr={cfg.outer.lr:g}: {step}")
    if Fraction(cfg.outer.overlap_steps, cfg.inner_steps) > SAFE_OVERLAP:
        causes.append(f"outer.overlap_steps={cfg.outer.overlap_steps} with inner_steps={cfg.inner_steps} "
                      f"(τ/H above {SAFE_OVERLAP})")
    causes.append(f"learning rates too high for the model (inner.lr={cfg.inner.lr:g}"
                  + (f", outer.lr={cfg.outer.lr:g})" if cfg.algorithm == "diloco" else ")"))
    causes.append(f"too few steps (steps={cfg.steps})")
    return "known causes: " + "; ".join(causes)


# ---------------------------------------------------------------------------------------
# Keys, values and overrides


@dataclass(frozen=True)
class Key:
    """One settable key: dotted name, Python type, default, doc and allowed values."""

    name: str
    type: Any
    default: Any
    doc: str
    choices: tuple | None


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def list_keys(cls: type = TrainConfig, prefix: str = "") -> list[Key]:
    """Every leaf key of the config, in declaration order."""
    hints = typing.get_type_hints(cls)
    keys: list[Key] = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            keys.extend(list_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(Key(prefix + f.name, tp, getattr(defaults, f.name), f.metadata.get("doc", ""),
                            f.metadata.get("choices")))
    return keys


#: Keys that change how a run executes, not what it computes: a finished run is the same run
#: whatever they were (a sweep may split a grid over machines with other values), and a report
#: does not tell runs apart by them.
EXECUTION_KEYS = frozenset({"device", "offload_workers", "micro_batch", "eval_batch", "checkpoint_every",
                            "keep_checkpoints", "log.tensorboard", "log.wandb", "log.wandb_project", "log.spectra",
                            "dist.gpus_per_worker", "dist.backend", "dist.timeout_s",
                            "dist.peer_silence_s", "dist.emulate_link"})

#: `data=X` is short for `data.source=X`, the one data key people set most; `gpus_per_worker=G`
#: and `islands=P` for `dist.gpus_per_worker=G` and `dist.islands=P`, the layout keys.
ALIASES = {"data": "data.source", "gpus_per_worker": "dist.gpus_per_worker", "islands": "dist.islands"}


def _coerce(key: Key, raw: Any) -> Any:
    """Turn a YAML-parsed value into the key's type, or raise naming the key."""
    tp = key.type
    expected = getattr(tp, "__name__", str(tp))
    if typing.get_origin(tp) is list:
        numbers = typing.get_args(tp) == (float,)
        if numbers and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            raw = [raw]  # one number is a list of one
        if isinstance(raw, str):
            # `a,b` or `[a, b]` (YAML cannot read the bracket form when an item starts with `*`).
            text = raw.strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            raw = [item.strip().strip("'\"") for item in text.split(",") if item.strip()]
        if not isinstance(raw, list):
            raise ConfigError(f"{key.name}={raw!r} is not allowed: expected a list (comma-separated)")
        if numbers:
            return [_number(key, item, raw) for item in raw]
        return [str(item) for item in raw]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw):
            return float(raw)
    elif tp is str:
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    raise ConfigError(f"{key.name}={raw!r} is not allowed: expected {expected}")


def _number(key: Key, item: Any, items: list) -> float:
    """One item of a list of numbers, or the error naming the whole list."""
    if not isinstance(item, bool):
        try:
            return float(item)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{key.name}={','.join(map(str, items))} is not allowed: expected numbers separated by commas "
                      "(e.g. 1,0.5)")


def _keys_by_name() -> dict[str, Key]:
    return {k.name: k for k in list_keys()}


def typed_values(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (aliases resolved) with their values in the keys' types, as `key=value`
    reads them; unknown keys and ill-typed values raise ConfigError."""
    keys = _keys_by_name()
    typed = {}
    for name, raw in values.items():
        name = ALIASES.get(name, name)
        if name not in keys:
            raise ConfigError(f"unknown key {name!r}{_did_you_mean(name, keys)}")
        typed[name] = _coerce(keys[name], raw)
    return typed


def apply_values(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """Set dotted keys on `cfg`; unknown keys and ill-typed values raise ConfigError."""
    for name, value in typed_values(values).items():
        target = cfg
        *sections, leaf = name.split(".")
        for section in sections:
            target = getattr(target, section)
        setattr(target, leaf, value)


def _did_you_mean(name: str, keys: dict[str, Key]) -> str:
    """A hint for a misspelt key: the keys with this leaf name, else the closest spellings."""
    close = [k for k in keys if k.split(".")[-1] == name.split(".")[-1]]
    if not close:
        # A leaf alone (`worker`) or a full dotted name (`inner.lrr`) may be the misspelt part.
        names = {**{k.split(".")[-1]: k for k in keys}, **{k: k for k in keys}, **ALIASES}
        close = sorted({names[m] for m in difflib.get_close_matches(name, names, n=3, cutoff=0.75)})
    if close:
        return f" (did you mean {', '.join(close)}?)"
    return "; see `isoloco train --help` for every key"


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings; values are read as YAML scalars (`1e-3`, `true`, `a,b`)."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r} is not a key=value override (example: workers=8)")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            values[key.strip()] = raw
    return values


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested YAML mappings to dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "per_method":
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------
# Presets

#: What `isoloco train` runs when no preset or file is named; overrides apply on top of it.
DEFAULT_PRESET = "quick"


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """A command line's optional preset (its first item, when it has no '=') and its key=value items."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items



def preset_names() -> list[str]:
    folder = resources.files("isoloco") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


#: The key of a config file that names the shipped preset the file applies on top of.
BASE_KEY = "preset"


def _is_file(name_or_path: str) -> bool:
    # A folder that happens to share a preset's name (a run's --out) does not hide the preset.
    return name_or_path.endswith((".yaml", ".yml")) or Path(name_or_path).is_file()


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset by name (shipped with the package) or a YAML file path, as dotted keys."""
    if _is_file(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"preset file {name_or_path!r} does not exist")
        text = path.read_text()
    else:
        if name_or_path not in preset_names():
            raise ConfigError(f"preset {name_or_path!r} is not known: choose one of {', '.join(preset_names())} "
                              "or give a .yaml file")
        text = (resources.files("isoloco") / "presets" / f"{name_or_path}.yaml").read_text()
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"preset {name_or_path!r} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"preset {name_or_path!r} must be a mapping of keys to values")
    return flatten(tree)


def preset_layers(name_or_path: str) -> list[tuple[str, dict[str, Any]]]:
    """What a run of `isoloco train PRESET|FILE` resolves from, base first, as (name, dotted
    keys): a shipped preset alone; a file on top of the shipped preset its `preset:` key names,
    `DEFAULT_PRESET` if none, as key=value items apply on top of it (a file and the same keys
    typed as items give the same run)."""
    values = load_preset(name_or_path)
    if not _is_file(name_or_path):
        return [(name_or_path, values)]
    base = values.pop(BASE_KEY, DEFAULT_PRESET)
    if base not in preset_names():
        raise ConfigError(f"{BASE_KEY}: {base!r} in {name_or_path} is not a shipped preset: choose one of "
                          f"{', '.join(preset_names())} (the file applies on top of it; {DEFAULT_PRESET} if the "
                          f"file names none)")
    return [(base, load_preset(base)), (name_or_path, values)]


def preset_said(name_or_path: str | None) -> str:
    """The preset (and file) a run of `isoloco train [PRESET|FILE]` starts from, in words."""
    if name_or_path is None:
        return f"preset {DEFAULT_PRESET} (the default)"
    (base, _), *file = preset_layers(name_or_path)
    return f"{name_or_path} on preset {base}" if file else f"preset {base}"


def resolve(preset: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Build and validate the full config (see the module docstring for the order)."""
    layers = preset_layers(preset) if preset else []
    for _, values in layers:
        for key in [k for k in values if k.startswith("sweep.")]:
            values.pop(key)
    per_methods = [values.pop("per_method", {}) or {} for _, values in layers]
    method = overrides.get("method", next((values["method"] for _, values in reversed(layers) if "method" in values),
                                          TrainConfig.method))
    check_choice("method", method, METHODS)
    cfg = TrainConfig()
    apply_values(cfg, METHODS[method])
    # What the user wrote: the overrides, and a file's keys off the defaults (a file may write every
    # key: a run's config.yaml). A shipped preset's keys serve every method, so one a method ignores
    # is not the user's doing.
    written: dict[str, Any] = {}
    for (name, values), per_method in zip(layers, per_methods):
        values = {**values, **flatten(per_method.get(method, {}) or {})}
        apply_values(cfg, {**values, **predated(values)})  # a run's config.yaml retrains as it ran
        if _is_file(name):
            written.update(values)
    apply_values(cfg, overrides)
    cfg.method = method
    defaults = flatten(to_dict(TrainConfig()))
    given = [*(key for key, value in written.items() if value != defaults.get(ALIASES.get(key, key))), *overrides]
    cfg.validate()
    _one_model(cfg, given)
    refuse_ignored_keys(cfg, given)
    check_exclude_patterns(cfg)
    return cfg


def _one_model(cfg: TrainConfig, given: list[str]) -> None:
    """The data-parallel baseline trains one model: refuse more workers given for it, and record
    the one it trains, whatever a preset or the default says."""
    if cfg.algorithm != "dp":
        return
    if "workers" in given and cfg.workers != 1:
        raise ConfigError(f"workers={cfg.workers} is ignored with algorithm=dp (method={cfg.method}): the "
                          "data-parallel baseline trains one model on the global batch; drop workers, or choose a "
                          "DiLoCo method (e.g. method=diloco)")
    cfg.workers = 1


# ---------------------------------------------------------------------------------------
# Parameter names


@functools.lru_cache(maxsize=None)
def parameter_names(model: str) -> tuple[tuple[str, int], ...]:
    """Every parameter of model preset `model` as (name, dimensions), in model order: the names
    `merge.compress_exclude` and `merge.exclude` match. From the model built on the meta device
    (no memory, no weights; the names do not depend on the vocabulary)."""
    import torch
    from transformers import LlamaForCausalLM  # seconds to import: only when patterns are given

    with torch.device("meta"):
        net = LlamaForCausalLM(llama_config(model, vocab_size=256, max_positions=128))
    return tuple((name, param.dim()) for name, param in net.named_parameters())


def matrix_names(model: str) -> list[str]:
    """The names of model preset `model`'s 2-D parameters, the only ones the patterns act on."""
    return [name for name, dims in parameter_names(model) if dims == 2]


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def excluded_matrices(cfg: TrainConfig) -> list[str]:
    """The matrices `merge.compress_exclude` keeps whole (none without patterns)."""
    patterns = list(cfg.merge.compress_exclude)
    return [name for name in matrix_names(cfg.model) if _matches(name, patterns)] if patterns else []


def check_exclude_patterns(cfg: TrainConfig) -> None:
    """Refuse a `merge.compress_exclude` or `merge.exclude` pattern that names no matrix of
    `cfg.model` (a typo would leave every matrix as it was, in silence), naming the matrices it
    could have meant; and a `merge.compress_exclude` that names every matrix, so that
    `merge.compress` compresses nothing."""
    for key in ("compress_exclude", "exclude"):
        patterns = list(getattr(cfg.merge, key))
        if not patterns:
            continue
        names, everything = matrix_names(cfg.model), parameter_names(cfg.model)
        for pattern in patterns:
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                continue
            vectors = [name for name, _ in everything if fnmatch.fnmatchcase(name, pattern)]
            what = (f"no matrix of model={cfg.model}, only vectors ({_listed(vectors)}), which merge.{key} never "
                    "touches" if vectors else f"no parameter of model={cfg.model}")
            raise ConfigError(f"merge.{key}={_shown(patterns)} is not allowed: the pattern {pattern!r} names {what}; "
                              f"{_meant(pattern, names)}")
    excluded = excluded_matrices(cfg)
    if excluded and len(excluded) == len(matrix_names(cfg.model)):
        raise ConfigError(f"merge.compress_exclude={_shown(cfg.merge.compress_exclude)} is not allowed: it keeps every "
                          f"matrix of model={cfg.model} whole, so merge.compress={cfg.merge.compress} would compress "
                          "nothing; name only the matrices to keep whole (e.g. model.embed_tokens.weight,"
                          "lm_head.weight), or drop both merge.compress and merge.compress_exclude")


def _shown(patterns: list[str]) -> str:
    """Patterns as the command line spells them."""
    return ",".join(patterns)


def _listed(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _meant(pattern: str, names: list[str]) -> str:
    """What a pattern that matched nothing could have meant: the matrices holding its longest
    literal part (`*embed_token` -> model.embed_tokens.weight), else the closest spellings of the
    whole name (a typo) or of a part of it, else a sample of what the names look like."""
    literal = max(re.split(r"[*?\[\]]", pattern), key=len).strip(".")
    close = [name for name in names if literal and literal in name][:3]
    close = close or difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
    if not close and literal:
        parts = {}
        for name in names:
            for part in name.split("."):
                parts.setdefault(part, name)
        close = [parts[part] for part in difflib.get_close_matches(literal, list(parts), n=3, cutoff=0.7)]
    if close:
        return f"did you mean {', '.join(close)}? (fnmatch patterns of parameter names, e.g. '*embed_tokens*')"
    layers = sorted({name for name in names if ".layers." not in name or ".layers.0." in name})
    return (f"the matrices are named like {_listed(layers, 4)} (fnmatch patterns, e.g. '*embed_tokens*' or "
            "'*.mlp.*')")


#: Keys that act only under some values of another key: key -> (that key, those values). Given
#: without one of them, such a key would be ignored (`refuse_ignored_keys`); a report's labels
#: leave it out of the runs it does not act in.
ACTS_ONLY_WITH = {"merge.compress_rank": ("merge.compress", ("lowrank",)),
                  "merge.compress_density": ("merge.compress", ("topk",)),
                  "merge.compress_chunk": ("merge.compress", ("topk",)),
                  "merge.exclude": ("merge.rule", tuple(name for name, rule in RULES.items() if rule.spectral)),
                  "inner.kernel": ("inner.optimizer", ("adamw", "muon")),  # Muon steps its vectors with AdamW
                  "outer.sparse_decay": ("outer.transport", ("sparseloco",)),
                  "outer.sparse_tile": ("outer.transport", ("sparseloco",)),
                  "outer.sparse_topk": ("outer.transport", ("sparseloco",))}

#: Sections whose every key acts only under some values of another key: the data-parallel
#: baseline has no merge and no outer step.
SECTION_ACTS_ONLY_WITH = {"merge.": ("algorithm", ("diloco",)), "outer.": ("algorithm", ("diloco",))}


def _needs(key: str) -> list[tuple[str, tuple[Any, ...]]]:
    """What `key` needs to act: (key, the values it acts under) pairs, the section's first."""
    return ([needs for section, needs in SECTION_ACTS_ONLY_WITH.items() if key.startswith(section)]
            + ([ACTS_ONLY_WITH[key]] if key in ACTS_ONLY_WITH else []))


def acts(key: str, settings: dict[str, Any]) -> bool:
    """Whether `key` acts in a run of these flat `settings` (see `ACTS_ONLY_WITH` and
    `SECTION_ACTS_ONLY_WITH`)."""
    return all(settings.get(needs) in values for needs, values in _needs(key))


def refuse_ignored_keys(cfg: TrainConfig, given: list[str]) -> None:
    """Refuse a key the user gave (a file's or an override) that `cfg` would ignore. Only
    given keys count: a saved config.yaml holds every key, at its default where not given."""
    values = flatten(to_dict(cfg))
    for key in dict.fromkeys(ALIASES.get(key, key) for key in given):
        for needs, acting in _needs(key):
            if values.get(needs) in acting:
                continue
            shown = _shown(values[key]) if isinstance(values[key], list) else values[key]
            if needs == "algorithm":
                raise ConfigError(f"{key}={shown} is ignored with algorithm={values[needs]} (method={cfg.method}): "
                                  f"the data-parallel baseline has no merge and no outer step; drop {key}, or "
                                  "choose a DiLoCo method (e.g. method=diloco)")
            if len(acting) == 1:
                method = " (method=sparseloco sets it)" if needs == "outer.transport" else ""
                only, fix = f"{needs}={acting[0]}", f"add {needs}={acting[0]}{method}"
            else:
                listed = f"{', '.join(map(str, acting[:-1]))} or {acting[-1]}"
                only, fix = f"{needs}={listed}", f"set {needs} to {listed}"
            raise ConfigError(f"{key}={shown} is ignored with {needs}={values[needs]}: it applies "
                              f"only with {only}; {fix}, or drop {key}")


#: Keys whose default changed the numerics after runs were saved: a config.yaml written before
#: the key existed lacks it, and its run used this value.
BEFORE_KEY = {"inner.kernel": "foreach"}


def predated(values: dict[str, Any]) -> dict[str, Any]:
    """The `BEFORE_KEY` values of a saved config that predates them: `values` (dotted keys)
    lacks the key but holds every other key of its section, as a config.yaml written by
    `to_dict` before the key existed does (a hand-written file or a preset names only some)."""
    keys = [key.name for key in list_keys()]
    found = {}
    for key, value in BEFORE_KEY.items():
        section = key.rsplit(".", 1)[0] + "."
        siblings = [k for k in keys if k.startswith(section) and k != key]
        if key not in values and all(k in values for k in siblings):
            found[key] = value
    return found


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved with `to_dict` (e.g. a run's config.yaml), validated; a key it
    predates takes the value its run used (`predated`), so it retrains bit for bit."""
    cfg = TrainConfig()
    values = flatten(tree)
    apply_values(cfg, {**values, **predated(values)})
    cfg.validate()
    return cfg


def describe_keys(cfg: TrainConfig) -> str:
    """The `--help` listing: every key with its value in `cfg`, allowed values and doc."""
    values = flatten(to_dict(cfg))
    lines = []
    for key in list_keys():
        allowed = f" {{{', '.join(map(str, key.choices))}}}" if key.choices else ""
        lines.append(f"  {key.name} = {values[key.name]!r}{allowed}\n      {key.doc}")
    return "\n".join(lines)
