"""The merge engine: how one round's pseudo-gradients reach every worker as merged updates.

The rules themselves are pure phases (`isoloco.rules`); this module runs them against a
`Communicator` and owns everything about *how*:

* **Streaming over workers.** A phase fetches one worker's delta at a time (offloaded
  workers keep theirs in host memory), adds its contribution to the phase's buffer and drops
  it, so merging a parameter holds a few deltas' worth of memory whatever the number of
  workers R.
* **Buckets.** Parameters are packed, in order, into buckets of about `merge.bucket_mb`;
  each phase of a bucket is one collective for all its parameters (a sum buffer or each
  worker's factors, laid end to end), and one finiteness check covers the whole bucket.
* **Compression.** With `merge.quantize`, a sum phase crosses the link as each island's
  encoded sum, with bytes per process flat in R and P (`isoloco.sync.compressed`); the codec
  decides which rules it can carry (`isoloco.sync.codec.carry_refusal`). With `merge.compress`
  a matrix's sum travels as PowerSGD's rank-k factors (`isoloco.sync.lowrank`; Iso-C then
  flattens the k singular values they carry) or as each chunk's largest entries
  (`isoloco.sync.topk`).
* **Stages.** A merge is steps (`isoloco.sync.handles`): each stage starts its collectives,
  and waits for them only when resumed, so an overlapped synchronisation runs its stages
  between inner steps, from the main thread, in one order on every rank.
* **Finalize, batched and shared.** A rule's pure last step (Iso-C's orthogonalisation)
  runs after every collective, on stacks of same-shape matrices, shared out among processes
  by `Communicator.shard_map`. The stacks do not depend on the process layout, so every
  layout computes the same numbers.

`Merger` is what a training loop uses; the peft-style functions (`mean`, `ties`, `dare`,
`tsv`, `iso_c`, `iso_cts`) merge a list of R tensors in this process through the same path.
Nothing here writes into the deltas; only the error-feedback residuals are updated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import torch

from isoloco.comm import Communicator, LocalCommunicator, nbytes
from isoloco.configbase import check_at_least, check_choices, check_positive, check_range, option
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.ortho import (FACTOR_METHODS, FINDER_DTYPES, NS_DTYPES, POLAR_METHODS, SCALE_METHODS, FactorSettings,
                           IsoSettings, iso_correct_in_span, spectrum_knob_problem)
from isoloco.rules import RULES, Knobs, Phase, WorkerSlot, mask_key, mean_phases
from isoloco.sync.codec import FORMATS, SCALE_GROUPS, Quantization, carry_refusal
from isoloco.sync.cost import wire_bytes
from isoloco.sync.handles import Pending, Steps, Sync, lockstep, padded, run_to_end
from isoloco.sync.phase import Compression, PhasePlan
from isoloco.sync.slowlink import SlowLink
from isoloco.sync.plan import buckets
from isoloco.sync.topk import MAX_CHUNK, TopK

Fetch = Callable[[torch.Tensor], torch.Tensor]

#: `merge.weighting`: how much each merged worker's pseudo-gradient counts.
WEIGHTINGS = ("equal", "tokens")
#: `merge.compress`: how a matrix's sum is cut down before it crosses the slow link.
COMPRESSORS = ("none", "lowrank", "topk")


# ------------------------------------------------------------------------- configuration


@dataclasses.dataclass
class MergeConfig:
    """How worker pseudo-gradients are merged (docs/fidelity.md has each rule's definition)."""

    rule: str = option("mean", "aggregation rule for the workers' pseudo-gradients", choices=RULES)
    density: float = option(0.9, "TIES: fraction of each delta's entries kept, by magnitude")
    drop_rate: float = option(0.1, "DARE: probability of dropping each entry")
    common_fraction: float = option(0.8, "Iso-CTS: fraction of the rank given to the common subspace")
    ortho: str = option(
        IsoSettings.ortho,
        "Iso-C orthogonalisation: exact auto (gram for non-square, svd for square matrices), svd or gram; "
        "or approximate newton_schulz / polar_express",
        choices=POLAR_METHODS,
    )
    scale: str = option(
        IsoSettings.scale, "Iso-C singular value: exact mean, rms (‖M‖_F/√r) or inner (⟨M, polar(M)⟩/r)",
        choices=SCALE_METHODS,
    )
    ns_steps: int = option(IsoSettings.ns_steps, "iterations of newton_schulz / polar_express")
    ns_dtype: str = option(IsoSettings.ns_dtype, "dtype of the newton_schulz / polar_express iterations",
                           choices=NS_DTYPES)
    iso_power: float = option(
        IsoSettings.iso_power,
        "Iso-C partial flattening in [0, 1]: each singular value σ becomes c·σ^p, c keeping their mean "
        "(0: Iso-C, 1: the update unchanged); needs merge.ortho=auto, svd or gram and merge.scale=exact")
    iso_floor: float = option(
        IsoSettings.iso_floor,
        "Iso-C floor in [0, 1): singular values below this fraction of the largest keep their own value, the "
        "others get their mean (0: Iso-C); needs merge.ortho=auto, svd or gram and merge.scale=exact")
    factors: str = option(
        FactorSettings.method,
        "TSV / Iso-CTS: how each worker's top singular directions are found: randomized (a range finder, "
        "matmuls only), exact (a full SVD per worker), or auto (randomized where a worker keeps at most 1/16 of "
        "a rank of at least 128 and its factors pass a certificate, exact top-k elsewhere)", choices=FACTOR_METHODS)
    oversample: int = option(FactorSettings.oversample, "factors=randomized: extra columns beyond the k wanted")
    power_iters: int = option(FactorSettings.power_iters, "factors=randomized: subspace iterations")
    finder_dtype: str = option(
        FactorSettings.finder_dtype,
        "factors=randomized: precision of every subspace iteration but the last (the last and the final product "
        "run in float32): auto (bfloat16 on CUDA GPUs of compute capability 8.0 or later, else float32; recorded "
        "as merge_finder_dtype in summary.json and metrics.jsonl), bfloat16 or float32", choices=FINDER_DTYPES)
    quantize: str = option(
        "none", "what crosses the slow link: each island's sum of its workers' contributions as float32 (none), or "
                "compressed to bfloat16, int8 or int4 codes with absmax scales (rules whose collectives are sums: "
                "mean, Iso-C, DARE)", choices=FORMATS)
    quantize_scales: str = option("block", "merge.quantize=int8/int4: one scale per block of entries or per "
                                           "matrix row", choices=SCALE_GROUPS)
    quantize_block: int = option(256, "merge.quantize_scales=block: entries per scale (4 bytes each)")
    compress: str = option(
        "none", "what a matrix's sum crosses the slow link as: whole (none), rank-k factors in PowerSGD's form "
                "(lowrank: two sums, of m×k and n×k factors), or each chunk's largest entries (topk: indices and "
                "values, all-gathered); vectors stay whole; the factors and values travel under merge.quantize "
                "(rules whose collectives are sums: mean, Iso-C, DARE)", choices=COMPRESSORS)
    compress_rank: int = option(4, "merge.compress=lowrank: rank k of the factors, clamped to each matrix's "
                                   "smaller side (the clamp is recorded as compress_rank_clamped in metrics.jsonl)")
    compress_density: float = option(0.03, "merge.compress=topk: fraction of each chunk's entries sent, in (0, 1]")
    compress_chunk: int = option(4096, f"merge.compress=topk: entries per chunk (at most {MAX_CHUNK}; indices "
                                       f"travel as 2 bytes)")
    compress_exclude: list[str] = option(
        [], "with merge.compress: fnmatch patterns of parameter names whose matrices skip it and cross the slow "
            "link whole under merge.quantize (e.g. ['*embed_tokens*', 'lm_head.weight'], so that the embeddings and "
            "the head travel dense while the blocks' matrices go low-rank or top-k); empty = compress every matrix")
    error_feedback: bool = option(
        False, "with merge.quantize or merge.compress: each island keeps what its sum lost on the way (its own "
               "encode, what low rank's projection or top-k left out, and the re-encode of the chunks of the total "
               "it owns) and adds it to its next sum; the islands are a job's processes, or the dist.islands the "
               "simulator plays (0: every worker an island); kept and checkpointed with each island's first worker")
    bucket_mb: float = option(
        64.0, "parameters are merged in buckets of about this many MiB: one collective per bucket and phase, "
              "one finiteness check per bucket")
    exclude: list[str] = option(
        [],
        "fnmatch patterns of parameter names whose 2-D tensors skip the spectral rules "
        "(tsv, iso_c, iso_cts) and take the mean; empty = correct every matrix",
    )
    weighting: str = option(
        "equal", "each worker's pseudo-gradient counts equally (equal), or in proportion to the tokens it trained "
                 "this round (tokens: differs from equal only with worker_speeds; docs/fidelity.md defines it per "
                 "rule)", choices=WEIGHTINGS)

    def validate(self) -> None:
        check_choices("merge", self)
        check_range("merge.density", self.density, 0, 1, low_open=True, high_open=False)
        check_range("merge.drop_rate", self.drop_rate, 0, 1, low_open=False, high_open=True)
        check_range("merge.common_fraction", self.common_fraction, 0, 1, low_open=True, high_open=False)
        check_at_least("merge.ns_steps", self.ns_steps, 1)
        spectrum_problem = spectrum_knob_problem(self, prefix="merge.")
        if spectrum_problem:
            raise ConfigError(spectrum_problem)
        check_at_least("merge.oversample", self.oversample, 0)
        check_at_least("merge.power_iters", self.power_iters, 0)
        check_positive("merge.bucket_mb", self.bucket_mb)
        check_at_least("merge.quantize_block", self.quantize_block, 1)
        check_at_least("merge.compress_rank", self.compress_rank, 1)
        check_range("merge.compress_density", self.compress_density, 0, 1, low_open=True, high_open=False)
        check_range("merge.compress_chunk", self.compress_chunk, 1, MAX_CHUNK, low_open=False, high_open=False)
        lossy = self.lossy_setting
        if self.error_feedback and lossy is None:
            raise ConfigError("merge.error_feedback=true is not allowed with merge.quantize=none and "
                              "merge.compress=none: there is no compression error to feed back; set "
                              "merge.quantize=bf16, int8 or int4, or merge.compress=lowrank or topk")
        # The phases of a typical matrix: a small one may skip a rule's gather (Iso-CTS's residuals).
        refusal = lossy and carry_refusal(lossy, RULES[self.rule].phases((256, 256), 2, self.knobs), self.rule)
        if refusal:
            raise ConfigError(refusal)
        for key in ("exclude", "compress_exclude"):
            patterns = getattr(self, key)
            if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
                raise ConfigError(f"merge.{key}={patterns!r} is not allowed: it must be a list of name patterns, "
                                  f"e.g. ['*embed_tokens*', 'lm_head.weight']")
        if self.compress_exclude and self.compress == "none":
            raise ConfigError(f"merge.compress_exclude={list(self.compress_exclude)} is ignored with merge.compress=none: "
                              f"it names matrices that skip merge.compress; set merge.compress=lowrank or topk, or "
                              f"drop merge.compress_exclude")

    @property
    def iso(self) -> IsoSettings:
        """The Iso-C settings these keys describe."""
        return IsoSettings(self.ortho, self.scale, self.ns_steps, self.ns_dtype, self.iso_power, self.iso_floor)

    @property
    def lossy_setting(self) -> str | None:
        """The setting that makes the slow link lossy, as `key=value` (the compressor first), or None."""
        if self.compress != "none":
            return f"merge.compress={self.compress}"
        return f"merge.quantize={self.quantize}" if self.quantize != "none" else None

    @property
    def topk(self) -> TopK:
        """Which entries merge.compress=topk sends."""
        return TopK(self.compress_density, self.compress_chunk)

    @property
    def quantization(self) -> Quantization:
        """How the workers' pseudo-gradients cross the slow link."""
        return Quantization(self.quantize, self.quantize_scales, self.quantize_block)

    @property
    def compression(self) -> Compression:
        """How a sum phase crosses the slow link."""
        return Compression(self.quantization, self.compress, self.topk, self.error_feedback,
                           tuple(self.compress_exclude), self.compress_rank)

    @property
    def knobs(self) -> Knobs:
        """The settings the rules read."""
        return Knobs(self.density, self.drop_rate, self.common_fraction, self.iso,
                     FactorSettings(self.factors, self.oversample, self.power_iters, self.finder_dtype))

    def finder_precision(self, device: torch.device) -> str | None:
        """The precision TSV's and Iso-CTS's range finder runs its early iterations in on `device`
        (`merge.finder_dtype` resolved: float32 or bfloat16), or None where no finder runs."""
        if self.rule not in ("tsv", "iso_cts") or self.factors == "exact":
            return None
        return self.knobs.factors.finder_precision(device)

    def excludes(self, name: str) -> bool:
        """Whether parameter `name` matches one of the `exclude` patterns."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)

    def applies(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the rule itself merges parameter `name` (else the mean does): a spectral
        rule takes only the matrices it is not told to exclude."""
        return not RULES[self.rule].spectral or (tensor.ndim == 2 and not self.excludes(name))


@dataclasses.dataclass(frozen=True)
class Participation:
    """The workers one merge counts, by global id, and how much each weighs; every process
    passes the same (each knows it without communication, e.g. from the seed).

    A worker left out contributes nothing: a sum phase skips it, a gather phase drops its
    block, and the rule is built for the n workers that arrived (the mean divides by n, TSV
    keeps ⌊r/n⌋ directions per worker)."""

    arrived: tuple[int, ...]  # global worker ids, ascending
    weights: tuple[float, ...] | None = None  # one per arrived worker (e.g. tokens trained); None: equal

    def scales(self, workers: int) -> dict[int, float]:
        """c_r = n·w_r / Σ w, by global id, of a run of `workers` workers. Every rule merges
        c_r·Δ_r: since Σ c_r = n, the mean's divisor n gives Σ w_r Δ_r / Σ w_r, and equal
        weights give c_r = 1 exactly (the unweighted merge, bit for bit)."""
        if not self.arrived or list(self.arrived) != sorted(set(self.arrived)) or not (
                0 <= self.arrived[0] and self.arrived[-1] < workers):
            raise ValueError(f"arrived={self.arrived} must be distinct worker ids in 0..{workers - 1}, ascending")
        weights = self.weights or (1.0,) * len(self.arrived)
        if len(weights) != len(self.arrived) or not all(w > 0 for w in weights):
            raise ValueError(f"weights={self.weights} must be one positive weight per arrived worker")
        if len(set(weights)) == 1:
            return dict.fromkeys(self.arrived, 1.0)
        total = sum(weights)
        return {worker: len(weights) * weight / total for worker, weight in zip(self.arrived, weights)}


# ------------------------------------------------------------------------------- helpers


def _first_non_finite(deltas: list[list[torch.Tensor]]) -> tuple[int, int] | None:
    """(tensor, worker) of the first non-finite delta, in order; one device sync for all.
    A tensor's extremes are finite exactly when all its entries are (NaN propagates), and
    finding them reads it once without allocating a mask of its size."""
    extremes = torch.stack([torch.stack(torch.aminmax(delta)) for per_tensor in deltas for delta in per_tensor])
    finite = torch.isfinite(extremes).all(dim=1)
    if bool(finite.all()):
        return None
    first = int((~finite).nonzero()[0])
    workers = len(deltas[0])
    return first // workers, first % workers


def _raise_non_finite(name: str, worker: int, round: int | None) -> None:
    when = f" in round {round}" if round is not None else ""
    raise NonFiniteDeltaError(
        f"the pseudo-gradient of {name!r} from worker {worker}{when} contains NaN or inf: "
        f"that worker's inner training diverged; lower the inner learning rate or "
        f"enable gradient clipping"
    )


@dataclasses.dataclass(frozen=True)
class _Round:
    """What every stage of one merge reads: the round (DARE's masks, errors), how stored
    deltas are fetched, and the scale c_r of each arrived worker (`Participation.scales`;
    None: every worker, unscaled)."""

    number: int | None  # None counts as round 0 for DARE's masks
    fetch: Fetch | None
    scales: dict[int, float] | None

    def fetched(self, stored: torch.Tensor) -> torch.Tensor:
        return self.fetch(stored) if self.fetch else stored

    def scale(self, worker: int) -> float | None:
        """c_r of global worker `worker`, or None when it did not arrive."""
        return 1.0 if self.scales is None else self.scales.get(worker)


@dataclasses.dataclass
class _Job:
    """One parameter on its way through its rule's phases."""

    name: str
    deltas: Sequence[torch.Tensor]  # stored, one per local worker
    residuals: Sequence[torch.Tensor] | None  # error feedback: stored, by local worker; the island heads' (updated)
    phases: list[Phase]
    finalize: Callable[[torch.Tensor], torch.Tensor] | None
    state: Any = None
    memos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: merge.compress=lowrank with Iso-C: finalized in the span of its factors after the last
    #: stage (`Merger._in_span`, `isoloco.ortho.iso_correct_in_span`), not by `finalize`.
    in_span: bool = False
    #: With `in_span`: P̂, the orthonormal basis of its low-rank sum, once the sum has landed.
    basis: torch.Tensor | None = None


# -------------------------------------------------------------------------------- merger


class Merger:
    """Applies the configured rule to each parameter, for the workers this process holds.

    Its only state between rounds is merge.compress=lowrank's warm-start factors (`link`'s,
    the same on every process, checkpointed by `isoloco.outer.OuterStep`): DARE's masks are a
    function of (seed, global worker id, round, parameter name, entry).
    """

    def __init__(self, cfg: MergeConfig, comm: Communicator, seed: int) -> None:
        cfg.validate()
        self.cfg = cfg
        self.comm = comm
        self.seed = seed
        #: How many workers' factors took each `ortho.FACTOR_PATHS` path (TSV, Iso-CTS) since it was last cleared.
        self.factor_paths: Counter = Counter()
        self._knobs = dataclasses.replace(cfg.knobs, factor_paths=self.factor_paths)
        self._rule = RULES[cfg.rule]
        #: How compressed sums cross the slow link: the islands this process plays, their plans,
        #: low rank's factors (None without a lossy setting).
        self.link = SlowLink(cfg.compression, comm, seed, cfg.lossy_setting) if cfg.lossy_setting else None

    def start(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int | None = None,
              fetch: Fetch | None = None, residuals: Mapping[str, Sequence[torch.Tensor]] | None = None,
              finalize: bool = True, participation: Participation | None = None) -> Sync[dict[str, torch.Tensor]]:
        """The merge of every parameter (`local_deltas[name]`: one delta per local worker, in
        order) across all R workers, as steps that start each stage's collectives and wait for
        them when resumed (`isoloco.sync.handles`); `merge_all` runs them at once.

        Stages are phase-major: phase k of every bucket starts before any bucket's phase k is
        waited for, then the finalize steps run batched and shared out among processes.
        `fetch` brings a stored delta to where the merge computes; it is called for one delta
        at a time, once per phase, and the fetched copy is dropped before the next. `round`
        names the synchronisation in errors and keys DARE's masks (None counts as 0).

        With `merge.quantize`, a sum crosses the link compressed (`isoloco.sync.compressed`);
        `residuals` (with `merge.error_feedback`: per parameter, indexed by local worker like the
        deltas) hold what earlier compressions lost and are updated in place; only those of
        `link.heads` are read, so a list of one per local worker or a mapping from the heads'
        indices both serve.

        `participation` says which of the R workers count and their weights (every worker
        alike when None); the deltas of local workers left out are passed too, and not read."""
        if self.cfg.error_feedback and residuals is None:
            raise ValueError("merge.error_feedback needs the workers' residuals: pass residuals=")
        scales = participation.scales(self.comm.num_workers) if participation is not None else None
        jobs = self._jobs(local_deltas, residuals if self.cfg.error_feedback else None,
                          self.comm.num_workers if scales is None else len(scales), finalize)
        limit = int(self.cfg.bucket_mb * 2**20)
        plan = [[jobs[i] for i in bucket]
                for bucket in buckets([(nbytes(job.deltas[0]), job.deltas[0].dtype) for job in jobs], limit)]
        round_ = _Round(round, fetch, scales)
        self._refuse_non_finite(plan, round_)
        stages = self._stages(plan)
        finalizing = any(job.finalize is not None for job in jobs)
        steps = self._steps(jobs, plan, stages, round_, limit if finalizing else None)
        return Sync(steps, sum(count for _, _, count in stages) + finalizing)

    def merge_all(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int | None = None,
                  fetch: Fetch | None = None,
                  residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """`start`'s merge, run to the end."""
        return run_to_end(self.start(local_deltas, round, fetch, residuals).steps)

    def merge(self, name: str, local_deltas: Sequence[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """Merge one parameter's local deltas (see `start`)."""
        return self.merge_all({name: local_deltas}, round)[name]

    def aggregate(self, name: str, local_deltas: Sequence[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """The collective part of the merge of one parameter: its rule's phases, without finalize."""
        return run_to_end(self.start({name: local_deltas}, round, finalize=False).steps)[name]

    def finalize(self, name: str, aggregated: torch.Tensor) -> torch.Tensor:
        """The pure, per-tensor rest of the merge of `name` (any one process may run it)."""
        finalize = self._finalize_of(name, aggregated)
        return finalize(aggregated) if finalize else aggregated

    @property
    def island_heads(self) -> list[int]:
        """The local workers (indices) whose error-feedback residuals this process reads (`start`)."""
        return self.link.heads if self.link is not None else []

    @property
    def clamped(self) -> dict[str, int]:
        """merge.compress=lowrank: the rank of each matrix merged so far whose smaller side is
        below merge.compress_rank."""
        return self.link.clamped if self.link is not None else {}

    # --------------------------------------------------------------------------- internals

    def _stages(self, plan: list[list[_Job]]) -> list[tuple[int, str, int]]:
        """(phase, collective, yields) of every stage, in order: sums before gathers within a
        phase; a compressed sum waits as often as its longest bucket's islands do."""
        depth = max((len(job.phases) for bucket in plan for job in bucket), default=0)
        stages = []
        for phase in range(depth):
            for kind in ("sum", "gather"):
                parts = [[job for job in bucket if len(job.phases) > phase and job.phases[phase].collective == kind]
                         for bucket in plan]
                parts = [part for part in parts if part]
                if not parts:
                    continue
                yields = 1
                if kind == "sum" and self.link is not None:
                    yields = max(self.link.plan(*_described(part, phase)).stages for part in parts)
                stages.append((phase, kind, yields))
        return stages

    def _refuse_non_finite(self, plan: list[list[_Job]], round: _Round) -> None:
        """Raise before anything is sent when an arrived local worker's delta is not finite:
        one device sync per bucket, before the first stage, so no stage converts a tensor."""
        arrived = [index for index, worker in enumerate(self.comm.local_worker_ids) if round.scale(worker) is not None]
        for bucket in plan:
            bad = _first_non_finite([[job.deltas[index] for index in arrived] for job in bucket]) if arrived else None
            if bad is not None:
                _raise_non_finite(bucket[bad[0]].name, self.comm.local_worker_ids[arrived[bad[1]]], round.number)

    def _steps(self, jobs: list[_Job], plan: list[list[_Job]], stages: list[tuple[int, str, int]], round: _Round,
               finalize_limit: int | None) -> Steps[dict[str, torch.Tensor]]:
        for phase, kind, yields in stages:
            parts = [[job for job in bucket if len(job.phases) > phase and job.phases[phase].collective == kind]
                     for bucket in plan]
            parts = [part for part in parts if part]
            if kind == "sum" and self.link is not None:
                yield from padded(lockstep([self._compressed_sum(part, phase, round) for part in parts]), yields)
            else:
                started = [self._start_phase(part, phase, kind, round) for part in parts]
                yield [handle for handle, _ in started]
                for part, (handle, offsets) in zip(parts, started):
                    self._combine(part, phase, kind, handle.wait(), offsets, round.scales)
        merged = {job.name: job.state for job in jobs}
        if finalize_limit is not None:
            yield from self._finalize(jobs, merged, finalize_limit)
        self._in_span(jobs, merged)
        return merged

    def _in_span(self, jobs: list[_Job], merged: dict[str, torch.Tensor]) -> None:
        """Iso-C of the low-rank sums in their factors' span (`isoloco.ortho.iso_correct_in_span`),
        after the last stage: an SVD (a host sync on a GPU), so it runs where the synchronisation
        lands, not inside a stage that an overlapped synchronisation runs between inner steps."""
        for job in jobs:
            if job.in_span:
                merged[job.name] = iso_correct_in_span(merged[job.name], job.basis, self._knobs.iso)
                job.basis = None

    def _finalize_of(self, name: str, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self._rule.finalize is None or not self.cfg.applies(name, tensor):
            return None
        knobs, finalize = self._knobs, self._rule.finalize
        return lambda merged: finalize(merged, knobs)

    def _jobs(self, local_deltas: Mapping[str, Sequence[torch.Tensor]],
              residuals: Mapping[str, Sequence[torch.Tensor]] | None, merged: int, finalize: bool) -> list[_Job]:
        workers = self.comm.local_worker_ids
        jobs = []
        for name, deltas in local_deltas.items():
            if len(deltas) != len(workers):
                raise ValueError(
                    f"{name!r}: got {len(deltas)} deltas but this process holds {len(workers)} "
                    f"workers; pass one delta per local worker, in order"
                )
            rule = self._rule.phases if self.cfg.applies(name, deltas[0]) else mean_phases
            finalizer = self._finalize_of(name, deltas[0]) if finalize else None
            in_span = (finalizer is not None and self.cfg.compress == "lowrank"
                       and self.cfg.compression.structured(deltas[0].shape, name))
            jobs.append(_Job(name, deltas, residuals[name] if residuals is not None else None,
                             rule(deltas[0].shape, merged, self._knobs), None if in_span else finalizer,
                             memos=[{} for _ in workers], in_span=in_span))
        return jobs

    def _contribution(self, jobs: list[_Job], phase: int, round: _Round, workers: Sequence[int],
                      onto: torch.Tensor | None = None) -> torch.Tensor | None:
        """The contributions to phase `phase` of `jobs` of the local workers `workers` (local
        indices) that arrived, added up in worker order and laid end to end (onto the running
        sum `onto`, if given); None when none arrived and there was nothing to add to."""
        sizes = [math.prod(job.phases[phase].shape) for job in jobs]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        buffer = onto
        for index in workers:
            worker = self.comm.local_worker_ids[index]
            scale = round.scale(worker)
            if scale is None:  # it did not arrive: it contributes nothing
                continue
            first = buffer is None
            for job, offset, size in zip(jobs, offsets, sizes):
                delta = round.fetched(job.deltas[index])
                if scale != 1:
                    delta = delta * scale
                if buffer is None:  # allocated where the deltas are fetched to
                    buffer = torch.empty(sum(sizes), dtype=delta.dtype, device=delta.device)
                target = buffer[offset:offset + size].view(job.phases[phase].shape)
                slot = WorkerSlot(worker, first, mask_key(self.seed, worker, round.number or 0, job.name),
                                  job.memos[index], scale)
                job.phases[phase].contribute(target, delta, slot, job.state)
                del delta  # the fetched copy goes before the next one comes
        return buffer

    def _start_phase(self, jobs: list[_Job], phase: int, collective: str, round: _Round) -> tuple[Pending, list[int]]:
        """Start phase `phase` of `jobs`: one collective for all; returns its handle and the
        offsets of the jobs in its buffer. Workers that did not arrive send zeros (the
        collective's shapes are the same on every process) and are left out by `_combine`."""
        sizes = [math.prod(job.phases[phase].shape) for job in jobs]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        workers = range(len(self.comm.local_worker_ids))

        def zeros() -> torch.Tensor:
            return self._zeros(jobs, sum(sizes), round)

        if collective == "sum":
            def build(onto: torch.Tensor | None) -> torch.Tensor | None:
                return self._contribution(jobs, phase, round, workers, onto)

            if any(job.phases[phase].in_order for job in jobs):
                handle = self.comm.sum_in_order_async(
                    build, zeros, lambda worker: any(round.scale(before) is not None for before in range(worker)))
            else:
                buffer = build(None)
                handle = self.comm.sum_async(buffer if buffer is not None else zeros())
        else:
            buffers = [self._contribution(jobs, phase, round, [index]) for index in workers]
            handle = self.comm.gather_async([buffer if buffer is not None else zeros() for buffer in buffers])
        return handle, offsets

    @staticmethod
    def _zeros(jobs: list[_Job], size: int, round: _Round) -> torch.Tensor:
        """What a worker that did not arrive sends: zeros of the deltas' dtype where they are fetched to."""
        where = round.fetched(jobs[0].deltas[0].reshape(-1)[:0])
        return torch.zeros(size, dtype=where.dtype, device=where.device)

    @staticmethod
    def _compute_device(jobs: list[_Job], round: _Round) -> torch.device:
        """Where the merge of `jobs` computes: the device their deltas are fetched to."""
        return round.fetched(jobs[0].deltas[0].reshape(-1)[:0]).device

    @staticmethod
    def _combine(jobs: list[_Job], phase: int, collective: str, result: Any, offsets: list[int],
                 scales: Mapping[int, float] | None) -> None:
        # A gather's blocks come in global worker order; those of workers that did not arrive are dropped.
        blocks = result if collective == "sum" or scales is None else [
            flat for worker, flat in enumerate(result) if worker in scales]
        for job, offset in zip(jobs, offsets):
            shape = job.phases[phase].shape
            size = math.prod(shape)
            if collective == "sum":
                job.state = job.phases[phase].combine(blocks[offset:offset + size].view(shape), job.state)
            else:
                stacked = torch.stack([flat[offset:offset + size].view(shape) for flat in blocks])
                job.state = job.phases[phase].combine(stacked, job.state)

    def _compressed_sum(self, jobs: list[_Job], phase: int, round: _Round) -> Steps[None]:
        """A sum phase of `jobs` that crosses the link compressed (`isoloco.sync.slowlink`),
        combined into each job's state; low rank's P̂ is kept for the jobs finalized in the
        factors' span."""
        shapes, names = _described(jobs, phase)
        size = sum(math.prod(shape) for shape in shapes)

        def contribution(workers: list[int]) -> Callable[[], torch.Tensor]:
            def build() -> torch.Tensor:
                buffer = self._contribution(jobs, phase, round, workers)
                return buffer if buffer is not None else self._zeros(jobs, size, round)
            return build

        residuals = None if jobs[0].residuals is None else (lambda head: [job.residuals[head] for job in jobs])
        sums = yield from self.link.sum(shapes, names, contribution,
                                        lambda index: round.scale(self.comm.local_worker_ids[index]) is not None,
                                        residuals, round.fetched, self._compute_device(jobs, round))
        for job, (total, basis) in zip(jobs, sums):
            shape = job.phases[phase].shape
            job.state = job.phases[phase].combine(total.view(shape).to(job.deltas[0].dtype), job.state)
            if job.in_span:  # corrected once every stage has run (`_in_span`): its SVD syncs with the host
                job.basis = basis

    def _finalize(self, jobs: list[_Job], merged: dict[str, torch.Tensor], limit: int) -> Steps[None]:
        """Run the pure finalize steps on stacks of same-shape matrices of at most `limit`
        bytes (at least one matrix), which `shard_map` shares out among processes."""
        pending = [job for job in jobs if job.finalize is not None]
        groups: dict[tuple, list[_Job]] = {}
        for job in pending:
            groups.setdefault((tuple(merged[job.name].shape), merged[job.name].dtype), []).append(job)
        stacks: list[list[_Job]] = []
        for group in groups.values():
            sizes = [(nbytes(merged[job.name]), merged[job.name].dtype) for job in group]
            stacks += [[group[i] for i in bucket] for bucket in buckets(sizes, limit)]
        finalize = pending[0].finalize  # one rule: every job finalizes alike
        # A stack of one stays a matrix: its numbers are then those of the unbatched finalize.
        inputs = [merged[stack[0].name] if len(stack) == 1 else torch.stack([merged[job.name] for job in stack])
                  for stack in stacks]
        handle = self.comm.shard_map_async(finalize, inputs)
        yield [handle]
        for stack, result in zip(stacks, handle.wait()):
            merged.update(zip((job.name for job in stack), [result] if len(stack) == 1 else result.unbind(0)))


def _described(jobs: list[_Job], phase: int) -> tuple[list[torch.Size], list[str]]:
    """The shapes of phase `phase` of `jobs` and their parameter names, as a plan takes them."""
    return [job.phases[phase].shape for job in jobs], [job.name for job in jobs]


def wire_bytes_per_merge(shapes: Sequence[torch.Size], cfg: MergeConfig, islands: int,
                         names: Sequence[str] | None = None, slices: int = 1) -> float:
    """The slow-link bytes one process puts on the link in a merge by the mean of tensors of
    `shapes` (float32; their parameter `names`, for merge.compress_exclude) under `cfg`'s
    compression, over `islands` islands of `slices` processes each, averaged over an island's
    processes: what the metrics' `wire_bytes_cross_island` counts. A compressed sum's bytes are
    its plan's (`isoloco.sync.phase.PhasePlan`, the plan the merge runs); float32's are each
    process's all-reduce of its slice of a bucket (`isoloco.torch_comm`), by the cost model
    (`isoloco.sync.cost`)."""
    total = 0.0
    names = list(names) if names is not None else [""] * len(shapes)
    for bucket in buckets([(4 * math.prod(shape), torch.float32) for shape in shapes], int(cfg.bucket_mb * 2**20)):
        chosen = [shapes[index] for index in bucket]
        if cfg.lossy_setting is None:
            total += wire_bytes("all_reduce", 4 * -(-sum(math.prod(shape) for shape in chosen) // slices), islands)
        else:
            total += PhasePlan.of(chosen, [names[index] for index in bucket], cfg.compression, islands,
                                  slices).wire_bytes()
    return total


# --------------------------------------------------- peft-style functions, one per rule


def _merge_in_process(deltas: Sequence[torch.Tensor], config: MergeConfig, seed: int = 0) -> torch.Tensor:
    """One tensor's R deltas merged by `config` in this process."""
    if not deltas:
        raise ValueError("a merge needs at least one delta")
    return Merger(config, LocalCommunicator(len(deltas)), seed).merge("tensor", deltas)


def mean(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """Task arithmetic: the mean of the deltas."""
    return _merge_in_process(deltas, MergeConfig(rule="mean"))


def ties(deltas: Sequence[torch.Tensor], density: float = MergeConfig.density) -> torch.Tensor:
    """TIES merge (trim to `density`, elect sign, disjoint mean); see `isoloco.rules.ties_phases`."""
    return _merge_in_process(deltas, MergeConfig(rule="ties", density=density))


def dare(deltas: Sequence[torch.Tensor], drop_rate: float = MergeConfig.drop_rate, seed: int = 0) -> torch.Tensor:
    """DARE merge; delta r's mask is keyed by (`seed`, r), as worker r's is in round 0 of a run."""
    return _merge_in_process(deltas, MergeConfig(rule="dare", drop_rate=drop_rate), seed)


def tsv(deltas: Sequence[torch.Tensor], factors: str = MergeConfig.factors,
        power_iters: int = MergeConfig.power_iters, finder_dtype: str = MergeConfig.finder_dtype) -> torch.Tensor:
    """Task Singular Vectors merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="tsv", factors=factors, power_iters=power_iters,
                                                 finder_dtype=finder_dtype))


def iso_c(deltas: Sequence[torch.Tensor], settings: IsoSettings = IsoSettings()) -> torch.Tensor:
    """Iso-C merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="iso_c", **dataclasses.asdict(settings)))


def iso_cts(deltas: Sequence[torch.Tensor], common_fraction: float = MergeConfig.common_fraction,
            factors: str = MergeConfig.factors, power_iters: int = MergeConfig.power_iters,
            finder_dtype: str = MergeConfig.finder_dtype) -> torch.Tensor:
    """Iso-CTS merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="iso_cts", common_fraction=common_fraction, factors=factors,
                                                 power_iters=power_iters, finder_dtype=finder_dtype))
