"""Merge rules as pure phases: how one parameter's R pseudo-gradients become one tensor.

A rule is a short list of *phases*. In each phase every worker adds its contribution to a
phase buffer (`contribute`), the buffers of all workers are combined by one collective
(``sum``: an all-reduce; ``gather``: an all-gather, for small per-worker factors), and
`combine` turns the result into what the next phase needs, or, after the last phase, into
the merged tensor. Rules hold no communicator and no storage: `isoloco.merge` runs the
phases, fetching one delta at a time, packing many parameters into one collective per
phase, and checking finiteness. That keeps every rule's memory flat in R: a phase holds its
buffer and one worker's delta, never all R of them.

* mean, Iso-C: one sum. DARE: one sum of the masked deltas (masks drawn where the delta is).
* TIES: a sum of the trimmed deltas to elect signs, then a sum of the agreeing entries and
  their count (the trim threshold of each worker is kept from the first phase).
* TSV: a gather of each worker's top-k factors (U_k, S_k, V_k).
* Iso-CTS: a sum for the common subspace, then a gather of each worker's residual factors.

`RULES` registers each rule once. docs/fidelity.md defines each against the paper's code.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from typing import Any, Callable, Literal

import torch

from isoloco.factors import FactorSettings, top_factors
from isoloco.ortho import IsoSettings, iso_correct
from isoloco.svd import full_float32_matmuls


@dataclasses.dataclass
class WorkerSlot:
    """What a phase knows of the worker whose delta it is given."""

    worker: int  # global worker id, 0..R-1
    first: bool  # the first local worker of a sum phase: write into the buffer, do not add
    mask_key: int  # DARE: the key of this worker's mask for this parameter and round
    memo: dict[str, Any]  # kept for this worker and parameter from one phase to the next
    #: c_r, the worker's share of the merge: the engine hands `contribute` c_r·Δ_r already
    #: (`isoloco.merge_config.Participation`); a rule that counts entries counts c_r instead of 1.
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Phase:
    """One collective of a rule: per-worker contributions into a buffer of `shape`, combined
    across all workers by `collective`, then `combine`d with the state of earlier phases."""

    collective: Literal["sum", "gather"]
    shape: tuple[int, ...]
    contribute: Callable[[torch.Tensor, torch.Tensor, WorkerSlot, Any], None]  # (buffer, delta, slot, state)
    combine: Callable[[torch.Tensor, Any], Any]  # (sum, or workers' buffers stacked in id order; state) -> state
    exact: bool = False  # a sum whose terms must arrive unrounded (counts): no lossy codec may carry it
    #: A sum added in worker order in every layout (`Communicator.sum_in_order_async`): for a
    #: combine so ill-conditioned that the rounding of another order shows in the merge.
    in_order: bool = False


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The settings a rule reads (from `isoloco.merge_config.MergeConfig`)."""

    density: float = 0.9
    drop_rate: float = 0.1
    common_fraction: float = 0.8
    iso: IsoSettings = IsoSettings()
    factors: FactorSettings = FactorSettings()
    #: Where TSV and Iso-CTS count the path each worker's factors took (`factors.FACTOR_PATHS`).
    factor_paths: Counter | None = dataclasses.field(default=None, compare=False)


def _put(buffer: torch.Tensor, term: torch.Tensor, slot: WorkerSlot) -> None:
    """Add a worker's term to a sum buffer; the first one is copied, so the sum is the same,
    bit for bit, as summing the terms in worker order."""
    if slot.first:
        buffer.copy_(term)
    else:
        buffer.add_(term)


# ------------------------------------------------------------------------------ mean


def mean_phases(shape: torch.Size, workers: int, knobs: Knobs) -> list[Phase]:
    """Task arithmetic: (1/R) Σ_r Δ_r."""
    return [Phase("sum", tuple(shape), lambda buffer, delta, slot, state: _put(buffer, delta, slot),
                  lambda total, state: total.div_(workers))]


# ------------------------------------------------------------------------------ TIES


def trim_threshold(delta: torch.Tensor, density: float) -> torch.Tensor:
    """The smallest magnitude TIES keeps: entries at least this large are kept (ties at the
    threshold all stay, deterministic on every device), max(1, ⌊density·numel⌋) of them.

    The count is the paper's code's (peft's `magnitude_based_pruning`). On the CPU the order
    statistic comes from numpy's in-place partition of the magnitudes, which needs no index
    array (torch's kthvalue holds two more copies of the tensor); the value is the same.
    """
    keep = max(1, int(density * delta.numel()))
    magnitude = delta.abs().flatten()
    kth = magnitude.numel() - keep
    if magnitude.device.type == "cpu":
        values = magnitude.numpy()
        values.partition(kth)
        return magnitude[kth].clone()
    return torch.kthvalue(magnitude, kth + 1).values


def trim(delta: torch.Tensor, density: float, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the max(1, ⌊density·numel⌋) entries of largest magnitude (those at least
    `threshold`, `trim_threshold` unless given), zero the rest."""
    if threshold is None:
        threshold = trim_threshold(delta, density)
    return torch.where(delta.abs() >= threshold, delta, 0)  # a scalar 0: no zero tensor beside the delta


def ties_phases(shape: torch.Size, workers: int, knobs: Knobs) -> list[Phase]:
    """TIES: trim each delta, elect a sign per entry, average the agreeing entries.

    γ = sign(Σ_r trimmed_r) (0 counts as +, as in peft's "total" method); the result is
    Σ_r trimmed_r·[sign(trimmed_r) = γ] / max(#agreeing nonzero entries, 1). The masked sum
    and the count travel as one (2, ...) buffer. Weighted (deltas c_r·Δ_r), an agreeing entry
    counts c_r: the result is the weighted mean of the agreeing entries.
    """

    def trimmed_sum(buffer, delta, slot, state):
        slot.memo["threshold"] = trim_threshold(delta, knobs.density)
        _put(buffer, trim(delta, knobs.density, slot.memo["threshold"]), slot)

    def agreeing(buffer, delta, slot, positive):
        # Kept (|Δ| ≥ t) with the elected sign, from comparisons alone: no |Δ| beside the delta.
        threshold = slot.memo["threshold"]
        agrees = torch.where(positive, delta >= threshold, delta <= -threshold).logical_and_(delta != 0)
        _put(buffer[0], torch.where(agrees, delta, 0), slot)  # Δ·mask would first make a float copy of the mask
        _put(buffer[1], agrees if slot.weight == 1 else agrees * slot.weight, slot)

    return [Phase("sum", tuple(shape), trimmed_sum, lambda total, state: total >= 0),
            Phase("sum", (2, *shape), agreeing, _agreeing_mean, exact=True)]


def _agreeing_mean(totals: torch.Tensor, state: Any) -> torch.Tensor:
    """The agreeing entries' sum over their count; where none agree the sum is 0 and stays 0
    (weighted counts may be below 1, so the count is not clamped to 1). The counts are the
    rule's own buffer, set to 1 in place where zero: one tensor fewer at the rule's peak."""
    counts = totals[1]
    return totals[0] / counts.masked_fill_(counts == 0, 1)


# ------------------------------------------------------------------------------ DARE


#: DARE's masks are drawn this many entries at a time, so the counters and hashes of a chunk,
#: not of the whole tensor, are held at once: on a CPU a chunk whose integers stay in cache
#: (measured fastest in docs/benchmarks.md, "DARE's masks"), on a GPU one that keeps the
#: kernel launches few. The bits do not depend on the chunk.
MASK_CHUNK = {"cpu": 1 << 14, "default": 1 << 22}
_UINT32 = 0xFFFFFFFF


def mask_key(seed: int, worker: int, round: int, name: str) -> int:
    """The 64-bit key of global worker `worker`'s DARE mask of parameter `name` in `round`.
    The hash keeps the streams apart (seed + worker would give run 0's worker 1 run 1's worker
    0 masks); masks need no state to checkpoint."""
    digest = hashlib.blake2b(f"isoloco.merge.dare:{seed}:{worker}:{round}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x·constant mod 2³² for int64 tensors holding 32-bit values, in two 16-bit halves so no
    product leaves int64's range (signed overflow is not defined behaviour)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _UINT32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(key: int, start: int, stop: int, keep: float, device: torch.device) -> torch.Tensor:
    """DARE's keep mask of entries [start, stop) of a flattened tensor: entry i is kept when
    hash(key, i) / 2³² < keep. A counter-based function of (key, index), computed with integer
    operations on `device`, so every device, layout, thread count and resume draws the same bits."""
    index = torch.arange(start, stop, device=device, dtype=torch.int64)
    bits = _mix32(_mix32((index & _UINT32) ^ (key & _UINT32)) ^ ((key >> 32) ^ (index >> 32)))
    return bits < int(keep * 2**32)


def dare_phases(shape: torch.Size, workers: int, knobs: Knobs) -> list[Phase]:
    """DARE: drop each entry with probability p, rescale survivors by 1/(1−p), then mean."""
    keep = 1.0 - knobs.drop_rate

    def dropped_sum(buffer, delta, slot, state):
        if delta.numel() >= 2**32:
            raise ValueError(f"DARE's masks index at most 2^32 entries per tensor; this one has {delta.numel()}")
        flat_delta, flat_buffer = delta.reshape(-1), buffer.view(-1)
        chunk = MASK_CHUNK.get(delta.device.type, MASK_CHUNK["default"])
        for start in range(0, flat_delta.numel(), chunk):
            stop = min(start + chunk, flat_delta.numel())
            mask = keep_mask(slot.mask_key, start, stop, keep, delta.device)
            _put(flat_buffer[start:stop], flat_delta[start:stop] * mask / keep, slot)

    return [Phase("sum", tuple(shape), dropped_sum, lambda total, state: total.div_(workers))]


# ------------------------------------------------------------------------- TSV, Iso-CTS


def _pack(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Factors U_k (m×k), S_k (k), V_k (n×k) packed as one (m + 1 + n) × k tensor."""
    return torch.cat([u, s[None], v])


def _unpack(stacked: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Workers' packed factors (R, m + 1 + n, k), concatenated column-wise: (U m×Rk, S Rk, V n×Rk)."""
    joined = torch.cat(stacked.unbind(0), dim=1)
    return joined[:rows], joined[rows], joined[rows + 1:]


def _assemble(u_polar: torch.Tensor, s: torch.Tensor, v_polar: torch.Tensor) -> torch.Tensor:
    """U⊥ diag(s) V⊥ᵀ from the stacked singular vectors' polar factors; `s` is one value per
    column, or one for all."""
    with full_float32_matmuls():
        return (u_polar * s) @ v_polar.mT


def tsv_components(rank: int, workers: int) -> int:
    """TSV's directions per worker: k = max(1, ⌊r/R⌋), at least one also when R > r."""
    return max(1, rank // workers)


def tsv_phases(shape: torch.Size, workers: int, knobs: Knobs) -> list[Phase]:
    """TSV: each worker's top k = `tsv_components(r, R)` singular triplets, stacked and decorrelated.

    The stacked U (m×Rk) and V (n×Rk) are replaced by their polar factors, the singular
    values kept; the result is their sum, not a mean (the paper's outer lr is tuned for it).
    """
    rows, cols = shape
    k = tsv_components(min(rows, cols), workers)

    def factors(buffer, delta, slot, state):
        buffer.copy_(_pack(*top_factors(delta, k, knobs.factors, paths=knobs.factor_paths)))

    def join(stacked, state):
        u, s, v = _unpack(stacked, rows)
        # U⊥ diag(s) V⊥ᵀ, multiplied from the right so a tall U's polar factor is never formed.
        return knobs.factors.polar_times(u, s.unsqueeze(-1) * knobs.factors.polar(v).mT)

    return [Phase("gather", (rows + 1 + cols, k), factors, join)]


def iso_cts_split(rank: int, workers: int, common_fraction: float) -> tuple[int, int]:
    """Iso-CTS's split of the rank r into (common, per_worker) directions, as the paper's code:
    k = ⌊f·r⌋, s = round((r − k)/R) with round-half-to-even, common = r − R·s.

    Where R·s would exceed r (a small f with R > r/2: the paper's code would slice with a
    negative index there), s is lowered to ⌊r/R⌋ so the common block is never negative.
    """
    per_worker = min(round((rank - int(common_fraction * rank)) / workers), rank // workers)
    return rank - workers * per_worker, per_worker


def iso_cts_phases(shape: torch.Size, workers: int, knobs: Knobs) -> list[Phase]:
    """Iso-CTS: Iso-C's common subspace plus each worker's own top directions outside it.

    With (common, s) = `iso_cts_split(r, R, f)`: the common block is the top `common` SVD
    factors of the mean M; each worker adds the top-s SVD factors of its residual
    Δ_r/R − U_c U_cᵀ Δ_r/R (the paper's code scales every delta by 1/R before anything else,
    so a worker's singular values are on the scale of its share of the mean). Common and
    per-worker blocks are stacked, U and V replaced by their polar factors, and every
    singular value set to the mean of all r collected ones.
    """
    rows, cols = shape
    rank = min(rows, cols)
    common, per_worker = iso_cts_split(rank, workers, knobs.common_fraction)

    def common_block(total, state):
        u, s, vh = knobs.factors.full_svd(total.div_(workers))
        return u[:, :common], s[:common], vh[:common].mT

    def common_only(total, state):
        u, s, v = common_block(total, state)
        return _assemble(knobs.factors.polar(u), s.mean(), knobs.factors.polar(v))

    # The common block is the top of the sum's spectrum, and the polar factor of it stacked
    # beside the workers' blocks weighs every direction alike: where two directions nearly
    # coincide, one rounding of the sum moves the merge by 1e-4, so the sum keeps one order.
    phases = [Phase("sum", tuple(shape), lambda buffer, delta, slot, state: _put(buffer, delta, slot),
                    common_block if per_worker else common_only, in_order=True)]
    if per_worker:
        def residual_factors(buffer, delta, slot, block):
            # The residual Δ_r/R − U_c U_cᵀ Δ_r/R; it is judged null against its delta
            # (‖Δ_r/R‖_F bounds its largest σ).
            buffer.copy_(_pack(*top_factors(delta, per_worker, knobs.factors, delta.norm() / workers,
                                            left_out=block[0], divisor=workers, paths=knobs.factor_paths)))

        def join(stacked, block):
            u_w, s_w, v_w = _unpack(stacked, rows)
            u_c, s_c, v_c = block
            # The workers' blocks are stacked after the common one, whose singular vectors are
            # orthonormal: the polar factors need only a problem as wide as the workers' blocks.
            return _assemble(knobs.factors.polar_beside(u_c, u_w), torch.cat([s_c, s_w]).mean(),
                             knobs.factors.polar_beside(v_c, v_w))

        phases.append(Phase("gather", (rows + 1 + cols, per_worker), residual_factors, join))
    return phases


# ---------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Rule:
    """A merge rule: its phases for one parameter, whether it acts on matrices only
    (`spectral`: every other tensor, and every excluded matrix, takes the mean), and an
    optional pure `finalize` of its result, kept apart so a distributed engine can share
    the (costly) finalize steps out among processes and batch same-shape matrices."""

    phases: Callable[[torch.Size, int, Knobs], list[Phase]]
    spectral: bool = False
    finalize: Callable[[torch.Tensor, Knobs], torch.Tensor] | None = None
    factored: bool = False  # each worker sends its top singular triplets (`factors.top_factors`)


RULES: dict[str, Rule] = {
    "mean": Rule(mean_phases),
    "ties": Rule(ties_phases),
    "dare": Rule(dare_phases),
    "tsv": Rule(tsv_phases, spectral=True, factored=True),
    # Iso-C: the mean (one all-reduce), then the pure correction of it.
    "iso_c": Rule(mean_phases, spectral=True, finalize=lambda merged, knobs: iso_correct(merged, knobs.iso)),
    "iso_cts": Rule(iso_cts_phases, spectral=True, factored=True),
}
