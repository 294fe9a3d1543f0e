"""Every merge rule inside torchft's quorum: isoloco's `Merger` over torchft's Manager.

torchft's `DiLoCo` takes each replica group's pseudo-gradient θ − θ_r and starts one all-reduce
of their mean. Mean and Iso-C are functions of that mean and step on it
(`isoloco.torchft.optimizer`). The other rules need collectives of their own: DARE masks each
group's delta before the sum, TIES sums twice, TSV and Iso-CTS gather every group's factors.
`merge_in_quorum` has each fragment of a `DiLoCo` run isoloco's `Merger` where torchft would
start its all-reduce, through `QuorumCommunicator`: a sum is the Manager's fault-tolerant
all-reduce, and a gather is a sum of zero-padded slots, one per group. The merged tensor
then takes the mean's place as the fragment's ``p.grad``. Everything else stays torchft's:
the quorum, `should_commit`, discarding a round whose collectives failed, and a restarted
group's recovery from a live peer.

No torchft import here: the Manager is used through its public calls, and `DiLoCo` through
private names that `isoloco.torchft.internals` gathers, with the version check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from isoloco.comm import Communicator
from isoloco.errors import ConfigError
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig
from isoloco.torchft import internals
from isoloco.torchft.optimizer import merges_in_quorum

if TYPE_CHECKING:
    from isoloco.train_config import TrainConfig

#: isoloco keys torchft's DiLoCo does not carry, with the value that means "off" and what to do
#: instead: refused, since a run would otherwise ignore them and end as without.
UNCARRIED = {
    "merge.quantize": ("none", "torchft's DiLoCo all-reduces float32 pseudo-gradients; drop it, or compress with "
                               "isoloco train / isoloco launch"),
    "merge.compress": ("none", "torchft's DiLoCo all-reduces whole pseudo-gradients; drop it, or compress with "
                               "isoloco train / isoloco launch"),
    "outer.transport": ("merge", "torchft's DiLoCo all-reduces whole pseudo-gradients; drop it, or run SparseLoCo "
                                 "with isoloco train / isoloco launch"),
    "outer.overlap_steps": (0, "torchft overlaps a synchronisation its own way: drop it and use its fragments and "
                               "sync delay (the example's --fragments N --sync-delay STEPS)"),
    "merge.weighting": ("equal", "torchft's quorum merges its groups with equal weights; drop it, or weigh by "
                                 "tokens with isoloco train / isoloco launch"),
    "faults.late_rate": (0.0, "torchft's own quorum decides who merges; drop it, or simulate late workers with "
                              "isoloco train"),
    "worker_speeds": ([], "every group trains H steps a round under torchft; drop it, or simulate unequal workers "
                          "with isoloco train"),
}


def refuse_uncarried(cfg: TrainConfig) -> None:
    """Raise `ConfigError` for the first key of `UNCARRIED` that `cfg` sets."""
    for key, (off, instead) in UNCARRIED.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if (list(value) if isinstance(value, tuple) else value) != off:
            raise ConfigError(f"{key}={value} is not supported under torchft: {instead}")


class QuorumBroken(Exception):
    """A collective of the merge failed: torchft has recorded the error, so `should_commit`
    discards the round and every group trains it again."""


class QuorumCommunicator(Communicator):
    """The replica groups of torchft's current quorum as isoloco's workers.

    This process is replica group `replica`, one worker whose global id is `replica` (DARE
    keys its masks by it, as the simulator keys worker r's). The workers are the groups in
    the quorum, so a round with a group missing merges the others alone, as the simulator
    merges the workers it keeps. Building it costs one small all-reduce: each group writes its
    id at its rank in the quorum, and the sum names every group in it.
    """

    def __init__(self, manager: Any, replica: int, device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self.manager = manager
        self.replica = replica
        # Where the group's process group takes tensors: NCCL reduces GPU tensors only.
        ids = torch.zeros(manager.num_participants(), dtype=torch.int64, device=device)
        rank = manager.participating_rank()
        if rank is not None:  # a group torchft keeps out of the quorum (a spare) names no slot
            ids[rank] = replica
        self._workers = sorted(self._all_reduce(ids).tolist())
        twice = sorted({worker for worker in self._workers if self._workers.count(worker) > 1})
        if twice:
            raise ConfigError(f"several replica groups in torchft's quorum are worker {twice[0]}: give each group its "
                              "own replica number")

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def local_worker_ids(self) -> list[int]:
        return [self.replica]

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the quorum in place, through the Manager, which turns a failure
        into a recorded error rather than an exception; `QuorumBroken` says so."""
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            raise QuorumBroken
        return tensor

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor)

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (tensor,) = tensors
        # Each group writes into its own slot, in worker order; the others' stay zero, so the
        # sum holds every group's tensor exactly (x + 0 = x).
        slots = tensor.new_zeros((self.num_workers, *tensor.shape))
        if self.replica in self._workers:
            slots[self._workers.index(self.replica)] = tensor
        return list(self._all_reduce(slots).unbind(0))


class _Merged:
    """What torchft waits on before its outer step: the merge already ran to its end."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class _FragmentMerge:
    """Stands in for one fragment's all-reduce of the mean: merges the pseudo-gradients torchft
    has just taken (θ − θ_r, as isoloco's) with isoloco's rule and leaves the result where
    torchft's outer step reads it."""

    def __init__(self, fragment: Any, names: dict[str, str], merge: MergeConfig, seed: int, replica: int,
                 fragments: int) -> None:
        self.fragment = fragment
        self.names = names  # the fragment's parameter names → the model's, which the rule and DARE's keys use
        self.merge = merge
        self.seed = seed
        self.replica = replica
        self.fragments = fragments

    def __call__(self) -> None:
        manager, grads = internals.fragment_manager(self.fragment), internals.pseudo_gradients(self.fragment)
        # torchft's step counts fragment synchronisations, so this is the fragment's round; a
        # round trained again keeps its number, and so its DARE masks.
        round = manager.current_step() // self.fragments
        try:
            device = next(iter(grads.values())).device
            merger = Merger(self.merge, QuorumCommunicator(manager, self.replica, device), self.seed)
            merged = merger.merge_all({self.names[name]: [delta] for name, delta in grads.items()}, round)
        except QuorumBroken:
            pass  # the round will not commit; what torchft's outer step would read is never used
        else:
            for name in grads:
                grads[name] = merged[self.names[name]]
        internals.add_pending_work(self.fragment, _Merged())


def merge_in_quorum(diloco: Any, model: torch.nn.Module, merge: MergeConfig, seed: int, replica: int) -> None:
    """Make torchft `DiLoCo` `diloco` merge with `merge.rule` over its quorum, for the rules
    torchft's all-reduce of the mean does not carry (nothing to do for the others).

    `model` names the parameters of `diloco`'s fragments (the rule and DARE's masks go by the
    model's names); `seed` and `replica` (this group's worker id, 0..R-1) key DARE's masks as
    the simulator's run with that seed keys worker `replica`'s. Give `diloco` the outer
    optimizers of `isoloco.torchft.outer_optimizers`: they step on the merged tensor. The
    merge runs where torchft would start its all-reduce and ends before the next inner step,
    so `fragment_sync_delay` moves when the pseudo-gradient is taken but overlaps nothing;
    `should_quantize` is refused (the merge sends full precision), and so are parameters
    sharded within the group (DTensors: the rules need whole tensors). The merge packs its
    collectives by `merge.bucket_mb`, not by torchft's bucket options.
    """
    if not merges_in_quorum(merge):
        return
    internals.check_version()
    fragments = internals.fragments(diloco)
    if any(fragment.should_quantize for fragment in fragments):
        raise ConfigError(f"should_quantize=True is not allowed with merge.rule={merge.rule}: its collectives are "
                          "isoloco's, in full precision; quantisation applies to torchft's all-reduce of the mean "
                          "(merge.rule=mean or iso_c)")
    names = {param: name for name, param in model.named_parameters()}
    sharded = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if sharded:  # TIES's trim, DARE's mask indices and the spectral rules all need the whole tensor
        raise ConfigError(f"merge.rule={merge.rule} needs whole tensors, but {sharded[0]!r} is sharded (a DTensor) "
                          "within the replica group; keep the parameters whole in each group, or use "
                          "merge.rule=mean, whose all-reduce torchft makes shard by shard")
    for fragment in fragments:
        fragment_names = {name: names[param] for name, param in internals.fragment_model(fragment).named_parameters()}
        internals.replace_average(fragment, _FragmentMerge(fragment, fragment_names, merge, seed, replica,
                                                           len(fragments)))
