"""`isoloco report DIR`: tables and plots of a directory of runs, the same bytes every time.

The paper's headline is each method's validation-loss gap to data-parallel training,
(loss − loss_DP) / loss_DP in percent, against the number of workers R. The report reads
every run directory directly under DIR (`config.yaml`, `summary.json`, `metrics.jsonl`),
pairs each run with the `dp` run of the same model, token budget and seed, groups the runs
that differ only in their seed (whatever else differs between runs of one method — a knob,
the number of processes — makes a point of its own, its *variant*), and writes:

* `results.csv`: one row per run; `summary.csv`: mean and sample std over seeds, per point;
* `results.md`: both tables in Markdown, with the plots linked; a run that ended above its
  unigram baseline (it diverged: it knows less than the token frequencies) is marked unstable,
  and a run whose validation loss was above that baseline at any evaluation is marked too, with
  its peak; where runs record them, the cross-island wire bytes and exposed synchronisation
  seconds; two runs of one point with the same seed count once (the rest are listed, not averaged);
* `plots/`: validation loss and gap to DP against R (log2 axis) — and against H when the
  directory holds several H —, validation loss against each numeric knob a method was run at
  several values of (a search or a grid: `outer.lr`, `merge.density`, ...), with the other
  methods at the same R and H as lines to compare with, and the validation-loss curves of
  every run, one panel per R;
* with `--compare A:B`, `compare.md`, and with `--contrast A:B::C:D`, `contrast.md`: paired
  differences with their intervals, tests and calls.

Rerunning on the same directory must give identical files, so the outputs carry no
timestamps or absolute paths, rows are sorted, and PNGs are written without the Software
metadata (the only varying field matplotlib adds) from a style reset to matplotlib's defaults.

One module per job: `runs` (loading runs), `tables` (results.csv, summary.csv, results.md),
`plots`, `spectra` (spectra.md and the plots of what `log.spectra` logged), `stats`
(scipy.stats: t quantiles, the paired t-test, TOST, Benjamini–Hochberg), `compare` (the paired
comparisons and contrasts) and `command` (the command line).
"""

from isoloco.report.command import add_report_command, cmd_report, write_report
from isoloco.report.compare import (COMPARE_FILE, CONTRAST_FILE, FDR, ONE_SEED, SUMMARY_SECTIONS, UNSTABLE_RUNS,
                                    TestRow,
                                    compare_markdown, compare_tests, contrast_markdown, contrast_tests, is_call,
                                    label_settings)
from isoloco.report.plots import X_AXES, participation_lines, write_plots
from isoloco.report.runs import Group, RunResult, dp_variants, group_runs, load_run, load_runs
from isoloco.report.stats import (DEFAULT_MARGIN_PCT, benjamini_hochberg, mean_ci, paired_p, t_quantile, tost_p)
from isoloco.report.tables import (ABOVE_UNIGRAM_MARK, CSV_FILE, MARKDOWN_FILE, PLOT_DIR, SUMMARY_CSV_FILE,
                                   UNSTABLE_MARK, results_csv, results_markdown, summary_csv)

__all__ = [
    "ABOVE_UNIGRAM_MARK", "COMPARE_FILE", "CONTRAST_FILE", "CSV_FILE", "DEFAULT_MARGIN_PCT", "FDR", "Group",
    "MARKDOWN_FILE", "ONE_SEED", "PLOT_DIR", "RunResult", "SUMMARY_CSV_FILE", "SUMMARY_SECTIONS", "TestRow", "UNSTABLE_MARK",
    "UNSTABLE_RUNS", "X_AXES", "add_report_command", "benjamini_hochberg", "cmd_report", "compare_markdown",
    "compare_tests", "contrast_markdown", "contrast_tests", "dp_variants", "group_runs", "is_call", "label_settings", "load_run",
    "load_runs", "mean_ci", "paired_p", "participation_lines", "results_csv", "results_markdown", "summary_csv",
    "t_quantile", "tost_p", "write_plots", "write_report",
]
