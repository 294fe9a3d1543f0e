"""Merge rules: how the R workers' pseudo-gradients of one parameter become one tensor.

Each rule is written once, against a `Communicator`, and receives only the K deltas of the
workers held by this process. Every rule moves the least data that keeps it
exact — no rule all-gathers full deltas:

* mean, Iso-C, DARE (drop locally first): one all-reduce;
* TIES: an all-reduce of the trimmed sum to elect signs, then one of the masked sum and count;
* TSV: an all-gather of each worker's top-k factors (U_k, S_k, V_k);
* Iso-CTS: an all-reduce of the mean for the common subspace, then an all-gather of each
  worker's residual factors.

`RULES` registers each rule once; `MergeConfig.applies` decides, in one place, which tensors
a rule leaves to the mean (non-matrices and excluded names, for the spectral rules).
`Merger` is what a training loop uses: it applies the configured rule to every parameter and
seeds DARE's masks by (seed, worker, round, parameter). The peft-style functions (`mean`,
`ties`, `dare`, `tsv`, `iso_c`, `iso_cts`) take a list of R tensors and go through the same
registry in this process. Rules never write into the deltas.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from typing import Callable, Mapping, Sequence

import torch

from isoloco.comm import Communicator, LocalCommunicator
from isoloco.configbase import check_at_least, check_choices, check_range, option
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.ortho import NS_DTYPES, POLAR_METHODS, SCALE_METHODS, IsoSettings, iso_correct, polar_svd, thin_svd


# ---------------------------------------------------------------------------- the rules


def mean_rule(deltas: list[torch.Tensor], comm: Communicator) -> torch.Tensor:
    """Task arithmetic: (1/R) Σ_r Δ_r."""
    return comm.mean(deltas)


def _trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the max(1, ⌊density·numel⌋) entries of largest magnitude, zero the rest.

    The count is the paper's code's (peft's `magnitude_based_pruning` keeps ⌊density·numel⌋,
    which is the same but for tensors too small to keep one entry). Entries tied with the
    smallest kept magnitude are all kept: a threshold is deterministic on every device,
    unlike the index order `topk` picks among ties.
    """
    keep = max(1, int(density * delta.numel()))
    magnitude = delta.abs().flatten()
    threshold = torch.kthvalue(magnitude, magnitude.numel() - keep + 1).values
    return torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta))


def ties_rule(deltas: list[torch.Tensor], comm: Communicator, *, density: float) -> torch.Tensor:
    """TIES: trim each delta, elect a sign per entry, average the agreeing entries.

    γ = sign(Σ_r trimmed_r) (0 counts as +, as in peft's "total" method); the result is
    Σ_r trimmed_r·[sign(trimmed_r) = γ] / max(#agreeing nonzero entries, 1).
    """
    trimmed = [_trim(delta, density) for delta in deltas]
    elected = torch.where(comm.sum(trimmed) >= 0, 1.0, -1.0).to(deltas[0].dtype)
    agreeing = [(torch.sign(t) == elected).to(t.dtype) for t in trimmed]
    # Masked sum and count travel as one stacked all-reduce.
    totals = comm.sum([torch.stack([t * a, a]) for t, a in zip(trimmed, agreeing)])
    return totals[0] / totals[1].clamp_min(1)


def dare_rule(
    deltas: list[torch.Tensor],
    comm: Communicator,
    *,
    drop_rate: float,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """DARE: drop each entry with probability p, rescale survivors by 1/(1−p), then mean.

    `generators[k]` draws local worker k's mask on the generator's device (None: torch's global
    generator, on the delta's device). The mask is drawn as peft's `random_pruning` draws it for
    float32 deltas, `bernoulli(full_like(Δ, 1 − p))`, so equal generator states give equal masks.
    """
    keep = 1.0 - drop_rate
    dropped = []
    for delta, generator in zip(deltas, generators):
        device = generator.device if generator is not None else delta.device
        # Drawn in float32 whatever the deltas' dtype: the draw depends on the dtype.
        mask = torch.bernoulli(torch.full(delta.shape, keep, device=device), generator=generator)
        dropped.append(delta * mask.to(delta.device, delta.dtype) / keep)
    return comm.mean(dropped)


def _top_factors(matrix: torch.Tensor, k: int, largest: torch.Tensor | None = None) -> torch.Tensor:
    """The top-k SVD factors of a matrix packed as one (m + 1 + n) × k tensor [U_k; S_k; V_k],
    so a worker's factors travel in one all-gather (`largest`: see `thin_svd`)."""
    u, s, vh = thin_svd(matrix, largest)
    return torch.cat([u[:, :k], s[None, :k], vh[:k].mT])


def _gather_factors(packed: list[torch.Tensor], comm: Communicator, rows: int) -> tuple[torch.Tensor, ...]:
    """All workers' packed factors, concatenated column-wise: (U m×Rk, S Rk, V n×Rk)."""
    stacked = torch.cat(comm.gather(packed), dim=1)
    return stacked[:rows], stacked[rows], stacked[rows + 1 :]


def _assemble(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """U⊥ diag(s) V⊥ᵀ with U⊥, V⊥ the polar factors of the stacked singular vectors."""
    return (polar_svd(u).factor * s) @ polar_svd(v).factor.mT


def tsv_components(rank: int, workers: int) -> int:
    """TSV's directions per worker: k = max(1, ⌊r/R⌋), at least one also when R > r."""
    return max(1, rank // workers)


def tsv_rule(deltas: list[torch.Tensor], comm: Communicator) -> torch.Tensor:
    """TSV: each worker's top k = `tsv_components(r, R)` singular triplets, stacked and decorrelated.

    The stacked U (m×Rk) and V (n×Rk) are replaced by their polar factors, the singular
    values kept; the result is their sum, not a mean (the paper's outer lr is tuned for it).
    """
    rows, cols = deltas[0].shape
    k = tsv_components(min(rows, cols), comm.num_workers)
    u, s, v = _gather_factors([_top_factors(delta, k) for delta in deltas], comm, rows)
    return _assemble(u, s, v)


def iso_cts_split(rank: int, workers: int, common_fraction: float) -> tuple[int, int]:
    """Iso-CTS's split of the rank r into (common, per_worker) directions, as the paper's code:
    k = ⌊f·r⌋, s = round((r − k)/R) with round-half-to-even, common = r − R·s.

    Where R·s would exceed r (a small f with R > r/2: the paper's code would slice with a
    negative index there), s is lowered to ⌊r/R⌋ so the common block is never negative.
    """
    per_worker = min(round((rank - int(common_fraction * rank)) / workers), rank // workers)
    return rank - workers * per_worker, per_worker


def iso_cts_rule(deltas: list[torch.Tensor], comm: Communicator, *, common_fraction: float) -> torch.Tensor:
    """Iso-CTS: Iso-C's common subspace plus each worker's own top directions outside it.

    With (common, s) = `iso_cts_split(r, R, f)`: the common block is the top `common` SVD
    factors of the mean M; each worker adds the top-s SVD factors of its residual
    Δ_r/R − U_c U_cᵀ Δ_r/R (the paper's code scales every delta by 1/R before anything else,
    so a worker's singular values are on the scale of its share of the mean). Common and
    per-worker blocks are stacked, U and V replaced by their polar factors, and every
    singular value set to the mean of all r collected ones.
    """
    mean = mean_rule(deltas, comm)
    rows, cols = mean.shape
    rank = min(rows, cols)
    common, per_worker = iso_cts_split(rank, comm.num_workers, common_fraction)
    u, s, vh = thin_svd(mean)
    u_c, s_c, v_c = u[:, :common], s[:common], vh[:common].mT
    if per_worker > 0:
        workers = comm.num_workers
        # A residual is judged null against its delta (‖Δ_r/R‖_F bounds its largest σ).
        packed = [_top_factors((delta - u_c @ (u_c.mT @ delta)) / workers, per_worker, delta.norm() / workers)
                  for delta in deltas]
        u_w, s_w, v_w = _gather_factors(packed, comm, rows)
        # Stack the workers' blocks after the common one.
        u_c, s_c, v_c = torch.cat([u_c, u_w], 1), torch.cat([s_c, s_w]), torch.cat([v_c, v_w], 1)
    return _assemble(u_c, s_c.mean().expand(rank), v_c)



# ---------------------------------------------------------------------------- the registry


@dataclasses.dataclass
class RuleContext:
    """What a rule may need beyond the deltas and the communicator."""

    config: MergeConfig
    generators: Sequence[torch.Generator | None]  # DARE: one per local worker (None: torch's global one)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A merge rule, split at its last collective.

    `aggregate` does everything that needs the communicator; `finalize` is an optional pure
    function of its result, kept apart so a distributed engine can aggregate every parameter
    first and then share the (costly) finalize steps out among processes. A `spectral` rule
    acts on matrices only: `applies` sends every other tensor, and every matrix the config
    excludes, to the mean.
    """

    aggregate: Callable[[list[torch.Tensor], Communicator, RuleContext], torch.Tensor]
    spectral: bool = False
    finalize: Callable[[torch.Tensor, MergeConfig], torch.Tensor] | None = None


RULES: dict[str, Rule] = {
    "mean": Rule(lambda d, comm, ctx: mean_rule(d, comm)),
    "ties": Rule(lambda d, comm, ctx: ties_rule(d, comm, density=ctx.config.density)),
    "dare": Rule(lambda d, comm, ctx: dare_rule(d, comm, drop_rate=ctx.config.drop_rate, generators=ctx.generators)),
    "tsv": Rule(lambda d, comm, ctx: tsv_rule(d, comm), spectral=True),
    # Iso-C: the mean (one all-reduce), then the pure correction of it.
    "iso_c": Rule(lambda d, comm, ctx: mean_rule(d, comm), spectral=True,
                  finalize=lambda aggregate, config: iso_correct(aggregate, config.iso)),
    "iso_cts": Rule(lambda d, comm, ctx: iso_cts_rule(d, comm, common_fraction=ctx.config.common_fraction),
                    spectral=True),
}


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
        if not isinstance(self.exclude, (list, tuple)) or not all(isinstance(p, str) for p in self.exclude):
            raise ConfigError(
                f"merge.exclude={self.exclude!r} is not allowed: it must be a list of name patterns, "
                f"e.g. ['*embed_tokens*', 'lm_head.weight']"
            )

    @property
    def iso(self) -> IsoSettings:
        """The Iso-C settings these keys describe."""
        return IsoSettings(self.ortho, self.scale, self.ns_steps, self.ns_dtype)

    def excludes(self, name: str) -> bool:
        """Whether parameter `name` matches one of the `exclude` patterns."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)

    def applies(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the rule itself merges parameter `name` (else the mean does): a spectral
        rule takes only the matrices it is not told to exclude."""
        return not RULES[self.rule].spectral or (tensor.ndim == 2 and not self.excludes(name))


# ------------------------------------------------------------------------------- merging


def check_finite(name: str, deltas: list[torch.Tensor], worker_ids: list[int], round: int | None = None) -> None:
    """Raise `NonFiniteDeltaError` naming the parameter, worker and round of a NaN/inf delta."""
    for worker, delta in zip(worker_ids, deltas):
        if not torch.isfinite(delta).all():
            when = f" in round {round}" if round is not None else ""
            raise NonFiniteDeltaError(
                f"the pseudo-gradient of {name!r} from worker {worker}{when} contains NaN or inf: "
                f"that worker's inner training diverged; lower the inner learning rate or "
                f"enable gradient clipping"
            )


def aggregate(config: MergeConfig, name: str, deltas: list[torch.Tensor], comm: Communicator,
              generators: Sequence[torch.Generator | None] = ()) -> torch.Tensor:
    """The collective part of merging parameter `name`: its rule's, or the mean where the rule
    does not apply (every process must call it, in the same order)."""
    if not config.applies(name, deltas[0]):
        return mean_rule(deltas, comm)
    return RULES[config.rule].aggregate(deltas, comm, RuleContext(config, generators))


def finalize(config: MergeConfig, name: str, aggregated: torch.Tensor) -> torch.Tensor:
    """The pure, per-tensor rest of the merge of `name` (any one process may run it)."""
    return aggregated if not needs_finalize(config, name, aggregated) else RULES[config.rule].finalize(aggregated, config)


def needs_finalize(config: MergeConfig, name: str, aggregated: torch.Tensor) -> bool:
    return RULES[config.rule].finalize is not None and config.applies(name, aggregated)


def mask_generator(seed: int, worker: int, round: int, name: str) -> torch.Generator:
    """The CPU generator of global worker `worker`'s DARE mask for parameter `name` in round
    `round`: seeded afresh from all four every time, so there is no state to checkpoint, and a
    CPU generator draws the same mask whatever device, process layout or resume the run has.
    The hash keeps the streams apart (seed + worker would give run 0's worker 1 run 1's
    worker 0 masks)."""
    digest = hashlib.blake2b(f"isoloco.merge.dare:{seed}:{worker}:{round}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class Merger:
    """Applies the configured rule to each parameter, for the workers this process holds.

    It holds no state between rounds: DARE's masks come from `mask_generator`, seeded by
    (seed, global worker id, round, parameter name).
    """

    def __init__(self, cfg: MergeConfig, comm: Communicator, seed: int) -> None:
        cfg.validate()
        self.cfg = cfg
        self.comm = comm
        self.seed = seed

    def merge(self, name: str, local_deltas: list[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """Merge parameter `name`'s local deltas (one per local worker, in order) across all
        R workers; the deltas are read, never written. Same as `finalize(aggregate(...))`.
        `round` names the synchronisation in errors and seeds DARE's masks (None counts as 0)."""
        return self.finalize(name, self.aggregate(name, local_deltas, round))

    def aggregate(self, name: str, local_deltas: list[torch.Tensor], round: int | None = None) -> torch.Tensor:
        """The collective part of the merge of parameter `name` (every process must call it)."""
        worker_ids = self.comm.local_worker_ids
        if len(local_deltas) != len(worker_ids):
            raise ValueError(
                f"{name!r}: got {len(local_deltas)} deltas but this process holds {len(worker_ids)} "
                f"workers; pass one delta per local worker, in order"
            )
        check_finite(name, local_deltas, worker_ids, round)
        generators = ([mask_generator(self.seed, worker, round or 0, name) for worker in worker_ids]
                      if self.cfg.rule == "dare" else ())
        return aggregate(self.cfg, name, local_deltas, self.comm, generators)

    def finalize(self, name: str, aggregated: torch.Tensor) -> torch.Tensor:
        """The pure, per-tensor rest of the merge of `name` (any one process may run it)."""
        return finalize(self.cfg, name, aggregated)

    def merge_all(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int | None = None,
                  fetch: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Merge every parameter: all collectives first, in the mapping's order (the same on
        every process), then the finalize steps, which the communicator's `shard_map`
        spreads over the processes. Same results as `merge` on each parameter.

        `fetch` brings a stored delta to where the merge computes (offloaded workers keep
        theirs in host memory); it is applied one parameter at a time and the fetched copies
        are dropped before the next, so the merge holds one parameter's deltas at once, not
        every worker's whole model."""
        merged = {}
        for name, deltas in local_deltas.items():
            merged[name] = self.aggregate(name, [fetch(d) for d in deltas] if fetch else list(deltas), round)
        pending = [name for name, aggregated in merged.items() if needs_finalize(self.cfg, name, aggregated)]
        rule = RULES[self.cfg.rule]
        finalized = self.comm.shard_map(lambda aggregated: rule.finalize(aggregated, self.cfg),
                                        [merged[name] for name in pending])
        merged.update(zip(pending, finalized))
        return merged


# --------------------------------------------------- peft-style functions, one per rule


def _merge_in_process(deltas: list[torch.Tensor], config: MergeConfig,
                      generators: Sequence[torch.Generator | None] = ()) -> torch.Tensor:
    """One tensor's R deltas merged by `config` in this process, through the registry."""
    if not deltas:
        raise ValueError("a merge needs at least one delta")
    config.validate()
    check_finite("tensor", deltas, list(range(len(deltas))))
    return finalize(config, "tensor", aggregate(config, "tensor", deltas, LocalCommunicator(len(deltas)), generators))


def mean(deltas: list[torch.Tensor]) -> torch.Tensor:
    """Task arithmetic: the mean of the deltas."""
    return _merge_in_process(deltas, MergeConfig(rule="mean"))


def ties(deltas: list[torch.Tensor], density: float = MergeConfig.density) -> torch.Tensor:
    """TIES merge (trim to `density`, elect sign, disjoint mean); see `ties_rule`."""
    return _merge_in_process(deltas, MergeConfig(rule="ties", density=density))


def dare(
    deltas: list[torch.Tensor],
    drop_rate: float = MergeConfig.drop_rate,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """DARE merge; `generator` is one generator drawn from for every delta in order, one
    generator per delta, or None for torch's global generator."""
    generators = generator if isinstance(generator, list) else [generator] * len(deltas)
    if len(generators) != len(deltas):
        raise ValueError(f"got {len(generators)} generators for {len(deltas)} deltas: pass one per delta")
    return _merge_in_process(deltas, MergeConfig(rule="dare", drop_rate=drop_rate), generators)


def tsv(deltas: list[torch.Tensor]) -> torch.Tensor:
    """Task Singular Vectors merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="tsv"))


def iso_c(deltas: list[torch.Tensor], settings: IsoSettings = IsoSettings()) -> torch.Tensor:
    """Iso-C merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="iso_c", **dataclasses.asdict(settings)))


def iso_cts(deltas: list[torch.Tensor], common_fraction: float = MergeConfig.common_fraction) -> torch.Tensor:
    """Iso-CTS merge (2-D tensors; others take the mean)."""
    return _merge_in_process(deltas, MergeConfig(rule="iso_cts", common_fraction=common_fraction))
