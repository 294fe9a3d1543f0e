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
Q' became on the wire, and on the ``exchange`` route the owner of a chunk of Q' also keeps
P̂ Oᵀ, O what re-encoding that chunk lost (zero elsewhere): the delivered P̂ Q'ᵀ plus every
island's new residual is then exactly Σ_i X_i, so what the rank-k projection and both
roundings leave out of the sum is what the islands carry to the next round. (P's own rounding
loses nothing: it only moves the basis, which every island shares.)

torch's `powerSGD_hook` is the model (error feedback, warm start, orthogonalisation) but is
not called: it is a DDP communication hook that averages over one process group with its own
all-reduce, where isoloco needs the island sum, the codecs and steps that an overlapped
synchronisation can spread over inner steps. Orthogonalisation is a reduced QR (Householder,
so a rank-deficient P still gives orthonormal columns, with no ε as Gram-Schmidt needs).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Sequence

import torch

from isoloco.sync.codec import Quantization
from isoloco.sync.compressed import ChunkPlan, Rounding, island_sum
from isoloco.sync.handles import Steps
from isoloco.sync.islands import IslandLink


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


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
    """The plan of one bucket's rank-k sums: the sum of the m×k factors P, then of the n×k
    factors Q', each a compressed sum (`ChunkPlan`); stages and bytes are theirs together."""

    ranks: tuple[int, ...]  # k of each matrix, clamped to its smaller side
    p: ChunkPlan
    q: ChunkPlan

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], rank: int, quantization: Quantization, islands: int,
           slices: int) -> LowRankPlan:
        ranks = tuple(factor_rank(shape, rank) for shape in shapes)
        return cls(ranks, *(ChunkPlan.of([torch.Size((shape[side], k)) for shape, k in zip(shapes, ranks)],
                                         quantization, islands, slices) for side in (0, 1)))

    @property
    def stages(self) -> int:
        return self.p.stages + self.q.stages

    @property
    def payload_bytes(self) -> int:
        return self.p.payload_bytes + self.q.payload_bytes

    def wire_bytes(self) -> float:
        return self.p.wire_bytes() + self.q.wire_bytes()


def lowrank_island_sum(link: IslandLink, plan: LowRankPlan, shapes: Sequence[torch.Size],
                       factors: list[torch.Tensor], inputs: Callable[[], list[torch.Tensor]], feedback: bool,
                       store: Callable[[int, torch.Tensor], None] | None = None
                       ) -> Steps[tuple[list[torch.Tensor], list[torch.Tensor], list[Rounding]]]:
    """One island's steps of the rank-k sums over every island of matrices of `shapes`, as
    `plan` says: `inputs()` gives this island's X_i (its sum plus its residual; called in the
    first stage of each of the two sums, so an island played in this process need not hold it
    between them), `factors[t]` matrix t's warm-start Q (n×k, k = `plan.ranks[t]`). Returns, per
    matrix, Q' and P̂ (the sum is P̂ Q'ᵀ), and with `feedback` the owner roundings of Q' this
    island keeps (e_i += P̂ Oᵀ).

    `store(t, e)` (error feedback, an island whose workers arrived) receives the island's new
    residual of matrix t, e = X − P̂ q(X_iᵀ P̂)ᵀ with q what its share became on the wire."""
    ranks = plan.ranks
    sums, _ = yield from island_sum(link, plan.p, lambda: [(x @ q).reshape(-1) for x, q in zip(inputs(), factors)])
    # Every island holds the same P, so the same P̂: the played islands hold one copy.
    bases = link.shared(lambda: [orthonormal(p.view(shape[0], k)) for p, shape, k in zip(sums, shapes, ranks)])
    del sums
    held: list[torch.Tensor | None] = []

    def shares() -> list[torch.Tensor]:
        held[:] = inputs()
        return [(x.T @ basis).reshape(-1) for x, basis in zip(held, bases)]

    def keep(tensor: int, decoded: torch.Tensor) -> None:
        x, held[tensor] = held[tensor], None
        assert store is not None and x is not None
        store(tensor, x - bases[tensor] @ decoded.view(-1, ranks[tensor]).T)

    warm, roundings = yield from island_sum(link, plan.q, shares, keep if store is not None else None, feedback)
    held.clear()
    return [q.view(shape[1], k) for q, shape, k in zip(warm, shapes, ranks)], bases, roundings
