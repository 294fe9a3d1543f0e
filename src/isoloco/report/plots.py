"""Plots: validation loss and gap to DP against R (log2 axis), and against H when the runs hold
several H; validation loss against each numeric knob a method was run at several values of (a
search or a grid: `outer.lr`, `merge.density`, ...), with the other methods at the same R and H as
lines to compare with; the validation-loss curves of every run, one panel per R; loss against the
slow link's bytes; and the workers merged per round where some were late. A method has one colour
in every plot of a report; a point is the mean ± std over seeds with its seed count beside it (hollow
for one seed), dp's loss a line with its own spread as a band, and a curve's marker names its seed.
Each PNG is drawn from a style reset to matplotlib's defaults and saved without the Software metadata
(the one field that varies), so a report of the same runs is the same bytes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

from isoloco.config import acts
from isoloco.report.runs import (DEFAULT_SETTINGS, RunResult, applies, dp_variants, group_runs, show_setting,
                                 sort_key)
from isoloco.report.stats import DEFAULT_MARGIN_PCT, mean_std

#: Axes a plot can put on x: run attribute -> (short label, axis title).
X_AXES = {"workers": ("R", "workers R"), "inner_steps": ("H", "inner steps H")}

#: A published series to draw beside the runs' gap to DP against R: (label, {R: gap %}).
Published = tuple[str, dict[int, float]]


def save_png(fig: Any, path: Path) -> None:
    """Save `fig` as a PNG whose bytes depend on the figure alone (no Software metadata)."""
    fig.savefig(path, dpi=110, metadata={"Software": None})


def _method_colors(runs: list[RunResult]) -> dict[str, str]:
    """Method -> its colour, from every run of the report, so that a method keeps its colour in
    every plot whichever of the methods a plot shows (dp is black)."""
    return {method: f"C{i % 10}" for i, method in enumerate(dict.fromkeys(r.method for r in runs if not r.is_dp))}


#: What tells apart the series of one colour in a plot (a method's variants, budgets, H, ...): the
#: k-th takes the k-th marker and line style. No "^": the curves mark a cut evaluation with it.
MARKERS = ("o", "s", "D", "v", "P", "X", "p")
LINESTYLES = ("-", "--", ":", "-.")
#: The same for flat reference lines, all dotted, apart from the searched series' solid lines and dp's dashes.
REFERENCE_LINESTYLES = (":", (0, (3, 1, 1, 1)), (0, (1, 3)), (0, (5, 2, 1, 2)))


class Style(NamedTuple):
    color: str
    index: int  # among the plot's series of its colour

    @property
    def marker(self) -> str:
        return MARKERS[self.index % len(MARKERS)]

    @property
    def linestyle(self) -> str:
        return LINESTYLES[self.index % len(LINESTYLES)]

    @property
    def reference(self) -> Any:
        return REFERENCE_LINESTYLES[self.index % len(REFERENCE_LINESTYLES)]


def _styles(series: dict[str, RunResult], runs: list[RunResult]) -> dict[str, Style]:
    """Series label -> its style: its method's colour (`_method_colors`) and its rank among the
    series of that colour in `series` (each label's first run)."""
    colors = _method_colors(runs)
    seen: dict[str, int] = {}
    styles = {}
    for label, run in series.items():
        color = colors[run.method]
        styles[label] = Style(color, seen.get(color, 0))
        seen[color] = styles[label].index + 1
    return styles


def _mean_points(ax: Any, xs: list[float], samples: list[list[float]], style: Style, label: str,
                 linestyle: Any) -> None:
    """A series' points: the mean ± sample std over seeds at each x, with its seed count beside it
    ("n=3"). A point of one seed has no spread to show: it is hollow and has no bar, rather than a
    bar of zero height that reads as no spread."""
    stats = [mean_std(values) for values in samples]
    means = [mean for mean, _ in stats]
    single = [len(values) == 1 for values in samples]
    ax.errorbar(xs, means, yerr=[math.nan if std is None else std for _, std in stats], marker=style.marker,
                markerfacecolor="white" if all(single) else style.color, capsize=3, color=style.color,
                linestyle=linestyle, label=label)
    if any(single) and not all(single):
        ax.plot([x for x, one in zip(xs, single) if one], [m for m, one in zip(means, single) if one],
                linestyle="none", marker=style.marker, markerfacecolor="white", color=style.color)
    ax.set_xmargin(0.08)  # room for the seed count of the rightmost point
    for x, mean, values in zip(xs, means, samples):  # below right: clear of the bar and of a rising line
        ax.annotate(f"n={len(values)}", (x, mean), xytext=(5, -4), textcoords="offset points", va="top",
                    fontsize="x-small", color=style.color)


#: The legend entry of a hollow point, and the axis label that says what a point and its "n=" are.
ONE_SEED = "hollow: one seed (no spread)"
MEAN_STD = "mean ± std over n seeds"


def _one_seed_entry(ax: Any, samples: Iterable[list[float]]) -> None:
    """A legend entry for the hollow points, where the plot has some."""
    if any(len(values) == 1 for values in samples):
        ax.plot([], [], linestyle="none", marker="o", markerfacecolor="white", color="grey", label=ONE_SEED)


def _dp_reference(ax: Any, runs: list[RunResult]) -> None:
    """dp's final loss at each budget: its mean over seeds as a dashed line, and mean ± std as a
    band, dp's own spread, which a method's distance from the line is read against. dp is the
    variant the gaps are to (`dp_variants`)."""
    strongest = {budget: variants[0] for budget, variants in dp_variants(runs).items()}
    for budget, variant in sorted(strongest.items()):
        losses = [r.final_val_loss for r in runs if r.is_dp and r.budget == budget and r.variant == variant
                  and r.final_val_loss is not None]
        mean, std = mean_std(losses)
        name = "dp" if len(strongest) == 1 else f"dp ({budget[1]:,} tokens)"
        ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=name)
        if std is not None:
            ax.axhspan(mean - std, mean + std, color="black", alpha=0.1, linewidth=0,
                       label=f"{name}: ± std over {len(losses)} seeds")


def _log2_axis(ax: Any, values: list[int], title: str) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(title)


_AXIS_NAMES = {"workers": "R", "inner_steps": "H", "tokens": "tokens"}


def _series_label(run: RunResult, varying: list[str]) -> str:
    """What tells a series apart in full: its method, variant and the other varying axes."""
    variant = f" {run.variant}" if run.variant else ""
    return run.method + variant + "".join(f" {_AXIS_NAMES[d]}={getattr(run, d)}" for d in varying)


def _typed(value: Any) -> str:
    """A setting's value as the command line spells it (`true`, `1,0.5`)."""
    return str(value).lower() if isinstance(value, bool) else show_setting(value)


def _legend_names(series: dict[str, RunResult], axes: list[str], ignore: frozenset[str] = frozenset()) -> dict[str, str]:
    """Series label -> a short legend name: the method, then each setting that sets a run apart
    from others of its method (a variant's key) and differs between the series shown (`series`:
    each label's first run), with its value as the command line spells it, in every series it
    applies to and acts in, and holds a value (an empty list is left out); then the varying `axes`.
    A key goes by its last part where that is
    unique among them (`quantize`, not `merge.quantize`). `ignore`: keys the plot's axis shows."""
    settings = {label: dict(run.settings) for label, run in series.items()}
    own = {label: {part.partition("=")[0] for part in run.variant.split()} for label, run in series.items()}
    varied = set().union(*own.values()) - ignore

    def named(label: str, key: str) -> bool:
        return (key in own[label] or applies(key, series[label].method)) and acts(key, settings[label])

    keys = sorted(key for key in varied if len({show_setting(settings[label].get(key)) for label in series
                                                if named(label, key)}) > 1)
    leaves = [key.rsplit(".", 1)[-1] for key in keys]
    short = {key: leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves)}
    return {label: " ".join([run.method, *(f"{short[key]}={_typed(settings[label].get(key))}" for key in keys
                                          if named(label, key) and _typed(settings[label].get(key))),
                             *(f"{_AXIS_NAMES[axis]}={getattr(run, axis)}" for axis in axes)]) + _tuned_note(run)
            for label, run in series.items()}


def _tuned_note(run: RunResult) -> str:
    """What a legend adds for a series whose settings were chosen at each R (the report's --tuned)."""
    keys = [part.partition("=")[0].rsplit(".", 1)[-1] for part in run.tuned.split()]
    return f" ({', '.join(keys)} tuned per R)" if keys else ""


def _dodge(x: float, index: int, count: int) -> float:
    """x moved a little along a log axis, series by series, so that series at the same point stay
    visible side by side: at most ±0.15 of a factor of 2 in all."""
    return x if count < 2 else x * 2 ** ((index - (count - 1) / 2) * min(0.04, 0.3 / (count - 1)))


#: Characters of a small legend font per inch of figure, and the inches a legend entry's marker and
#: padding take.
LEGEND_CHARS_PER_INCH, LEGEND_MARKER_INCHES = 13, 0.8


def _legend_below(fig: Any, handles: list[Any] | None = None, labels: list[str] | None = None) -> None:
    """The figure's legend under its axes, names wrapped to the figure's width, in as many columns as
    the longest allows, the figure taller by its rows: a legend there takes height and never the
    axes' width, and stays inside the figure, whatever the number of series or their names' length."""
    import textwrap

    if handles is None:
        handles, labels = fig.axes[0].get_legend_handles_labels()
        # The key to the hollow points after the series, whatever order the artists were added in.
        entries = sorted(zip(handles, labels), key=lambda entry: entry[1] == ONE_SEED)
        handles, labels = [handle for handle, _ in entries], [label for _, label in entries]
    width = fig.get_figwidth()
    labels = [textwrap.fill(label, int((width - LEGEND_MARKER_INCHES) * LEGEND_CHARS_PER_INCH)) for label in labels]
    widest = max(len(line) for label in labels for line in label.splitlines())
    entry = widest / LEGEND_CHARS_PER_INCH + LEGEND_MARKER_INCHES
    columns = max(1, min(len(labels), int(width // entry)))
    rows = -(-len(labels) // columns)
    lines_per_row = max(label.count("\n") + 1 for label in labels)
    fig.set_figheight(fig.get_figheight() + 0.2 * rows * lines_per_row + 0.2)
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize="small")


def _plain_y(ax: Any, least_span: float) -> None:
    """A y axis without an offset (no `+5.838` above it) that spans at least `least_span`, so a
    difference well inside the report's equivalence margin does not fill the plot."""
    ax.ticklabel_format(axis="y", useOffset=False)
    low, high = ax.get_ylim()
    if high - low < least_span:
        middle = (low + high) / 2
        ax.set_ylim(middle - least_span / 2, middle + least_span / 2)


def _loss_span(losses: Iterable[float]) -> float:
    """The least span of a loss axis: the equivalence margin either side of the largest loss."""
    return 2 * DEFAULT_MARGIN_PCT / 100 * max(losses, default=1.0)


def _against(runs: list[RunResult], axis: str, gap: bool, published: Sequence[Published] = ()) -> Any:
    """Final loss (or gap to DP) against `axis`: one line per method (and per other varying axis),
    and `published` gaps as hollow stars, in the colour of the method their label starts with."""
    from matplotlib.figure import Figure

    trained = [r for r in runs if not r.is_dp and r.final_val_loss is not None]
    varying = [d for d in ("workers", "inner_steps", "tokens")
               if d != axis and len({getattr(r, d) for r in trained}) > 1]
    series: dict[str, dict[int, list[float]]] = {}
    firsts: dict[str, RunResult] = {}
    for r in trained:
        value = r.gap_pct if gap else r.final_val_loss
        if value is not None:
            label = _series_label(r, varying)
            series.setdefault(label, {}).setdefault(getattr(r, axis), []).append(value)
            firsts.setdefault(label, r)
    # A series run at one value of the axis says nothing about it: where others span it, leave it out.
    series = {label: points for label, points in series.items() if len(points) > 1} or series
    styles = _styles({label: firsts[label] for label in series}, runs)
    names = _legend_names({label: firsts[label] for label in series}, varying)
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"{'Gap to DP' if gap else 'Final validation loss'} against {X_AXES[axis][1]}")
    for index, (label, points) in enumerate(series.items()):
        xs = sorted(points)
        _mean_points(ax, [_dodge(x, index, len(series)) for x in xs], [points[x] for x in xs], styles[label],
                     names[label], styles[label].linestyle)
    _one_seed_entry(ax, (values for points in series.values() for values in points.values()))
    colors = _method_colors(runs)
    for index, (label, points) in enumerate(published):
        xs = sorted(points)
        color = colors.get(label.split()[0], f"C{(len(colors) + index) % 10}")
        ax.plot(xs, [points[x] for x in xs], marker="*", markersize=12, linestyle="none", markerfacecolor="none",
                color=color, label=label)
    if gap:
        # dp's gap is 0 at every seed (each run's gap is to dp's run of its own seed), so dp's spread
        # is already inside every point's: the line has no band.
        ax.axhline(0.0, color="black", linestyle="--", linewidth=1, label="dp")
        ax.set_ylabel(f"gap to DP (%), {MEAN_STD}")
        _plain_y(ax, 2 * DEFAULT_MARGIN_PCT)
    else:
        _dp_reference(ax, runs)
        ax.set_ylabel(f"final validation loss, {MEAN_STD}")
        _plain_y(ax, _loss_span(r.final_val_loss for r in trained))
    _log2_axis(ax, sorted({getattr(r, axis) for r in trained}.union(*(points for _, points in published))),
               X_AXES[axis][1])
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def _knobs(runs: list[RunResult]) -> dict[str, list[str]]:
    """Numeric config keys that are the one setting varying between a method's runs: knob -> methods."""
    knobs: dict[str, list[str]] = {}
    for method in dict.fromkeys(r.method for r in runs if not r.is_dp):
        members = [r for r in runs if r.method == method and r.final_val_loss is not None]
        names = {part.partition("=")[0] for r in members for part in r.variant.split()}
        if len(names) != 1 or (key := names.pop()) not in DEFAULT_SETTINGS:
            continue
        values = {dict(r.settings)[key] for r in members}
        if len(values) > 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            knobs.setdefault(key, []).append(method)
    return knobs


def _against_knob(runs: list[RunResult], key: str, knobs: dict[str, list[str]]) -> Any:
    """Final loss against `key`: a line per method searched over it (and R, H); the methods no knob was
    searched for, at the same R and H, as flat references."""
    from matplotlib.figure import Figure

    methods = knobs[key]
    trained = [r for r in runs if not r.is_dp and r.final_val_loss is not None]
    searched = [r for r in trained if r.method in methods]
    varying = [d for d in ("workers", "inner_steps", "tokens") if len({getattr(r, d) for r in searched}) > 1]
    series: dict[str, dict[float, list[float]]] = {}
    firsts: dict[str, RunResult] = {}
    for r in searched:
        label = _series_label(replace(r, variant=""), varying)
        series.setdefault(label, {}).setdefault(dict(r.settings)[key], []).append(r.final_val_loss)
        firsts.setdefault(label, r)
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"Final validation loss against {key}")
    searched_any = {m for ms in knobs.values() for m in ms}
    where = (searched[0].workers, searched[0].inner_steps, searched[0].budget)
    references = [g for g in group_runs([r for r in runs if r.method not in searched_any and not r.is_dp
                                         and r.final_val_loss is not None])
                  if not varying and (g.first.workers, g.first.inner_steps, g.first.budget) == where]
    firsts.update((g.first.label, g.first) for g in references)
    styles = _styles(firsts, runs)
    names = _legend_names(firsts, varying, ignore=frozenset({key}))
    for label, points in series.items():
        xs = sorted(points)
        _mean_points(ax, xs, [points[x] for x in xs], styles[label], names[label], styles[label].linestyle)
    _one_seed_entry(ax, (values for points in series.values() for values in points.values()))
    # Flat lines: what the searched method is compared with (dp; the other methods at its one R and H).
    _dp_reference(ax, runs)
    for group in references:
        style = styles[group.first.label]
        ax.axhline(mean_std(group.values("final_val_loss"))[0], color=style.color, linestyle=style.reference,
                   linewidth=1.5, label=names[group.first.label])
    ticks = sorted({x for points in series.values() for x in points})
    if ticks[0] > 0 and ticks[-1] / ticks[0] >= 4:  # a search over scales (learning rates): log axis
        from matplotlib.ticker import NullLocator

        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks], rotation=90 if len(ticks) > 5 else 0)
    ax.set_xlabel(key)
    ax.set_ylabel(f"final validation loss, {MEAN_STD}")
    _plain_y(ax, _loss_span(r.final_val_loss for r in trained))
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def _curves(runs: list[RunResult]) -> Any:
    """Validation loss against tokens, one panel per R; dp (dashed) in every panel; each seed its
    marker, so that one run's curve can be followed and told from the other seeds'."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    with_curve = [r for r in runs if r.curve]
    trained = [r for r in with_curve if not r.is_dp]
    panels = sorted({r.workers for r in trained}) or [None]
    varying = [d for d in ("inner_steps", "tokens") if len({getattr(r, d) for r in trained}) > 1]
    seeds = sorted({r.seed for r in with_curve})
    markers = {seed: MARKERS[i % len(MARKERS)] for i, seed in enumerate(seeds)}
    firsts: dict[str, RunResult] = {}
    for r in trained:
        firsts.setdefault(_series_label(r, varying), r)
    styles = _styles(firsts, runs)
    names = _legend_names(firsts, varying)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(max(6.4, 4.2 * cols), 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).ravel()
    # The first evaluations sit far above the rest; cap the y axis at the losses after a
    # quarter of training so the differences between methods stay visible, and mark what it cuts.
    last = max(t for r in with_curve for t, _ in r.curve)
    low = min(v for r in with_curve for _, v in r.curve)
    high = max(v for r in with_curve for t, v in r.curve if t >= 0.25 * last)
    # The legend's entries: a series by its colour and line style, a seed by its marker.
    handles: dict[str, Any] = {}
    for ax, workers in zip(axes, panels):
        for r in [x for x in with_curve if x.is_dp or x.workers == workers]:
            if r.is_dp:
                label, color, linestyle = f"dp ({r.tokens:,} tokens)", "black", "--"
            else:
                style = styles[_series_label(r, varying)]
                label, color, linestyle = names[_series_label(r, varying)], style.color, style.linestyle
            ax.plot([t for t, _ in r.curve], [v for _, v in r.curve], marker=markers[r.seed], markersize=3.5,
                    linewidth=1, color=color, linestyle=linestyle)
            handles.setdefault(label, Line2D([], [], color=color, linestyle=linestyle, linewidth=1))
        ax.set_title("dp" if workers is None else f"R = {workers}")
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    pad = 0.03 * (high - low or 1.0)
    top = high + pad
    for ax, workers in zip(axes, panels):  # what the cap hides, drawn as ▲ on the top edge
        for r in [x for x in with_curve if x.is_dp or x.workers == workers]:
            above = [t for t, v in r.curve if v > top]
            if above:
                color = "black" if r.is_dp else styles[_series_label(r, varying)].color
                ax.plot(above, [top] * len(above), marker="^", linestyle="none", color=color, clip_on=False)
    axes[0].set_ylim(low - pad, top)
    _plain_y(axes[0], _loss_span([high]))
    if any(v > top for r in with_curve for _, v in r.curve):
        fig.suptitle(f"y axis cut at {top:.2f} (the losses after a quarter of training); ▲: an evaluation above it",
                     fontsize="small")
    for ax in axes[::cols]:
        ax.set_ylabel("validation loss")
    if len(seeds) > 1:
        handles.update((f"seed {seed}", Line2D([], [], color="grey", marker=markers[seed], linestyle="none"))
                       for seed in seeds)
    _legend_below(fig, list(handles.values()), list(handles))
    return fig


def _against_bytes(runs: list[RunResult]) -> Any:
    """Final loss against the slow-link bytes per round, log scale: what each setting saved and
    what it cost, one point per setting (mean ± std over seeds), dp as a dashed line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    groups = [g for g in group_runs([r for r in runs if not r.is_dp and r.final_val_loss is not None
                                     and r.slow_link_bytes])]
    varying = [d for d in ("workers", "inner_steps", "tokens") if len({getattr(g.first, d) for g in groups}) > 1]
    firsts = {_series_label(g.first, varying): g.first for g in groups}
    names, styles = _legend_names(firsts, varying), _styles(firsts, runs)
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Final validation loss against the slow link's bytes")
    sent = {id(group): mean_std(group.values("slow_link_bytes"))[0] for group in groups}
    for group in groups:
        label = _series_label(group.first, varying)
        # Settings that send the same bytes stand side by side, not on top of each other.
        same = [other for other in groups if f"{sent[id(other)]:.6g}" == f"{sent[id(group)]:.6g}"]
        _mean_points(ax, [_dodge(sent[id(group)], same.index(group), len(same))], [group.values("final_val_loss")],
                     styles[label], names[label], "none")
    _one_seed_entry(ax, (group.values("final_val_loss") for group in groups))
    _dp_reference(ax, runs)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=""))
    ax.set_xlabel("slow-link bytes per process per round (measured, or modelled in one process)")
    ax.set_ylabel(f"final validation loss, {MEAN_STD}")
    _plain_y(ax, _loss_span(loss for g in groups for loss in g.values("final_val_loss")))
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def _partial(run: RunResult) -> bool:
    """Whether some round of the run merged fewer than all its workers (`faults.late_rate`)."""
    return any(merged < run.workers for _, merged in run.participation)


def participation_lines(runs: list[RunResult]) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """The participation plot's lines: one per distinct sequence of (step, workers merged) among
    the runs whose participation varied, named after its first run and how many share it. Runs
    with the same seed and late rate draw the same late workers whatever the method, so a grid
    of them would otherwise draw the same line many times over."""
    groups: dict[tuple[tuple[int, int], ...], list[str]] = {}
    for run in sorted((r for r in runs if _partial(r)), key=sort_key):
        groups.setdefault(run.participation, []).append(run.name)
    return [(names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more with the same rounds", rounds)
            for rounds, names in groups.items()]


def _participation(runs: list[RunResult]) -> Any:
    """Workers merged in each round, one step line per distinct participation (`participation_lines`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    lines = participation_lines(runs)
    # The legend goes under the axes: its labels name runs, too long to sit beside them.
    fig = Figure(figsize=(7.0, 3.4), layout="constrained")
    ax = fig.subplots()
    for index, (label, rounds) in enumerate(lines):
        # Lines that share a round's count are dodged apart so each stays visible.
        ax.plot([_dodge(step, index, len(lines)) for step, _ in rounds], [merged for _, merged in rounds],
                marker="o", label=label)
    ax.set_ylim(-0.2, max(r.workers for r in runs if _partial(r)) + 0.2)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (end of the round)")
    ax.set_ylabel("workers merged")
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def write_plots(runs: list[RunResult], folder: Path, published: Sequence[Published] = ()) -> list[tuple[str, str]]:
    """Write every plot that has data, `published` gaps beside the gap against R; return (file
    name, caption) pairs in a fixed order."""
    import matplotlib.style

    folder.mkdir(parents=True, exist_ok=True)
    trained = [r for r in runs if not r.is_dp and r.final_val_loss is not None]
    written: list[tuple[str, str]] = []
    with matplotlib.style.context("default"):
        for axis, (short, _) in X_AXES.items():
            if trained and (axis == "workers" or len({getattr(r, axis) for r in trained}) > 1):
                for gap, stem, caption in ((False, "val_loss", "Final validation loss"), (True, "gap", "Gap to DP")):
                    if gap and all(r.gap_pct is None for r in trained):
                        continue  # no dp run to measure a gap to: an empty chart says nothing
                    file = f"{stem}_vs_{short}.png"
                    save_png(_against(runs, axis, gap, published if gap and axis == "workers" else ()), folder / file)
                    written.append((file, f"{caption} vs {short}"))
        knobs = _knobs(runs)
        for key in sorted(knobs):
            file = f"val_loss_vs_{key}.png"
            save_png(_against_knob(runs, key, knobs), folder / file)
            written.append((file, f"Final validation loss vs {key}"))
        if any(r.curve for r in runs):
            save_png(_curves(runs), folder / "val_curves.png")
            written.append(("val_curves.png", "Validation loss curves"))
        if len({r.slow_link_bytes for r in trained if r.slow_link_bytes}) > 1:
            save_png(_against_bytes(runs), folder / "val_loss_vs_bytes.png")
            written.append(("val_loss_vs_bytes.png", "Final validation loss vs slow-link bytes per round"))
        if any(_partial(r) for r in runs if not r.is_dp):
            save_png(_participation([r for r in runs if not r.is_dp]), folder / "participation.png")
            written.append(("participation.png", "Workers merged per round"))
    return written

