"""Iso-C of parameters sharded inside a replica group: the spectral step sees the whole matrix.

Under FSDP (or tensor parallelism) each process of a replica group holds a shard of every
matrix, a DTensor, and so does the mean pseudo-gradient torchft leaves in ``p.grad``. Iso-C
of a shard is not a shard of Iso-C (its singular vectors and values are the whole matrix's),
so `whole_matrices`, given to `IsoLoCo` as its ``shard_map``, gathers each sharded matrix
inside the group (one all-gather over the fast link), corrects it, and keeps this process's
shard of the result: no communication on the way back, since every process of the group
computes the same corrected matrix from the same gathered one.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate


def whole_matrices(fn: Callable[[torch.Tensor], torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[fn(t) for t in tensors]`, `fn` applied to each DTensor's whole matrix and the result
    sharded as the DTensor was; plain tensors are passed to `fn` as they are."""
    return [_on_whole(fn, tensor) if isinstance(tensor, DTensor) else fn(tensor) for tensor in tensors]


def _on_whole(fn: Callable[[torch.Tensor], torch.Tensor], tensor: DTensor) -> DTensor:
    mesh = tensor.device_mesh
    whole = DTensor.from_local(fn(tensor.full_tensor()), mesh, [Replicate()] * mesh.ndim, run_check=False)
    # Replicate → Shard keeps a slice of what every process holds: local, no collective.
    return whole.redistribute(mesh, tensor.placements)
