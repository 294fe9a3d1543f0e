"""Paired comparisons: compare.md (A − B paired by seed at every point both reached: its 95%
interval, the equivalence test, the call, the paired t-test's p and its Benjamini–Hochberg
adjustment over the file's points) and contrast.md ((A − B) − (C − D), the difference of two such
differences); `compare_tests` and `contrast_tests` give their rows' unrounded p-values, for an
adjustment over several reports."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable

from isoloco.config import parse_overrides, typed_values
from isoloco.errors import ConfigError, ReportError
from isoloco.methods import METHODS
from isoloco.report.runs import RunResult, finished_runs
from isoloco.report.stats import (DEFAULT_MARGIN_PCT, TOST_LEVEL, benjamini_hochberg, mean_ci, mean_std, paired_p,
                                  tost_p)
from isoloco.report.tables import dash, fmt, md_table

COMPARE_FILE = "compare.md"
#: compare.md's sections of every pair at once: the rows of every point, and each pair's change with R.
SUMMARY_SECTIONS = ("Every pair", "Change with R")
CONTRAST_FILE = "contrast.md"
ONE_SEED = "one seed: no call"
UNSTABLE_RUNS = "unstable run(s): no call"
#: The false discovery rate the Benjamini–Hochberg column of compare.md holds a report's calls to.
FDR = 0.05

#: A's and B's runs at one point (R, H, budget), one pair per seed both ran.
Paired = Iterable[tuple[RunResult, RunResult]]


def _has_unstable(paired: Paired) -> bool:
    return any(run.unstable for pair in paired for run in pair)


def _differences(paired: Paired) -> list[float]:
    return [a.final_val_loss - b.final_val_loss for a, b in paired]


def _undecided(seeds: int) -> str:
    return f"not distinguishable with {seeds} seeds"


@dataclass(frozen=True)
class Judged:
    """The tests of A − B at one point: the call, the equivalence test's result, and what the call
    falls back to when a multiple-comparison correction drops the difference; p is None where no
    test is made (one seed, an unstable run)."""

    call: str
    equivalence: str
    fallback: str
    p: float | None = None

    @property
    def called(self) -> bool:
        return self.call.endswith(" lower")


def _judge(paired: list[tuple[RunResult, RunResult]], a: str, b: str, margin_pct: float) -> Judged:
    """The call on A − B at one point, and the equivalence test's result: TOST, two one-sided paired
    t-tests at level 0.05 against ±margin_pct of B's mean final loss, shown as the 90% t-interval of
    the difference in % of that loss (it passes exactly when that interval lies inside the margin). A
    difference is called when its 95% interval excludes 0, whatever the test says; a tie only when
    the test passes."""
    if _has_unstable(paired):
        return Judged(UNSTABLE_RUNS, UNSTABLE_RUNS, UNSTABLE_RUNS)
    if len(paired) < 2:
        return Judged(ONE_SEED, ONE_SEED, ONE_SEED)
    differences = _differences(paired)
    b_loss = statistics.fmean(b_run.final_val_loss for _, b_run in paired)
    equivalent = tost_p(differences, margin_pct / 100 * b_loss) < TOST_LEVEL
    mean, half = mean_ci(differences, 100 * (1 - 2 * TOST_LEVEL))
    low, high = 100 * (mean - half) / b_loss, 100 * (mean + half) / b_loss
    tie = f"equivalent within ±{margin_pct:g}%"
    mean, half = mean_ci(differences, 95)
    call = ((f"{a} lower" if mean < 0 else f"{b} lower") if abs(mean) > half
            else tie if equivalent else _undecided(len(differences)))
    return Judged(call, f"[{low:+.2f}%, {high:+.2f}%] {'pass' if equivalent else 'fail'}",
                  tie if equivalent else "not called after BH", paired_p(differences))


def _after_bh(judged: Judged, adjusted: float | None) -> tuple[str, str]:
    """The p column (raw, and BH-adjusted in brackets) and the call that survives the adjustment."""
    if judged.p is None:
        return "—", judged.call
    p = f"{format_p(judged.p)} ({format_p(adjusted)})"
    return p, judged.fallback if judged.called and adjusted >= FDR else judged.call


def format_p(value: float) -> str:
    """Three decimals, or two significant digits below 0.001 (an adjustment over several reports
    starts from the unrounded p of `compare_tests`, not from these)."""
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}" if value else "0"


def _interval(mean: float, half: float | None) -> str:
    return f"{mean:+.4f}" + (f" ± {half:.4f}" if half is not None else "")


@dataclass(frozen=True)
class Trend:
    """How A − B changes from the smallest R to the largest (at the smallest H), paired by seed: the
    per-seed changes, the call on them (a change is called when its 95% interval excludes 0) and
    the paired t-test's p (None with one seed)."""

    low: int
    high: int
    inner_steps: int
    changes: list[float]
    call: str
    p: float | None

    @property
    def workers(self) -> str:
        """The R column of the change-with-R table: from R to R."""
        return f"{self.low} → {self.high}"

    @property
    def value(self) -> str:
        return _interval(*mean_ci(self.changes))

    @property
    def cells(self) -> tuple[str, str, str, str]:
        """R, H, seeds and the change, as the change-with-R table prints them (and as its tests are keyed)."""
        return self.workers, str(self.inner_steps), str(len(self.changes)), self.value


def _trend(points: dict[tuple, dict[int, tuple[RunResult, RunResult]]], a: str, b: str) -> Trend | None:
    """How A − B changes from the smallest R to the largest (at the smallest H), paired by seed, over
    the points without unstable runs; None when fewer than two R are left."""
    stable = {key: by_seed for key, by_seed in points.items() if not _has_unstable(by_seed.values())}
    smallest_h = min((inner for _, inner, _ in stable), default=None)
    by_r = {workers: by_seed for (workers, inner, _), by_seed in stable.items() if inner == smallest_h}
    if len(by_r) < 2:
        return None
    low, high = min(by_r), max(by_r)
    common = sorted(set(by_r[low]) & set(by_r[high]))
    if not common:
        return None
    change = [at_high - at_low for at_high, at_low in zip(_differences(by_r[high][s] for s in common),
                                                          _differences(by_r[low][s] for s in common))]
    mean, half = mean_ci(change)
    call = (ONE_SEED if half is None else _undecided(len(common)) if abs(mean) <= half
            else f"{a} gains on {b} as R grows" if mean < 0 else f"{a} loses ground to {b} as R grows")
    return Trend(low, high, smallest_h, change, call, None if half is None else paired_p(change))


def is_call(call: str) -> bool:
    """Whether a compare.md call says a difference (or its change with R) is there."""
    return call.endswith((" lower", " as R grows"))


def label_settings(label: str, option: str = "--compare") -> tuple[str, dict[str, Any]]:
    """A run label's method and settings (`isoloco merge.quantize=int8 processes=2`), each value
    read as `isoloco train` reads `key=value` (`true` and `True` alike); an unknown method, key or
    value is refused, naming it and `option`."""
    method, *items = label.split()
    try:
        if method not in METHODS:
            raise ReportError(f"unknown method {method!r}: a label starts with one of {', '.join(METHODS)}")
        raw = parse_overrides(items)
        processes = raw.pop("processes", None)
        if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int)):
            raise ReportError(f"processes={processes!r} is not a number of processes")
        wanted = {key: tuple(value) if isinstance(value, list) else value for key, value in typed_values(raw).items()}
    except ConfigError as error:
        raise ReportError(f"{option} {label!r}: {error}") from None
    return method, wanted if processes is None else {**wanted, "processes": processes}


def named_runs(finished: list[RunResult], label: str, option: str = "--compare") -> dict[tuple, RunResult]:
    """(R, H, budget, seed) -> the one run `label` names there (its method, and any of its
    settings: `diloco` and `diloco outer.lr=0.7` both name DiLoCo's runs at lr 0.7); an error
    when it names several."""
    method, wanted = label_settings(label, option)
    named: dict[tuple, RunResult] = {}
    for run in finished:
        own = dict(run.settings)
        if run.method == method and all(own.get(key) == value for key, value in wanted.items()):
            key = (run.workers, run.inner_steps, run.budget, run.seed)
            if key in named:
                raise ReportError(f"{option} {label!r} names runs of several settings at one point: "
                                  f"{named[key].label!r} and {run.label!r}; name one of them in full")
            named[key] = run
    return named


def _paired_points(finished: list[RunResult], a: str, b: str) -> dict[tuple, dict[int, tuple[RunResult, RunResult]]]:
    """(R, H, budget) -> seed -> (A's run, B's run), where both finished with that seed (B = a
    dp method: its run of the seed, at every R and H)."""
    points: dict[tuple, dict[int, tuple[RunResult, RunResult]]] = {}
    others = named_runs(finished, b)
    for (workers, inner, budget, seed), run in named_runs(finished, a).items():
        other = others.get((workers, inner, budget, seed)) or others.get((None, None, budget, seed))
        if other is not None:
            points.setdefault((workers or 0, inner or 0, budget), {})[seed] = (run, other)
    return points


@dataclass(frozen=True)
class TestRow:
    """One row of a compare or contrast table with its p unrounded (None where the row makes no test:
    one seed, an unstable run): the pair ("A − B") or contrast ("(A − B) − (C − D)"), and R, H, the
    seeds and the difference (or contrast) as the table prints them."""

    name: str
    workers: str
    inner_steps: str
    seeds: str
    value: str
    p: float | None


def _contrast_rows(finished: list[RunResult], first_pair: tuple[str, str],
                   second_pair: tuple[str, str]) -> list[tuple[tuple, list[float], bool]]:
    """(R, H, budget), the contrasts paired by seed and whether any of their runs is unstable, at
    every point all four reached with the same seeds."""
    first, second = _paired_points(finished, *first_pair), _paired_points(finished, *second_pair)
    rows = []
    for key in sorted(set(first) & set(second)):
        both = [(*first[key][s], *second[key][s]) for s in sorted(set(first[key]) & set(second[key]))]
        values = [(w.final_val_loss - x.final_val_loss) - (y.final_val_loss - z.final_val_loss) for w, x, y, z in both]
        rows.append((key, values, any(run.unstable for runs_of_seed in both for run in runs_of_seed)))
    return rows


#: ((A, B), (C, D)) of each contrast (A − B) − (C − D).
Contrasts = list[tuple[tuple[str, str], tuple[str, str]]]


def contrast_tests(runs: list[RunResult], contrasts: Contrasts) -> list[TestRow]:
    """Every row of `contrast_markdown`'s tables with the paired t-test's p of its contrast against 0."""
    finished = finished_runs(runs)
    return [TestRow(f"({a} − {b}) − ({c} − {d})", dash(key[0] or None), dash(key[1] or None), str(len(values)),
                    _interval(*mean_ci(values)), None if unstable or len(values) < 2 else paired_p(values))
            for (a, b), (c, d) in contrasts for key, values, unstable in _contrast_rows(finished, (a, b), (c, d))]


def contrast_markdown(runs: list[RunResult], contrasts: Contrasts) -> str:
    """For each ((A, B), (C, D)): (A − B) − (C − D) paired by seed at every point all four
    reached with the same seeds, its 95% interval and the call: whether a change (B → A) costs
    one method more than another change (D → C) costs another, e.g. what quantisation costs
    IsoLoCo against what it costs DiLoCo."""
    finished = finished_runs(runs)
    parts = ["# Contrasts", "",
             "(A − B) − (C − D): the difference of two paired differences of final validation loss, over the seeds "
             "all four ran, mean ± the half-width of its 95% t-interval; called only when the interval excludes "
             "0. A point where any of the runs ended above its unigram baseline (unstable) gets no call."]
    for (a, b), (c, d) in contrasts:
        rows = []
        for key, values, unstable in _contrast_rows(finished, (a, b), (c, d)):
            mean, half = mean_ci(values)
            if unstable:
                call = UNSTABLE_RUNS
            elif half is None:
                call = ONE_SEED
            elif abs(mean) > half:
                call = f"{a} − {b} lower" if mean < 0 else f"{c} − {d} lower"
            else:
                call = _undecided(len(values))
            rows.append([dash(key[0] or None), dash(key[1] or None), str(len(values)), _interval(mean, half), call])
        parts += ["", f"## ({a} − {b}) − ({c} − {d})", ""]
        parts.append(md_table(["R", "H", "seeds", "contrast (final loss)", "call"], rows) if rows
                     else "No point where all four finished with the same seeds.")
    return "\n".join(parts) + "\n"


#: A pair's runs at each point, each point's tests in the order of the points, and its change with R.
JudgedPair = tuple[str, str, dict[tuple, dict[int, tuple[RunResult, RunResult]]], list[tuple[tuple, Judged]],
                   Trend | None]


def _judged_pairs(runs: list[RunResult], pairs: list[tuple[str, str]], margin_pct: float) -> list[JudgedPair]:
    finished = finished_runs(runs)
    judged = []
    for a, b in pairs:
        points = _paired_points(finished, a, b)
        judged.append((a, b, points, [(key, _judge(list(by_seed.values()), a, b, margin_pct))
                                      for key, by_seed in sorted(points.items())], _trend(points, a, b)))
    return judged


def compare_tests(runs: list[RunResult], pairs: list[tuple[str, str]],
                  margin_pct: float = DEFAULT_MARGIN_PCT) -> list[TestRow]:
    """Every row of `compare_markdown`'s tables with its paired t-test's p, unrounded: each pair's
    points, then its change with R."""
    tests = []
    for a, b, points, rows, trend in _judged_pairs(runs, pairs, margin_pct):
        tests += [TestRow(f"{a} − {b}", dash(key[0] or None), dash(key[1] or None), str(len(points[key])),
                          _interval(*mean_ci(_differences(points[key].values()))), judged.p) for key, judged in rows]
        if trend is not None:
            tests.append(TestRow(f"{a} − {b}", *trend.cells, trend.p))
    return tests


def compare_markdown(runs: list[RunResult], pairs: list[tuple[str, str]],
                     margin_pct: float = DEFAULT_MARGIN_PCT) -> str:
    """For each (A, B): the final-loss difference A − B paired by seed at every R and H both
    reached with the same seeds (B = a dp method: its run of the same seed, at every R and H),
    its 95% interval, its equivalence test at ±margin_pct of B's loss, the call, and both methods'
    mean gaps to DP over those seeds; with several R, also how the difference changes from the
    smallest R to the largest. A and B are run labels: a method, or a method and its variant
    ("isoc outer.lr=3.0"). Several pairs also get one table of every pair's rows first, to read
    (and quote) side by side. Beside each call: the paired t-test's p-value, its Benjamini–Hochberg
    adjustment over every point's test of the report (a change with R keeps its raw p), and the
    call that survives the adjustment."""
    margin = f"±{margin_pct:g}%"
    parts = ["# Paired comparisons", "",
             "Difference of final validation loss A − B over the seeds both ran (same seed: same initialisation "
             "and data order), mean ± the half-width of its 95% t-interval. The call is \"A lower\" or \"B lower\" "
             f"when that interval excludes 0; otherwise \"equivalent within {margin}\" when the difference passes "
             f"the equivalence test at a margin of {margin} of B's mean final loss at that point, and \"not "
             "distinguishable with n seeds\" when it does not. The equivalence test is two one-sided paired "
             "t-tests at level 0.05 (TOST): it passes when the 90% t-interval of the difference lies inside the "
             "margin; its column gives that interval in % of B's mean final loss. A difference can be called and "
             "lie within the margin too: the call is then the difference, and the equivalence column still says "
             "pass. A point where a run of either method, at any seed, ended above its unigram baseline "
             "(unstable) gets neither a call nor a test, and is left out of the change with R. The gaps to DP "
             "are means over the same seeds.",
             "",
             "p (BH): the two-sided p-value of the paired t-test, and in brackets its Benjamini–Hochberg "
             "adjustment over the tests of every point in this file (not the changes with R, whose p is left "
             f"raw); \"call after BH\" keeps a difference only where the adjusted p is below {FDR:g}, which holds "
             f"the expected share of false calls among the points' calls to {FDR:g} (a dropped difference falls "
             "back to the equivalence test)."]
    judged_points = _judged_pairs(runs, pairs, margin_pct)
    tested = [judged for _, _, _, rows, _ in judged_points for _, judged in rows if judged.p is not None]
    adjusted = dict(zip(map(id, tested), benjamini_hochberg([judged.p for judged in tested])))
    sections: list[str] = []
    every_pair: list[list[str]] = []
    changes: list[list[str]] = []
    negative_gap = False
    for a, b, points, judged_rows, trend in judged_points:
        rows = []
        for (workers, inner, budget), judged in judged_rows:
            paired = list(points[workers, inner, budget].values())
            gaps = [mean_std([r.gap_pct for r in side if r.gap_pct is not None])[0] for side in zip(*paired)]
            negative_gap |= None not in gaps and min(gaps) < 0
            ratio = gaps[0] / gaps[1] if None not in gaps and min(gaps) >= 0 and gaps[1] > 0 else None
            rows.append([dash(workers or None), dash(inner or None), str(len(paired)),
                         _interval(*mean_ci(_differences(paired))), judged.equivalence, judged.call,
                         *_after_bh(judged, adjusted.get(id(judged))),
                         *(fmt(g, "+.2f") or "—" for g in gaps), fmt(ratio, ".2f") or "—"])
        every_pair += [[f"{a} − {b}", *row] for row in rows]
        sections += ["", f"## {a} − {b}", ""]
        if not rows:
            sections.append(f"No point where both {a} and {b} finished with the same seed.")
            continue
        sections.append(md_table(["R", "H", "seeds", f"{a} − {b} (final loss)", f"equivalence ({margin})", "call",
                                  "p (BH)", "call after BH", f"gap {a} (%)", f"gap {b} (%)", "gap ratio"], rows))
        if trend is not None:
            sections += ["", f"Change of the difference from R = {trend.low} to R = {trend.high} "
                             f"({len(trend.changes)} seeds): {trend.value} ({trend.call})."]
            changes.append([f"{a} − {b}", *trend.cells, "—" if trend.p is None else format_p(trend.p), trend.call])
    if negative_gap:
        parts += ["", "Gap ratio: A's mean gap to DP over B's, the share of B's gap A keeps. It is \"—\" where a "
                      "gap is negative (a method below dp): the ratio of a negative gap is no such share (its sign "
                      "and size do not say which method is nearer dp), so none is given."]
    if len(pairs) > 1 and every_pair:
        parts += ["", f"## {SUMMARY_SECTIONS[0]}", "",
                  md_table(["A − B", "R", "H", "seeds", "A − B (final loss)", f"equivalence ({margin})", "call",
                            "p (BH)", "call after BH", "gap A (%)", "gap B (%)", "gap ratio"], every_pair)]
    if changes:
        sections += ["", f"## {SUMMARY_SECTIONS[1]}", "",
                     "Each pair's difference at the largest R minus its difference at the smallest (at the smallest "
                     "H, over the seeds both points ran, points with unstable runs left out), mean ± the half-width "
                     "of its 95% t-interval, called when that interval excludes 0; p is the paired t-test's, not "
                     "adjusted here (the Benjamini–Hochberg column above covers the points).", "",
                     md_table(["A − B", "R", "H", "seeds", "change (final loss)", "p", "call"], changes)]
    return "\n".join(parts + sections) + "\n"

