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
* **Compression.** With `merge.quantize`, a sum of the workers' deltas (the mean and Iso-C)
  crosses the link as each worker's quantised delta (plus its error-feedback residual), and
  every process dequantises and adds them in worker order (`isoloco.quantize`).
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
from typing import Any, Callable, Mapping, Sequence

import torch

from isoloco.comm import Communicator, LocalCommunicator, buckets, nbytes
from isoloco.configbase import check_at_least, check_choices, check_positive, check_range, option
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.ortho import (FACTOR_METHODS, FINDER_DTYPES, NS_DTYPES, POLAR_METHODS, SCALE_METHODS, FactorSettings,
                           IsoSettings, spectrum_knob_problem)
from isoloco.quantize import (FORMATS, SCALE_GROUPS, Quantization, Wire, compress_with_feedback, dequantize,
                              quantize, wire_nbytes)
from isoloco.rules import RULES, Knobs, Phase, WorkerSlot, mask_key, mean_phases

Fetch = Callable[[torch.Tensor], torch.Tensor]

#: The rules whose one collective sums the workers' pseudo-gradients themselves, which can
#: therefore travel compressed (`merge.quantize`).
COMPRESSIBLE_RULES = ("mean", "iso_c")


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
        "the rank, exact elsewhere)", choices=FACTOR_METHODS)
    oversample: int = option(FactorSettings.oversample, "factors=randomized: extra columns beyond the k wanted")
    power_iters: int = option(FactorSettings.power_iters, "factors=randomized: subspace iterations")
    finder_dtype: str = option(
        FactorSettings.finder_dtype,
        "factors=randomized: precision of every subspace iteration but the last (the last and the final product "
        "run in float32): auto (bfloat16 on CUDA GPUs of compute capability 8.0 or later, else float32; recorded "
        "as merge_finder_dtype in summary.json and metrics.jsonl), bfloat16 or float32", choices=FINDER_DTYPES)
    quantize: str = option(
        "none", "what crosses the slow link: each worker's pseudo-gradient as float32 (none), or compressed to "
                "bfloat16, int8 or int4 codes with absmax scales (mean and Iso-C rules only)", choices=FORMATS)
    quantize_scales: str = option("block", "merge.quantize=int8/int4: one scale per block of entries or per "
                                           "matrix row", choices=SCALE_GROUPS)
    quantize_block: int = option(256, "merge.quantize_scales=block: entries per scale (4 bytes each)")
    error_feedback: bool = option(
        False, "with merge.quantize: each worker keeps what compression lost and adds it to its next pseudo-gradient "
               "(checkpointed with the worker)")
    bucket_mb: float = option(
        64.0, "parameters are merged in buckets of about this many MiB: one collective per bucket and phase, "
              "one finiteness check per bucket")
    exclude: list[str] = option(
        [],
        "fnmatch patterns of parameter names whose 2-D tensors skip the spectral rules "
        "(tsv, iso_c, iso_cts) and take the mean; empty = correct every matrix",
    )

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
        if self.error_feedback and self.quantize == "none":
            raise ConfigError("merge.error_feedback=true is not allowed with merge.quantize=none: there is no "
                              "compression error to feed back; set merge.quantize=bf16, int8 or int4")
        if self.quantize != "none" and self.rule not in COMPRESSIBLE_RULES:
            raise ConfigError(
                f"merge.quantize={self.quantize} is not allowed with merge.rule={self.rule}: only the rules whose one "
                f"collective is the sum of the workers' pseudo-gradients ({', '.join(COMPRESSIBLE_RULES)}) send them "
                f"compressed; use merge.quantize=none")
        if not isinstance(self.exclude, (list, tuple)) or not all(isinstance(p, str) for p in self.exclude):
            raise ConfigError(
                f"merge.exclude={self.exclude!r} is not allowed: it must be a list of name patterns, "
                f"e.g. ['*embed_tokens*', 'lm_head.weight']"
            )

    @property
    def iso(self) -> IsoSettings:
        """The Iso-C settings these keys describe."""
        return IsoSettings(self.ortho, self.scale, self.ns_steps, self.ns_dtype, self.iso_power, self.iso_floor)

    @property
    def quantization(self) -> Quantization:
        """How the workers' pseudo-gradients cross the slow link."""
        return Quantization(self.quantize, self.quantize_scales, self.quantize_block)

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


@dataclasses.dataclass
class _Job:
    """One parameter on its way through its rule's phases."""

    name: str
    deltas: Sequence[torch.Tensor]  # stored, one per local worker
    residuals: Sequence[torch.Tensor] | None  # error feedback: stored, one per local worker (updated)
    phases: list[Phase]
    finalize: Callable[[torch.Tensor], torch.Tensor] | None
    state: Any = None
    memos: list[dict[str, Any]] = dataclasses.field(default_factory=list)


# -------------------------------------------------------------------------------- merger


class Merger:
    """Applies the configured rule to each parameter, for the workers this process holds.

    It holds no state between rounds: DARE's masks are a function of (seed, global worker
    id, round, parameter name, entry).
    """

    def __init__(self, cfg: MergeConfig, comm: Communicator, seed: int) -> None:
        cfg.validate()
        self.cfg = cfg
        self.comm = comm
        self.seed = seed
        self._knobs = cfg.knobs
        self._rule = RULES[cfg.rule]

    def merge_all(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int | None = None,
                  fetch: Fetch | None = None,
                  residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """Merge every parameter (`local_deltas[name]`: one delta per local worker, in order)
        across all R workers, bucket by bucket in the mapping's order (the same on every
        process), then the finalize steps, batched and shared out among processes.

        `fetch` brings a stored delta to where the merge computes; it is called for one delta
        at a time, once per phase, and the fetched copy is dropped before the next. `round`
        names the synchronisation in errors and keys DARE's masks (None counts as 0).

        With `merge.quantize`, each worker's delta crosses the link compressed; `residuals`
        (with `merge.error_feedback`: one per parameter and local worker, like the deltas)
        hold what earlier compressions lost and are updated in place."""
        if self.cfg.error_feedback and residuals is None:
            raise ValueError("merge.error_feedback needs the workers' residuals: pass residuals=")
        return self._merge(local_deltas, round, fetch, finalize=True, residuals=residuals)

    def merge(self, name: str, local_deltas: Sequence[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """Merge one parameter's local deltas (see `merge_all`)."""
        return self._merge({name: local_deltas}, round, None, finalize=True)[name]

    def aggregate(self, name: str, local_deltas: Sequence[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """The collective part of the merge of one parameter: its rule's phases, without finalize."""
        return self._merge({name: local_deltas}, round, None, finalize=False)[name]

    def finalize(self, name: str, aggregated: torch.Tensor) -> torch.Tensor:
        """The pure, per-tensor rest of the merge of `name` (any one process may run it)."""
        finalize = self._finalize_of(name, aggregated)
        return finalize(aggregated) if finalize else aggregated

    # --------------------------------------------------------------------------- internals

    def _merge(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int | None, fetch: Fetch | None,
               finalize: bool, residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        jobs = self._jobs(local_deltas, residuals if self.cfg.error_feedback else None)
        merged: dict[str, torch.Tensor] = {}
        limit = int(self.cfg.bucket_mb * 2**20)
        for bucket in buckets([(nbytes(job.deltas[0]), job.deltas[0].dtype) for job in jobs], limit):
            chosen = [jobs[i] for i in bucket]
            bad = _first_non_finite([list(job.deltas) for job in chosen])
            if bad is not None:
                _raise_non_finite(chosen[bad[0]].name, self.comm.local_worker_ids[bad[1]], round)
            for phase in range(max(len(job.phases) for job in chosen)):
                active = [job for job in chosen if len(job.phases) > phase]
                for collective in ("sum", "gather"):
                    part = [job for job in active if job.phases[phase].collective == collective]
                    if part:
                        self._run_phase(part, phase, collective, round or 0, fetch)
            merged.update((job.name, job.state) for job in chosen)
        if finalize:
            self._finalize(jobs, merged, limit)
        return merged

    def _finalize_of(self, name: str, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self._rule.finalize is None or not self.cfg.applies(name, tensor):
            return None
        knobs, finalize = self._knobs, self._rule.finalize
        return lambda merged: finalize(merged, knobs)

    def _jobs(self, local_deltas: Mapping[str, Sequence[torch.Tensor]],
              residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> list[_Job]:
        workers = self.comm.local_worker_ids
        jobs = []
        for name, deltas in local_deltas.items():
            if len(deltas) != len(workers):
                raise ValueError(
                    f"{name!r}: got {len(deltas)} deltas but this process holds {len(workers)} "
                    f"workers; pass one delta per local worker, in order"
                )
            rule = self._rule.phases if self.cfg.applies(name, deltas[0]) else mean_phases
            jobs.append(_Job(name, deltas, residuals[name] if residuals is not None else None,
                             rule(deltas[0].shape, self.comm.num_workers, self._knobs),
                             self._finalize_of(name, deltas[0]), memos=[{} for _ in workers]))
        return jobs

    def _run_phase(self, jobs: list[_Job], phase: int, collective: str, round: int, fetch: Fetch | None) -> None:
        """Every local worker's contribution to phase `phase` of `jobs`, one collective for all."""
        if collective == "sum" and self.cfg.quantize != "none":
            return self._run_compressed_sum(jobs, phase, fetch)
        sizes = [math.prod(job.phases[phase].shape) for job in jobs]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        workers = self.comm.local_worker_ids
        # A sum phase accumulates into one buffer; a gather phase gives each worker its own.
        buffers: list[torch.Tensor] = []
        for index, worker in enumerate(workers):
            if collective == "gather" or index == 0:
                buffers.append(None)
            for job, offset, size in zip(jobs, offsets, sizes):
                delta = fetch(job.deltas[index]) if fetch else job.deltas[index]
                if buffers[-1] is None:  # allocated where the deltas are fetched to
                    buffers[-1] = torch.empty(sum(sizes), dtype=delta.dtype, device=delta.device)
                target = buffers[-1][offset:offset + size].view(job.phases[phase].shape)
                first = collective == "gather" or index == 0
                slot = WorkerSlot(worker, first, mask_key(self.seed, worker, round, job.name), job.memos[index])
                job.phases[phase].contribute(target, delta, slot, job.state)
                del delta  # the fetched copy goes before the next one comes
        if collective == "sum":
            total = self.comm.sum(buffers[0])
            for job, offset, size in zip(jobs, offsets, sizes):
                shape = job.phases[phase].shape
                job.state = job.phases[phase].combine(total[offset:offset + size].view(shape), job.state)
        else:
            gathered = self.comm.gather(buffers)
            for job, offset, size in zip(jobs, offsets, sizes):
                shape = job.phases[phase].shape
                stacked = torch.stack([flat[offset:offset + size].view(shape) for flat in gathered])
                job.state = job.phases[phase].combine(stacked, job.state)

    def _run_compressed_sum(self, jobs: list[_Job], phase: int, fetch: Fetch | None) -> None:
        """A sum of the workers' deltas that crosses the link compressed: each local worker's
        deltas (plus its residual, with error feedback) are quantised and packed, one all-gather
        carries every worker's packed bytes, and every process dequantises them and adds them
        up in worker order, so each layout computes the same sum as one process would."""
        quantization = self.cfg.quantization
        shapes = [job.deltas[0].shape for job in jobs]
        wires = [wire_nbytes(math.prod(shape), quantization, quantization.group_size(shape)) for shape in shapes]
        sizes = [_aligned(size) for size in wires]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        packed = []
        for index in range(len(self.comm.local_worker_ids)):
            parts = []
            for job, size in zip(jobs, sizes):
                delta = fetch(job.deltas[index]) if fetch else job.deltas[index]
                if job.residuals is None:
                    wire = quantize(delta, quantization)
                else:
                    stored = job.residuals[index]
                    residual = fetch(stored) if fetch else stored
                    wire, residual = compress_with_feedback(delta, residual, quantization)
                    if residual is not stored:
                        stored.copy_(residual)
                raw = wire.as_bytes()
                parts.append(torch.nn.functional.pad(raw, (0, size - raw.numel())))
                del delta, wire
            packed.append(torch.cat(parts))
        gathered = self.comm.gather(packed)
        for job, offset, size, shape in zip(jobs, offsets, wires, shapes):
            total = None
            for flat in gathered:  # in global worker order
                sent = dequantize(Wire.from_bytes(flat[offset:offset + size], quantization, shape))
                total = sent if total is None else total.add_(sent)
            job.state = job.phases[phase].combine(total.to(job.deltas[0].dtype), job.state)

    def _finalize(self, jobs: list[_Job], merged: dict[str, torch.Tensor], limit: int) -> None:
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
        if not stacks:
            return
        finalize = pending[0].finalize  # one rule: every job finalizes alike
        # A stack of one stays a matrix: its numbers are then those of the unbatched finalize.
        inputs = [merged[stack[0].name] if len(stack) == 1 else torch.stack([merged[job.name] for job in stack])
                  for stack in stacks]
        for stack, result in zip(stacks, self.comm.shard_map(finalize, inputs)):
            merged.update(zip((job.name for job in stack), [result] if len(stack) == 1 else result.unbind(0)))


def _aligned(size: int) -> int:
    """`size` rounded up to a multiple of 4 bytes: packed wires stay aligned for their float32 scales."""
    return -(-size // 4) * 4


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
