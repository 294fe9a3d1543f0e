"""`merge.factors=auto`'s accuracy guard: TSV and Iso-CTS keep the randomized range finder's
factors only where an a-posteriori estimate puts them within the fidelity bar, and take the
exact ones elsewhere (`isoloco.factors._Found.accurate`; docs/fidelity.md)."""

import math
from collections import Counter

import pytest
import torch

from isoloco import merge, merge_config, merge_functions, rules
from isoloco.comm import LocalCommunicator
from isoloco.factors import FACTOR_PATHS, FINDER_TOLERANCE, FactorSettings, top_factors
from isoloco.svd import gram_svd
from helpers import SMALL_ARGS
from test_merge import reference_iso_cts, reference_tsv

#: docs/fidelity.md: `auto` stays within this relative Frobenius distance of `exact`.
BAR = 1e-3


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = torch.as_tensor(ours).double(), torch.as_tensor(theirs).double()
    return float((ours - theirs).norm() / theirs.norm())


def gaussian(shape: tuple[int, int], workers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for _ in range(workers)]


def rank8_plus_noise(shape: tuple[int, int], workers: int) -> list[torch.Tensor]:
    """A rank-8 signal shared by the workers plus 0.3 of each worker's own Gaussian noise."""
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(shape[0], 8, generator=g) @ torch.randn(8, shape[1], generator=g) / math.sqrt(8)
    return [signal + 0.3 * torch.randn(shape, generator=g) for _ in range(workers)]


CASES = {
    "gaussian 256x256, R=16": lambda: gaussian((256, 256), 16),
    "gaussian 512x128, R=8": lambda: gaussian((512, 128), 8),
    "rank 8 + 0.3 noise 256x256, R=16": lambda: rank8_plus_noise((256, 256), 16),
}


def reference(rule: str, deltas: list[torch.Tensor]):
    """The rule from its definition in numpy float64 (tests/test_merge.py's oracles)."""
    if rule == "tsv":
        return reference_tsv(deltas)
    return reference_iso_cts(deltas, *rules.iso_cts_split(min(deltas[0].shape), len(deltas), 0.8))


@pytest.mark.parametrize("rule", ["tsv", "iso_cts"])
@pytest.mark.parametrize("case", CASES)
def test_auto_stays_within_the_bar_on_flat_spectra(case, rule):
    """Noise-like deltas, where a worker's top k are not separated from the rest: the range
    finder alone misses them (it is not within 10 times the bar on the square cases), and
    the guard falls back to the exact factors, so auto is exact and the float64 definition
    to well within the bar."""
    deltas = CASES[case]()
    merged = {factors: getattr(merge_functions, rule)(deltas, factors=factors) for factors in ("auto", "exact", "randomized")}
    assert relative(merged["auto"], merged["exact"]) < BAR
    assert relative(merged["auto"], reference(rule, deltas)) < BAR
    if deltas[0].shape == (256, 256):  # the finder is taken there: show that the guard mattered
        assert relative(merged["randomized"], merged["exact"]) > 10 * BAR


def low_rank_dominated(shape: tuple[int, int], workers: int) -> list[torch.Tensor]:
    """Each worker's directions with a geometric spectrum (15% apart) plus a little noise."""
    g = torch.Generator().manual_seed(0)

    def delta() -> torch.Tensor:
        u = torch.linalg.qr(torch.randn(shape[0], 64, generator=g))[0]
        v = torch.linalg.qr(torch.randn(shape[1], 64, generator=g))[0]
        return (u * 0.85 ** torch.arange(64.0)) @ v.T + 1e-4 * torch.randn(shape, generator=g)

    return [delta() for _ in range(workers)]


@pytest.mark.parametrize("finder_dtype", ["bfloat16", "float32"])
def test_the_guard_keeps_the_finder_where_it_is_accurate(finder_dtype):
    """On low-rank-dominated deltas the check passes: auto's factors are the range finder's,
    bit for bit (no fall-back, so no full SVD), and within the bar of the float64 SVD's."""
    settings = {method: FactorSettings(method, finder_dtype=finder_dtype) for method in ("auto", "randomized")}
    for delta in low_rank_dominated((256, 192), 4):
        k = 192 // 16
        auto, found = (top_factors(delta, k, settings[method]) for method in ("auto", "randomized"))
        assert all(torch.equal(a, b) for a, b in zip(auto, found))
        u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
        assert relative((auto[0] * auto[1]) @ auto[2].T, (u[:, :k] * s[:k]) @ vh[:k]) < BAR


def test_the_guard_falls_back_exactly_where_the_finder_errs():
    """A rank-8 signal under noise of growing size, k = 6 of rank 128: while the noise leaves
    the top 6 separated, auto keeps the finder's factors, and they are within the bar of the
    float64 SVD's (the bound's √2·`FINDER_TOLERANCE`); once it does not, auto's factors are
    the exact path's. Both happen over the sweep."""
    g = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(160, 8, generator=g))[0]
    v = torch.linalg.qr(torch.randn(128, 8, generator=g))[0]
    signal = (u * 0.8 ** torch.arange(8.0)) @ v.T
    outcomes = []
    for noise in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        delta = signal + noise / math.sqrt(160) * torch.randn(160, 128, generator=g)
        auto, found, exact = (top_factors(delta, 6, FactorSettings(method, finder_dtype="float32"))
                              for method in ("auto", "randomized", "exact"))
        kept = all(torch.equal(a, b) for a, b in zip(auto, found))
        outcomes.append(kept)
        if kept:
            left, s, right = torch.linalg.svd(delta.double(), full_matrices=False)
            truth = (left[:, :6] * s[:6]) @ right[:6]
            assert relative((auto[0] * auto[1]) @ auto[2].T, truth) < math.sqrt(2) * FINDER_TOLERANCE
        else:
            assert all(torch.equal(a, b) for a, b in zip(auto, exact))
    assert outcomes[0] and not outcomes[-1], outcomes


def test_a_rank_below_k_is_handled_by_the_guard():
    """Exactly rank-3 deltas with k = 8: the directions past the rank are null for either path,
    and auto agrees with exact, whichever path the guard takes. (The definition keeps the null
    directions, which isoloco drops on purpose: docs/fidelity.md.)"""
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(160, 3, generator=g) @ torch.randn(3, 128, generator=g) for _ in range(16)]
    for rule in ("tsv", "iso_cts"):
        auto, exact = (getattr(merge_functions, rule)(deltas, factors=factors) for factors in ("auto", "exact"))
        assert relative(auto, exact) < BAR, rule


def shared_signal_under_noise(shape: tuple[int, int], workers: int, rank: int = 16) -> list[torch.Tensor]:
    """Issue 43's deltas: a rank-16 signal shared by the workers plus 0.3 of each one's own noise."""
    g = torch.Generator().manual_seed(4)
    signal = torch.randn(shape[0], rank, generator=g) @ torch.randn(rank, shape[1], generator=g)
    return [signal + 0.3 * torch.randn(shape, generator=g) for _ in range(workers)]


def float64_top(delta: torch.Tensor, k: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


@pytest.mark.parametrize("finder_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(256, 640), (640, 256), (320, 320)])
def test_a_hopeless_finder_stops_after_one_iteration_and_the_factors_are_exact(shape, finder_dtype):
    """k = r/16 past a shared rank-4 signal, where the spectrum is flat: the first iteration's
    Ritz values say the certificate cannot pass, so auto stops the finder there and takes the
    exact factors (the Gram route's top k on the non-square shapes, LAPACK's on the square
    one), which are the float64 SVD's to float32 rounding. bfloat16 early iterations
    orthonormalise one side only, and the Ritz values are read on that side."""
    k = min(shape) // 16
    for delta in shared_signal_under_noise(shape, 2, rank=4):
        paths = Counter()
        u, s, v = top_factors(delta, k, FactorSettings(finder_dtype=finder_dtype), paths=paths)
        assert paths == Counter({"exact_finder_stopped": 1})
        assert relative((u * s) @ v.T, float64_top(delta, k)) < 1e-5


def test_the_finder_is_not_stopped_where_it_passes():
    """Decaying spectra: the stop never fires, the certificate keeps the finder's factors."""
    paths = Counter()
    for delta in low_rank_dominated((256, 192), 4):
        top_factors(delta, 192 // 16, FactorSettings(finder_dtype="float32"), paths=paths)
    assert paths == Counter({"finder": 4})


@pytest.mark.parametrize("shape", [(300, 96), (96, 300)])
def test_the_gram_route_gives_the_top_k_of_the_float64_svd(shape):
    """`gram_svd`'s top k of a float32 matrix (tall and wide): singular values and rank-k
    product those of the float64 SVD to float32 rounding, orthonormal singular vectors."""
    g = torch.Generator().manual_seed(5)
    matrix = (torch.randn(shape, generator=g) * torch.logspace(0, -2, shape[1])).float()
    k = 10
    u, s, vh = gram_svd(matrix, k)
    assert u.shape == (shape[0], k) and s.shape == (k,) and vh.shape == (k, shape[1])
    truth = torch.linalg.svdvals(matrix.double())[:k]
    assert float(((s.double() - truth) / truth).abs().max()) < 1e-6
    assert relative((u * s) @ vh, float64_top(matrix, k)) < 1e-6
    for factor in (u, vh.T):
        torch.testing.assert_close(factor.T.double() @ factor.double(), torch.eye(k, dtype=torch.float64), atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("rule", ["tsv", "iso_cts"])
def test_the_merger_counts_the_path_of_every_workers_factors(rule):
    """One count per worker and matrix, under the path it took; cleared by whoever reads it."""
    deltas = shared_signal_under_noise((128, 320), 16)
    merger = merge.Merger(merge_config.MergeConfig(rule=rule), LocalCommunicator(16), seed=0)
    merger.merge_all({"a": deltas, "b": [d[:, :128] for d in deltas]})
    assert sum(merger.factor_paths.values()) == 2 * 16
    assert set(merger.factor_paths) <= set(FACTOR_PATHS)


@pytest.mark.slow
def test_each_rounds_factor_paths_are_in_the_metrics(tmp_path):
    """Iso-CTS at R = 4 on the tiny model: each worker keeps 3 residual directions of each of
    the 30 matrices (rank 64, below `RANDOMIZED_MIN_RANK`: all exact); every round's last
    metrics line counts the 4 × 30 factorisations."""
    import json

    from isoloco.cli import main

    run = tmp_path / "run"
    assert main(["train", *SMALL_ARGS, "method=isocts", "workers=4", "inner_steps=2", "steps=4", "eval_every=4",
                 "--out", str(run), "--quiet"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [line["factor_paths"] for line in lines if "factor_paths" in line]
    assert len(rounds) == 2
    for paths in rounds:
        assert paths == {**dict.fromkeys(FACTOR_PATHS, 0), "exact": 4 * 30}
