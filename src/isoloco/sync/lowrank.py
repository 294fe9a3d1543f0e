"""A sum of matrices sent as low-rank factors, in PowerSGD's form (Vogels et al., 2019).

For one m×n matrix whose islands hold X_i (an island's sum of its workers' contributions,
plus its error-feedback residual), with Q an n×k factor every island holds alike:

    P = Σ_i X_i Q            a sum of m×k factors (the compressed sum, flat in R and P)
    P̂ = orthonormal(P)       the same bits on every island, which all hold the same P
    Q' = Σ_i X_iᵀ P̂          a sum of n×k factors
    Σ_i X_i ≈ P̂ Q'ᵀ          the projection of the sum on span(P̂)

Both sums are linear, so they ride `isoloco.sync.compressed` like any sum, quantised by
`merge.quantize` when set. Q' is the next round's Q (the warm start that makes one power
iteration per round track the top-k subspace), so the factors are part of the run's state.
With error feedback island i keeps e_i = X_i − P̂ q(X_iᵀ P̂)ᵀ, where q is what its share of
Q' became on the wire: Σ_i of the island terms is P̂ Q' up to the factors' rounding, so what
the rank-k projection leaves out of the sum is exactly what the islands carry to the next round.

torch's `powerSGD_hook` is the model (error feedback, warm start, orthogonalisation) but is
not called: it is a DDP communication hook that averages over one process group with its own
all-reduce, where isoloco needs the island sum, the codecs and steps that an overlapped
synchronisation can spread over inner steps. Orthogonalisation is a reduced QR (Householder,
so a rank-deficient P still gives orthonormal columns, with no ε as Gram-Schmidt needs).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch

from isoloco.sync.codec import Quantization, dequantize, fold_residuals, quantize
from isoloco.sync.handles import Steps

#: Sums a list of per-island lists of tensors over the islands (see `lowrank_sum`).
IslandSum = Callable[[list[list[torch.Tensor]]], Steps[list[torch.Tensor]]]


def factor_rank(shape: Sequence[int], rank: int) -> int:
    """The rank a matrix of `shape` is sent at: `rank`, clamped to its smaller side."""
    return min(rank, *shape)


def initial_factor(name: str, shape: Sequence[int], rank: int, seed: int) -> torch.Tensor:
    """The first round's Q of matrix `name` (n×k, float32, on the CPU): standard normal entries
    drawn from (seed, name), so every process starts from the same bits without communicating."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn(shape[1], factor_rank(shape, rank), generator=generator, dtype=torch.float32)


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `p`'s (m×k) column space."""
    return torch.linalg.qr(p, mode="reduced").Q


def lowrank_sum(islands: list[list[torch.Tensor]], factors: list[torch.Tensor], quantization: Quantization,
                summed: IslandSum, residuals: list[list[torch.Tensor]] | None = None
                ) -> Steps[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
    """The rank-k sums over all islands of matrices, as steps: `islands[i][t]` is matrix t of
    an island held here (every island in the simulator, this process's in a distributed run),
    `factors[t]` its warm-start Q, and `summed` adds per-island lists over all islands (the
    compressed sum). Returns (P̂ Q'ᵀ, Q' and P̂, per matrix). With `residuals` (like
    `islands`), X_i = x_i + e_i and e_i is updated in place."""
    islands = fold_residuals(islands, residuals)
    bases = [orthonormal(p) for p in (yield from summed([[x @ q for x, q in zip(island, factors)]
                                                         for island in islands]))]
    shares = [[x.T @ basis for x, basis in zip(island, bases)] for island in islands]
    warm = yield from summed(shares)
    if residuals is not None:
        for island, share in zip(islands, shares):
            for residual, basis, q in zip(island, bases, share):
                residual.sub_(basis @ dequantize(quantize(q, quantization)).T)
    return [basis @ q.T for basis, q in zip(bases, warm)], warm, bases
