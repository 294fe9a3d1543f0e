"""Each worker's top singular directions for TSV and Iso-CTS: `top_factors`, from a full SVD or
a randomized range finder (Halko, Martinsson, Tropp 2011) whose factors an a-posteriori
certificate vouches for, and `FactorSettings`, how they are found and how the rules'
orthogonalisations of stacked singular vectors run.

All functions take one matrix or a batch of same-shape matrices (..., m, n).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch

from isoloco.svd import (GRAM_MIN_ASPECT, GramRoute, check_matrix, full_float32_matmuls, full_rank, lapack_svd,
                         null_mask, null_rtol, polar_auto, polar_gram, polar_svd, svd_auto, thin_svd)

#: How `top_factors` finds a matrix's top-k singular triplets: a full SVD (``exact``), a
#: randomized range finder (Halko, Martinsson, Tropp 2011) whose cost is matmuls with
#: k + oversample columns (``randomized``), or ``auto``: randomized where k is at most
#: 1/`RANDOMIZED_MAX_FRACTION` of a rank of at least `RANDOMIZED_MIN_RANK`, where it is both much
#: cheaper and accurate on pseudo-gradients (docs/fidelity.md, "Truncated factors and DARE's
#: masks"), exact elsewhere.
FACTOR_METHODS = ("auto", "exact", "randomized")
RANDOMIZED_MAX_FRACTION = 16
#: Below this rank LAPACK's SVD costs less than the finder's many small steps, even where the
#: finder's factors pass (docs/benchmarks.md, "Thresholds in the code").
RANDOMIZED_MIN_RANK = 128

#: ``auto`` keeps the range finder's top-k only where an a-posteriori estimate (`_Found.accurate`)
#: puts their singular subspaces within this ‖sin Θ‖_F of the exact ones, and so each worker's
#: rank-k approximation within √2 times it: the 1e-3 fidelity bar (docs/fidelity.md).
FINDER_TOLERANCE = 1e-3 / math.sqrt(2)
#: Fresh Gaussian probes of what the finder's basis leaves of the matrix.
FINDER_PROBES = 6

#: The precision of the range finder's early iterations (all but the last), by the names configs
#: use: ``auto`` is bfloat16 where the device multiplies it faster than float32, else float32.
FINDER_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


def fast_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices natively, judged by public torch APIs:
    CUDA GPUs of compute capability 8.0 or later (`torch.cuda.is_bf16_supported` also counts
    the emulation of earlier ones). No CPU: torch's public `torch.backends.cpu.get_cpu_capability()`
    names the vector code it dispatches to (AVX2, AVX512, ...), never AVX512-BF16 or AMX, so it
    cannot tell a CPU with native bfloat16 from one that emulates it; there, set
    ``merge.finder_dtype=bfloat16`` explicitly."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@dataclasses.dataclass(frozen=True)
class FactorSettings:
    """How TSV and Iso-CTS find each worker's top singular directions."""

    method: str = "auto"  # a FACTOR_METHODS name
    oversample: int = 16  # extra columns of the randomized range finder beyond k
    power_iters: int = 3  # subspace iterations of the randomized range finder
    finder_dtype: str = "auto"  # a FINDER_DTYPES name: the precision of all iterations but the last

    def __post_init__(self) -> None:
        if self.method not in FACTOR_METHODS:
            raise ValueError(f"method={self.method!r} is not allowed: choose one of {', '.join(FACTOR_METHODS)}")
        if self.oversample < 0 or self.power_iters < 0:
            raise ValueError(f"oversample={self.oversample} and power_iters={self.power_iters} must be >= 0")
        if self.finder_dtype not in FINDER_DTYPES:
            raise ValueError(f"finder_dtype={self.finder_dtype!r} is not allowed: choose one of "
                             f"{', '.join(FINDER_DTYPES)}")

    def early_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the range finder's early iterations run in on `device`."""
        chosen = FINDER_DTYPES[self.finder_dtype]
        if chosen is None:
            return torch.bfloat16 if fast_bfloat16(device) else torch.float32
        return chosen

    def finder_precision(self, device: torch.device) -> str:
        """`finder_dtype` resolved on `device`: ``float32`` or ``bfloat16``, never ``auto``."""
        return str(self.early_dtype(device)).removeprefix("torch.")

    @full_float32_matmuls()
    def full_svd(self, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A thin SVD of all of `matrix` (Iso-CTS's common subspace): LAPACK's for ``exact``,
        else the Gram route on clearly non-square matrices, as `polar_auto` chooses."""
        return thin_svd(matrix) if self.method == "exact" else svd_auto(matrix)

    @full_float32_matmuls()
    def polar(self, matrix: torch.Tensor) -> torch.Tensor:
        """The polar factor of stacked singular vectors: LAPACK's SVD for ``exact``, else the
        faster exact route for the shape (`polar_auto`)."""
        return (polar_svd(matrix) if self.method == "exact" else polar_auto(matrix)).factor

    @full_float32_matmuls()
    def polar_times(self, matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """polar(matrix)·right. On a clearly tall matrix (m×r, a vocabulary-sized stack) the
        Gram route's polar factor is matrix·W with W r×r, so this is matrix·(W·right): the
        m×r factor is never formed, one m·r² product fewer."""
        if self.method == "exact" or matrix.shape[-2] < GRAM_MIN_ASPECT * matrix.shape[-1]:
            return self.polar(matrix) @ right
        gram = GramRoute(matrix)
        return gram.tall @ (gram.weights() @ right.to(gram.q.dtype)).to(gram.tall.dtype)

    @full_float32_matmuls()
    def polar_beside(self, orthonormal: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """The polar factor of [L, X] (n×(c + w), one matrix) for L with orthonormal or zero
        columns, as Iso-CTS's common block of singular vectors is, beside the workers' X.

        ``exact`` orthogonalises the whole [L, X], as the paper's code does. The others solve
        a problem of width 2w instead of c + w: with C = LᵀX = P Σ Yᵀ (P: the directions of
        L that X reaches), the Gram matrix of [L, X] is the identity on the rest of L's
        coordinates, so the polar factor keeps L there, and the remainder is the polar factor
        of the narrow Z = [LP, X]:

            polar([L, X]) = [L + (Z₁ − LP)Pᵀ, Z₂],   [Z₁, Z₂] = polar(Z).

        P keeps the directions whose σ is not null (a null one could reach L's zero columns,
        where the Gram matrix is not the identity), and X's components along the others, which
        are rounding, are taken off first; with none left this is [L, polar(X off L)].
        """
        if self.method == "exact":
            return self.polar(torch.cat([orthonormal, extra], -1))
        rtol = null_rtol(extra)
        # Whether X reaches L at all is decided in the input's precision: for a vocabulary-sized
        # U, which it does not reach, that and one projection are all the work.
        coupling = orthonormal.mT @ extra
        sigma = torch.linalg.svdvals(coupling)
        reach = int((~null_mask(sigma, rtol, torch.linalg.matrix_norm(extra))).sum())
        if not reach:  # Iso-CTS's U: the residuals were projected off L
            return torch.cat([orthonormal, self.polar(extra - orthonormal @ coupling)], -1)
        # In float64: Z has X's near-dependent columns beside LP, and rounding LP to the input's
        # precision would cost the small directions far more than rounding L itself does.
        work = torch.promote_types(extra.dtype, torch.float64)
        ell, x = orthonormal.to(work), extra.to(work)
        coupling = ell.mT @ x
        p = torch.linalg.svd(coupling, full_matrices=False)[0][:, :reach]
        # Kept, X's rounding along the rest of L would be amplified by 1/σ of its near-null directions.
        x = x - ell @ (coupling - p @ (p.mT @ coupling))
        reached = ell @ p
        z = polar_gram(torch.cat([reached, x], -1), rtol).factor
        return torch.cat([ell + (z[:, :reach] - reached) @ p.mT, z[:, reach:]], -1).to(extra.dtype)

    def randomized(self, k: int, rank: int) -> bool:
        """Whether the top `k` of a rank-`rank` matrix come from the range finder."""
        wanted = self.method == "randomized" or (
            self.method == "auto" and RANDOMIZED_MAX_FRACTION * k <= rank and rank >= RANDOMIZED_MIN_RANK)
        # With as many columns as the rank, a range finder costs what the SVD costs.
        return wanted and k + self.oversample < rank


def _project_out(x: torch.Tensor, left_out: torch.Tensor | None) -> torch.Tensor:
    """(I − L Lᵀ)·x for L = `left_out` (orthonormal columns), or x itself for none; x − LLᵀx
    is formed in the product's own storage, so no second tensor of x's size is held."""
    return x if left_out is None else (left_out @ (left_out.mT @ x)).neg_().add_(x)


def _orthonormal_columns(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(matrix).Q


@dataclasses.dataclass
class _Found:
    """What the range finder found for M = (I − L Lᵀ)·a: its orthonormal basis Q (m×c), the
    SVD Û Ŝ V̂ᵀ of QQᵀM (c triplets, Ŝ the Ritz values, each ≤ M's singular value of its rank),
    and what is needed to apply M again, all in the working precision (at least float32)."""

    a: torch.Tensor
    left_out: torch.Tensor | None
    basis: torch.Tensor
    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor

    def accurate(self, k: int, null: torch.Tensor) -> bool:
        """Whether an a-posteriori estimate puts the top `k` triplets within `FINDER_TOLERANCE`
        of M's exact ones (`null`: the singular value at or below which a direction is null).

        With E = (I − QQᵀ)M, MᵀÛ = V̂Ŝ holds exactly and MV̂ − ÛŜ = EV̂, so Wedin's theorem bounds
        the angles between the kept singular subspaces and M's top ones,
        ‖sin Θ‖_F ≤ ‖EV̂_k‖_F / (σ̂_k − σ_{k+1}(M)), and each worker's rank-k approximation errs by
        at most √2 times that, relative to its norm. MᵀM = BᵀB + EᵀE (B = QᵀM) gives
        σ_{k+1}(M)² ≤ σ̂_{k+1}² + ‖E‖²; ‖E‖ is estimated from `FINDER_PROBES` fresh Gaussian
        probes (Halko, Martinsson, Tropp 2011, section 4.3) turned once towards E's top direction.
        A flat spectrum leaves no gap and fails; so does a direction the finder found null
        while M may not have it null.
        """
        kept = int((self.s[..., :k] > null).sum(-1).min())
        probes = torch.randn(self.a.shape[-1], FINDER_PROBES, generator=torch.Generator().manual_seed(1),
                             dtype=self.a.dtype).to(self.a.device)
        image = self.image(torch.cat([self.vh[..., :kept, :].mT, probes], -1))
        residual = image[..., :kept] - self.u[..., :kept] * self.s[..., None, :kept]
        # ‖E‖ ≈ max ‖E·EᵀEω‖ / ‖EᵀEω‖ over the probes ω (EᵀEΩ = Mᵀ·EΩ: EΩ is orthogonal to Q).
        turned = self.adjoint(_project_out(image[..., kept:], self.basis))
        spread = (_project_out(self.image(turned), self.basis).norm(dim=-2)
                  / turned.norm(dim=-2).clamp_min(torch.finfo(turned.dtype).tiny)).amax(-1)
        after = self.s[..., kept] if kept < self.s.shape[-1] else torch.zeros_like(spread)
        beyond = torch.hypot(after, spread)  # ≈ an upper bound on σ_{kept+1}(M)
        if kept < k and bool((beyond > null.squeeze(-1)).any()):
            return False
        if not kept:
            return True
        gap = self.s[..., kept - 1] - beyond
        return bool(((gap > 0) & (residual.norm(dim=(-2, -1)) <= FINDER_TOLERANCE * gap)).all())

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """M·x."""
        return _project_out(self.a @ x, self.left_out)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        """Mᵀ·y."""
        return self.a.mT @ _project_out(y, self.left_out)

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Û, Ŝ, V̂ᵀ in `dtype`."""
        return self.u.to(dtype), self.s.to(dtype), self.vh.to(dtype)


def _randomized_svd(matrix: torch.Tensor, columns: int, power_iters: int, left_out: torch.Tensor | None,
                    early_dtype: torch.dtype, judged: int | None = None) -> _Found | None:
    """Thin SVD of the best rank-`columns` approximation of M = (I − L Lᵀ)·matrix found by
    subspace iteration (L: orthonormal columns projected out, or none): a basis Q of
    (M Mᵀ)^q M Ω, then the SVD of the thin Qᵀ M. With `judged` = k, None where the first
    iteration's Ritz values say the top k cannot pass `_Found.accurate` (`_hopeless`): the
    rest of the finder would be work thrown away.

    M is applied, never formed: projecting L out costs products with `columns` vectors,
    not with the whole matrix. The test matrix Ω comes from a fixed CPU generator, so every
    device, process and worker uses the same one and the result is deterministic.

    Only the last iteration and the final product need full precision: the earlier ones turn
    the basis towards the top directions, and one full-precision iteration then refines what
    their rounding left (docs/fidelity.md). So they multiply a copy of the matrix in
    `early_dtype` (bfloat16 where it is fast). Their projections run in that precision too,
    twice: L holds the matrix's largest directions, and what one rounded projection leaves of
    them could swamp the residual searched. They re-orthonormalise only the short side of
    each step (the long side's QR is the costlier); plain float32 iteration keeps both.
    """
    a = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
    early = a.to(early_dtype) if power_iters else a
    early_left = None if left_out is None else left_out.to(early.dtype)

    def image(by: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """M·x, computed in the precision of `by`, returned in a's."""
        y = by @ x.to(by.dtype)
        if by is a:
            return _project_out(y, left_out)
        return _project_out(_project_out(y, early_left), early_left).to(a.dtype)

    probe = torch.randn(a.shape[-1], columns, generator=torch.Generator().manual_seed(0), dtype=a.dtype)
    every_side = early is a
    short_rows = a.shape[-2] < a.shape[-1]
    column_side, row_side = every_side or short_rows, every_side or not short_rows  # which get a QR
    basis = image(early, probe.to(a.device))
    for step in range(power_iters):
        by = a if step == power_iters - 1 else early
        judge = judged is not None and step == 0
        # No second projection of the basis here: its columns spanning M's range already lie
        # in the range of I − L Lᵀ, and any others QR added to complete a rank-deficient
        # block only widen the subspace searched.
        if column_side:
            basis = _orthonormal_columns(basis)
        row_basis = (by.mT @ basis.to(by.dtype)).to(a.dtype)
        # Ritz values are those of Mᵀ or M times orthonormal columns: Mᵀ·Q where Q had its QR,
        # else M·(the row basis after its QR) below.
        if judge and column_side and _hopeless(row_basis, judged, power_iters):
            return None
        if row_side:
            row_basis = _orthonormal_columns(row_basis)
        basis = image(by, row_basis)
        if judge and not column_side and _hopeless(basis, judged, power_iters):
            return None
    basis = _orthonormal_columns(basis)
    # The last product is projected: columns QR added need not lie in the range of I − L Lᵀ,
    # and here they would carry L's directions into the factors.
    u_small, s, vh = lapack_svd((a.mT @ _project_out(basis, left_out)).mT)
    return _Found(a, left_out, basis, basis @ u_small, s, vh)


def _hopeless(estimate: torch.Tensor, k: int, power_iters: int) -> bool:
    """Whether `power_iters` subspace iterations cannot bring the top `k` within the
    certificate's reach, judged from the Ritz values σ̂ of `estimate` (M times orthonormal
    columns, after one pass).

    After q iterations what the basis misses of the top k is about ρ^{2q+1} of σ̂_k, with
    ρ = σ̂_c/σ̂_k (c: the basis's columns; Halko, Martinsson, Tropp 2011, section 10), and
    `_Found.accurate` needs it within `FINDER_TOLERANCE` of the gap σ̂_k − σ̂_{k+1}; where the
    estimate already misses that, the finder stops (a flat spectrum: Gaussian noise, a few
    shared directions under noise with k past them, a slowly decaying one). One pass's Ritz
    values put σ̂_c low, so the estimate errs towards trying, and the check still decides
    (docs/fidelity.md, `isoloco.bench.factors` measures both)."""
    s = torch.linalg.svdvals(estimate)
    if s.shape[-1] <= k:
        return False
    s_k = s[..., k - 1]
    alive = s_k > null_rtol(estimate) * s[..., 0]  # a rank below k: the check handles it cheaply
    missed = (s[..., -1] / s_k) ** (2 * power_iters + 1)
    return bool((alive & (missed > FINDER_TOLERANCE * (s_k - s[..., k]) / s_k)).any())


#: How `top_factors` got a worker's factors, the keys it counts them under: the range
#: finder's, certified; the exact ones without trying it (k too large a share of the rank, or
#: ``exact``); the exact ones after its first iteration judged it hopeless; the exact ones after
#: the certificate turned its factors down (all its work thrown away).
FACTOR_PATHS = ("finder", "exact", "exact_finder_stopped", "exact_finder_rejected")


@full_float32_matmuls()
def top_factors(matrix: torch.Tensor, k: int, settings: FactorSettings = FactorSettings(),
                largest: torch.Tensor | None = None, left_out: torch.Tensor | None = None,
                divisor: int = 1, paths: Counter | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k singular triplets U_k (m×k), S_k (k), V_k (n×k) of M = (I − L Lᵀ)·matrix / divisor
    (L = `left_out`, orthonormal columns, or none), numerically null directions zeroed in all
    three (relative to `largest`, see `thin_svd`). `paths` counts the `FACTOR_PATHS` taken.

    See `FactorSettings.randomized` for when the range finder is used; with ``auto`` its
    factors are kept only where `_Found.accurate` vouches for them, and it stops after one
    iteration where it cannot (`_hopeless`); else the exact path runs, which forms M (LAPACK's
    SVD for ``exact``, `svd_auto`'s top k otherwise).
    """
    check_matrix(matrix)
    rtol, found, path = null_rtol(matrix), None, "exact"
    if settings.randomized(k, full_rank(matrix)):
        auto = settings.method == "auto"
        found = _randomized_svd(matrix, k + settings.oversample, settings.power_iters, left_out,
                                settings.early_dtype(matrix.device), judged=k if auto else None)
        path = "finder" if found is not None else "exact_finder_stopped"
    if found is not None:
        # The null threshold on M·divisor, whose singular values the finder computed.
        top = found.s[..., :1]
        null = rtol * (top if largest is None else torch.broadcast_to(largest * divisor, top.shape))
        if settings.method == "auto" and not found.accurate(k, null):
            found, path = None, "exact_finder_rejected"
    if paths is not None:
        paths[path] += math.prod(matrix.shape[:-2])
    if found is not None:
        u, s, vh = found.factors(matrix.dtype)
        u, s, vh = u[..., :k], s[..., :k] / divisor, vh[..., :k, :]
    else:
        residual = _project_out(matrix, left_out)
        if divisor != 1:  # in place where the projection made a new tensor
            residual = residual / divisor if left_out is None else residual.div_(divisor)
        if settings.method == "exact":
            u, s, vh = lapack_svd(residual)
            u, s, vh = u[..., :k], s[..., :k], vh[..., :k, :]
        else:
            u, s, vh = svd_auto(residual, k)
    if largest is None:
        largest = s[..., :1]
    null = null_mask(s, rtol, largest)
    return u.masked_fill(null.unsqueeze(-2), 0), s.masked_fill(null, 0), vh.masked_fill(null.unsqueeze(-1), 0).mT
