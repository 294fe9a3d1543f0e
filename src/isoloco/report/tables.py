"""Tables: results.csv (one row per run), summary.csv (mean and sample std over seeds, per point)
and results.md (both in Markdown, with the plots linked), each row in a fixed order, so that a
report of the same runs is the same bytes; and the Markdown helpers the comparisons' tables share."""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable

from isoloco.report.runs import Group, RunResult, dp_variants
from isoloco.report.stats import mean_std

CSV_FILE = "results.csv"
SUMMARY_CSV_FILE = "summary.csv"
MARKDOWN_FILE = "results.md"
PLOT_DIR = "plots"


def fmt(value: float | int | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _pm(values: list[float], spec: str) -> str:
    """`mean ± std` for Markdown (just the value for one seed, — for none)."""
    mean, std = mean_std(values)
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
        ([r.name, r.method, fmt(r.workers, "d"), fmt(r.inner_steps, "d"), r.settings_shown, str(r.seed), r.model,
          str(r.tokens), fmt(r.final_val_loss, ".6f"), fmt(r.gap_pct, ".4f"),
          fmt(r.peak and r.peak[1], ".6f"), fmt(r.peak and r.peak[0], "d"), str(r.rose_above_unigram).lower(),
          str(r.above_after_first).lower(), str(r.unstable).lower(),
          fmt(r.wall_time_s, ".1f"), fmt(r.cpu_time_s, ".1f"),
          *([fmt(r.wire_bytes, ".0f"), fmt(r.exposed_sync_s, ".3f")] if link else []),
          *([fmt(r.slow_link_bytes, ".0f"), fmt(r.fewer_than_float32, ".3f")] if slow else []),
          "finished" if r.final_val_loss is not None else "incomplete"] for r in runs))


def summary_csv(groups: list[Group]) -> str:
    link, slow = _has_link(r for g in groups for r in g.runs), _has_slow_link(r for g in groups for r in g.runs)
    rows = []
    for g in groups:
        loss, loss_std = mean_std(g.values("final_val_loss"))
        gap, gap_std = mean_std(g.values("gap_pct"))
        wall, _ = mean_std(g.values("wall_time_s"))
        cpu, _ = mean_std(g.values("cpu_time_s"))
        wire, _ = mean_std(g.values("wire_bytes"))
        exposed, _ = mean_std(g.values("exposed_sync_s"))
        slow_link, _ = mean_std(g.values("slow_link_bytes"))
        fewer, _ = mean_std(g.values("fewer_than_float32"))
        rows.append([g.first.method, fmt(g.first.workers, "d"), fmt(g.first.inner_steps, "d"), g.first.settings_shown,
                     g.first.model, str(g.first.tokens), str(len(g.values("final_val_loss"))), fmt(loss, ".6f"),
                     fmt(loss_std, ".6f"), fmt(gap, ".4f"), fmt(gap_std, ".4f"), fmt(g.peak_loss, ".6f"),
                     str(sum(r.rose_above_unigram for r in g.runs)), str(sum(r.unstable for r in g.runs)),
                     fmt(wall, ".1f"), fmt(cpu, ".1f"),
                     *([fmt(wire, ".0f"), fmt(exposed, ".3f")] if link else []),
                     *([fmt(slow_link, ".0f"), fmt(fewer, ".3f")] if slow else [])])
    return _csv(["method", "R", "H", "variant", "model", "tokens", "seeds", "final_val_loss_mean", "final_val_loss_std",
                 "gap_to_dp_pct_mean", "gap_to_dp_pct_std", "peak_val_loss_max", "runs_above_unigram_at_an_evaluation",
                 "runs_ended_above_unigram", "wall_time_s_mean", "cpu_time_s_mean",
                 *(["cross_island_wire_bytes_mean", "exposed_sync_seconds_mean"] if link else []),
                 *(["slow_link_bytes_per_round_mean", "slow_link_fewer_than_float32_mean"] if slow else [])], rows)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def dash(value: int | None) -> str:
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
    variant = (lambda r: [r.shown_variant or "—"]) if any(r.settings_shown for r in runs) else (lambda r: [])
    variant_header = ["variant"] if any(r.settings_shown for r in runs) else []
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
                 "across processes, modelled (the cost model, for the islands the simulator plays: R of one "
                 "worker unless dist.islands) in a one-process run; × fewer than float32: float32's for the same "
                 "model and layout, divided by them." if slow else ""),
              "", "## By method, R and H", "",
              md_table(["method", "R", "H", *variant_header, "seeds", "final val loss", "gap to DP (%)",
                         "peak val loss", "tokens", "wall time (s)", "CPU time (s)", *link_header],
                        [[g.first.method, dash(g.first.workers), dash(g.first.inner_steps), *variant(g.first),
                          str(len(g.values("final_val_loss"))),
                          _marked(_pm(g.values("final_val_loss"), ".4f"), g.unstable),
                          _pm(g.values("gap_pct"), "+.2f"),
                          _marked(fmt(g.peak_loss, ".4f") or "—", g.rose_above_unigram, ABOVE_UNIGRAM_MARK),
                          f"{g.first.tokens:,}", _pm(g.values("wall_time_s"), ".0f"),
                          _pm(g.values("cpu_time_s"), ".0f"),
                          *([_pm(g.values("wire_bytes"), ",.0f"), _pm(g.values("exposed_sync_s"), ".2f")] if link else []),
                          *([_pm(g.values("slow_link_bytes"), ",.0f"),
                             _fewer(mean_std(g.values("fewer_than_float32"))[0]) or "—"] if slow else [])]
                         for g in groups]),
              *_footnotes(any(g.unstable for g in groups), any(g.rose_above_unigram for g in groups),
                          " in at least one seed"),
              "", "## Every run", "",
              md_table(["run", "method", "R", "H", *variant_header, "seed", "final val loss", "gap to DP (%)",
                         "peak val loss", "tokens", "wall time (s)", "CPU time (s)", *link_header],
                        [[r.name, r.method, dash(r.workers), dash(r.inner_steps), *variant(r), str(r.seed),
                          _marked(fmt(r.final_val_loss, ".4f") or "incomplete", r.unstable),
                          fmt(r.gap_pct, "+.2f") or "—", _peak(r), f"{r.tokens:,}", fmt(r.wall_time_s, ".0f") or "—",
                          fmt(r.cpu_time_s, ".0f") or "—",
                          *([fmt(r.wire_bytes, ",.0f") or "—", fmt(r.exposed_sync_s, ".2f") or "—"] if link else []),
                          *([fmt(r.slow_link_bytes, ",.0f") or "—", _fewer(r.fewer_than_float32) or "—"]
                            if slow else [])]
                         for r in runs]),
              *_footnotes(any(r.unstable for r in runs), any(r.rose_above_unigram for r in runs))]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{caption}]({PLOT_DIR}/{file})" for file, caption in plots]
    return "\n".join(parts) + "\n"

