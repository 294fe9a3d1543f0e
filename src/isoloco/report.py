"""`isoloco report DIR`: tables and plots of a directory of runs, the same bytes every time.

The paper's headline is each method's validation-loss gap to data-parallel training,
(loss − loss_DP) / loss_DP in percent, against the number of workers R. This module reads
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
  every run, one panel per R.

Rerunning on the same directory must give identical files, so the outputs carry no
timestamps or absolute paths, rows are sorted, and PNGs are written without the Software
metadata (the only varying field matplotlib adds) from a style reset to matplotlib's defaults.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from isoloco.config import (EXECUTION_KEYS, TrainConfig, acts, flatten, from_dict, parse_overrides, to_dict,
                            typed_values)
from isoloco.errors import ConfigError, ReportError
from isoloco.methods import METHODS
from isoloco.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, SWEEP_MANIFEST

CSV_FILE = "results.csv"
SUMMARY_CSV_FILE = "summary.csv"
MARKDOWN_FILE = "results.md"
COMPARE_FILE = "compare.md"
CONTRAST_FILE = "contrast.md"
PLOT_DIR = "plots"
#: Axes a plot can put on x: run attribute -> (short label, axis title).
X_AXES = {"workers": ("R", "workers R"), "inner_steps": ("H", "inner steps H")}


@dataclass(frozen=True)
class RunResult:
    """What the report needs of one run directory; workers and inner_steps are None for dp."""

    name: str
    method: str
    workers: int | None
    inner_steps: int | None
    seed: int
    model: str
    tokens: int
    final_val_loss: float | None  # None until the run has finished (summary.json)
    unigram_baseline: float | None  # the loss of predicting the token frequencies (summary.json)
    wall_time_s: float | None
    cpu_time_s: float | None  # the training process's CPU time in rounds (absent from older runs)
    curve: tuple[tuple[int, float], ...]  # (tokens, validation loss) at each evaluation
    settings: tuple[tuple[str, Any], ...] = ()  # what the run computes: config keys and processes
    variant: str = ""  # the settings that set it apart from other runs of its method, `key=value ...`
    gap_pct: float | None = None
    peak: tuple[int, float] | None = None  # (step, validation loss) of its highest evaluation
    # Above the unigram baseline at an evaluation after its first: not a model still learning the
    # token frequencies, but one that lost them again (or never learnt them).
    above_after_first: bool = False
    wire_bytes: float | None = None  # cross-island bytes over the run, all processes (newer runs only)
    # Slow-link bytes per process per round (measured in a job, modelled in the simulator) and how
    # many times fewer than float32's for the same model and layout (newer runs only).
    slow_link_bytes: float | None = None
    fewer_than_float32: float | None = None
    exposed_sync_s: float | None = None  # synchronisation seconds training waited for (newer runs only)
    # (step, workers merged) of each round (runs that record `workers_merged`): fewer than R with late workers.
    participation: tuple[tuple[int, int], ...] = ()
    # The variant, plus its values of the settings other methods vary that apply to it: what the
    # tables show, so that a method run with one setting does not read as "—" beside the others.
    shown_variant: str = ""

    @property
    def label(self) -> str:
        """The method, and its variant when it has one: what `--compare` names."""
        return f"{self.method} {self.variant}" if self.variant else self.method

    @property
    def unstable(self) -> bool:
        """Ended above the unigram baseline: training diverged, so its loss supports no comparison."""
        return None not in (self.final_val_loss, self.unigram_baseline) and self.final_val_loss > self.unigram_baseline

    @property
    def rose_above_unigram(self) -> bool:
        """Above the unigram baseline at some evaluation (early, before the model has learnt the token
        frequencies, or later, diverging): the verdicts that rest on such a run say so."""
        return None not in (self.peak, self.unigram_baseline) and self.peak[1] > self.unigram_baseline

    @property
    def is_dp(self) -> bool:
        return self.workers is None

    @property
    def budget(self) -> tuple[str, int]:
        return self.model, self.tokens


def _method_rank(method: str) -> tuple[int, str]:
    order = list(METHODS)
    return (order.index(method), "") if method in order else (len(order), method)


def _sort_key(run: RunResult) -> tuple:
    return (_method_rank(run.method), run.workers or 0, run.inner_steps or 0, run.model, run.tokens, run.variant,
            run.seed, run.name)


def _records(path: Path) -> list[dict[str, Any]]:
    """The lines of metrics.jsonl; a torn last line of a run in progress is skipped, and so is a missing file."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _read_curve(records: list[dict[str, Any]]) -> tuple[tuple[int, int, float], ...]:
    """(step, tokens, validation loss) of each evaluation."""
    return tuple((int(r["step"]), int(r["tokens"]), float(r["val_loss"])) for r in records if "val_loss" in r)


#: Every config key at its default, for configs written before a key existed.
_DEFAULT_SETTINGS = flatten(to_dict(TrainConfig()))


def load_run(run_dir: Path) -> RunResult:
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    summary = json.loads((run_dir / SUMMARY_FILE).read_text()) if (run_dir / SUMMARY_FILE).is_file() else {}
    dp = cfg["algorithm"] == "dp"
    # Everything that changes what the run computes, but the seed and the axes of the tables.
    # A key an older config lacks has its default value, not a value of its own.
    saved = {**_DEFAULT_SETTINGS, **flatten(cfg)}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                if k not in EXECUTION_KEYS and k not in ("seed", "method", "workers", "inner_steps")}
    settings["processes"] = summary.get("processes", 1)
    records = _records(run_dir / METRICS_FILE)
    evaluations = _read_curve(records)
    peak = max(evaluations, key=lambda point: point[2], default=None)
    unigram = summary.get("unigram_baseline")
    return RunResult(
        name=run_dir.name, method=cfg["method"], workers=None if dp else cfg["workers"],
        inner_steps=None if dp else cfg["inner_steps"], seed=cfg["seed"], model=cfg["model"],
        # The budget a run was given: what a finished one scheduled (older runs: what they trained, the
        # same without slow workers); an unfinished one is counted by its plan.
        tokens=summary.get("tokens_scheduled") or summary.get("tokens")
        or from_dict(cfg).train_steps * cfg["global_batch"] * cfg["seq_len"],
        final_val_loss=summary.get("final_val_loss"), unigram_baseline=unigram,
        wall_time_s=summary.get("wall_time_s"), cpu_time_s=summary.get("cpu_time_s"),
        curve=tuple((tokens, loss) for _, tokens, loss in evaluations),
        peak=None if peak is None else (peak[0], peak[2]),
        above_after_first=unigram is not None and any(loss > unigram for *_, loss in evaluations[1:]),
        wire_bytes=summary.get("cross_island_wire_bytes"), exposed_sync_s=summary.get("exposed_sync_seconds"),
        slow_link_bytes=summary.get("slow_link_bytes_per_round"),
        fewer_than_float32=summary.get("slow_link_fewer_than_float32"),
        participation=tuple((int(r["step"]), int(r["workers_merged"])) for r in records if "workers_merged" in r),
        settings=tuple(sorted(settings.items())))


def load_runs(directory: Path, repeats: list[tuple[RunResult, RunResult]] | None = None) -> list[RunResult]:
    """Every run directly under `directory`, sorted, each with its gap to the matching dp run. Of
    two runs of one point with the same seed, the first by name is kept; `repeats`, when given,
    receives each (left out, kept) pair."""
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory: give the folder a sweep wrote its runs to")
    runs = [load_run(p) for p in directory.iterdir() if (p / CONFIG_FILE).is_file()]
    if not runs:
        raise ReportError(f"{directory} holds no run directories (folders with {CONFIG_FILE}); give the --out "
                          "folder of `isoloco sweep` or a folder of `isoloco train` runs")
    runs = _drop_repeats(sorted(_with_variants(runs), key=_sort_key), repeats if repeats is not None else [])
    # The reference of a run: the dp run of its budget and seed, of the strongest dp variant.
    strongest = {budget: variants[0] for budget, variants in dp_variants(runs).items()}
    reference = {(r.budget, r.seed): r.final_val_loss for r in runs if r.is_dp and r.final_val_loss is not None
                 and r.variant == strongest[r.budget]}
    return [replace(r, gap_pct=_gap(r.final_val_loss, reference.get((r.budget, r.seed)))) for r in runs]


def _drop_repeats(runs: list[RunResult], repeats: list[tuple[RunResult, RunResult]]) -> list[RunResult]:
    """One run per point and seed: a second run of the same seed is the same sample again (a rerun,
    or one run linked twice), so averaging both would count one seed as two and shrink the spread."""
    kept: dict[tuple, RunResult] = {}
    for run in runs:
        key = (run.method, run.workers, run.inner_steps, run.budget, run.variant, run.seed)
        if key in kept:
            repeats.append((run, kept[key]))
        else:
            kept[key] = run
    return list(kept.values())


def dp_variants(runs: list[RunResult]) -> dict[tuple, list[str]]:
    """Budget -> the variants of its finished dp runs, lowest mean final loss first. The gaps are to
    the first: where dp ran with several settings at one budget (an lr search), the strongest
    baseline, the same one for every seed."""
    means: dict[tuple, list[tuple[float, str]]] = {}
    for group in group_runs([r for r in runs if r.is_dp and r.final_val_loss is not None]):
        means.setdefault(group.first.budget, []).append(
            (statistics.fmean(group.values("final_val_loss")), group.first.variant))
    return {budget: [variant for _, variant in sorted(found)] for budget, found in means.items()}


def _show(value: Any) -> str:
    """A setting as `key=value` writes it on the command line (lists comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


#: Keys some method's defaults set (merge.density: TIES's): a method that does not set one ignores it.
_METHOD_KEYS = {key for values in METHODS.values() for key in values}


def _applies(key: str, method: str) -> bool:
    """Whether `key` can change what `method` computes: dp has no merge and no outer step, and a
    key that only some methods' defaults set (a merge rule's parameter) belongs to those."""
    if METHODS.get(method, {}).get("algorithm") == "dp" and key.startswith(("merge.", "outer.")):
        return False
    return key not in _METHOD_KEYS or key in METHODS.get(method, {})


def _with_variants(runs: list[RunResult]) -> list[RunResult]:
    """Each run with its variant: the settings whose values differ between the runs of its method;
    and what the tables show of it: those, and its values of the settings other methods vary."""
    by_method: dict[str, list[RunResult]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)
    varying: dict[str, list[str]] = {}
    for method, members in by_method.items():
        values: dict[str, set] = {}
        for run in members:
            for key, value in run.settings:
                values.setdefault(key, set()).add(value)
        varying[method] = sorted(key for key, seen in values.items() if len(seen) > 1)
    anywhere = sorted({key for keys in varying.values() for key in keys})
    labelled = []
    for method, members in by_method.items():
        shown = sorted({*varying[method], *(key for key in anywhere if _applies(key, method))})
        for run in members:
            own = dict(run.settings)
            labelled.append(replace(run, variant=" ".join(f"{key}={_show(own.get(key))}" for key in varying[method]),
                                    shown_variant=" ".join(f"{key}={_show(own.get(key))}" for key in shown)))
    return labelled


def _gap(loss: float | None, dp_loss: float | None) -> float | None:
    return None if loss is None or dp_loss is None else 100.0 * (loss - dp_loss) / dp_loss


# ---------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Group:
    """The runs of one (method, R, H, budget, variant) over seeds."""

    runs: tuple[RunResult, ...]

    @property
    def first(self) -> RunResult:
        return self.runs[0]

    def values(self, field: str) -> list[float]:
        return [getattr(r, field) for r in self.runs if getattr(r, field) is not None]

    @property
    def unstable(self) -> bool:
        return any(r.unstable for r in self.runs)

    @property
    def rose_above_unigram(self) -> bool:
        return any(r.rose_above_unigram for r in self.runs)

    @property
    def peak_loss(self) -> float | None:
        """The highest validation loss any of its runs reached."""
        return max((r.peak[1] for r in self.runs if r.peak is not None), default=None)


def group_runs(runs: list[RunResult]) -> list[Group]:
    groups: dict[tuple, list[RunResult]] = {}
    for run in runs:  # already sorted, and seed is the last key but the name: groups stay in order
        groups.setdefault((run.method, run.workers, run.inner_steps, run.budget, run.variant), []).append(run)
    return [Group(tuple(members)) for members in groups.values()]


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _fmt(value: float | int | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _pm(values: list[float], spec: str) -> str:
    """`mean ± std` for Markdown (just the value for one seed, — for none)."""
    mean, std = _mean_std(values)
    if mean is None:
        return "—"
    return format(mean, spec) + (f" ± {std:{spec.lstrip('+')}}" if std is not None else "")


def _csv(header: list[str], rows: Iterable[list[str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def _has_link(runs: Iterable[RunResult]) -> bool:
    """Whether any run records its link traffic: only then do the tables get those columns."""
    return any(r.wire_bytes is not None or r.exposed_sync_s is not None for r in runs)


def _has_slow_link(runs: Iterable[RunResult]) -> bool:
    """Whether any run records its slow-link bytes per round beside float32's: only then do the
    tables get those columns."""
    return any(r.slow_link_bytes is not None for r in runs)


def _fewer(value: float | None) -> str:
    """How many times fewer bytes than float32, as the tables write it."""
    return "" if value is None else f"{value:.1f}×"


def results_csv(runs: list[RunResult]) -> str:
    link, slow = _has_link(runs), _has_slow_link(runs)
    return _csv(
        ["run", "method", "R", "H", "variant", "seed", "model", "tokens", "final_val_loss", "gap_to_dp_pct",
         "peak_val_loss", "peak_step", "above_unigram_at_an_evaluation", "above_unigram_after_first_evaluation",
         "ended_above_unigram", "wall_time_s", "cpu_time_s",
         *(["cross_island_wire_bytes", "exposed_sync_seconds"] if link else []),
         *(["slow_link_bytes_per_round", "slow_link_fewer_than_float32"] if slow else []), "status"],
        ([r.name, r.method, _fmt(r.workers, "d"), _fmt(r.inner_steps, "d"), r.variant, str(r.seed), r.model,
          str(r.tokens), _fmt(r.final_val_loss, ".6f"), _fmt(r.gap_pct, ".4f"),
          _fmt(r.peak and r.peak[1], ".6f"), _fmt(r.peak and r.peak[0], "d"), str(r.rose_above_unigram).lower(),
          str(r.above_after_first).lower(), str(r.unstable).lower(),
          _fmt(r.wall_time_s, ".1f"), _fmt(r.cpu_time_s, ".1f"),
          *([_fmt(r.wire_bytes, ".0f"), _fmt(r.exposed_sync_s, ".3f")] if link else []),
          *([_fmt(r.slow_link_bytes, ".0f"), _fmt(r.fewer_than_float32, ".3f")] if slow else []),
          "finished" if r.final_val_loss is not None else "incomplete"] for r in runs))


def summary_csv(groups: list[Group]) -> str:
    link, slow = _has_link(r for g in groups for r in g.runs), _has_slow_link(r for g in groups for r in g.runs)
    rows = []
    for g in groups:
        loss, loss_std = _mean_std(g.values("final_val_loss"))
        gap, gap_std = _mean_std(g.values("gap_pct"))
        wall, _ = _mean_std(g.values("wall_time_s"))
        cpu, _ = _mean_std(g.values("cpu_time_s"))
        wire, _ = _mean_std(g.values("wire_bytes"))
        exposed, _ = _mean_std(g.values("exposed_sync_s"))
        slow_link, _ = _mean_std(g.values("slow_link_bytes"))
        fewer, _ = _mean_std(g.values("fewer_than_float32"))
        rows.append([g.first.method, _fmt(g.first.workers, "d"), _fmt(g.first.inner_steps, "d"), g.first.variant,
                     g.first.model, str(g.first.tokens), str(len(g.values("final_val_loss"))), _fmt(loss, ".6f"),
                     _fmt(loss_std, ".6f"), _fmt(gap, ".4f"), _fmt(gap_std, ".4f"), _fmt(g.peak_loss, ".6f"),
                     str(sum(r.rose_above_unigram for r in g.runs)), str(sum(r.unstable for r in g.runs)),
                     _fmt(wall, ".1f"), _fmt(cpu, ".1f"),
                     *([_fmt(wire, ".0f"), _fmt(exposed, ".3f")] if link else []),
                     *([_fmt(slow_link, ".0f"), _fmt(fewer, ".3f")] if slow else [])])
    return _csv(["method", "R", "H", "variant", "model", "tokens", "seeds", "final_val_loss_mean", "final_val_loss_std",
                 "gap_to_dp_pct_mean", "gap_to_dp_pct_std", "peak_val_loss_max", "runs_above_unigram_at_an_evaluation",
                 "runs_ended_above_unigram", "wall_time_s_mean", "cpu_time_s_mean",
                 *(["cross_island_wire_bytes_mean", "exposed_sync_seconds_mean"] if link else []),
                 *(["slow_link_bytes_per_round_mean", "slow_link_fewer_than_float32_mean"] if slow else [])], rows)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _dash(value: int | None) -> str:
    return "—" if value is None else str(value)


#: What marks an unstable run, or a point with one, in the tables of results.md.
UNSTABLE_MARK = "†"
#: What marks a run (or a point with one) whose validation loss was above the unigram baseline at an evaluation.
ABOVE_UNIGRAM_MARK = "‡"


def _marked(text: str, marked: bool, mark: str = UNSTABLE_MARK) -> str:
    return f"{text} {mark}" if marked else text


def _footnotes(unstable: bool, above: bool, scope: str = "") -> list[str]:
    """The lines under a table that say what its marks mean; none when nothing is marked."""
    lines = [f"{UNSTABLE_MARK} ended above the unigram baseline (unstable){scope}: not counted as support."] * unstable
    lines += [f"{ABOVE_UNIGRAM_MARK} validation loss above the unigram baseline at an evaluation{scope} (peak val "
              "loss): at the first, a model that has not yet learnt the token frequencies, unless the loss is "
              "above ln(vocabulary), worse than a uniform guess; at a later one, a divergence for a while."] * above
    return ["", *lines] if lines else []


def _peak(run: RunResult) -> str:
    if run.peak is None:
        return "—"
    return _marked(f"{run.peak[1]:.4f} (step {run.peak[0]})", run.rose_above_unigram, ABOVE_UNIGRAM_MARK)


def results_markdown(title: str, runs: list[RunResult], groups: list[Group], manifest: dict[str, Any] | None,
                     plots: list[tuple[str, str]], repeats: list[tuple[RunResult, RunResult]] = ()) -> str:
    finished = [r for r in runs if r.final_val_loss is not None]
    budgets = sorted({r.budget for r in runs})
    cpu = [r.cpu_time_s for r in finished if r.cpu_time_s is not None]
    cpu_note = f"; {sum(cpu):,.0f} s of CPU time in the training rounds of the {len(cpu)} that record it" if cpu else ""
    parts = [f"# Results: {title}", "",
             f"{len(runs)} runs, {len(finished)} finished{cpu_note}; "
             + "; ".join(f"model {model}, {tokens:,} training tokens per run" for model, tokens in budgets) + "."]
    if manifest:
        overrides = " ".join(manifest.get("overrides") or []) or "none"
        parts += ["", f"Last sweep into this directory: preset `{manifest.get('preset') or 'none'}`, "
                      f"overrides `{overrides}`; "
                      f"methods {', '.join(manifest['methods'])}; R {', '.join(map(str, manifest['workers']))}; "
                      f"H {', '.join(map(str, manifest['inner_steps']))}; "
                      f"seeds {', '.join(map(str, manifest['seeds']))}."]
    for (model, tokens), variants in sorted(dp_variants(runs).items()):
        if len(variants) > 1:
            parts += ["", f"dp ran with several settings for model {model} at {tokens:,} tokens: the gaps are to "
                          f"`{variants[0]}`, the one with the lowest mean final loss."]
    above = [r for r in finished if r.rose_above_unigram]
    if above:
        parts += ["", f"{len(above)} of the {len(finished)} finished runs were above their unigram baseline at an "
                      f"evaluation ({ABOVE_UNIGRAM_MARK}), {sum(r.above_after_first for r in above)} of them at an "
                      f"evaluation after their first; {sum(r.unstable for r in above)} ended above it "
                      f"({UNSTABLE_MARK})."]
    if repeats:
        parts += ["", "Runs of one point with a seed already counted, left out of every table, mean and plot "
                      "(one seed is one sample): " + "; ".join(f"{left.name} (seed {left.seed}, as {kept.name})"
                                                               for left, kept in repeats) + "."]
    # A variant column only where runs of one method differ in more than seed, R and H.
    variant = (lambda r: [r.shown_variant or "—"]) if any(r.variant for r in runs) else (lambda r: [])
    variant_header = ["variant"] if any(r.variant for r in runs) else []
    # Link columns only where a run records its traffic; older runs show "—" beside newer ones.
    link, slow = _has_link(runs), _has_slow_link(runs)
    link_header = (["wire bytes", "exposed sync (s)"] if link else []) + (
        ["slow link per round (bytes)", "× fewer than float32"] if slow else [])


    parts += ["", "Gap to DP = (loss − loss_DP) / loss_DP × 100, against the dp run of the same model, token "
                  "budget and seed (dp does not depend on R or H). Mean ± sample standard deviation over seeds; "
                  "runs of a method that differ in anything but the seed (their variant) are separate rows. Peak "
                  "val loss: the highest validation loss at any evaluation (of any seed)."
              + (" Wire bytes: what crossed between islands over the run, all processes, measured (0 in one "
                 "process, which has no islands to cross); exposed sync: the seconds training waited for "
                 "synchronisations." if link else "")
              + (" Slow link per round: the bytes a synchronisation puts on the slow link per process, measured "
                 "across processes, modelled (the cost model, R islands of one worker) in a one-process run; × "
                 "fewer than float32: float32's for the same model and layout, divided by them." if slow else ""),
              "", "## By method, R and H", "",
              _md_table(["method", "R", "H", *variant_header, "seeds", "final val loss", "gap to DP (%)",
                         "peak val loss", "tokens", "wall time (s)", "CPU time (s)", *link_header],
                        [[g.first.method, _dash(g.first.workers), _dash(g.first.inner_steps), *variant(g.first),
                          str(len(g.values("final_val_loss"))),
                          _marked(_pm(g.values("final_val_loss"), ".4f"), g.unstable),
                          _pm(g.values("gap_pct"), "+.2f"),
                          _marked(_fmt(g.peak_loss, ".4f") or "—", g.rose_above_unigram, ABOVE_UNIGRAM_MARK),
                          f"{g.first.tokens:,}", _pm(g.values("wall_time_s"), ".0f"),
                          _pm(g.values("cpu_time_s"), ".0f"),
                          *([_pm(g.values("wire_bytes"), ",.0f"), _pm(g.values("exposed_sync_s"), ".2f")] if link else []),
                          *([_pm(g.values("slow_link_bytes"), ",.0f"),
                             _fewer(_mean_std(g.values("fewer_than_float32"))[0]) or "—"] if slow else [])]
                         for g in groups]),
              *_footnotes(any(g.unstable for g in groups), any(g.rose_above_unigram for g in groups),
                          " in at least one seed"),
              "", "## Every run", "",
              _md_table(["run", "method", "R", "H", *variant_header, "seed", "final val loss", "gap to DP (%)",
                         "peak val loss", "tokens", "wall time (s)", "CPU time (s)", *link_header],
                        [[r.name, r.method, _dash(r.workers), _dash(r.inner_steps), *variant(r), str(r.seed),
                          _marked(_fmt(r.final_val_loss, ".4f") or "incomplete", r.unstable),
                          _fmt(r.gap_pct, "+.2f") or "—", _peak(r), f"{r.tokens:,}", _fmt(r.wall_time_s, ".0f") or "—",
                          _fmt(r.cpu_time_s, ".0f") or "—",
                          *([_fmt(r.wire_bytes, ",.0f") or "—", _fmt(r.exposed_sync_s, ".2f") or "—"] if link else []),
                          *([_fmt(r.slow_link_bytes, ",.0f") or "—", _fewer(r.fewer_than_float32) or "—"]
                            if slow else [])]
                         for r in runs]),
              *_footnotes(any(r.unstable for r in runs), any(r.rose_above_unigram for r in runs))]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{caption}]({PLOT_DIR}/{file})" for file, caption in plots]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------
# Plots


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=110, metadata={"Software": None})


def _colors(labels: Iterable[str]) -> dict[str, str]:
    """A colour per series (a method at one token budget, H, ...), in the order of `labels`."""
    return {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(labels))}


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
    return str(value).lower() if isinstance(value, bool) else _show(value)


def _legend_names(series: dict[str, RunResult], axes: list[str], ignore: frozenset[str] = frozenset()) -> dict[str, str]:
    """Series label -> a short legend name: the method, then each setting that sets a run apart
    from others of its method (a variant's key) and differs between the series shown (`series`:
    each label's first run), with its value as the command line spells it, in every series it
    applies to and acts in; then the varying `axes`. A key goes by its last part where that is
    unique among them (`quantize`, not `merge.quantize`). `ignore`: keys the plot's axis shows."""
    settings = {label: dict(run.settings) for label, run in series.items()}
    own = {label: {part.partition("=")[0] for part in run.variant.split()} for label, run in series.items()}
    varied = set().union(*own.values()) - ignore

    def named(label: str, key: str) -> bool:
        return (key in own[label] or _applies(key, series[label].method)) and acts(key, settings[label])

    keys = sorted(key for key in varied if len({_show(settings[label].get(key)) for label in series
                                                if named(label, key)}) > 1)
    leaves = [key.rsplit(".", 1)[-1] for key in keys]
    short = {key: leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves)}
    return {label: " ".join([run.method, *(f"{short[key]}={_typed(settings[label].get(key))}" for key in keys
                                          if named(label, key)),
                             *(f"{_AXIS_NAMES[axis]}={getattr(run, axis)}" for axis in axes)])
            for label, run in series.items()}


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


def _against(runs: list[RunResult], axis: str, gap: bool) -> Any:
    """Final loss (or gap to DP) against `axis`: one line per method (and per other varying axis)."""
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
    colors = _colors(series)
    names = _legend_names({label: firsts[label] for label in series}, varying)
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"{'Gap to DP' if gap else 'Final validation loss'} against {X_AXES[axis][1]}")
    for index, (label, points) in enumerate(series.items()):
        xs = sorted(points)
        stats = [_mean_std(points[x]) for x in xs]
        ax.errorbar([_dodge(x, index, len(series)) for x in xs], [m for m, _ in stats],
                    yerr=[s or 0.0 for _, s in stats], marker="o", capsize=3, color=colors[label], label=names[label])
    if gap:
        ax.axhline(0.0, color="black", linestyle="--", linewidth=1, label="dp")
        ax.set_ylabel("gap to DP (%)")
        _plain_y(ax, 2 * DEFAULT_MARGIN_PCT)
    else:
        for model, tokens in sorted({r.budget for r in runs if r.is_dp and r.final_val_loss is not None}):
            dp = _mean_std([r.final_val_loss for r in runs if r.is_dp and r.budget == (model, tokens)
                            and r.final_val_loss is not None])[0]
            ax.axhline(dp, color="black", linestyle="--", linewidth=1,
                       label="dp" if "tokens" not in varying else f"dp tokens={tokens}")
        ax.set_ylabel("final validation loss")
        _plain_y(ax, _loss_span(r.final_val_loss for r in trained))
    _log2_axis(ax, sorted({getattr(r, axis) for r in trained}), X_AXES[axis][1])
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def _knobs(runs: list[RunResult]) -> dict[str, list[str]]:
    """Numeric config keys that are the one setting varying between a method's runs: knob -> methods."""
    knobs: dict[str, list[str]] = {}
    for method in dict.fromkeys(r.method for r in runs if not r.is_dp):
        members = [r for r in runs if r.method == method and r.final_val_loss is not None]
        names = {part.partition("=")[0] for r in members for part in r.variant.split()}
        if len(names) != 1 or (key := names.pop()) not in _DEFAULT_SETTINGS:
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
    references = [g for g in group_runs([r for r in runs if r.method not in searched_any and r.final_val_loss is not None])
                  if g.first.is_dp or (not varying and (g.first.workers, g.first.inner_steps, g.first.budget) == where)]
    firsts.update((g.first.label, g.first) for g in references if not g.first.is_dp)
    colors = _colors(firsts)
    names = _legend_names(firsts, varying, ignore=frozenset({key}))
    for label, points in series.items():
        xs = sorted(points)
        stats = [_mean_std(points[x]) for x in xs]
        ax.errorbar(xs, [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats], marker="o", capsize=3,
                    color=colors[label], label=names[label])
    # Flat lines: what the searched method is compared with (dp; the other methods at its one R and H).
    for group in references:
        mean = _mean_std(group.values("final_val_loss"))[0]
        if group.first.is_dp:
            ax.axhline(mean, color="black", linestyle="--", linewidth=1, label="dp")
        else:
            ax.axhline(mean, color=colors[group.first.label], linestyle=":", linewidth=1.5,
                       label=names[group.first.label])
    ticks = sorted({x for points in series.values() for x in points})
    if ticks[0] > 0 and ticks[-1] / ticks[0] >= 4:  # a search over scales (learning rates): log axis
        from matplotlib.ticker import NullLocator

        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks], rotation=90 if len(ticks) > 5 else 0)
    ax.set_xlabel(key)
    ax.set_ylabel("final validation loss (mean ± std over seeds)")
    _plain_y(ax, _loss_span(r.final_val_loss for r in trained))
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def _curves(runs: list[RunResult]) -> Any:
    """Validation loss against tokens, one panel per R; dp (dashed) in every panel."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator

    with_curve = [r for r in runs if r.curve]
    trained = [r for r in with_curve if not r.is_dp]
    panels = sorted({r.workers for r in trained}) or [None]
    varying = [d for d in ("inner_steps", "tokens") if len({getattr(r, d) for r in trained}) > 1]
    seeds = len({r.seed for r in with_curve}) > 1
    firsts: dict[str, RunResult] = {}
    for r in trained:
        firsts.setdefault(_series_label(r, varying), r)
    colors = _colors(firsts)
    names = _legend_names(firsts, varying)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(max(6.4, 4.2 * cols), 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).ravel()
    # The first evaluations sit far above the rest; cap the y axis at the losses after a
    # quarter of training so the differences between methods stay visible.
    last = max(t for r in with_curve for t, _ in r.curve)
    low = min(v for r in with_curve for _, v in r.curve)
    high = max(v for r in with_curve for t, v in r.curve if t >= 0.25 * last)
    handles: dict[str, Any] = {}
    for ax, workers in zip(axes, panels):
        for r in [x for x in with_curve if x.is_dp or x.workers == workers]:
            label = "dp" if r.is_dp else names[_series_label(r, varying)]
            label += f" seed {r.seed}" if seeds else ""
            color, style = ("black", "--") if r.is_dp else (colors[_series_label(r, varying)], "-")
            (line,) = ax.plot([t for t, _ in r.curve], [v for _, v in r.curve], marker=".", color=color,
                              linestyle=style)
            handles.setdefault(label, line)
        ax.set_title("dp" if workers is None else f"R = {workers}")
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    pad = 0.03 * (high - low or 1.0)
    axes[0].set_ylim(low - pad, high + pad)
    _plain_y(axes[0], _loss_span([high]))
    for ax in axes[::cols]:
        ax.set_ylabel("validation loss")
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
    names, colors = _legend_names(firsts, varying), _colors(firsts)
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Final validation loss against the slow link's bytes")
    for group in groups:
        label = _series_label(group.first, varying)
        loss, spread = _mean_std(group.values("final_val_loss"))
        ax.errorbar([_mean_std(group.values("slow_link_bytes"))[0]], [loss], yerr=[spread or 0.0], marker="o",
                    capsize=3, linestyle="none", color=colors[label], label=names[label])
    for model, tokens in sorted({r.budget for r in runs if r.is_dp and r.final_val_loss is not None}):
        dp = _mean_std([r.final_val_loss for r in runs if r.is_dp and r.budget == (model, tokens)
                        and r.final_val_loss is not None])[0]
        ax.axhline(dp, color="black", linestyle="--", linewidth=1, label=f"dp tokens={tokens}" if varying else "dp")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=""))
    ax.set_xlabel("slow-link bytes per process per round (measured, or modelled in one process)")
    ax.set_ylabel("final validation loss")
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
    for run in sorted((r for r in runs if _partial(r)), key=_sort_key):
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


def write_plots(runs: list[RunResult], folder: Path) -> list[tuple[str, str]]:
    """Write every plot that has data; return (file name, caption) pairs in a fixed order."""
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
                    _save(_against(runs, axis, gap), folder / file)
                    written.append((file, f"{caption} vs {short}"))
        knobs = _knobs(runs)
        for key in sorted(knobs):
            file = f"val_loss_vs_{key}.png"
            _save(_against_knob(runs, key, knobs), folder / file)
            written.append((file, f"Final validation loss vs {key}"))
        if any(r.curve for r in runs):
            _save(_curves(runs), folder / "val_curves.png")
            written.append(("val_curves.png", "Validation loss curves"))
        if len({r.slow_link_bytes for r in trained if r.slow_link_bytes}) > 1:
            _save(_against_bytes(runs), folder / "val_loss_vs_bytes.png")
            written.append(("val_loss_vs_bytes.png", "Final validation loss vs slow-link bytes per round"))
        if any(_partial(r) for r in runs if not r.is_dp):
            _save(_participation([r for r in runs if not r.is_dp]), folder / "participation.png")
            written.append(("participation.png", "Workers merged per round"))
    return written


# ---------------------------------------------------------------------------------------
# Paired comparisons

#: Two-sided quantiles of Student's t by degrees of freedom 1 to 30 (the normal one beyond), by the
#: confidence of the interval they bound: 95% (t_{0.975, df}) to call a difference, 90% (t_{0.95, df})
#: for the equivalence test, since two one-sided t-tests at level 0.05 both reject exactly when the 90%
#: interval lies inside the margin.
_T_QUANTILES: dict[int, tuple[list[float], float]] = {
    95: ([12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
          2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042],
         1.960),
    90: ([6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
          1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697],
         1.645),
}


def t_quantile(confidence: int, df: int) -> float:
    """The t quantile that bounds a two-sided `confidence`% interval with `df` degrees of freedom."""
    table, normal = _T_QUANTILES[confidence]
    return table[df - 1] if df <= len(table) else normal


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| ≥ |t|) for Student's t with `df` degrees of freedom, exact for whole df: the finite
    series of Abramowitz & Stegun 26.7.3-4 for P(|T| < |t|) in θ = arctan(|t|/√df)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2/π)(θ + sinθ cosθ (1 + (2/3)cos²θ + (2·4)/(3·5)cos⁴θ + ...)), df − 2 the last power
        term, total = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= cos2 * 2 * k / (2 * k + 1)
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    else:  # even: sinθ (1 + (1/2)cos²θ + (1·3)/(2·4)cos⁴θ + ...), df − 2 the last power
        term, total = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            total += term
            term *= cos2 * (2 * k - 1) / (2 * k)
        inside = math.sin(theta) * total
    return max(0.0, 1.0 - inside)


def paired_p(differences: list[float]) -> float:
    """The two-sided p-value of the paired t-test that the mean difference is 0 (two seeds or more)."""
    mean, std = statistics.fmean(differences), statistics.stdev(differences)
    if std == 0:  # every seed the same difference: certain, unless that difference is 0
        return 1.0 if mean == 0 else 0.0
    return t_two_sided_p(mean / (std / math.sqrt(len(differences))), len(differences) - 1)


def benjamini_hochberg(pvalues: list[float]) -> list[float]:
    """Benjamini–Hochberg adjusted p-values, in the order given: p_(i) · m / i over the ranks i of
    the sorted p-values, made non-decreasing from the largest down, at most 1. A difference whose
    adjusted p is below q keeps the false discovery rate of the whole family at q."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        index = order[rank - 1]
        running = min(running, pvalues[index] * m / rank)
        adjusted[index] = running
    return adjusted


def mean_ci(values: list[float], confidence: int = 95) -> tuple[float, float | None]:
    """The mean and the half-width of its `confidence`% t-interval over the seeds (None for one)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t_quantile(confidence, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


#: The equivalence margin of --compare, in % of B's mean final loss at the point compared.
DEFAULT_MARGIN_PCT = 1.0
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
    """The call on A − B at one point, and the equivalence test's result: the 90% t-interval of the
    difference in % of B's mean final loss, and whether it lies inside ±margin_pct (TOST at level
    0.05). A difference is called when its 95% interval excludes 0, whatever the test says; a tie
    only when the test passes."""
    if _has_unstable(paired):
        return Judged(UNSTABLE_RUNS, UNSTABLE_RUNS, UNSTABLE_RUNS)
    if len(paired) < 2:
        return Judged(ONE_SEED, ONE_SEED, ONE_SEED)
    differences = _differences(paired)
    b_loss = statistics.fmean(b_run.final_val_loss for _, b_run in paired)
    mean, half = mean_ci(differences, 90)
    low, high = 100 * (mean - half) / b_loss, 100 * (mean + half) / b_loss
    equivalent = -margin_pct < low and high < margin_pct
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
    p = f"{_p(judged.p)} ({_p(adjusted)})"
    return p, judged.fallback if judged.called and adjusted >= FDR else judged.call


def _p(value: float) -> str:
    """Three decimals, or two significant digits below 0.001, so that a page can adjust them again."""
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}" if value else "0"


def _interval(mean: float, half: float | None) -> str:
    return f"{mean:+.4f}" + (f" ± {half:.4f}" if half is not None else "")


def _trend(points: dict[tuple, dict[int, tuple[RunResult, RunResult]]], a: str, b: str) -> list[str]:
    """How A − B changes from the smallest R to the largest (at the smallest H), paired by seed, over
    the points without unstable runs; nothing when fewer than two R are left."""
    stable = {key: by_seed for key, by_seed in points.items() if not _has_unstable(by_seed.values())}
    smallest_h = min((inner for _, inner, _ in stable), default=None)
    by_r = {workers: by_seed for (workers, inner, _), by_seed in stable.items() if inner == smallest_h}
    if len(by_r) < 2:
        return []
    low, high = min(by_r), max(by_r)
    common = sorted(set(by_r[low]) & set(by_r[high]))
    if not common:
        return []
    change = [at_high - at_low for at_high, at_low in zip(_differences(by_r[high][s] for s in common),
                                                          _differences(by_r[low][s] for s in common))]
    mean, half = mean_ci(change)
    trend = (ONE_SEED if half is None else _undecided(len(common)) if abs(mean) <= half
             else f"{a} gains on {b} as R grows" if mean < 0 else f"{a} loses ground to {b} as R grows")
    return ["", f"Change of the difference from R = {low} to R = {high} ({len(common)} seeds): "
                f"{_interval(mean, half)} ({trend})."]


Finished = list[RunResult]


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


def _named(finished: Finished, label: str, option: str = "--compare") -> dict[tuple, RunResult]:
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


def _paired_points(finished: Finished, a: str, b: str) -> dict[tuple, dict[int, tuple[RunResult, RunResult]]]:
    """(R, H, budget) -> seed -> (A's run, B's run), where both finished with that seed (B = a
    dp method: its run of the seed, at every R and H)."""
    points: dict[tuple, dict[int, tuple[RunResult, RunResult]]] = {}
    others = _named(finished, b)
    for (workers, inner, budget, seed), run in _named(finished, a).items():
        other = others.get((workers, inner, budget, seed)) or others.get((None, None, budget, seed))
        if other is not None:
            points.setdefault((workers or 0, inner or 0, budget), {})[seed] = (run, other)
    return points


def _finished(runs: list[RunResult]) -> Finished:
    return [r for r in runs if r.final_val_loss is not None]


def contrast_markdown(runs: list[RunResult], contrasts: list[tuple[tuple[str, str], tuple[str, str]]]) -> str:
    """For each ((A, B), (C, D)): (A − B) − (C − D) paired by seed at every point all four
    reached with the same seeds, its 95% interval and the call: whether a change (B → A) costs
    one method more than another change (D → C) costs another, e.g. what quantisation costs
    IsoLoCo against what it costs DiLoCo."""
    finished = _finished(runs)
    parts = ["# Contrasts", "",
             "(A − B) − (C − D): the difference of two paired differences of final validation loss, over the seeds "
             "all four ran, mean ± the half-width of its 95% t-interval; called only when the interval excludes "
             "0. A point where any of the runs ended above its unigram baseline (unstable) gets no call."]
    for (a, b), (c, d) in contrasts:
        first, second = _paired_points(finished, a, b), _paired_points(finished, c, d)
        rows = []
        for key in sorted(set(first) & set(second)):
            seeds = sorted(set(first[key]) & set(second[key]))
            both = [(*first[key][s], *second[key][s]) for s in seeds]
            values = [(w.final_val_loss - x.final_val_loss) - (y.final_val_loss - z.final_val_loss) for w, x, y, z in both]
            mean, half = mean_ci(values)
            if any(run.unstable for runs_of_seed in both for run in runs_of_seed):
                call = UNSTABLE_RUNS
            elif half is None:
                call = ONE_SEED
            elif abs(mean) > half:
                call = f"{a} − {b} lower" if mean < 0 else f"{c} − {d} lower"
            else:
                call = _undecided(len(values))
            rows.append([_dash(key[0] or None), _dash(key[1] or None), str(len(values)), _interval(mean, half), call])
        parts += ["", f"## ({a} − {b}) − ({c} − {d})", ""]
        parts.append(_md_table(["R", "H", "seeds", "contrast (final loss)", "call"], rows) if rows
                     else "No point where all four finished with the same seeds.")
    return "\n".join(parts) + "\n"


def compare_markdown(runs: list[RunResult], pairs: list[tuple[str, str]],
                     margin_pct: float = DEFAULT_MARGIN_PCT) -> str:
    """For each (A, B): the final-loss difference A − B paired by seed at every R and H both
    reached with the same seeds (B = a dp method: its run of the same seed, at every R and H),
    its 95% interval, its equivalence test at ±margin_pct of B's loss, the call, and both methods'
    mean gaps to DP over those seeds; with several R, also how the difference changes from the
    smallest R to the largest. A and B are run labels: a method, or a method and its variant
    ("isoc outer.lr=3.0"). Several pairs also get one table of every pair's rows first, to read
    (and quote) side by side. Beside each call: the paired t-test's p-value, its Benjamini–Hochberg
    adjustment over every test of the report, and the call that survives the adjustment."""
    finished = _finished(runs)
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
             f"adjustment over every test in this file; \"call after BH\" keeps a difference only where the "
             f"adjusted p is below {FDR:g}, which holds the expected share of false calls among this file's "
             f"calls to {FDR:g} (a dropped difference falls back to the equivalence test)."]
    judged_points = []
    for a, b in pairs:
        points = _paired_points(finished, a, b)
        judged_points.append((a, b, points, [(key, _judge(list(by_seed.values()), a, b, margin_pct))
                                             for key, by_seed in sorted(points.items())]))
    tested = [judged for *_, rows in judged_points for _, judged in rows if judged.p is not None]
    adjusted = dict(zip(map(id, tested), benjamini_hochberg([judged.p for judged in tested])))
    sections: list[str] = []
    every_pair: list[list[str]] = []
    for a, b, points, judged_rows in judged_points:
        rows = []
        for (workers, inner, budget), judged in judged_rows:
            paired = list(points[workers, inner, budget].values())
            gaps = [_mean_std([r.gap_pct for r in side if r.gap_pct is not None])[0] for side in zip(*paired)]
            ratio = gaps[0] / gaps[1] if None not in gaps and gaps[1] else None
            rows.append([_dash(workers or None), _dash(inner or None), str(len(paired)),
                         _interval(*mean_ci(_differences(paired))), judged.equivalence, judged.call,
                         *_after_bh(judged, adjusted.get(id(judged))),
                         *(_fmt(g, "+.2f") or "—" for g in gaps), _fmt(ratio, ".2f") or "—"])
        every_pair += [[f"{a} − {b}", *row] for row in rows]
        sections += ["", f"## {a} − {b}", ""]
        if not rows:
            sections.append(f"No point where both {a} and {b} finished with the same seed.")
            continue
        sections.append(_md_table(["R", "H", "seeds", f"{a} − {b} (final loss)", f"equivalence ({margin})", "call",
                                   "p (BH)", "call after BH", f"gap {a} (%)", f"gap {b} (%)", "gap ratio"], rows))
        sections += _trend(points, a, b)
    if len(pairs) > 1 and every_pair:
        parts += ["", "## Every pair", "",
                  _md_table(["A − B", "R", "H", "seeds", "A − B (final loss)", f"equivalence ({margin})", "call",
                             "p (BH)", "call after BH", "gap A (%)", "gap B (%)", "gap ratio"], every_pair)]
    return "\n".join(parts + sections) + "\n"


# ---------------------------------------------------------------------------------------
# The command


def write_report(directory: Path) -> list[tuple[RunResult, RunResult]]:
    """Write the tables and plots; return the runs left out as repeats of a seed, each with the one kept."""
    repeats: list[tuple[RunResult, RunResult]] = []
    runs = load_runs(directory, repeats)
    groups = group_runs(runs)
    manifest_path = directory / SWEEP_MANIFEST
    manifest = yaml.safe_load(manifest_path.read_text()) if manifest_path.is_file() else None
    plots = write_plots(runs, directory / PLOT_DIR)
    from isoloco.spectra import write_spectra_plots

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
    # Every label is read, and must name one setting at each point, before anything is written.
    finished = _finished(load_runs(directory))
    for option, labels in (("--compare", [label for pair in pairs for label in pair]),
                           ("--contrast", [label for both in contrasts for pair in both for label in pair])):
        for label in labels:
            _named(finished, label, option)
    for left, kept in write_report(directory):
        print(f"warning: {left.name} repeats seed {left.seed} of {kept.name} (same method and settings): counted "
              f"once, as {kept.name}; give the rerun another seed or move it out of {directory}", file=sys.stderr)
    print(f"wrote {directory / MARKDOWN_FILE}, {CSV_FILE}, {SUMMARY_CSV_FILE} and {directory / PLOT_DIR}/")
    if pairs:
        (directory / COMPARE_FILE).write_text(compare_markdown(load_runs(directory), pairs, margin_pct))
        print(f"wrote {directory / COMPARE_FILE}")
    if contrasts:
        (directory / CONTRAST_FILE).write_text(contrast_markdown(load_runs(directory), contrasts))
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
    report.set_defaults(func=cmd_report)
