"""The peft-style merge functions, one per rule: `mean`, `ties`, `dare`, `tsv`, `iso_c` and
`iso_cts` merge a list of R tensors in this process, through the merge engine
(`isoloco.merge.Merger`) that a training loop uses, so they compute its numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from isoloco.comm import LocalCommunicator
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig
from isoloco.ortho import IsoSettings


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
