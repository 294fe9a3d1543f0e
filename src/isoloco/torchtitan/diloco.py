"""The binding: torchft's `DiLoCo` for torchtitan, with isoloco's outer optimizers.

torchtitan's ``maybe_semi_sync_training`` builds torchft's `DiLoCo` with
``SGD(lr=0.7, momentum=0.9, nesterov=True)`` per fragment, fixed. `semi_sync_training` takes
its place (same arguments; `isoloco.torchtitan.trainer` binds it) and builds the same `DiLoCo`
with the outer optimizer `OuterSettings` describe: `IsoLoCo` for Iso-C, whose corrections see
each sharded matrix whole (`isoloco.torchtitan.sharded`), torch's SGD / Nesterov for the mean.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torchft.local_sgd import DiLoCo

from isoloco.outer import IsoLoCo
from isoloco.torchft import outer_optimizer
from isoloco.torchtitan.settings import OuterSettings
from isoloco.torchtitan.sharded import whole_matrices


def fragment_outer_optimizer(named_params: list[tuple[str, torch.nn.Parameter]],
                             settings: OuterSettings) -> torch.optim.Optimizer:
    """The outer optimizer of one fragment: isoloco's torchft outer optimizer, and for Iso-C
    the same `IsoLoCo` groups with corrections of whole matrices (parameters may be DTensors)."""
    optimizer = outer_optimizer(named_params, settings.merge_config(), settings.outer_config())
    if isinstance(optimizer, IsoLoCo):
        # Its groups carry every hyper-parameter (lr, momentum, placement, the Iso-C knobs).
        return IsoLoCo(optimizer.param_groups, shard_map=whole_matrices)
    return optimizer


def semi_sync_training(ft_config: Any, ft_manager: Any, model: torch.nn.Module, n_layers: int,
                       optimizer: torch.optim.Optimizer, fragment_fn: Callable[..., list[torch.nn.Module]] | None = None,
                       *, settings: OuterSettings) -> DiLoCo:
    """torchtitan's ``maybe_semi_sync_training`` with isoloco's outer step (`settings`). The
    trainer has checked that semi-sync DiLoCo is on."""
    fragments = fragment_fn(model, ft_config, n_layers) if fragment_fn else [model]
    names = {param: name for name, param in model.named_parameters()}  # merge.exclude goes by these
    outer = [fragment_outer_optimizer([(names[p], p) for p in fragment.parameters() if p.requires_grad], settings)
             for fragment in fragments]
    return DiLoCo(manager=ft_manager.manager, model_fragments=fragments, inner_optimizer=optimizer,
                  outer_optimizer=outer, sync_every=ft_config.sync_steps, should_quantize=ft_config.should_quantize,
                  fragment_sync_delay=ft_config.fragment_sync_delay,
                  fragment_update_alpha=ft_config.fragment_update_alpha)
