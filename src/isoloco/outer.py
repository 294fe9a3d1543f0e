"""The outer step of DiLoCo: merge the workers' pseudo-gradients, then one outer optimizer step.

* `OuterConfig`: SGD (no momentum; lr 1 is FedAvg / task arithmetic) or Nesterov momentum with
  torch's `SGD(nesterov=True)` semantics: b ← μb + g; u ← g + μb; θ ← θ − ηu.
* `IsoLoCo`: a standalone `torch.optim.Optimizer` — Nesterov with an Iso-C correction of the
  2-D parameters, either of the pseudo-gradient before momentum (``gradient``, the paper's
  IsoLoCo) or of the momentum update (``update``, Muon-like). Any DiLoCo implementation can
  use it as its outer optimizer by putting the averaged pseudo-gradient in ``p.grad``.
* `OuterStep`: what the trainer calls once per round: merge every parameter's local deltas
  through the communicator, write the result to ``p.grad``, step, clear the grads.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable, Mapping, Sequence

import torch

from isoloco.comm import Communicator
from isoloco.configbase import check_choices, check_positive, check_range, option
from isoloco.errors import ConfigError
from isoloco.merge import Merger, refuse_non_finite
from isoloco.merge_config import MergeConfig, Participation
from isoloco.ortho import IsoSettings, iso_correct
from isoloco.spectra import SpectraProbe
from isoloco.sync.handles import Steps, Sync, run_to_end
from isoloco.sync.sparseloco import MAX_TILE, Tiling, sparseloco_mean

PLACEMENTS = ("gradient", "update")
#: `outer.transport`: how the workers' pseudo-gradients reach the outer step.
TRANSPORTS = ("merge", "sparseloco")
#: The rules that can follow SparseLoCo's mean: those applied to the mean itself.
SPARSELOCO_RULES = ("mean", "iso_c")


@dataclasses.dataclass
class OuterConfig:
    """The outer optimizer that applies the merged pseudo-gradient to the global model."""

    optimizer: str = option("nesterov", "outer optimizer: sgd (no momentum) or nesterov", choices=("sgd", "nesterov"))
    lr: float = option(0.7, "outer learning rate η")
    momentum: float = option(0.9, "Nesterov momentum μ (ignored by sgd)")
    iso_placement: str = option(
        "gradient",
        "with merge.rule=iso_c: Iso-C-correct the merged pseudo-gradient before momentum (gradient, "
        "the paper's IsoLoCo) or the momentum update after it (update)",
        choices=PLACEMENTS,
    )
    overlap_steps: int = option(
        0,
        "τ: inner steps of the next round each worker trains from its own weights while a "
        "synchronisation is in flight (0: none, the synchronisation blocks)",
    )
    overlap_alpha: float = option(
        0.0,
        "with overlap_steps > 0: the share α of a worker's own weights kept when the merged "
        "update lands, θ_r ← (1 − α)·θ + α·θ_r (0 discards the τ steps' progress, as torchft)",
    )
    transport: str = option(
        "merge",
        "how the workers' pseudo-gradients reach the outer step: merge (merge.rule, with merge.quantize and "
        "merge.compress) or sparseloco (each worker's error-feedback accumulator, the top-k of its tiles with "
        "2-bit values, all-gathered, clipped to the median worker and averaged; merge.rule mean or iso_c then "
        "applies to that mean; docs/fidelity.md)", choices=TRANSPORTS)
    sparse_decay: float = option(0.95, "transport=sparseloco: β of each worker's accumulator, e ← β·e + Δ before "
                                       "it is sent; in [0, 1]")
    sparse_tile: int = option(64, f"transport=sparseloco: a matrix travels in tiles whose sides are the largest "
                                  f"divisors of its sides at most this, a vector in runs as long; at most "
                                  f"{MAX_TILE} (indices travel as 12 bits)")
    sparse_topk: int = option(64, "transport=sparseloco: entries sent per tile, an even number in [2, "
                                  "sparse_tile²] (a tile with fewer entries, e.g. a vector's, is sent whole)")

    def validate(self) -> None:
        check_choices("outer", self)
        check_positive("outer.lr", self.lr)
        check_range("outer.momentum", self.momentum, 0, 1, low_open=False, high_open=True)
        check_range("outer.overlap_alpha", self.overlap_alpha, 0, 1, low_open=False, high_open=False)
        if self.overlap_steps < 0:
            raise ConfigError(f"outer.overlap_steps={self.overlap_steps} is not allowed: it must be >= 0 "
                              "(0 turns the overlap off)")
        check_range("outer.sparse_decay", self.sparse_decay, 0, 1, low_open=False, high_open=False)
        check_range("outer.sparse_tile", self.sparse_tile, 1, MAX_TILE, low_open=False, high_open=False)
        check_positive("outer.sparse_topk", self.sparse_topk)
        if self.transport == "sparseloco":
            self._check_sparse_topk()
        if self.optimizer == "nesterov" and self.momentum == 0:
            raise ConfigError(
                "outer.momentum=0 is not allowed with outer.optimizer=nesterov: Nesterov needs "
                "momentum > 0; use outer.optimizer=sgd for plain SGD"
            )

    def _check_sparse_topk(self) -> None:
        """Refuse a k that SparseLoCo would change: it sends an even number of entries per tile,
        at least 2 and at most a whole tile of sparse_tile × sparse_tile."""
        k, most = self.sparse_topk, self.sparse_tile ** 2
        if most < 2:
            raise ConfigError(f"outer.sparse_tile={self.sparse_tile} is not allowed with outer.transport=sparseloco: "
                              "a tile of one entry leaves no top-k to choose; use outer.sparse_tile >= 2 (e.g. 64)")
        if 2 <= k <= most and k % 2 == 0:
            return
        runs = min(most, max(2, k - k % 2))
        raise ConfigError(f"outer.sparse_topk={k} is not allowed with outer.sparse_tile={self.sparse_tile}: SparseLoCo "
                          f"sends an even number of entries per tile, from 2 to the {most} of a "
                          f"{self.sparse_tile}×{self.sparse_tile} tile, so it would run as k={runs}; use an even "
                          f"outer.sparse_topk in [2, {most}] (e.g. outer.sparse_topk={min(64, most - most % 2)})")

    @property
    def effective_momentum(self) -> float:
        return self.momentum if self.optimizer == "nesterov" else 0.0

    @property
    def tiling(self) -> Tiling | None:
        """Which entries transport=sparseloco sends; None with transport=merge."""
        return Tiling(self.sparse_tile, self.sparse_topk) if self.transport == "sparseloco" else None


def validate_combination(merge: MergeConfig, outer: OuterConfig) -> None:
    """Checks that involve both configs (each is validated on its own by its `validate`)."""
    if outer.iso_placement == "update" and merge.rule != "iso_c":
        raise ConfigError(
            f"outer.iso_placement=update is not allowed with merge.rule={merge.rule}: it moves the "
            f"Iso-C correction after the momentum, so it needs merge.rule=iso_c; set "
            f"merge.rule=iso_c, or outer.iso_placement=gradient to keep {merge.rule}"
        )
    if outer.transport != "sparseloco":
        return
    if merge.lossy_setting is not None:
        raise ConfigError(f"{merge.lossy_setting} is not allowed with outer.transport=sparseloco: SparseLoCo sends "
                          f"its own 2-bit top-k entries; set {merge.lossy_setting.split('=')[0]}=none")
    if merge.rule not in SPARSELOCO_RULES:
        raise ConfigError(f"merge.rule={merge.rule} is not allowed with outer.transport=sparseloco: SparseLoCo "
                          "averages the workers' decoded entries itself, and only a rule applied to that mean can "
                          "follow; set merge.rule=mean or iso_c")
    if merge.weighting != "equal":
        raise ConfigError(f"merge.weighting={merge.weighting} is not allowed with outer.transport=sparseloco: an "
                          "entry is the plain mean over the workers that sent it; set merge.weighting=equal")


def _nesterov(grad: torch.Tensor, state: dict, momentum: float) -> torch.Tensor:
    """The update u of torch's SGD(nesterov=True, dampening=0), op for op so bits match."""
    if momentum == 0:
        return grad
    buffer = state.get("momentum_buffer")
    if buffer is None:
        buffer = state["momentum_buffer"] = torch.clone(grad).detach()
    else:
        buffer.mul_(momentum).add_(grad)
    return grad.add(buffer, alpha=momentum)


class IsoLoCo(torch.optim.Optimizer):
    """Nesterov momentum whose 2-D parameters receive an Iso-C-corrected step.

    Put the (averaged) pseudo-gradient in ``p.grad``, then call `step`. For parameters of a
    group with ``iso=True`` and two dimensions:

    * ``placement="gradient"``: g ← iso(g); b ← μb + g; θ ← θ − η(g + μb)  (the paper's IsoLoCo)
    * ``placement="update"``:   b ← μb + g; θ ← θ − η·iso(g + μb)

    Every other parameter (1-D, or in a group with ``iso=False``: e.g. embeddings the caller
    excludes) takes the plain Nesterov step. The momentum buffer lives in
    ``state[p]["momentum_buffer"]`` as in `torch.optim.SGD`. The defaults are the paper's
    IsoLoCo settings at 178M (lr 1.8, momentum 0.8); `settings` says how iso(·) is computed.

    `shard_map` (e.g. a communicator's) applies the correction to a group's matrices as one
    batch, so a multi-process job can share the orthogonalisations out among processes.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1.8,
        momentum: float = 0.8,
        placement: str = "gradient",
        settings: IsoSettings = IsoSettings(),
        iso: bool = True,
        shard_map: Callable[[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]
        | None = None,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr} is not allowed: it must be > 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum} is not allowed: it must be in [0, 1)")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not allowed: choose one of {', '.join(PLACEMENTS)}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            placement=placement,
            iso=iso,
            # Plain values, as torch optimizers keep hyper-parameters (state_dict, torch.load).
            **dataclasses.asdict(settings),
        )
        super().__init__(params, defaults)
        self._shard_map = shard_map or (lambda fn, tensors: [fn(tensor) for tensor in tensors])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            settings = IsoSettings(**{f.name: group[f.name] for f in dataclasses.fields(IsoSettings)})

            def iso(matrix: torch.Tensor) -> torch.Tensor:
                return iso_correct(matrix, settings)

            def iso_where(corrected: list[bool], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
                """`tensors` with iso applied to the corrected ones, as one batch."""
                chosen = [i for i, c in enumerate(corrected) if c]
                tensors = list(tensors)
                for i, result in zip(chosen, self._shard_map(iso, [tensors[i] for i in chosen])):
                    tensors[i] = result
                return tensors

            params = [param for param in group["params"] if param.grad is not None]
            corrected = [group["iso"] and param.ndim == 2 for param in params]
            grads = [param.grad for param in params]
            if group["placement"] == "gradient":
                grads = iso_where(corrected, grads)
            updates = [_nesterov(grad, self.state[param], group["momentum"]) for grad, param in zip(grads, params)]
            if group["placement"] == "update":
                updates = iso_where(corrected, updates)
            for param, update in zip(params, updates):
                param.add_(update, alpha=-group["lr"])
        return loss


def build_outer_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], merge: MergeConfig, outer: OuterConfig,
    comm: Communicator | None = None,
) -> torch.optim.Optimizer:
    """torch's SGD for every rule, or `IsoLoCo` when the Iso-C correction follows momentum
    (its corrections shared out through `comm.shard_map` when a communicator is given)."""
    if outer.iso_placement == "update":
        corrected = [p for name, p in named_params if not merge.excludes(name)]
        excluded = [p for name, p in named_params if merge.excludes(name)]
        groups = [g for g in (dict(params=corrected), dict(params=excluded, iso=False)) if g["params"]]
        return IsoLoCo(
            groups,
            lr=outer.lr,
            momentum=outer.effective_momentum,
            placement="update",
            settings=merge.iso,
            shard_map=comm.shard_map if comm is not None else None,
        )
    return torch.optim.SGD(
        [p for _, p in named_params],
        lr=outer.lr,
        momentum=outer.effective_momentum,
        nesterov=outer.optimizer == "nesterov",
    )


class OuterStep:
    """Merge the workers' pseudo-gradients and apply them to the global parameters.

    With ``merge.rule=iso_c`` and ``outer.iso_placement=update`` the aggregation is the plain
    mean and `IsoLoCo` corrects after momentum; every other combination merges with the
    configured rule and steps with torch's SGD. With ``outer.transport=sparseloco`` the
    pseudo-gradients travel as SparseLoCo's (`isoloco.sync.sparseloco`) and the rule's last
    step (Iso-C's orthogonalisation) applies to their mean.
    """

    _BUFFER_KEY = "momentum_buffer."
    _FACTOR_KEY = "lowrank_factor."

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        merge: MergeConfig,
        outer: OuterConfig,
        comm: Communicator,
        seed: int,
    ) -> None:
        merge.validate()
        outer.validate()
        validate_combination(merge, outer)
        self.named_params = list(named_params)
        self._params = dict(self.named_params)
        if len(self._params) != len(self.named_params):
            raise ValueError("parameter names must be unique")
        self.comm = comm
        aggregation = dataclasses.replace(merge, rule="mean") if outer.iso_placement == "update" else merge
        self.merger = Merger(aggregation, comm, seed)
        self.tiling, self.decay = outer.tiling, outer.sparse_decay
        self.optimizer = build_outer_optimizer(self.named_params, merge, outer, comm)
        #: Measures every outer step's spectra once `measure_spectra` is called (`log.spectra`).
        self.spectra: SpectraProbe | None = None

    def measure_spectra(self) -> SpectraProbe:
        """From now on, measure each step's spectra (`isoloco.spectra`); the probe holds them."""
        self.spectra = SpectraProbe(self.comm)
        return self.spectra

    def step(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int,
             fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
             participation: Participation | None = None,
             residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> None:
        """One outer step, run at once (see `start`)."""
        run_to_end(self.start(local_deltas, round, fetch, participation, residuals).steps)

    def start(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int,
              fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
              participation: Participation | None = None,
              residuals: Mapping[str, Sequence[torch.Tensor]] | None = None) -> Sync[None]:
        """One outer step as steps (`isoloco.sync.handles`): the merge's stages, then the
        optimizer step on θ. `local_deltas[name]` holds θ − θ_r for each local worker r, in the
        communicator's order; the deltas are only read, so the caller may reuse their storage
        once the steps have ended. `fetch` brings stored deltas to the compute device, one
        parameter at a time (see `Merger.start`). `participation`: the workers this step merges
        and their weights, when not every worker alike (a round that left out a late or diverged
        worker, or weighs workers by their tokens); the merge normalises by those that arrived.
        `residuals`: the workers' error-feedback residuals, like the deltas (see `Merger.start`);
        with outer.transport=sparseloco, their accumulators."""
        if set(local_deltas) != set(self._params):
            missing = sorted(set(self._params) - set(local_deltas))
            unexpected = sorted(set(local_deltas) - set(self._params))
            raise ValueError(
                f"local_deltas must hold one entry per parameter; missing {missing}, unexpected {unexpected}"
            )
        ordered = {name: local_deltas[name] for name, _ in self.named_params}
        if self.tiling is None:
            merge = self.merger.start(ordered, round, fetch, residuals, participation=participation)
        else:
            merge = self._sparseloco(ordered, round, fetch, participation, residuals)
        if participation is not None:  # the spectra measure the merged workers' deltas
            arrived = [i for i, w in enumerate(self.comm.local_worker_ids) if w in participation.arrived]
            local_deltas = {name: [deltas[i] for i in arrived] for name, deltas in local_deltas.items()}
        return Sync(self._apply(merge.steps, local_deltas, fetch), merge.stages, merge.traffic)

    def _sparseloco(self, local_deltas: Mapping[str, Sequence[torch.Tensor]], round: int,
                    fetch: Callable[[torch.Tensor], torch.Tensor] | None, participation: Participation | None,
                    accumulators: Mapping[str, Sequence[torch.Tensor]] | None) -> Sync[dict[str, torch.Tensor]]:
        """SparseLoCo's merge (one stage), then the rule's finalize of each mean."""
        if accumulators is None:
            raise ValueError("outer.transport=sparseloco needs the workers' accumulators: pass residuals=")
        if participation is not None and len(set(participation.weights or (1.0,))) > 1:
            raise ValueError("outer.transport=sparseloco averages its workers alike: pass no unequal weights")
        arrived = None if participation is None else participation.arrived
        local = [index for index, worker in enumerate(self.comm.local_worker_ids)
                 if arrived is None or worker in arrived]
        refuse_non_finite({name: [deltas[index] for index in local] for name, deltas in local_deltas.items()},
                          [self.comm.local_worker_ids[index] for index in local], round)
        means = sparseloco_mean(self.comm, local_deltas, accumulators, self.tiling, self.decay, arrived, fetch)
        return Sync(self._finalized(means), 1)

    def _finalized(self, means: Steps[dict[str, torch.Tensor]]) -> Steps[dict[str, torch.Tensor]]:
        merged = yield from means
        return {name: self.merger.finalize(name, mean) for name, mean in merged.items()}

    def _apply(self, merge: Steps[dict[str, torch.Tensor]], local_deltas: Mapping[str, Sequence[torch.Tensor]],
               fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> Steps[None]:
        merged_all = yield from merge
        for name, param in self.named_params:
            merged = merged_all[name]
            if merged.shape != param.shape:
                raise ValueError(f"{name!r}: merged delta has shape {tuple(merged.shape)}, parameter {tuple(param.shape)}")
            param.grad = merged.to(device=param.device, dtype=param.dtype)
        with self._observed(local_deltas, fetch):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _observed(self, local_deltas: Mapping[str, Sequence[torch.Tensor]],
                  fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> AbstractContextManager:
        """The spectra measurement of the matrices around the optimizer step; nothing when off."""
        if self.spectra is None:
            return nullcontext()
        matrices = [(name, param) for name, param in self.named_params if param.ndim == 2]
        return self.spectra.observe(matrices, local_deltas, fetch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A flat snapshot (copies) of what every process holds alike between outer steps: the
        momentum buffers, ``momentum_buffer.<param>``, and merge.compress=lowrank's warm-start
        factors, ``lowrank_factor.<param>``. Parameters without a buffer (before the first step,
        or with no momentum) or a factor (before the first merge) are absent."""
        state = {}
        for name, param in self.named_params:
            buffer = self.optimizer.state.get(param, {}).get("momentum_buffer")
            if buffer is not None:
                state[self._BUFFER_KEY + name] = buffer.detach().clone()
        link = self.merger.link
        state.update((self._FACTOR_KEY + name, factor.detach().clone())
                     for name, factor in (link.factors.items() if link is not None else ()))
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore a `state_dict`; continuing afterwards reproduces the original run bit for bit."""
        buffers, factors = {}, {}
        for key, value in state.items():
            prefix = self._FACTOR_KEY if key.startswith(self._FACTOR_KEY) else self._BUFFER_KEY
            name = key.removeprefix(prefix)
            if not key.startswith(prefix) or name not in self._params:
                raise ValueError(
                    f"unexpected outer state key {key!r}: expected {self._BUFFER_KEY}<parameter name> or "
                    f"{self._FACTOR_KEY}<parameter name> (is this checkpoint from another model?)"
                )
            param = self._params[name]
            if prefix == self._FACTOR_KEY:
                factors[name] = value.to(device=param.device, dtype=torch.float32).clone()
                continue
            if value.shape != param.shape:
                raise ValueError(f"{key!r} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
            buffers[param] = value.to(device=param.device, dtype=param.dtype).clone()
        if self.merger.link is not None:  # a resume checks the config first: factors come with low rank
            self.merger.link.factors = factors
        self.optimizer.state.clear()
        for param, buffer in buffers.items():
            self.optimizer.state[param]["momentum_buffer"] = buffer
