"""Iso-C: orthogonalisation and scale estimators, the two halves of an Iso-C correction, and
`IsoSettings`, the one set of its knobs.

Iso-C replaces the spectrum of a matrix M = U S Vᵀ (m×n, r = min(m, n)) by its mean:

    iso(M) = mean(S) · U Vᵀ = (‖M‖_* / r) · polar(M)

so it needs an orthogonal factor ``polar(M)`` and a scale. This module offers four ways to
get the factor and three ways to get the scale, so the exact reference and the fast paths
share one entry point, `iso_correct`, and can be measured against each other
(``benchmarks/ortho.py``):

* ``svd``: `torch.linalg.svd`, the reference, and ``gram``: the same factor from the
  eigendecomposition of the small Gram matrix (float64), exact without an SVD (`isoloco.svd`);
* ``newton_schulz``: Muon's quintic iteration (approximate, matmuls only, any dtype), and
  ``polar_express``: the Polar Express per-step schedule (approximate, converges tighter)
  (`isoloco.newton_schulz`).

Scales: ``exact`` (mean singular value), ``rms`` (‖M‖_F/√r, the paper's fast mode) and
``inner`` (⟨M, O⟩/r with O the computed factor).

Two variants flatten the spectrum less than Iso-C (`reshaped_spectrum`), for updates whose
spectrum is so steep (a nearly rank-one first pseudo-gradient of the embedding or LM head)
that giving every direction the mean singular value mostly amplifies noise: ``iso_power``
maps σ to c·σ^p, ``iso_floor`` leaves the directions below a fraction of σ_max as they are.
They reshape singular values, so they take the exact routes only. At their defaults (0)
`iso_correct` runs the paper's Iso-C on its own code path.

Rank-deficient matrices: every method leaves numerically null directions out (the exact
routes' minimal polar factor; the iterations grow them only by their slope at 0), so Iso-C
does not give rounding noise the mean singular value. An all-zero matrix has the all-zero
factor under every method, and its Iso-C update is zero.

All functions take one matrix or a batch of same-shape matrices (..., m, n).
"""


from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import torch

from isoloco.newton_schulz import NS_DTYPE, NS_DTYPES, NS_STEPS, polar_express, polar_newton_schulz
from isoloco.svd import (Polar, check_matrix, full_float32_matmuls, full_rank, gram_svd, polar_auto, polar_gram,
                         polar_svd, singular_values, svd_auto, thin_svd)

OrthoMethod = Literal["auto", "svd", "gram", "newton_schulz", "polar_express"]
ScaleMethod = Literal["exact", "rms", "inner"]


@dataclasses.dataclass(frozen=True)
class IsoSettings:
    """How an Iso-C correction is computed: the one set of knobs (and the one default) that
    merge rules, the outer optimizer and the run config share."""

    ortho: OrthoMethod = "auto"  # how the orthogonal factor is computed (POLAR_METHODS)
    scale: ScaleMethod = "exact"  # how the one singular value is estimated (SCALE_METHODS)
    ns_steps: int = NS_STEPS  # iterations of newton_schulz / polar_express
    ns_dtype: str = NS_DTYPE  # dtype of those iterations, a key of NS_DTYPES
    iso_power: float = 0.0  # in [0, 1]: σ ↦ c·σ^p keeping the mean (0: Iso-C, 1: the update unchanged)
    iso_floor: float = 0.0  # in [0, 1): σ below this fraction of σ_max keep their value (0: Iso-C)

    def __post_init__(self) -> None:
        for knob, value, allowed in (("ortho", self.ortho, POLAR_METHODS), ("scale", self.scale, SCALE_METHODS),
                                     ("ns_dtype", self.ns_dtype, NS_DTYPES)):
            if value not in allowed:
                raise ValueError(f"{knob}={value!r} is not allowed: choose one of {', '.join(allowed)}")
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps={self.ns_steps} is not allowed: it must be >= 1")
        problem = spectrum_knob_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def reshapes_spectrum(self) -> bool:
        """Whether a variant is on; if not, the correction is the paper's Iso-C."""
        return self.iso_power != 0 or self.iso_floor != 0


def spectrum_knob_problem(knobs: Any, prefix: str = "") -> str | None:
    """What is wrong with the ``iso_power`` / ``iso_floor`` of `knobs` (an `IsoSettings`, or a
    config with fields of the same names whose keys start with `prefix`), or None.

    The variants reshape exact singular values: the iterative orthogonalisations compute
    none, and a scale estimate other than the exact mean would contradict the mean they keep.
    """
    power, floor = f"{prefix}iso_power={knobs.iso_power!r}", f"{prefix}iso_floor={knobs.iso_floor!r}"
    if not 0 <= knobs.iso_power <= 1:
        return f"{power} is not allowed: it must be in [0, 1] (0: Iso-C, 1: the update unchanged)"
    if not 0 <= knobs.iso_floor < 1:
        return f"{floor} is not allowed: it must be in [0, 1) (0: Iso-C)"
    if knobs.iso_power == 0 and knobs.iso_floor == 0:
        return None
    variant = power if knobs.iso_power != 0 else floor
    off = f"{prefix}iso_power=0 and {prefix}iso_floor=0"
    if knobs.ortho not in SVD_METHODS:
        *others, last = SVD_METHODS
        return (f"{variant} is not allowed with {prefix}ortho={knobs.ortho}: it reshapes singular values, which "
                f"{knobs.ortho} does not compute; set {prefix}ortho={', '.join(others)} or {last}, or {off}")
    if knobs.scale != "exact":
        return (f"{variant} is not allowed with {prefix}scale={knobs.scale}: it keeps the exact mean singular "
                f"value; set {prefix}scale=exact, or {off}")
    return None


def scale_exact(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """The mean singular value ‖M‖_*/r, Iso-C's scale (shape (...)).

    Uses the method's singular values when it produced them; otherwise (Newton–Schulz, Polar
    Express) computes them from the Gram eigenvalues, which costs most of what the ``gram``
    path costs: pair ``exact`` with an iterative method only when accuracy of the scale
    matters more than speed.
    """
    sigma = polar.singular_values if polar.singular_values is not None else singular_values(matrix)
    return sigma.sum(dim=-1) / full_rank(matrix)


def scale_rms(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """‖M‖_F/√r: the RMS of the singular values, ≥ their mean (the paper's fast mode)."""
    del polar  # needs only the matrix
    return torch.linalg.matrix_norm(matrix) / math.sqrt(full_rank(matrix))


def scale_inner(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """⟨M, O⟩/r with O the computed factor: equals the exact mean when O = polar(M).

    For an approximate O = U f(S) Vᵀ it is Σ σ_i f(σ_i)/r, a mean weighted towards the large
    singular values, which the iterations get right first.
    """
    return (matrix * polar.factor).sum(dim=(-2, -1)) / full_rank(matrix)

POLAR_METHODS: dict[str, Callable[[torch.Tensor, int, torch.dtype], Polar]] = {
    "auto": lambda matrix, steps, dtype: polar_auto(matrix),
    "svd": lambda matrix, steps, dtype: polar_svd(matrix),
    "gram": lambda matrix, steps, dtype: polar_gram(matrix),
    "newton_schulz": polar_newton_schulz,
    "polar_express": polar_express,
}

#: The thin SVD behind each exact orthogonalisation: what the spectrum variants reshape.
SVD_METHODS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "auto": svd_auto,
    "svd": thin_svd,
    "gram": gram_svd,
}

SCALE_METHODS: dict[str, Callable[[torch.Tensor, Polar], torch.Tensor]] = {
    "exact": scale_exact,
    "rms": scale_rms,
    "inner": scale_inner,
}


def orthogonalize(
    matrix: torch.Tensor,
    method: OrthoMethod,
    ns_steps: int = IsoSettings.ns_steps,
    ns_dtype: torch.dtype = NS_DTYPES[IsoSettings.ns_dtype],
) -> Polar:
    """The orthogonal factor of `matrix` by `method`; ns_* only affect the iterative ones."""
    if method not in POLAR_METHODS:
        raise ValueError(f"unknown orthogonalisation {method!r}: choose one of {', '.join(POLAR_METHODS)}")
    if ns_steps < 1:
        raise ValueError(f"ns_steps={ns_steps} is not allowed: it must be >= 1")
    return POLAR_METHODS[method](matrix, ns_steps, ns_dtype)


def reshaped_spectrum(sigma: torch.Tensor, power: float, floor: float) -> torch.Tensor:
    """Singular values (..., r; null ones 0) reshaped by Iso-C's variants.

    The values at or above floor·σ_max are flattened: σ ↦ c·σ^power, with c = Σσ / Σσ^power
    over them, so their mean is kept; the values below the floor keep their own. power 1
    changes nothing; power 0 gives the flattened values their mean, which with floor 0 is
    Iso-C's (0⁰ = 1 counts the null values in that mean, as Iso-C's mean over r does).
    """
    flattened = sigma >= floor * sigma.amax(dim=-1, keepdim=True)
    lifted = torch.where(flattened, sigma.pow(power), 0)
    total, lifted_total = torch.where(flattened, sigma, 0).sum(-1, keepdim=True), lifted.sum(-1, keepdim=True)
    c = torch.where(lifted_total > 0, total / lifted_total, 0)  # a zero matrix: 0/0
    return torch.where(flattened, c * lifted, sigma)


def iso_correct_in_span(matrix: torch.Tensor, basis: torch.Tensor, settings: IsoSettings = IsoSettings()) -> torch.Tensor:
    """Iso-C of an m×n `matrix` whose columns lie in the span of `basis` (m×k, orthonormal
    columns), as a rank-k sum from merge.compress=lowrank does: its k singular values (those
    of basisᵀ·matrix) reshaped by `reshaped_spectrum`, so Iso-C gives each their mean over
    the k, not over min(m, n). The n − k null values are directions nobody sent: counting
    them would shrink the update by about k/min(m, n), and orthogonalising them would make
    rounding noise full-rank. Exact (one SVD of a k×n matrix) whatever `settings.ortho`."""
    u, sigma, vh = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
    sigma = reshaped_spectrum(sigma, settings.iso_power, settings.iso_floor)
    return ((basis @ u) * sigma) @ vh


def _iso_variant(matrix: torch.Tensor, settings: IsoSettings) -> torch.Tensor:
    """U·reshaped_spectrum(S)·Vᵀ from the exact SVD of `settings.ortho`, in at least float32."""
    check_matrix(matrix)
    u, sigma, vh = SVD_METHODS[settings.ortho](matrix.to(torch.promote_types(matrix.dtype, torch.float32)))
    sigma = reshaped_spectrum(sigma, settings.iso_power, settings.iso_floor)
    return ((u * sigma.unsqueeze(-2)) @ vh).to(matrix.dtype)


@full_float32_matmuls()
def iso_correct(matrix: torch.Tensor, settings: IsoSettings = IsoSettings()) -> torch.Tensor:
    """The Iso-C correction scale · polar(M): every singular value replaced by one scale, or,
    with ``iso_power`` / ``iso_floor`` set, the spectrum reshaped by `reshaped_spectrum`.

    Same shape and dtype as `matrix`; an all-zero matrix gives zeros.
    """
    if settings.reshapes_spectrum:
        return _iso_variant(matrix, settings)
    polar = orthogonalize(matrix, settings.ortho, settings.ns_steps, NS_DTYPES[settings.ns_dtype])
    factor = SCALE_METHODS[settings.scale](matrix, polar).to(matrix.dtype)
    return polar.factor * factor[..., None, None]
