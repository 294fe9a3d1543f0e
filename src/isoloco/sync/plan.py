"""The bucket plan: which tensors travel together in one collective.

Tensors are packed, in order, into flat buffers of about `merge.bucket_mb` (and the gradient
all-reduce's 25 MiB): one collective per bucket and phase instead of one per tensor, so a
synchronisation makes a handful of calls whatever the number of tensors. Every process builds
the same plan from the same shapes, so their collectives pair up.
"""

from __future__ import annotations

from typing import Sequence

import torch


def buckets(sizes: Sequence[tuple[int, torch.dtype]], limit: int) -> list[list[int]]:
    """Indices of consecutive items (byte size, dtype) grouped into runs of one dtype and at
    most `limit` bytes, for one collective each; an item of `limit` bytes or more is a bucket
    of its own."""
    groups: list[list[int]] = []
    used = 0
    for index, (size, dtype) in enumerate(sizes):
        if groups and used + size <= limit and sizes[groups[-1][0]][1] == dtype:
            groups[-1].append(index)
            used += size
        else:
            groups.append([index])
            used = size
    return groups
