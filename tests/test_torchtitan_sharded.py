"""Iso-C of matrices sharded inside a replica group (`isoloco.torchtitan.sharded`): `IsoLoCo`
stepping on DTensors sharded over 2 gloo processes equals `IsoLoCo` on the whole plain tensors,
and so does the outer optimizer the torchtitan binding builds for a fragment of such DTensors
(`isoloco.torchtitan.diloco.fragment_outer_optimizer`).

Needs torch and torchft (no torchtitan): the processes are started here, as FSDP's would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from isoloco.ortho import IsoSettings
from isoloco.outer import IsoLoCo

from torchft_groups import SPAWN, join_groups

pytestmark = [pytest.mark.multiprocess]

#: Uneven rows (7 and 5 over 2 processes), a wide and a tall matrix, and a vector (plain Nesterov).
SHAPES = {"uneven": (7, 5), "wide": (6, 10), "tall": (12, 4), "gain": (9,)}
STEPS = 3
SETTINGS = {"gradient": {"placement": "gradient"}, "update": {"placement": "update"},
            "fast": {"placement": "gradient", "settings": IsoSettings(ortho="newton_schulz", scale="rms")},
            "binding": {"placement": "gradient"}}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _rank(rank: int, store: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from isoloco.torchtitan.diloco import fragment_outer_optimizer
    from isoloco.torchtitan.settings import OuterSettings
    from isoloco.torchtitan.sharded import whole_matrices

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    errors = {}
    try:
        for name, kwargs in SETTINGS.items():
            plain = {n: torch.nn.Parameter(t) for n, t in _tensors(0).items()}
            sharded = {n: torch.nn.Parameter(distribute_tensor(t.detach().clone(), mesh, [Shard(0)]))
                       for n, t in plain.items()}
            reference = IsoLoCo(plain.values(), lr=0.5, momentum=0.8, **kwargs)
            if name == "binding":  # what torchtitan's DiLoCo steps: the binding's outer optimizer
                ours = fragment_outer_optimizer(list(sharded.items()), OuterSettings(lr=0.5, momentum=0.8))
            else:
                ours = IsoLoCo(sharded.values(), lr=0.5, momentum=0.8, shard_map=whole_matrices, **kwargs)
            for step in range(STEPS):
                for n, grad in _tensors(step + 1).items():
                    plain[n].grad = grad
                    sharded[n].grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
                reference.step()
                ours.step()
            errors[name] = {n: (p.detach().full_tensor() - plain[n].detach()).abs().max().item()
                            for n, p in sharded.items()}
        dist.barrier()  # neither leaves while the other still talks: gloo aborts a process whose peer left
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(errors))


def test_isoloco_on_sharded_matrices_equals_isoloco_on_whole_ones(tmp_path):
    ranks = [SPAWN.Process(target=_rank, args=(r, str(tmp_path / "store"), tmp_path)) for r in range(2)]
    for rank in ranks:
        rank.start()
    join_groups(ranks)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    for r in range(2):
        errors = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert errors == {name: {n: 0.0 for n in SHAPES} for name in SETTINGS}, (r, errors)
