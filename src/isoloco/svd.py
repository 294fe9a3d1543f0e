"""The exact routes to a matrix's polar factor and thin SVD: LAPACK's SVD and the Gram
matrix's eigendecomposition (float64), and the null threshold both judge directions by.

* ``svd``: `torch.linalg.svd` (`thin_svd`, `polar_svd`), the reference;
* ``gram``: the same factor, singular values and vectors from the eigendecomposition of the
  small Gram matrix (float64), exact without an SVD (`polar_gram`, `gram_svd`,
  `singular_values`);
* ``auto``: whichever of the two is faster for the shape (`polar_auto`, `svd_auto`).

Rank-deficient matrices. These routes return the *minimal* polar factor M (MᵀM)^{+1/2}:
directions whose singular value is numerically zero (see `null_rtol`) are left out instead
of being completed by arbitrary orthonormal vectors. An unconstrained SVD would fill them with
rounding noise, and Iso-C (`isoloco.ortho`) would then give that noise the full mean singular
value. An all-zero matrix has the all-zero factor.

`full_float32_matmuls` pins float32 matmuls at full precision while a merge computes, so its
numbers do not depend on what the host framework set. All functions take one matrix or a
batch of same-shape matrices (..., m, n).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

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
class Polar:
    """An orthogonal factor (same shape and dtype as the input) and, when the method yields
    them for free, the singular values (..., r) with numerically null ones set to 0."""

    factor: torch.Tensor
    singular_values: torch.Tensor | None


def check_matrix(matrix: torch.Tensor) -> None:
    """Refuse anything but a floating-point matrix or a batch of them."""
    if matrix.ndim < 2 or not matrix.is_floating_point():
        raise ValueError(
            f"expected a floating-point matrix (or a batch of them, shape (..., m, n)), got "
            f"dtype {matrix.dtype} and shape {tuple(matrix.shape)}"
        )


def full_rank(matrix: torch.Tensor) -> int:
    """r = min(m, n): how many singular values a matrix of this shape has."""
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


def null_mask(singular_values: torch.Tensor, rtol: float, largest: torch.Tensor | None = None) -> torch.Tensor:
    """True where a singular value is numerically null (all of them for a zero matrix);
    `largest` defaults to the largest of `singular_values`."""
    if largest is None:
        largest = singular_values.amax(dim=-1, keepdim=True)
    return singular_values <= rtol * largest


def tall_view(matrix: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The matrix in the orientation with rows ≥ columns, and whether it was transposed."""
    wide = matrix.shape[-2] < matrix.shape[-1]
    return (matrix.mT if wide else matrix), wide


def lapack_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD, computed on the tall orientation in at least float32.

    Tall, because on CPU LAPACK's SVD of a wide matrix is much slower than of its transposed
    view (docs/benchmarks.md, "Thresholds in the code"); at least float32, because LAPACK has
    no half precision. If it fails to converge: log a warning and retry in float64.
    """
    tall, transposed = tall_view(matrix)
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
    check_matrix(matrix)
    u, s, vh = lapack_svd(matrix)
    null = null_mask(s, null_rtol(matrix), largest)
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
    sigma = sigma.masked_fill(null_mask(sigma, max(rtol or null_rtol(tall), resolution)), 0)
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
    gram = GramRoute(matrix, rtol)
    factor = gram.tall @ gram.weights().to(gram.tall.dtype)
    factor = factor.mT if gram.transposed else factor
    return Polar(factor.to(matrix.dtype), gram.sigma.to(matrix.dtype))


class GramRoute:
    """What the Gram route needs of a matrix: its tall orientation in the working precision
    (at least float32) and whether it was transposed, and the eigendecomposition of the Gram
    matrix (float64): singular values σ (null ones 0), right singular vectors q, and 1/σ with
    0 for the null directions (their 1/σ would explode). Null is `null_rtol` of the matrix, or
    `rtol` for a float64 matrix computed from data of a lower precision."""

    def __init__(self, matrix: torch.Tensor, rtol: float | None = None) -> None:
        check_matrix(matrix)
        tall, self.transposed = tall_view(matrix)
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
    check_matrix(matrix)
    sigma, _ = _gram_eigen(tall_view(matrix)[0], vectors=False)
    return sigma.to(matrix.dtype)


#: Below this aspect ratio `auto` takes the SVD: on square matrices the Gram route gains
#: nothing (docs/benchmarks.md, "Thresholds in the code").
GRAM_MIN_ASPECT = 1.5


def _aspect(matrix: torch.Tensor) -> float:
    short, long = sorted(matrix.shape[-2:])
    return long / max(short, 1)


def polar_auto(matrix: torch.Tensor) -> Polar:
    """The fastest exact polar factor for this shape: `gram` for clearly non-square
    matrices (MLP, embedding and LM-head weights), `svd` for square-ish ones."""
    check_matrix(matrix)
    return polar_gram(matrix) if _aspect(matrix) >= GRAM_MIN_ASPECT else polar_svd(matrix)


def gram_svd(matrix: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD U, S, Vᴴ from the Gram eigendecomposition (float64), null directions zeroed
    in all three: for a tall A = U S Vᵀ, V and S² are the eigenpairs of AᵀA and U = A V / S.
    Costs what `polar_gram` costs; U errs by ~eps·σ_max/σ_i in direction i (see there).
    With `k`, only the top k triplets: U_k = A V_k / S_k is then an m·r·k product, not m·r²."""
    gram = GramRoute(matrix)
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
