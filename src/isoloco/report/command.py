"""The command: `isoloco report DIR [--compare A:B] [--contrast A:B::C:D] [--margin PCT]`, which
reads every run of DIR and writes its tables, plots and comparisons (`write_report` alone is what
`isoloco sweep` runs at its end)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

import yaml

from isoloco.errors import ReportError
from isoloco.report.compare import COMPARE_FILE, CONTRAST_FILE, compare_markdown, contrast_markdown, named_runs
from isoloco.report.plots import Published, write_plots
from isoloco.report.runs import RunResult, finished_runs, group_runs, load_runs
from isoloco.report.spectra import write_spectra_plots
from isoloco.report.stats import DEFAULT_MARGIN_PCT
from isoloco.report.tables import (CSV_FILE, MARKDOWN_FILE, PLOT_DIR, SUMMARY_CSV_FILE, results_csv, results_markdown,
                                   summary_csv)
from isoloco.rundir import SWEEP_MANIFEST


def write_report(directory: Path, published: Sequence[Published] = (),
                 tuned: Sequence[str] = ()) -> list[tuple[RunResult, RunResult]]:
    """Write the tables and plots (`published` gaps drawn beside the runs' gap against R; `tuned`
    settings chosen per R, as `load_runs` takes them); return the runs left out as repeats of a
    seed, each with the one kept."""
    repeats: list[tuple[RunResult, RunResult]] = []
    runs = load_runs(directory, repeats, tuned)
    groups = group_runs(runs)
    manifest_path = directory / SWEEP_MANIFEST
    manifest = yaml.safe_load(manifest_path.read_text()) if manifest_path.is_file() else None
    plots = write_plots(runs, directory / PLOT_DIR, published)
    plots += write_spectra_plots(directory, runs, directory / PLOT_DIR)
    (directory / CSV_FILE).write_text(results_csv(runs))
    (directory / SUMMARY_CSV_FILE).write_text(summary_csv(groups))
    title = directory.resolve().name
    (directory / MARKDOWN_FILE).write_text(results_markdown(title, runs, groups, manifest, plots, repeats))
    return repeats


def cmd_report(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    pairs = [_pair(text) for text in args.compare]
    contrasts = [_contrast(text) for text in args.contrast]
    margin_pct = _margin(args.margin)
    published = [_published(text) for text in args.published]
    tuned = [key.strip() for text in args.tuned for key in text.split(",") if key.strip()]
    # Every label is read, and must name one setting at each point, before anything is written.
    finished = finished_runs(load_runs(directory, tuned=tuned))
    for option, labels in (("--compare", [label for pair in pairs for label in pair]),
                           ("--contrast", [label for both in contrasts for pair in both for label in pair])):
        for label in labels:
            named_runs(finished, label, option)
    for left, kept in write_report(directory, published, tuned):
        print(f"warning: {left.name} repeats seed {left.seed} of {kept.name} (same method and settings): counted "
              f"once, as {kept.name}; give the rerun another seed or move it out of {directory}", file=sys.stderr)
    print(f"wrote {directory / MARKDOWN_FILE}, {CSV_FILE}, {SUMMARY_CSV_FILE} and {directory / PLOT_DIR}/")
    if pairs:
        (directory / COMPARE_FILE).write_text(compare_markdown(load_runs(directory, tuned=tuned), pairs, margin_pct))
        print(f"wrote {directory / COMPARE_FILE}")
    if contrasts:
        (directory / CONTRAST_FILE).write_text(contrast_markdown(load_runs(directory, tuned=tuned), contrasts))
        print(f"wrote {directory / CONTRAST_FILE}")
    return 0


def _contrast(text: str) -> tuple[tuple[str, str], tuple[str, str]]:
    first, sep, second = text.partition("::")
    try:
        if not sep:
            raise ReportError("")
        return _pair(first), _pair(second)
    except ReportError:
        raise ReportError(f"--contrast {text!r} is not A:B::C:D; example: --contrast "
                          "'isoloco merge.quantize=int8:isoloco::diloco merge.quantize=int8:diloco'") from None


def _pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise ReportError(f"--compare {text!r} is not A:B; example: --compare isoloco:diloco")
    return a, b


def _published(text: str) -> Published:
    """`LABEL@R=GAP[,R=GAP...]`: a published series of gaps to DP (%) at R workers."""
    label, sep, points = text.rpartition("@")
    example = "example: --published 'isoloco (paper, 178M)@128=9.7'"
    if not sep or not label.strip():
        raise ReportError(f"--published {text!r} is not LABEL@R=GAP[,R=GAP...]; {example}")
    gaps = {}
    for point in points.split(","):
        workers, _, gap = point.partition("=")
        try:
            gaps[int(workers)] = float(gap)
        except ValueError:
            raise ReportError(f"--published {text!r}: {point!r} is not R=GAP (a whole number of workers, a gap to "
                              f"DP in %); {example}") from None
        if int(workers) < 1 or not math.isfinite(gaps[int(workers)]):
            raise ReportError(f"--published {text!r}: {point!r} needs R >= 1 and a finite gap; {example}")
    return label.strip(), gaps


def _margin(text: str) -> float:
    try:
        pct = float(text)
    except ValueError:
        pct = math.nan
    if not 0 < pct < 100:  # false for nan too
        raise ReportError(f"--margin {text!r} is not a percentage of the loss between 0 and 100; example: "
                          "--margin 1 (equivalence within ±1% of B's mean final loss)")
    return pct


def add_report_command(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser(
        "report", help="tables and plots of a directory of runs (results.csv, results.md, plots/)",
        description="Read every run directory in DIR and write results.csv, summary.csv, results.md and "
                    "plots/*.png: final validation loss and gap to the dp run of the same budget and seed, "
                    "mean ± std over seeds. Rerunning gives identical files.")
    report.add_argument("directory", metavar="DIR", help="a folder of run directories (the --out of isoloco sweep)")
    report.add_argument("--compare", action="append", default=[], metavar="A:B",
                        help="also write compare.md: method A's final loss minus B's, paired by seed, at every R "
                             "and H, with 95%% intervals and an equivalence test at --margin (repeatable); A or B "
                             "may name a variant as results.md writes it, e.g. 'isoc outer.lr=3.0:isoloco'")
    report.add_argument("--contrast", action="append", default=[], metavar="A:B::C:D",
                        help="also write contrast.md: (A − B) − (C − D) paired by seed, with its 95%% interval: "
                             "whether a change costs one method more than another (repeatable)")
    report.add_argument("--margin", default=format(DEFAULT_MARGIN_PCT, "g"), metavar="PCT",
                        help="the equivalence margin of --compare, in %% of B's mean final loss at each point: a "
                             "tie is called only when the 90%% interval of A − B lies inside ±PCT%% (two one-sided "
                             "t-tests at level 0.05; default %(default)s)")
    report.add_argument("--published", action="append", default=[], metavar="LABEL@R=GAP[,R=GAP...]",
                        help="draw a published gap to DP (%%) at R workers beside the runs' gap against R, as "
                             "hollow stars labelled LABEL, in the colour of the method LABEL starts with "
                             "(repeatable), e.g. 'isoloco (paper, 178M)@128=9.7'")
    report.add_argument("--tuned", action="append", default=[], metavar="KEY[,KEY...]",
                        help="settings a search chose at each R and H, e.g. outer.lr,outer.momentum: a method's "
                             "runs that differ only in them form one series in the tables and plots, each row "
                             "showing its values (two values at one R and H is an error; repeatable)")
    report.set_defaults(func=cmd_report)
