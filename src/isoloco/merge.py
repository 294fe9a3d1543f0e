"""The merge engine: how one round's pseudo-gradients reach every worker as merged updates.

The rules themselves are pure phases (`isoloco.rules`); this module runs them against a
`Communicator` and owns everything about *how*:

* **Streaming over workers.** A phase fetches one worker's delta at a time (offloaded
  workers keep theirs in host memory), adds its contribution to the phase's buffer and drops
  it, so merging a parameter holds a few deltas' worth of memory whatever the number of
  workers R.
* **Buckets.** Parameters are packed, in order, into buckets of about `merge.bucket_mb`;
  each phase of a bucket is one collective for all its parameters (a sum buffer or each
  worker's factors, laid end to end), and one finiteness check (`refuse_non_finite`) covers
  the whole bucket.
* **Compression.** With `merge.quantize` or `merge.compress`, a sum phase crosses the slow
  link compressed: the engine hands each bucket's sum to `isoloco.sync.slowlink.SlowLink`,
  which plans it, runs the islands' steps and, for low rank with Iso-C, corrects the sums in
  their factors' span; the codec decides which rules it can carry
  (`isoloco.sync.codec.carry_refusal`).
* **Stages.** A merge is steps (`isoloco.sync.handles`): each stage starts its collectives,
  and waits for them only when resumed, so an overlapped synchronisation runs its stages
  between inner steps, from the main thread, in one order on every rank.
* **Finalize, batched and shared.** A rule's pure last step (Iso-C's orthogonalisation)
  runs after every collective, on stacks of same-shape matrices, shared out among processes
  by `Communicator.shard_map`. The stacks do not depend on the process layout, so every
  layout computes the same numbers.

`Merger` is what a training loop uses, configured by `isoloco.merge_config.MergeConfig`; the
peft-style functions (`isoloco.merge_functions`) merge a list of R tensors in this process
through the same path. Nothing here writes into the deltas; only the error-feedback residuals
are updated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import torch

from isoloco.comm import Communicator, nbytes
from isoloco.errors import NonFiniteDeltaError
from isoloco.merge_config import MergeConfig, Participation
from isoloco.rules import RULES, Phase, WorkerSlot, mask_key, mean_phases
from isoloco.sync.handles import Pending, Steps, Sync, run_to_end
from isoloco.sync.plan import buckets
from isoloco.sync.slowlink import BucketSum, SlowLink

Fetch = Callable[[torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------- finiteness


def finite_each(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether each of `tensors` is finite, as a boolean tensor (one device sync to read). A
    tensor's extremes are finite exactly when all its entries are (NaN propagates), and
    finding them reads it once without allocating a mask of its size."""
    extremes = torch.stack([torch.stack(torch.aminmax(tensor)) for tensor in tensors])
    return torch.isfinite(extremes).all(dim=1)


def refuse_non_finite(deltas: Mapping[str, Sequence[torch.Tensor]], workers: Sequence[int],
                      round: int | None) -> None:
    """Raise `NonFiniteDeltaError` naming the first parameter, in order, and worker whose delta
    is not finite (`deltas[name][i]` is global worker `workers[i]`'s): one device sync for all,
    none without workers."""
    if not workers:
        return
    finite = finite_each([delta for per_worker in deltas.values() for delta in per_worker])
    if bool(finite.all()):
        return
    first = int((~finite).nonzero()[0])
    name, worker = list(deltas)[first // len(workers)], workers[first % len(workers)]
    when = f" in round {round}" if round is not None else ""
    raise NonFiniteDeltaError(
        f"the pseudo-gradient of {name!r} from worker {worker}{when} contains NaN or inf: "
        f"that worker's inner training diverged; lower the inner learning rate or "
        f"enable gradient clipping"
    )


# ------------------------------------------------------------------------------- helpers


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
    #: Finalized by the slow link in the span of its sum's factors after the last stage
    #: (`isoloco.sync.slowlink.SlowLink.correct_in_span`), not by `finalize`.
    in_span: bool = False


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
        #: How many workers' factors took each `factors.FACTOR_PATHS` path (TSV, Iso-CTS) since it was last cleared.
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

        With `merge.quantize` or `merge.compress`, a sum crosses the link compressed
        (`isoloco.sync.slowlink`);
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
        limit = self.cfg.bucket_bytes
        plan = [[jobs[i] for i in bucket]
                for bucket in buckets([(nbytes(job.deltas[0]), job.deltas[0].dtype) for job in jobs], limit)]
        round_ = _Round(round, fetch, scales)
        self._refuse_non_finite(plan, round_)
        stages = self._stages(plan)
        finalizing = any(job.finalize is not None for job in jobs)
        steps = self._steps(jobs, plan, stages, round_, limit if finalizing else None)
        # Every stage but the finalize starts collectives between islands; the finalize computes
        # (its broadcasts stay inside an island).
        transfers = sum(count for _, _, count in stages)
        return Sync(steps, transfers + finalizing, (1.0,) * transfers + (0.0,) * finalizing)

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
        phase; a sum over the slow link waits as often as it says (`SlowLink.stages`)."""
        depth = max((len(job.phases) for bucket in plan for job in bucket), default=0)
        stages = []
        for phase in range(depth):
            for kind in ("sum", "gather"):
                parts = _parts(plan, phase, kind)
                if not parts:
                    continue
                yields = 1
                if kind == "sum" and self.link is not None:
                    yields = self.link.stages([([job.phases[phase].shape for job in part], [job.name for job in part])
                                               for part in parts])
                stages.append((phase, kind, yields))
        return stages

    def _refuse_non_finite(self, plan: list[list[_Job]], round: _Round) -> None:
        """Raise before anything is sent when an arrived local worker's delta is not finite:
        one device sync per bucket, before the first stage, so no stage converts a tensor."""
        arrived = [index for index, worker in enumerate(self.comm.local_worker_ids) if round.scale(worker) is not None]
        for bucket in plan:
            refuse_non_finite({job.name: [job.deltas[index] for index in arrived] for job in bucket},
                              [self.comm.local_worker_ids[index] for index in arrived], round.number)

    def _steps(self, jobs: list[_Job], plan: list[list[_Job]], stages: list[tuple[int, str, int]], round: _Round,
               finalize_limit: int | None) -> Steps[dict[str, torch.Tensor]]:
        for phase, kind, yields in stages:
            parts = _parts(plan, phase, kind)
            if kind == "sum" and self.link is not None:
                yield from self.link.phase([self._bucket_sum(part, phase, round) for part in parts], yields,
                                           lambda index: round.scale(self.comm.local_worker_ids[index]) is not None,
                                           round.fetched)
            else:
                started = [self._start_phase(part, phase, kind, round) for part in parts]
                yield [handle for handle, _ in started]
                for part, (handle, offsets) in zip(parts, started):
                    self._combine(part, phase, kind, handle.wait(), offsets, round.scales)
        merged = {job.name: job.state for job in jobs}
        if finalize_limit is not None:
            yield from self._finalize(jobs, merged, finalize_limit)
        if self.link is not None:
            self.link.correct_in_span(merged, [job.name for job in jobs if job.in_span], self._knobs.iso)
        return merged

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
            in_span = finalizer is not None and self.link is not None and self.link.spans(deltas[0].shape, name)
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

    def _bucket_sum(self, jobs: list[_Job], phase: int, round: _Round) -> BucketSum:
        """Sum phase `phase` of `jobs` as the slow link takes it, combined into each job's state."""
        shapes = [job.phases[phase].shape for job in jobs]
        size = sum(math.prod(shape) for shape in shapes)

        def contribution(workers: list[int]) -> Callable[[], torch.Tensor]:
            def build() -> torch.Tensor:
                buffer = self._contribution(jobs, phase, round, workers)
                return buffer if buffer is not None else self._zeros(jobs, size, round)
            return build

        def combine(totals: list[torch.Tensor]) -> None:
            for job, total in zip(jobs, totals):
                shape = job.phases[phase].shape
                job.state = job.phases[phase].combine(total.view(shape).to(job.deltas[0].dtype), job.state)

        residuals = None if jobs[0].residuals is None else (lambda head: [job.residuals[head] for job in jobs])
        return BucketSum(shapes, [job.name for job in jobs], contribution, residuals,
                         self._compute_device(jobs, round), [job.in_span for job in jobs], combine)

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



def _parts(plan: list[list[_Job]], phase: int, kind: str) -> list[list[_Job]]:
    """The jobs of each bucket of `plan` whose phase `phase` is a `kind` collective (buckets
    with none left out)."""
    parts = [[job for job in bucket if len(job.phases) > phase and job.phases[phase].collective == kind]
             for bucket in plan]
    return [part for part in parts if part]
