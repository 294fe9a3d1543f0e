"""Which merge rules fit torchft's all-reduce of the mean, and the outer optimizer that applies them.

torchft's `DiLoCo` computes each replica group's pseudo-gradient θ − θ_r, all-reduces its
mean into ``p.grad`` and steps the outer optimizer it was given. A rule fits when it is a
function of that mean alone: the outer optimizer then finishes the rule and steps, with the
numbers of isoloco's own `OuterStep` (merge, then torch's SGD / Nesterov or `IsoLoCo`).
"""

from __future__ import annotations

import dataclasses

import torch

from isoloco.errors import ConfigError
from isoloco.merge import MergeConfig
from isoloco.outer import OuterConfig, build_outer_optimizer, validate_combination

#: Every merge rule: None where it fits torchft's all-reduce of the mean, else why it cannot.
RULE_FIT: dict[str, str | None] = {
    "mean": None,
    "iso_c": None,
    "ties": "its sign election needs the sum of every group's trimmed delta before the masked mean "
            "is formed, and per-entry counts after it: collectives torchft's DiLoCo does not make",
    "dare": "each group's delta must be masked with that group's random drop before the mean, and "
            "torchft's DiLoCo computes the delta and starts its all-reduce in one step, with no hook "
            "between them",
    "tsv": "it stacks every group's own top singular vectors (an all-gather of factors); the mean "
           "has lost them",
    "iso_cts": "it adds every group's own top singular vectors outside the common subspace (an "
               "all-gather of factors); the mean has lost them",
}


def outer_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], merge: MergeConfig, outer: OuterConfig
) -> torch.optim.Optimizer:
    """The outer optimizer for torchft's `DiLoCo` that, stepping on the mean pseudo-gradient in
    ``p.grad``, does what isoloco's outer step does with `merge` and `outer`.

    Mean: torch's SGD (Nesterov when configured). Iso-C: `IsoLoCo` with `outer.iso_placement`,
    the configured orthogonalisation (exact or the fast modes) and `merge.exclude`; the
    correction of the mean then happens in the optimizer instead of in the merge, the same
    numbers. Any other rule raises `ConfigError` saying why it cannot fit.
    """
    merge.validate()
    outer.validate()
    validate_combination(merge, outer)
    reason = RULE_FIT.get(merge.rule)
    if reason is not None:
        fitting = ", ".join(rule for rule, why in RULE_FIT.items() if why is None)
        raise ConfigError(f"merge.rule={merge.rule} does not fit torchft's all-reduce of the mean: {reason}; "
                          f"use one of {fitting}")
    if merge.rule == "mean":
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
