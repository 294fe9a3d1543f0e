"""The report's statistics, from scipy.stats: Student's t quantiles and tail areas, the paired
t-test, the equivalence test (TOST) and the Benjamini–Hochberg adjustment.

Every function takes the seeds' values (or p-values) as plain lists and returns floats, unrounded:
the tables round what they print, and whatever adjusts p-values again (a page-wide adjustment)
starts from these, not from the printed digits.
"""

from __future__ import annotations

import statistics

# scipy.stats is imported where it is used: every process of a run imports the CLI, which
# registers `isoloco report`, and scipy.stats alone takes about a second to import.

#: The equivalence margin of --compare, in % of B's mean final loss at the point compared.
DEFAULT_MARGIN_PCT = 1.0
#: The level of each of TOST's two one-sided tests: both reject exactly when the 90% t-interval of
#: the difference lies inside the margin.
TOST_LEVEL = 0.05


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and the sample standard deviation (None for fewer than two values; both None for none)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def t_quantile(confidence: float, df: int) -> float:
    """The t quantile that bounds a two-sided `confidence`% interval with `df` degrees of freedom:
    t_{0.975, df} for 95, t_{0.95, df} for 90 (exact, any df)."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + confidence / 200, df))


def paired_p(differences: list[float]) -> float:
    """The two-sided p-value of the paired t-test that the mean difference is 0 (two seeds or more):
    scipy's one-sample t-test of the per-seed differences, which is `ttest_rel` of the two sides."""
    if statistics.stdev(differences) == 0:  # every seed the same difference: certain, unless that is 0
        return 1.0 if differences[0] == 0 else 0.0
    from scipy.stats import ttest_1samp

    return float(ttest_1samp(differences, 0.0).pvalue)


def tost_p(differences: list[float], margin: float) -> float:
    """The p-value of the equivalence test of the paired differences at ±`margin` (the same unit):
    the larger of scipy's two one-sided t-tests, of "mean ≤ −margin" and of "mean ≥ +margin"
    (two seeds or more). Equivalence is shown at level α when it is below α, exactly when the
    (1 − 2α) t-interval of the mean lies inside the margin."""
    if statistics.stdev(differences) == 0:  # no spread: inside the margin or not, with certainty
        return 0.0 if -margin < differences[0] < margin else 1.0
    from scipy.stats import ttest_1samp

    above_lower = ttest_1samp(differences, -margin, alternative="greater").pvalue
    below_upper = ttest_1samp(differences, margin, alternative="less").pvalue
    return float(max(above_lower, below_upper))


def benjamini_hochberg(pvalues: list[float]) -> list[float]:
    """Benjamini–Hochberg adjusted p-values, in the order given (scipy's `false_discovery_control`):
    p_(i) · m / i over the ranks i of the sorted p-values, made non-decreasing from the largest
    down, at most 1. A difference whose adjusted p is below q keeps the false discovery rate of the
    whole family at q."""
    if not pvalues:
        return []
    from scipy.stats import false_discovery_control

    return [float(p) for p in false_discovery_control(pvalues, method="bh")]


def mean_ci(values: list[float], confidence: float = 95) -> tuple[float, float | None]:
    """The mean and the half-width of its `confidence`% t-interval over the seeds (None for one)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t_quantile(confidence, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
