"""Orthogonalisation and scale estimators: exact paths against numpy, fast paths against exact."""

import math

import numpy as np
import pytest
import torch

from isoloco import newton_schulz, ortho, svd
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

    polar = svd.polar_svd(matrix)
    np.testing.assert_allclose(polar.factor.numpy(), u @ vh, atol=1e-12)
    np.testing.assert_allclose(polar.singular_values.numpy(), s, rtol=1e-12)
    np.testing.assert_allclose(ortho.iso_correct(matrix, SVD).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (64, 64)])
def test_gram_matches_svd(shape):
    matrix = signal_plus_noise(*shape)
    exact, gram = svd.polar_svd(matrix), svd.polar_gram(matrix)
    assert relative_error(gram.factor, exact.factor) < 1e-4
    assert relative_error(gram.singular_values, exact.singular_values) < 1e-4
    assert relative_error(ortho.iso_correct(matrix, ortho.IsoSettings("gram")), ortho.iso_correct(matrix, SVD)) < 1e-4


def test_singular_values_match_svdvals():
    matrix = signal_plus_noise(80, 30)
    torch.testing.assert_close(svd.singular_values(matrix), torch.linalg.svdvals(matrix), rtol=1e-5, atol=1e-6)


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
    exact = svd.polar_svd(matrix).factor
    ns = newton_schulz.polar_newton_schulz(matrix, dtype=torch.float32).factor
    pe = newton_schulz.polar_express(matrix, dtype=torch.float32).factor
    assert relative_error(pe, exact) < relative_error(ns, exact)


def test_polar_express_schedule():
    coefficients = newton_schulz.POLAR_EXPRESS_COEFFICIENTS
    assert len(coefficients) == 8
    assert coefficients[-1] == (1.875, -1.25, 0.375)  # the limit polynomial, unscaled
    a, b, c = coefficients[0]
    s = newton_schulz.POLAR_EXPRESS_SAFETY
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
    exact_polar = svd.polar_svd(matrix)
    ns_polar = newton_schulz.polar_newton_schulz(matrix)
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
    with caplog.at_level("WARNING", logger="isoloco.svd"):
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
    from isoloco.svd import polar_auto, polar_gram, polar_svd

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
    assert max(shape[-2:]) >= newton_schulz.NS_GRAM_SPACE_MIN_ASPECT * min(shape[-2:])
    in_gram_space = ortho.orthogonalize(matrix, method, ns_steps=5, ns_dtype=torch.float64).factor
    bf16_in_gram_space = ortho.orthogonalize(matrix.float(), method, ns_steps=5, ns_dtype=torch.bfloat16).factor
    monkeypatch.setattr(newton_schulz, "NS_GRAM_SPACE_MIN_ASPECT", math.inf)
    on_the_matrix = ortho.orthogonalize(matrix, method, ns_steps=5, ns_dtype=torch.float64).factor
    torch.testing.assert_close(in_gram_space, on_the_matrix, rtol=0, atol=1e-10)
    # In bfloat16 the Gram route is closer to the exact polynomial than iterating on X (its
    # r×r work is float32): measured 0.3% against 2-7%.
    bf16_on_the_matrix = ortho.orthogonalize(matrix.float(), method, ns_steps=5, ns_dtype=torch.bfloat16).factor
    assert relative_error(bf16_in_gram_space, on_the_matrix) < 0.01
    assert relative_error(bf16_in_gram_space, on_the_matrix) < relative_error(bf16_on_the_matrix, on_the_matrix)


# -- the spectrum variants: iso_power and iso_floor ---------------------------------------------

EXACT = list(ortho.SVD_METHODS)
VARIANT_SHAPES = [(40, 24), (24, 40), (32, 32)]


def spectrum_of(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.double())


def paper_iso_c(matrix: torch.Tensor, settings: ortho.IsoSettings) -> torch.Tensor:
    """Iso-C as `iso_correct` computed it before the variants existed: scale · polar factor."""
    polar = ortho.orthogonalize(matrix, settings.ortho, settings.ns_steps, newton_schulz.NS_DTYPES[settings.ns_dtype])
    return polar.factor * ortho.SCALE_METHODS[settings.scale](matrix, polar).to(matrix.dtype)[..., None, None]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", SCALES)
def test_default_knobs_keep_the_paper_code_path_bit_for_bit(monkeypatch, method, scale):
    def variant_called(*args):
        raise AssertionError("the spectrum variants ran with their knobs at the defaults")

    monkeypatch.setattr(ortho, "_iso_variant", variant_called)
    settings = ortho.IsoSettings(method, scale)
    assert (settings.iso_power, settings.iso_floor) == (0, 0) and not settings.reshapes_spectrum
    for seed, shape in enumerate([(40, 24), (24, 40), (32, 32), (3, 12, 20)]):
        matrix = signal_plus_noise(*shape, seed=seed) if len(shape) == 2 else torch.randn(*shape)
        assert torch.equal(ortho.iso_correct(matrix, settings), paper_iso_c(matrix, settings))


def test_merge_config_defaults_are_the_paper_iso_c():
    from isoloco.merge_config import MergeConfig

    assert MergeConfig().iso == ortho.IsoSettings()


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", VARIANT_SHAPES)
def test_power_one_returns_the_update(method, shape):
    matrix = signal_plus_noise(*shape)
    assert relative_error(ortho.iso_correct(matrix, ortho.IsoSettings(method, iso_power=1.0)), matrix) < 1e-5


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", VARIANT_SHAPES)
def test_power_zero_is_iso_c(method, shape):
    """The reshaped spectrum at p = 0 is Iso-C's (the defaults take Iso-C's own path), and p → 0
    converges to it."""
    matrix = signal_plus_noise(*shape)
    iso_c = ortho.iso_correct(matrix, ortho.IsoSettings(method))
    sigma = spectrum_of(matrix)
    torch.testing.assert_close(ortho.reshaped_spectrum(sigma, 0.0, 0.0), sigma.mean().expand_as(sigma))
    assert relative_error(ortho.iso_correct(matrix, ortho.IsoSettings(method, iso_power=1e-9)), iso_c) < 1e-5


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", VARIANT_SHAPES)
def test_power_half_keeps_the_mean_and_orders_the_spectrum_as_its_square_root(method, shape):
    matrix = signal_plus_noise(*shape)
    sigma = spectrum_of(matrix)
    result = spectrum_of(ortho.iso_correct(matrix, ortho.IsoSettings(method, iso_power=0.5)))
    assert result.mean().item() == pytest.approx(sigma.mean().item(), rel=1e-5)
    expected = sigma.sqrt() * sigma.mean() / sigma.sqrt().mean()
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    # Flatter than the update, steeper than Iso-C: the largest is damped, the smallest lifted.
    assert sigma[-1] < result[-1] < result[0] < sigma[0]


@pytest.mark.parametrize("method", EXACT)
def test_power_keeps_the_singular_vectors(method):
    matrix = signal_plus_noise(40, 24)
    result = ortho.iso_correct(matrix, ortho.IsoSettings(method, iso_power=0.5)).double()
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    torch.testing.assert_close(u @ torch.diag(torch.diagonal(u.T @ result @ vh.T)) @ vh, result, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", VARIANT_SHAPES)
def test_floor_keeps_small_singular_values_and_flattens_the_rest_to_their_mean(method, shape):
    matrix = signal_plus_noise(*shape)
    sigma = spectrum_of(matrix)
    floor = 0.2
    above = sigma >= floor * sigma[0]
    assert 1 < int(above.sum()) < len(sigma)  # the test matrix has values on both sides
    result = spectrum_of(ortho.iso_correct(matrix, ortho.IsoSettings(method, iso_floor=floor)))
    expected = torch.where(above, sigma[above].mean(), sigma).sort(descending=True).values
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


def test_floor_and_power_together_reshape_only_the_values_above_the_floor():
    sigma = torch.tensor([[16.0, 4.0, 1.0, 0.5, 0.0]], dtype=torch.float64)
    reshaped = ortho.reshaped_spectrum(sigma, power=0.5, floor=0.05)
    torch.testing.assert_close(reshaped[0, 3:], sigma[0, 3:])  # below 0.05·16: kept
    lifted = torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(reshaped[0, :3], lifted * 21 / 7)  # c = Σσ / Σσ^0.5 = 21 / 7


@pytest.mark.parametrize("knob", [dict(iso_power=0.5), dict(iso_floor=0.3)])
def test_variants_leave_null_directions_out(knob):
    matrix = rank_deficient(20, 12, rank=4)
    result = spectrum_of(ortho.iso_correct(matrix, ortho.IsoSettings("svd", **knob)))
    assert result[4:].max() < 1e-5 * result[0]
    torch.testing.assert_close(result.sum(), spectrum_of(matrix).sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("knob", [dict(iso_power=0.5), dict(iso_floor=0.3), dict(iso_power=0.3, iso_floor=0.1)])
def test_variants_batched_equal_one_by_one(method, knob):
    batch = torch.stack([signal_plus_noise(12, 20, seed=s) for s in range(3)])
    settings = ortho.IsoSettings(method, **knob)
    together = ortho.iso_correct(batch, settings)
    one_by_one = torch.stack([ortho.iso_correct(m, settings) for m in batch])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("knob", [dict(iso_power=0.5), dict(iso_floor=0.3)])
@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4)])
def test_variants_of_a_zero_matrix_are_zeros(knob, shape):
    assert torch.equal(ortho.iso_correct(torch.zeros(shape), ortho.IsoSettings(**knob)), torch.zeros(shape))


def test_variants_keep_the_dtype_and_compute_half_precision_in_float32():
    matrix = signal_plus_noise(24, 16)
    settings = ortho.IsoSettings(iso_power=0.5)
    assert ortho.iso_correct(matrix.double(), settings).dtype == torch.float64
    result = ortho.iso_correct(matrix.bfloat16(), settings)
    assert result.dtype == torch.bfloat16
    assert relative_error(result, ortho.iso_correct(matrix.bfloat16().float(), settings)) < 1e-2


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express"])
@pytest.mark.parametrize("knob, named", [(dict(iso_power=0.5), "iso_power=0.5"),
                                         (dict(iso_floor=0.1), "iso_floor=0.1")])
def test_variants_refuse_the_iterative_methods(method, knob, named):
    with pytest.raises(ValueError, match=f"{named} is not allowed with ortho={method}.*set ortho=auto, svd or gram"):
        ortho.IsoSettings(method, **knob)


def test_variant_knob_errors():
    with pytest.raises(ValueError, match=r"iso_power=1.5 is not allowed: it must be in \[0, 1\]"):
        ortho.IsoSettings(iso_power=1.5)
    with pytest.raises(ValueError, match=r"iso_power=-0.1 is not allowed"):
        ortho.IsoSettings(iso_power=-0.1)
    with pytest.raises(ValueError, match=r"iso_floor=1.0 is not allowed: it must be in \[0, 1\)"):
        ortho.IsoSettings(iso_floor=1.0)
    with pytest.raises(ValueError, match="iso_floor=0.1 is not allowed with scale=rms.*set scale=exact"):
        ortho.IsoSettings("svd", "rms", iso_floor=0.1)


def test_variant_keys_are_config_keys():
    from isoloco.config import parse_overrides, resolve

    cfg = resolve(None, {"merge.iso_power": 0.5, "merge.iso_floor": 0.05})
    assert (cfg.merge.iso.iso_power, cfg.merge.iso.iso_floor) == (0.5, 0.05)
    assert resolve(None, parse_overrides(["merge.iso_power=0.5"])).merge.iso.iso_power == 0.5
    assert resolve(None, {}).merge.iso == ortho.IsoSettings()


@pytest.mark.parametrize("overrides, named", [
    ({"method": "isoloco_fast", "merge.iso_power": 0.5},
     "merge.iso_power=0.5 is not allowed with merge.ortho=newton_schulz"),
    ({"merge.ortho": "polar_express", "merge.iso_floor": 0.1},
     "merge.iso_floor=0.1 is not allowed with merge.ortho=polar_express"),
    ({"merge.iso_power": 2.0}, "merge.iso_power=2.0 is not allowed"),
])
def test_config_refuses_bad_variant_settings(overrides, named):
    from isoloco.config import resolve
    from isoloco.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        resolve(None, overrides)


def test_cli_refuses_variants_with_newton_schulz_before_any_work(tmp_path, capsys):
    from isoloco.cli import main

    out = tmp_path / "run"
    assert main(["train", "method=isoloco_fast", "merge.iso_power=0.5", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "merge.iso_power=0.5" in err and "merge.ortho=auto, svd or gram" in err
    assert not out.exists()


def test_variants_reach_the_merge_and_the_update_placement():
    """`merge_functions.iso_c` (the engine's finalize) and `IsoLoCo` (outer.iso_placement=update) both
    apply the configured variant."""
    from isoloco import merge_config, merge_functions
    from isoloco.outer import OuterConfig, build_outer_optimizer

    settings = ortho.IsoSettings("svd", iso_power=0.5, iso_floor=0.05)
    deltas = [signal_plus_noise(24, 16, seed=s) for s in range(3)]
    expected = ortho.iso_correct(torch.stack(deltas).mean(0), settings)
    torch.testing.assert_close(merge_functions.iso_c(deltas, settings), expected)

    config = merge_config.MergeConfig(rule="iso_c", ortho="svd", iso_power=0.5, iso_floor=0.05)
    param = torch.nn.Parameter(torch.zeros(24, 16))
    optimizer = build_outer_optimizer([("w", param)], config, OuterConfig(iso_placement="update", lr=1.0,
                                                                           momentum=0.5))
    param.grad = deltas[0].clone()
    optimizer.step()
    # First step: the momentum buffer is g, the Nesterov update g + 0.5·g.
    torch.testing.assert_close(param.detach(), -ortho.iso_correct(1.5 * deltas[0], settings))
