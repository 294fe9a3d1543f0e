"""Orthogonalisation and scale estimators: the two halves of an Iso-C correction.

Iso-C replaces the spectrum of a matrix M = U S Vᵀ (m×n, r = min(m, n)) by its mean:

    iso(M) = mean(S) · U Vᵀ = (‖M‖_* / r) · polar(M)

so it needs an orthogonal factor ``polar(M)`` and a scale. This module offers four ways to
get the factor and three ways to get the scale, so the exact reference and the fast paths
share one entry point, `iso_correct`, and can be measured against each other
(``benchmarks/ortho.py``):

* ``svd``: `torch.linalg.svd`, the reference;
* ``gram``: the same factor from the eigendecomposition of the small Gram matrix (float64),
  exact without an SVD;
* ``newton_schulz``: Muon's quintic iteration (approximate, matmuls only, any dtype);
* ``polar_express``: the Polar Express per-step schedule (approximate, converges tighter).

Scales: ``exact`` (mean singular value), ``rms`` (‖M‖_F/√r, the paper's fast mode) and
``inner`` (⟨M, O⟩/r with O the computed factor).

Two variants flatten the spectrum less than Iso-C (`reshaped_spectrum`), for updates whose
spectrum is so steep (a nearly rank-one first pseudo-gradient of the embedding or LM head)
that giving every direction the mean singular value mostly amplifies noise: ``iso_power``
maps σ to c·σ^p, ``iso_floor`` leaves the directions below a fraction of σ_max as they are.
They reshape singular values, so they take the exact routes only. At their defaults (0)
`iso_correct` runs the paper's Iso-C on its own code path.

Rank-deficient matrices. The exact paths return the *minimal* polar factor
M (MᵀM)^{+1/2}: directions whose singular value is numerically zero (see
`null_rtol`) are left out instead of being completed by arbitrary orthonormal vectors. An
unconstrained SVD would fill them with rounding noise and Iso-C would then give that noise
the full mean singular value. The iterative methods approximate the same answer: their odd
polynomials keep 0 at 0 and grow a rounding-level singular value only by their slope at 0
per step, not to 1. An all-zero matrix has the all-zero factor under every method, and its
Iso-C update is zero.

All functions take one matrix or a batch of same-shape matrices (..., m, n).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections import Counter
from typing import Any, Callable, Iterator, Literal

import torch

logger = logging.getLogger(__name__)

OrthoMethod = Literal["auto", "svd", "gram", "newton_schulz", "polar_express"]
ScaleMethod = Literal["exact", "rms", "inner"]

#: Muon's quintic coefficients (Jordan et al. 2024): fast initial growth of small singular
#: values; after 5 steps they sit in roughly [0.68, 1.13] rather than at 1.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: Polar Express schedule (Amsel, Persson, Musco, Gower 2025, Algorithm 1): one minimax-
#: optimal odd quintic per step for singular values in [1e-3, 1]. The last entry is the
#: limit polynomial (15x − 10x³ + 3x⁵)/8, repeated for longer runs.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
#: Low-precision rounding can push a singular value slightly above 1, where the aggressive
#: early polynomials overshoot. The published safety scaling evaluates p(x / s) instead of
#: p(x), i.e. (a/s, b/s³, c/s⁵), on every step but the last; the input is divided by s too.
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS_COEFFICIENTS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)


#: The dtypes the iterative methods may run in, by the names configs use.
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

#: The float32 matmul settings of the backends the merge runs on: torch's per-backend
#: ``fp32_precision`` ("ieee": full float32; a host may set "tf32", or "bf16" on oneDNN).
_MATMUL_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
_pinned_lock = threading.Lock()
_pinned: list[str] = []  # the settings to restore, while a pin is held
_pin_count = 0


@contextlib.contextmanager
def full_float32_matmuls() -> Iterator[None]:
    """float32 matmuls at full precision for the duration, whatever the host framework set
    (TF32 on a GPU, bfloat16 passes on a CPU), so a merge computes the same numbers under any
    host; the settings are restored after.

    torch's settings are process-wide: nested and concurrent pins restore them when the last
    one ends, and meanwhile every float32 matmul of the process runs at full precision too: slower, never less precise (training's matmuls under
    bfloat16 autocast are not float32 ones)."""
    global _pin_count
    with _pinned_lock:
        if not _pin_count:
            _pinned[:] = [backend.fp32_precision for backend in _MATMUL_BACKENDS]
            for backend in _MATMUL_BACKENDS:
                backend.fp32_precision = "ieee"
        _pin_count += 1
    try:
        yield
    finally:
        with _pinned_lock:
            _pin_count -= 1
            if not _pin_count:
                for backend, saved in zip(_MATMUL_BACKENDS, _pinned):
                    backend.fp32_precision = saved


@dataclasses.dataclass(frozen=True)
class IsoSettings:
    """How an Iso-C correction is computed: the one set of knobs (and the one default) that
    merge rules, the outer optimizer and the run config share."""

    ortho: OrthoMethod = "auto"  # how the orthogonal factor is computed (POLAR_METHODS)
    scale: ScaleMethod = "exact"  # how the one singular value is estimated (SCALE_METHODS)
    ns_steps: int = 5  # iterations of newton_schulz / polar_express
    ns_dtype: str = "bfloat16"  # dtype of those iterations, a key of NS_DTYPES
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


@dataclasses.dataclass(frozen=True)
class Polar:
    """An orthogonal factor (same shape and dtype as the input) and, when the method yields
    them for free, the singular values (..., r) with numerically null ones set to 0."""

    factor: torch.Tensor
    singular_values: torch.Tensor | None


def _check_matrix(matrix: torch.Tensor) -> None:
    if matrix.ndim < 2 or not matrix.is_floating_point():
        raise ValueError(
            f"expected a floating-point matrix (or a batch of them, shape (..., m, n)), got "
            f"dtype {matrix.dtype} and shape {tuple(matrix.shape)}"
        )


def _rank(matrix: torch.Tensor) -> int:
    return min(matrix.shape[-2], matrix.shape[-1])


def null_rtol(matrix: torch.Tensor) -> float:
    """Relative threshold σ ≤ rtol·σ_max below which a singular direction is numerically null.

    rtol = √max(m, n) · eps(dtype): an SVD computes singular values with an absolute error of
    order eps·σ_max times a slowly growing function of the size, so the "zero" singular values
    of an exactly rank-deficient matrix fall below it. numpy's worst-case rank tolerance
    max(m, n)·eps is deliberately not used: Iso-C gives every kept direction the same weight,
    so dropping a small but genuine direction changes the update by ~1/√r per direction, and
    pseudo-gradients do have genuine singular values between the two thresholds
    (docs/benchmarks.md, "Thresholds in the code").
    Half-precision inputs are judged at float32 precision, the precision the methods work in.
    """
    dtype = torch.promote_types(matrix.dtype, torch.float32)
    return math.sqrt(max(matrix.shape[-2], matrix.shape[-1])) * torch.finfo(dtype).eps


def _null_mask(singular_values: torch.Tensor, rtol: float, largest: torch.Tensor | None = None) -> torch.Tensor:
    """True where a singular value is numerically null (all of them for a zero matrix);
    `largest` defaults to the largest of `singular_values`."""
    if largest is None:
        largest = singular_values.amax(dim=-1, keepdim=True)
    return singular_values <= rtol * largest


def _tall_view(matrix: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The matrix in the orientation with rows ≥ columns, and whether it was transposed."""
    wide = matrix.shape[-2] < matrix.shape[-1]
    return (matrix.mT if wide else matrix), wide


def _svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD, computed on the tall orientation in at least float32.

    Tall, because on CPU LAPACK's SVD of a wide matrix is much slower than of its transposed
    view (docs/benchmarks.md, "Thresholds in the code"); at least float32, because LAPACK has
    no half precision. If it fails to converge: log a warning and retry in float64.
    """
    tall, transposed = _tall_view(matrix)
    work_dtype = torch.promote_types(matrix.dtype, torch.float32)
    try:
        u, s, vh = torch.linalg.svd(tall.to(work_dtype), full_matrices=False)
    except torch.linalg.LinAlgError as error:
        if work_dtype == torch.float64:
            raise
        logger.warning("torch.linalg.svd did not converge on a %s %s matrix (%s); retrying in float64",
                       tuple(matrix.shape), matrix.dtype, error)
        u, s, vh = torch.linalg.svd(tall.double(), full_matrices=False)
    if transposed:  # M = (U S Vᴴ)ᵀ = V S Uᵀ
        u, vh = vh.mT, u.mT
    return u.to(matrix.dtype), s.to(matrix.dtype), vh.to(matrix.dtype)


def thin_svd(
    matrix: torch.Tensor, largest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD U, S, Vᴴ with numerically null directions zeroed in all three.

    The singular vectors of a null direction are arbitrary (whatever rounding produced), so
    callers that stack or orthogonalise singular vectors (Iso-C, TSV, Iso-CTS) must not see
    them. "Null" is relative to the matrix's own largest singular value unless `largest` is
    given: what is left of a matrix after projecting a subspace out must be judged against
    the matrix it was cut from, or its rounding noise would pass for signal. Retries in
    float64, with a warning, if LAPACK fails to converge.
    """
    _check_matrix(matrix)
    u, s, vh = _svd(matrix)
    null = _null_mask(s, null_rtol(matrix), largest)
    return u.masked_fill(null.unsqueeze(-2), 0), s.masked_fill(null, 0), vh.masked_fill(null.unsqueeze(-1), 0)


def polar_svd(matrix: torch.Tensor) -> Polar:
    """Exact polar factor U Vᵀ and singular values from `torch.linalg.svd` (the reference)."""
    u, s, vh = thin_svd(matrix)
    return Polar(u @ vh, s)


#: `_gram64` converts the rows of a matrix to float64 in blocks of about this many entries
#: (8 MiB): a whole float64 copy of a float32 matrix would be twice its size, at the peak of
#: Iso-C and of TSV's and Iso-CTS's exact factors. The tiny preset's largest matrix is one block.
GRAM_BLOCK_ENTRIES = 2**20


def _gram64(tall: torch.Tensor) -> torch.Tensor:
    """AᵀA in float64 for a tall A (..., m, r), summed over blocks of `GRAM_BLOCK_ENTRIES`."""
    blocks = tall.split(max(1, GRAM_BLOCK_ENTRIES // tall.shape[-1]), dim=-2)
    first = blocks[0].double()
    gram = first.mT @ first
    for block in blocks[1:]:
        block = block.double()
        gram += block.mT @ block
    return gram


def _gram_eigen(tall: torch.Tensor, vectors: bool,
                rtol: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigen-decomposition of G = AᵀA (n×n, float64) of a tall A: singular values (descending,
    null ones 0) and, if asked, the right singular vectors as columns.

    float64 because forming G squares the condition number: in float64 the eigensolver still
    resolves σ down to ~√(n·eps64)·σ_max ≈ 1e-7·σ_max, below `null_rtol` for float32 inputs.
    Float64 inputs get the larger of the two thresholds.
    """
    gram = _gram64(tall)
    if vectors:
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
        eigenvectors = eigenvectors.flip(-1)
    else:
        eigenvalues, eigenvectors = torch.linalg.eigvalsh(gram), None
    sigma = eigenvalues.flip(-1).clamp_min(0).sqrt()
    resolution = math.sqrt(tall.shape[-1] * torch.finfo(torch.float64).eps)
    sigma = sigma.masked_fill(_null_mask(sigma, max(rtol or null_rtol(tall), resolution)), 0)
    return sigma, eigenvectors


def polar_gram(matrix: torch.Tensor, rtol: float | None = None) -> Polar:
    """Exact polar factor without an SVD: polar(A) = A·W, W = Q Λ^{-1/2} Qᵀ, AᵀA = Q Λ Qᵀ.

    Works on the tall orientation so the Gram matrix is r×r; costs two m·r² matmuls and one
    r×r symmetric eigendecomposition instead of an m×r SVD. Null directions get weight 0
    (their 1/σ would explode). Only the Gram matrix and its eigendecomposition need float64;
    the final A·W runs in the input's precision (at least float32), which halves its cost and
    errs by ~eps·σ_max/σ_i in direction i — the same order as a float32 SVD's own error in
    its singular vectors. `rtol` judges null directions of a float64 matrix built from data of
    a lower precision at that data's `null_rtol` (float64's own would keep directions that are
    rounding of the data, and give them full weight).
    """
    gram = _GramRoute(matrix, rtol)
    factor = gram.tall @ gram.weights().to(gram.tall.dtype)
    factor = factor.mT if gram.transposed else factor
    return Polar(factor.to(matrix.dtype), gram.sigma.to(matrix.dtype))


class _GramRoute:
    """What the Gram route needs of a matrix: its tall orientation in the working precision
    (at least float32) and whether it was transposed, and the eigendecomposition of the Gram
    matrix (float64): singular values σ (null ones 0), right singular vectors q, and 1/σ with
    0 for the null directions (their 1/σ would explode). Null is `null_rtol` of the matrix, or
    `rtol` for a float64 matrix computed from data of a lower precision."""

    def __init__(self, matrix: torch.Tensor, rtol: float | None = None) -> None:
        _check_matrix(matrix)
        tall, self.transposed = _tall_view(matrix)
        self.sigma, self.q = _gram_eigen(tall, vectors=True, rtol=rtol)
        self.inverse_sigma = torch.where(self.sigma > 0, self.sigma.reciprocal(), torch.zeros_like(self.sigma))
        self.tall = tall.to(torch.promote_types(matrix.dtype, torch.float32))

    def weights(self) -> torch.Tensor:
        """W = Q Λ^{-1/2} Qᵀ (float64), so that polar(tall) = tall·W."""
        return (self.q * self.inverse_sigma.unsqueeze(-2)) @ self.q.mT


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """All r singular values, descending, null ones 0, via the Gram eigenvalues (float64).

    Cheaper than `torch.linalg.svdvals` for the tall shapes of a language model and agrees
    with it to ~1e-7·σ_max, far below what a mean over r values can notice.
    """
    _check_matrix(matrix)
    sigma, _ = _gram_eigen(_tall_view(matrix)[0], vectors=False)
    return sigma.to(matrix.dtype)


def _odd_quintic_iteration(
    matrix: torch.Tensor,
    coefficients: list[tuple[float, float, float]],
    dtype: torch.dtype,
    headroom: float,
) -> torch.Tensor:
    """Apply X ← aX + (bA + cA²)X, A = XXᵀ, once per coefficient triple.

    Each step maps every singular value x of X to a x + b x³ + c x⁵ and keeps the singular
    vectors. X starts as M/(headroom·‖M‖_F) so all singular values lie in [0, 1]; the
    iteration runs on the wide orientation (A is r×r, the cheap side), and on a CPU very wide
    matrices run it on their Gram matrix instead (`_gram_space_iteration`). Normalisation is done
    in float32 with the norm clamped at the smallest normal number rather than offset by an
    epsilon: a zero matrix stays zero and a tiny but nonzero one is not shrunk further.
    """
    _check_matrix(matrix)
    tall, transposed = _tall_view(matrix)
    x = tall.mT.float()  # wide
    norm = torch.linalg.matrix_norm(x, keepdim=True) * headroom
    x = (x / norm.clamp_min(torch.finfo(torch.float32).tiny)).to(dtype)
    if x.device.type == "cpu" and x.shape[-1] >= NS_GRAM_SPACE_MIN_ASPECT * x.shape[-2]:
        x = _gram_space_iteration(x, coefficients)
    else:
        for a, b, c in coefficients:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x if transposed else x.mT).to(matrix.dtype)


#: On CPU, a wide X (r×c) with c at least this many times r iterates on its Gram matrix
#: (`_gram_space_iteration`): faster for very wide matrices, slower once the float32 r×r work
#: is no longer small (docs/benchmarks.md, "Thresholds in the code"); of the presets'
#: matrices only the vocabulary ones (aspect 16 to 128) qualify.
#: Not on GPUs, whose bfloat16 matmuls are many times faster than the float32 ones this needs.
NS_GRAM_SPACE_MIN_ASPECT = 8


def _gram_space_iteration(x: torch.Tensor, coefficients: list[tuple[float, float, float]]) -> torch.Tensor:
    """The steps of `_odd_quintic_iteration` for a wide X₀ (r×c), run on r×r matrices.

    Every iterate is X_k = Q_k X₀ with Q_k a polynomial in G = X₀X₀ᵀ, and A_k = X_k X_kᵀ =
    Q_k G Q_k commutes with it, so a step is Q ← PQ, A ← PAP with P = aI + bA + cA². That
    costs O(r³) per step instead of O(r²c), and X₀ is multiplied by Q once at the end: two
    r×c products in all instead of two per step. The r×r work runs in at least float32
    whatever the dtype of X₀, because Q tends to G^(-1/2), whose large entries (from the small
    singular values) would swamp the rest in bfloat16; G is formed from the (possibly rounded)
    X₀ itself, so the final product applies Q to the very matrix it was built for.
    """
    exact = x.to(torch.promote_types(x.dtype, torch.float32))
    a_k = exact @ exact.mT
    q = None
    for step, (a, b, c) in enumerate(coefficients):
        p = b * a_k + c * (a_k @ a_k)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        q = p if q is None else p @ q
        if step + 1 < len(coefficients):
            a_k = p @ a_k @ p
    return q.to(x.dtype) @ x


def polar_newton_schulz(matrix: torch.Tensor, steps: int = IsoSettings.ns_steps,
                        dtype: torch.dtype = NS_DTYPES[IsoSettings.ns_dtype]) -> Polar:
    """Approximate polar factor by Muon's Newton–Schulz iteration (no singular values)."""
    factor = _odd_quintic_iteration(matrix, [MUON_COEFFICIENTS] * steps, dtype, headroom=1.0)
    return Polar(factor, None)


def polar_express(matrix: torch.Tensor, steps: int = IsoSettings.ns_steps,
                  dtype: torch.dtype = NS_DTYPES[IsoSettings.ns_dtype]) -> Polar:
    """Approximate polar factor by the Polar Express schedule (no singular values).

    Steps beyond the published schedule repeat its last (limit) polynomial.
    """
    schedule = list(POLAR_EXPRESS_COEFFICIENTS[:steps])
    schedule += [POLAR_EXPRESS_COEFFICIENTS[-1]] * (steps - len(schedule))
    factor = _odd_quintic_iteration(matrix, schedule, dtype, headroom=POLAR_EXPRESS_SAFETY)
    return Polar(factor, None)


def scale_exact(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """The mean singular value ‖M‖_*/r, Iso-C's scale (shape (...)).

    Uses the method's singular values when it produced them; otherwise (Newton–Schulz, Polar
    Express) computes them from the Gram eigenvalues, which costs most of what the ``gram``
    path costs: pair ``exact`` with an iterative method only when accuracy of the scale
    matters more than speed.
    """
    sigma = polar.singular_values if polar.singular_values is not None else singular_values(matrix)
    return sigma.sum(dim=-1) / _rank(matrix)


def scale_rms(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """‖M‖_F/√r: the RMS of the singular values, ≥ their mean (the paper's fast mode)."""
    del polar  # needs only the matrix
    return torch.linalg.matrix_norm(matrix) / math.sqrt(_rank(matrix))


def scale_inner(matrix: torch.Tensor, polar: Polar) -> torch.Tensor:
    """⟨M, O⟩/r with O the computed factor: equals the exact mean when O = polar(M).

    For an approximate O = U f(S) Vᵀ it is Σ σ_i f(σ_i)/r, a mean weighted towards the large
    singular values, which the iterations get right first.
    """
    return (matrix * polar.factor).sum(dim=(-2, -1)) / _rank(matrix)


#: Below this aspect ratio `auto` takes the SVD: on square matrices the Gram route gains
#: nothing (docs/benchmarks.md, "Thresholds in the code").
GRAM_MIN_ASPECT = 1.5


def _aspect(matrix: torch.Tensor) -> float:
    short, long = sorted(matrix.shape[-2:])
    return long / max(short, 1)


def polar_auto(matrix: torch.Tensor) -> Polar:
    """The fastest exact polar factor for this shape: `gram` for clearly non-square
    matrices (MLP, embedding and LM-head weights), `svd` for square-ish ones."""
    _check_matrix(matrix)
    return polar_gram(matrix) if _aspect(matrix) >= GRAM_MIN_ASPECT else polar_svd(matrix)


def gram_svd(matrix: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD U, S, Vᴴ from the Gram eigendecomposition (float64), null directions zeroed
    in all three: for a tall A = U S Vᵀ, V and S² are the eigenpairs of AᵀA and U = A V / S.
    Costs what `polar_gram` costs; U errs by ~eps·σ_max/σ_i in direction i (see there).
    With `k`, only the top k triplets: U_k = A V_k / S_k is then an m·r·k product, not m·r²."""
    gram = _GramRoute(matrix)
    q, sigma, inverse = gram.q[..., :k], gram.sigma[..., :k], gram.inverse_sigma[..., :k]
    u = gram.tall @ (q * inverse.unsqueeze(-2)).to(gram.tall.dtype)
    v = q.masked_fill((sigma == 0).unsqueeze(-2), 0).to(gram.tall.dtype)
    if gram.transposed:  # M = (U S Vᵀ)ᵀ = V S Uᵀ
        u, v = v, u
    return u.to(matrix.dtype), sigma.to(matrix.dtype), v.mT.to(matrix.dtype)


def svd_auto(matrix: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The faster exact thin SVD for this shape (its top `k` triplets, or all), chosen as
    `polar_auto` chooses: `gram_svd` for clearly non-square matrices, `thin_svd` for square-ish ones."""
    if _aspect(matrix) >= GRAM_MIN_ASPECT:
        return gram_svd(matrix, k)
    u, s, vh = thin_svd(matrix)
    return u[..., :k], s[..., :k], vh[..., :k, :]


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
    _check_matrix(matrix)
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
        gram = _GramRoute(matrix)
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
        reach = int((~_null_mask(sigma, rtol, torch.linalg.matrix_norm(extra))).sum())
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
    u_small, s, vh = _svd((a.mT @ _project_out(basis, left_out)).mT)
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
    _check_matrix(matrix)
    rtol, found, path = null_rtol(matrix), None, "exact"
    if settings.randomized(k, _rank(matrix)):
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
            u, s, vh = _svd(residual)
            u, s, vh = u[..., :k], s[..., :k], vh[..., :k, :]
        else:
            u, s, vh = svd_auto(residual, k)
    if largest is None:
        largest = s[..., :1]
    null = _null_mask(s, rtol, largest)
    return u.masked_fill(null.unsqueeze(-2), 0), s.masked_fill(null, 0), vh.masked_fill(null.unsqueeze(-1), 0).mT
