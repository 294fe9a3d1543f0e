"""Orthogonalisation and scale estimators: exact paths against numpy, fast paths against exact."""

import math

import numpy as np
import pytest
import torch

from isoloco import ortho

METHODS = list(ortho.POLAR_METHODS)
SVD = ortho.IsoSettings(ortho="svd")  # the exact reference
SCALES = list(ortho.SCALE_METHODS)


def signal_plus_noise(rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A rank-8 signal with decaying strengths plus dense noise, like a pseudo-gradient."""
    g = torch.Generator().manual_seed(seed)
    rank = min(8, rows, cols)
    u = torch.linalg.qr(torch.randn(rows, rank, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, rank, generator=g, dtype=torch.float64))[0]
    strengths = torch.logspace(1, 0, rank, dtype=torch.float64)
    noise = torch.randn(rows, cols, generator=g, dtype=torch.float64) / math.sqrt(max(rows, cols))
    return ((u * strengths) @ v.T + noise).to(dtype)


def rank_deficient(rows: int, cols: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def singular_values_of(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.double())


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6), (1, 9), (9, 1)])
def test_svd_iso_c_matches_numpy(shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u, s, vh = np.linalg.svd(matrix.numpy(), full_matrices=False)
    expected = s.mean() * (u @ vh)

    polar = ortho.polar_svd(matrix)
    np.testing.assert_allclose(polar.factor.numpy(), u @ vh, atol=1e-12)
    np.testing.assert_allclose(polar.singular_values.numpy(), s, rtol=1e-12)
    np.testing.assert_allclose(ortho.iso_correct(matrix, SVD).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (64, 64)])
def test_gram_matches_svd(shape):
    matrix = signal_plus_noise(*shape)
    exact, gram = ortho.polar_svd(matrix), ortho.polar_gram(matrix)
    assert relative_error(gram.factor, exact.factor) < 1e-4
    assert relative_error(gram.singular_values, exact.singular_values) < 1e-4
    assert relative_error(ortho.iso_correct(matrix, ortho.IsoSettings("gram")), ortho.iso_correct(matrix, SVD)) < 1e-4


def test_singular_values_match_svdvals():
    matrix = signal_plus_noise(80, 30)
    torch.testing.assert_close(ortho.singular_values(matrix), torch.linalg.svdvals(matrix), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
@pytest.mark.parametrize(
    "method, range_tolerance, null_tolerance",
    [("svd", 1e-5, 1e-6), ("gram", 1e-5, 1e-6), ("newton_schulz", 0.35, 1e-3), ("polar_express", 0.15, 1e-3)],
)
def test_rank_deficient_gives_the_partial_isometry(shape, method, range_tolerance, null_tolerance):
    """Null directions are left out: the factor is (about) 1 on the range of M, 0 elsewhere.

    The iterations only approximate this: they grow rounding noise in null directions by
    their slope at 0 (≈ 3.4 per Newton–Schulz step) instead of completing them to 1.
    """
    matrix = rank_deficient(*shape, rank=3)
    factor = ortho.orthogonalize(matrix, method, ns_dtype=torch.float32).factor
    sigma = singular_values_of(factor)
    torch.testing.assert_close(sigma[:3], torch.ones(3, dtype=torch.float64), atol=range_tolerance, rtol=0)
    assert sigma[3:].max() < null_tolerance
    # The factor lies in the column space of M: (I − U₃U₃ᵀ) O ≈ 0.
    u = torch.linalg.svd(matrix.double())[0][:, :3]
    outside = factor.double() - u @ (u.T @ factor.double())
    assert outside.norm() < null_tolerance * math.sqrt(min(shape))


def test_exact_paths_agree_on_rank_deficient_iso_c():
    matrix = rank_deficient(20, 12, rank=4)
    exact = ortho.iso_correct(matrix, SVD)
    torch.testing.assert_close(ortho.iso_correct(matrix, ortho.IsoSettings("gram")), exact, atol=1e-5, rtol=1e-4)
    expected_scale = torch.linalg.svdvals(matrix.double())[:4].sum() / 12
    torch.testing.assert_close(singular_values_of(exact)[:4], expected_scale.expand(4), rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (1, 5), (5, 1), (3, 6, 4)])
def test_zero_matrix_gives_zeros(method, scale, shape):
    result = ortho.iso_correct(torch.zeros(shape), ortho.IsoSettings(method, scale))
    assert torch.equal(result, torch.zeros(shape))


@pytest.mark.parametrize("method", ["svd", "gram"])
@pytest.mark.parametrize("shape", [(1, 7), (7, 1)])
def test_vector_shaped_matrix_is_its_own_iso_c(method, shape):
    """r = 1: one singular value, so the mean changes nothing."""
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ortho.iso_correct(matrix, ortho.IsoSettings(method)), matrix)


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express"])
@pytest.mark.parametrize("shape", [(1, 7), (7, 1)])
def test_iterative_vector_shaped(method, shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    ratio = ortho.orthogonalize(matrix, method).factor / (matrix / matrix.norm())
    assert 0.6 < ratio.min() and ratio.max() < 1.2


# Bands are the iterations' fixed behaviour on a well-conditioned matrix: Muon's polynomial
# oscillates in about [0.68, 1.13]; Polar Express contracts towards 1.
@pytest.mark.parametrize(
    "method, steps, dtype, low, high",
    [
        ("newton_schulz", 5, torch.bfloat16, 0.6, 1.2),
        ("newton_schulz", 5, torch.float32, 0.6, 1.2),
        ("polar_express", 5, torch.bfloat16, 0.8, 1.15),
        ("polar_express", 8, torch.float32, 0.999, 1.001),
    ],
)
@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
def test_iterative_singular_values_in_band(method, steps, dtype, low, high, shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    factor = ortho.orthogonalize(matrix, method, ns_steps=steps, ns_dtype=dtype).factor
    assert factor.dtype == matrix.dtype
    sigma = singular_values_of(factor)
    assert low < sigma.min() and sigma.max() < high


def test_polar_express_converges_closer_than_newton_schulz():
    matrix = signal_plus_noise(64, 96)
    exact = ortho.polar_svd(matrix).factor
    ns = ortho.polar_newton_schulz(matrix, dtype=torch.float32).factor
    pe = ortho.polar_express(matrix, dtype=torch.float32).factor
    assert relative_error(pe, exact) < relative_error(ns, exact)


def test_polar_express_schedule():
    coefficients = ortho.POLAR_EXPRESS_COEFFICIENTS
    assert len(coefficients) == 8
    assert coefficients[-1] == (1.875, -1.25, 0.375)  # the limit polynomial, unscaled
    a, b, c = coefficients[0]
    s = ortho.POLAR_EXPRESS_SAFETY
    assert (a * s, b * s**3, c * s**5) == pytest.approx((8.28721201814563, -23.595886519098837, 17.300387312530933))
    # Composed on scalars, the schedule sends all of [1e-3, 1]/safety to 1: within 0.85..1.13
    # after the 5 steps Muon budgets, and to 2e-5 after 7.
    x = torch.logspace(-3, 0, 1000, dtype=torch.float64) / s
    for step, (a, b, c) in enumerate(coefficients, start=1):
        x = a * x + b * x**3 + c * x**5
        if step == 5:
            assert 0.84 < x.min() and x.max() < 1.13
        if step == 7:
            torch.testing.assert_close(x, torch.ones_like(x), atol=2e-5, rtol=0)


def test_scale_estimators_are_as_defined():
    matrix = signal_plus_noise(30, 50)
    sigma = torch.linalg.svdvals(matrix.double())
    exact_polar = ortho.polar_svd(matrix)
    ns_polar = ortho.polar_newton_schulz(matrix)
    r = 30
    mean = (sigma.sum() / r).item()
    assert ortho.scale_exact(matrix, exact_polar).item() == pytest.approx(mean, rel=1e-5)
    # Without singular values from the method, exact still computes the true mean.
    assert ortho.scale_exact(matrix, ns_polar).item() == pytest.approx(mean, rel=1e-5)
    assert ortho.scale_rms(matrix, ns_polar).item() == pytest.approx(matrix.norm().item() / math.sqrt(r), rel=1e-6)
    assert ortho.scale_rms(matrix, ns_polar).item() >= mean
    inner = (matrix * ns_polar.factor).sum().item() / r
    assert ortho.scale_inner(matrix, ns_polar).item() == pytest.approx(inner, rel=1e-6)
    # With the exact factor the inner-product estimate is the exact mean.
    assert ortho.scale_inner(matrix, exact_polar).item() == pytest.approx(mean, rel=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_one_by_one(method):
    batch = torch.stack([signal_plus_noise(12, 20, seed=s) for s in range(3)])
    settings = ortho.IsoSettings(method, "inner", ns_dtype="float32")
    together = ortho.iso_correct(batch, settings)
    one_by_one = torch.stack([ortho.iso_correct(m, settings) for m in batch])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_dtype_is_preserved(method):
    matrix = signal_plus_noise(10, 6, dtype=torch.float64)
    assert ortho.iso_correct(matrix, ortho.IsoSettings(method)).dtype == torch.float64


@pytest.mark.parametrize("method", METHODS)
def test_half_precision_input_is_computed_in_float32(method):
    matrix = signal_plus_noise(10, 6)
    result = ortho.iso_correct(matrix.bfloat16(), ortho.IsoSettings(method, ns_dtype="float32"))
    assert result.dtype == torch.bfloat16
    expected = ortho.iso_correct(matrix.bfloat16().float(), ortho.IsoSettings(method, ns_dtype="float32"))
    assert relative_error(result, expected) < 1e-2


def test_svd_failure_retries_in_float64(monkeypatch, caplog):
    real_svd = torch.linalg.svd

    def flaky_svd(matrix, full_matrices=True):
        if matrix.dtype != torch.float64:
            raise torch.linalg.LinAlgError("failed to converge")
        return real_svd(matrix, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", flaky_svd)
    matrix = signal_plus_noise(9, 5)
    with caplog.at_level("WARNING", logger="isoloco.ortho"):
        result = ortho.iso_correct(matrix, SVD)
    assert "retrying in float64" in caplog.text
    assert result.dtype == torch.float32
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    torch.testing.assert_close(result, ortho.iso_correct(matrix, SVD), atol=1e-6, rtol=1e-5)


def test_user_errors():
    with pytest.raises(ValueError, match="matrix"):
        ortho.iso_correct(torch.ones(5))
    with pytest.raises(ValueError, match="choose one of"):
        ortho.IsoSettings(ortho="qr")
    with pytest.raises(ValueError, match="choose one of"):
        ortho.IsoSettings(scale="median")
    with pytest.raises(ValueError, match="choose one of"):
        ortho.IsoSettings(ns_dtype="float16")
    with pytest.raises(ValueError, match="ns_steps"):
        ortho.IsoSettings(ortho="newton_schulz", ns_steps=0)


def test_auto_takes_gram_for_non_square_and_svd_for_square_matrices():
    from isoloco.ortho import polar_auto, polar_gram, polar_svd

    generator = torch.Generator().manual_seed(0)
    tall = torch.randn(96, 32, generator=generator)
    square = torch.randn(40, 40, generator=generator)
    assert torch.equal(polar_auto(tall).factor, polar_gram(tall).factor)
    assert torch.equal(polar_auto(tall.mT).factor, polar_gram(tall.mT).factor)
    assert torch.equal(polar_auto(square).factor, polar_svd(square).factor)
    exact = polar_svd(tall).factor
    assert (torch.linalg.norm(polar_auto(tall).factor - exact) / torch.linalg.norm(exact)).item() < 1e-4


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express"])
@pytest.mark.parametrize("shape", [(12, 200), (200, 12), (3, 12, 200)])
def test_gram_space_iteration_applies_the_same_polynomial(monkeypatch, method, shape):
    """Very wide (or tall) matrices iterate on their Gram matrix on CPU: same steps, same result."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(*shape, generator=generator, dtype=torch.float64)
    assert max(shape[-2:]) >= ortho.NS_GRAM_SPACE_MIN_ASPECT * min(shape[-2:])
    in_gram_space = ortho.orthogonalize(matrix, method, ns_steps=5, ns_dtype=torch.float64).factor
    bf16_in_gram_space = ortho.orthogonalize(matrix.float(), method, ns_steps=5, ns_dtype=torch.bfloat16).factor
    monkeypatch.setattr(ortho, "NS_GRAM_SPACE_MIN_ASPECT", math.inf)
    on_the_matrix = ortho.orthogonalize(matrix, method, ns_steps=5, ns_dtype=torch.float64).factor
    torch.testing.assert_close(in_gram_space, on_the_matrix, rtol=0, atol=1e-10)
    # In bfloat16 the Gram route is closer to the exact polynomial than iterating on X (its
    # r×r work is float32): measured 0.3% against 2-7%.
    bf16_on_the_matrix = ortho.orthogonalize(matrix.float(), method, ns_steps=5, ns_dtype=torch.bfloat16).factor
    assert relative_error(bf16_in_gram_space, on_the_matrix) < 0.01
    assert relative_error(bf16_in_gram_space, on_the_matrix) < relative_error(bf16_on_the_matrix, on_the_matrix)
