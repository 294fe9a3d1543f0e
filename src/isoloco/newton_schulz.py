"""Approximate polar factors by odd quintic iterations, matmuls only, in any dtype:

* ``newton_schulz``: Muon's quintic iteration (`polar_newton_schulz`);
* ``polar_express``: the Polar Express per-step schedule, which converges tighter
  (`polar_express`).

Their odd polynomials keep 0 at 0 and grow a rounding-level singular value only by their
slope at 0 per step, not to 1, so they approximate the minimal polar factor that the exact
routes (`isoloco.svd`) compute; an all-zero matrix stays zero. They yield no singular values.
"""

from __future__ import annotations

import torch

from isoloco.svd import Polar, check_matrix, tall_view

#: Iterations, and their dtype (a key of `NS_DTYPES`), when none are named: `IsoSettings`'s defaults.
NS_STEPS = 5
NS_DTYPE = "bfloat16"

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
    check_matrix(matrix)
    tall, transposed = tall_view(matrix)
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


def polar_newton_schulz(matrix: torch.Tensor, steps: int = NS_STEPS,
                        dtype: torch.dtype = NS_DTYPES[NS_DTYPE]) -> Polar:
    """Approximate polar factor by Muon's Newton–Schulz iteration (no singular values)."""
    factor = _odd_quintic_iteration(matrix, [MUON_COEFFICIENTS] * steps, dtype, headroom=1.0)
    return Polar(factor, None)


def polar_express(matrix: torch.Tensor, steps: int = NS_STEPS,
                  dtype: torch.dtype = NS_DTYPES[NS_DTYPE]) -> Polar:
    """Approximate polar factor by the Polar Express schedule (no singular values).

    Steps beyond the published schedule repeat its last (limit) polynomial.
    """
    schedule = list(POLAR_EXPRESS_COEFFICIENTS[:steps])
    schedule += [POLAR_EXPRESS_COEFFICIENTS[-1]] * (steps - len(schedule))
    factor = _odd_quintic_iteration(matrix, schedule, dtype, headroom=POLAR_EXPRESS_SAFETY)
    return Polar(factor, None)
