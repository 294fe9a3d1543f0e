"""Which merge rules torchft's all-reduce of the mean carries, and the outer optimizer of every rule.

torchft's `DiLoCo` computes each replica group's pseudo-gradient θ − θ_r, all-reduces its
mean into ``p.grad`` and steps the outer optimizer it was given. Mean and Iso-C are functions
of that mean: the outer optimizer finishes the rule and steps, with the numbers of isoloco's
own `OuterStep` (merge, then torch's SGD / Nesterov or `IsoLoCo`). Every other rule needs
collectives of its own, which `isoloco.torchft.quorum.merge_in_quorum` makes in torchft's
quorum in place of the mean; its outer optimizer then steps on the merged tensor, as
isoloco's `OuterStep` does.
"""

from __future__ import annotations

import dataclasses

import torch

from isoloco.merge_config import MergeConfig
from isoloco.outer import OuterConfig, build_outer_optimizer, validate_combination

#: The rules that are a function of the groups' mean, which torchft's own all-reduce carries
#: (so it overlaps with `fragment_sync_delay` and may be quantised).
MEAN_RULES = ("mean", "iso_c")


def merges_in_quorum(merge: MergeConfig) -> bool:
    """Whether `merge.rule` needs isoloco's collectives in torchft's quorum
    (`isoloco.torchft.quorum.merge_in_quorum`) instead of torchft's all-reduce of the mean."""
    return merge.rule not in MEAN_RULES


def outer_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], merge: MergeConfig, outer: OuterConfig
) -> torch.optim.Optimizer:
    """The outer optimizer for torchft's `DiLoCo` that does what isoloco's outer step does with
    `merge` and `outer`, stepping on what torchft leaves in ``p.grad``.

    Mean: torch's SGD (Nesterov when configured), on the mean. Iso-C: `IsoLoCo` with
    `outer.iso_placement`, the configured orthogonalisation (exact or the fast modes) and
    `merge.exclude`, on the mean; the correction then happens in the optimizer instead of in
    the merge, the same numbers. Any other rule: torch's SGD / Nesterov on the merged tensor,
    which needs `merge_in_quorum` on the `DiLoCo`.
    """
    merge.validate()
    outer.validate()
    validate_combination(merge, outer)
    if merge.rule != "iso_c":
        return build_outer_optimizer(named_params, merge, outer)
    # isoloco's builder makes the update-placement IsoLoCo (param groups split by merge.exclude);
    # the gradient placement differs only in the group key `placement`, read at each step.
    optimizer = build_outer_optimizer(named_params, merge, dataclasses.replace(outer, iso_placement="update"))
    for group in optimizer.param_groups:
        group["placement"] = outer.iso_placement
    return optimizer


def outer_optimizers(
    fragments: list[list[tuple[str, torch.nn.Parameter]]], merge: MergeConfig, outer: OuterConfig
) -> list[torch.optim.Optimizer]:
    """One outer optimizer per Streaming DiLoCo fragment (``DiLoCo(..., outer_optimizer=[...])``).

    One per fragment, not one shared: torchft steps a fragment's outer optimizer while the other
    fragments' parameters still hold their inner gradients in ``p.grad``, and a shared optimizer
    would step those too; each fragment's recovery state also saves and loads its own optimizer.
    """
    return [outer_optimizer(named_params, merge, outer) for named_params in fragments]
