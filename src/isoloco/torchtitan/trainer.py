"""torchtitan's fault-tolerant trainer with isoloco's outer step, and the checks before it starts.

`IsoLoCoTrainer.Config` is torchtitan's torchft trainer config plus the ``--isoloco.*`` flags
(`OuterSettings`). The trainer refuses a bad setting in one line before anything starts
(torch.distributed, torchft's manager, the model), then trains as torchtitan's
`FaultTolerantTrainer` does, with `semi_sync_training` in place of torchtitan's
``maybe_semi_sync_training`` for the length of `train`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torchtitan.experiments.torchft import trainer as torchft_trainer
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

from isoloco.torchtitan import internals
from isoloco.torchtitan.diloco import semi_sync_training
from isoloco.torchtitan.settings import OuterSettings, check_fault_tolerance


class IsoLoCoTrainer(FaultTolerantTrainer):
    """torchtitan's `FaultTolerantTrainer` whose DiLoCo steps isoloco's outer optimizer."""

    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):
        isoloco: OuterSettings = field(default_factory=OuterSettings)
        """isoloco's outer step of torchft's DiLoCo"""

    def __init__(self, config: Config) -> None:
        check_recipe(config)
        super().__init__(config)

    def train(self) -> None:
        binding = functools.partial(semi_sync_training, settings=self.config.isoloco)
        with internals.bound(torchft_trainer, "maybe_semi_sync_training", binding):
            super().train()


def check_recipe(config: IsoLoCoTrainer.Config) -> None:
    """Raise `ConfigError`, naming the flag, for a setting the recipe cannot train as asked."""
    internals.check_version()
    ft = config.fault_tolerance
    check_fault_tolerance(ft.enable, ft.semi_sync_method)
    config.isoloco.validate()
