"""The stragglers-science view in one table (docs/claims/stragglers.md, "Stragglers and late workers"):
per method and setting, how much of a round's training it keeps, its final loss, what it costs
against the method's fault-free runs, the contrast of the two methods' costs, IsoLoCo − DiLoCo
under it, and each remedy against the setting it is held against (`STRAGGLER_REMEDIES`).

`python scripts/straggler_table.py [--root results/claims]` writes
stragglers-science/settings.md (run `python scripts/claim_reports.py stragglers-science`
first). The participation columns come from each run's metrics.jsonl (`worker_steps`,
`workers_merged` per round), the tests from the view's compare.md and contrast.md.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from statistics import mean

from claim_reports import (STRAGGLER_REMEDIES, STRAGGLER_SETTINGS, compare_rows,  # noqa: E402  (scripts/)
                           difference_cell, straggler_label, table_rows)

VIEW, WORKERS, STEPS_PER_ROUND = "stragglers-science", 8, 30
METHODS = ("diloco", "isoloco")


def setting_name(speeds: str = "", weighting: str = "equal", late: str = "drop", rate: float = 0.0,
                 stale: float = 0.5) -> str:
    """A short name of a `straggler_label` setting."""
    if speeds:
        return f"speeds {speeds} cycled, {'token' if weighting == 'tokens' else weighting} weights"
    if rate and late == "carry":
        return f"late {rate:.0%}, carried at weight {stale:g}"
    if rate:
        return f"late {rate:.0%}, dropped"
    return "fault-free"


def participation(run: Path) -> tuple[float, float] | None:
    """The share of the inner steps a round could hold that the run's workers took, and the mean
    number of deltas merged per round; None when its metrics predate `worker_steps`."""
    rounds = [record for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "worker_steps" in record]
    if not rounds:
        return None
    taken = sum(sum(record["worker_steps"]) for record in rounds)
    return taken / (len(rounds) * WORKERS * STEPS_PER_ROUND), mean(record["workers_merged"] for record in rounds)


def participation_cells(view: Path) -> dict[str, str]:
    """Per run label (method and variant), the two participation columns as cells, averaged over
    its seeds ("— (not recorded)" for runs whose metrics predate them)."""
    by_label: dict[str, list[tuple[float, float] | None]] = {}
    with open(view / "results.csv") as results:
        for run in csv.DictReader(results):
            if run["method"] != "dp":
                by_label.setdefault(f"{run['method']} {run['variant']}", []).append(participation(view / run["run"]))
    cells = {}
    for label, runs in by_label.items():
        if any(run is None for run in runs):
            cells[label] = "— (not recorded) | —"
        else:
            cells[label] = f"{mean(r[0] for r in runs):.1%} | {mean(r[1] for r in runs):.2f} of {WORKERS}"
    return cells


def contrast_cell(view: Path, setting: dict) -> str:
    """What the setting costs IsoLoCo minus what it costs DiLoCo, with its call ("—": not yet)."""
    costs = [f"{straggler_label(m, **setting)} − {straggler_label(m)}" for m in ("isoloco", "diloco")]
    rows = [row for row in table_rows(view / "contrast.md", f"({costs[0]}) − ({costs[1]})")
            if row["R"] == str(WORKERS)]
    if not rows:
        return "—"
    call = "called" if rows[0]["call"].endswith(" lower") else rows[0]["call"]  # its sign says which way
    return f"{rows[0]['contrast (final loss)']}, {call}"


def settings_table(root: Path) -> str:
    """settings.md: one row per method and setting of the view, fault-free first."""
    view = root / VIEW
    pairs = compare_rows(view, WORKERS)
    cells = participation_cells(view)
    losses = {}
    with open(view / "summary.csv") as summary:
        for row in csv.DictReader(summary):
            losses[f"{row['method']} {row['variant']}"] = (
                f"{float(row['final_val_loss_mean']):.4f} ± {float(row['final_val_loss_std'] or 0):.4f} | "
                f"{row['seeds']} | {row['runs_ended_above_unigram']}")
    held_against = {tuple(sorted(remedy.items())): other for remedy, other in STRAGGLER_REMEDIES}
    lines = ["| method | setting | inner steps taken | deltas merged per round | final loss | seeds | diverged | "
             "− fault-free: difference, call after BH | contrast: isoloco's cost − diloco's | "
             "isoloco − diloco: difference, call after BH | − the setting it is held against |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        for setting in ({}, *STRAGGLER_SETTINGS):
            label = straggler_label(method, **setting)
            if label not in losses:
                continue
            other = held_against.get(tuple(sorted(setting.items())))
            names = {label: setting_name(**setting), straggler_label(method): "fault-free"}
            heads = {straggler_label(m, **setting): m for m in ("isoloco", "diloco")}
            lines.append(" | ".join([
                f"| {method}", setting_name(**setting), cells.get(label, "— | —"), losses[label],
                difference_cell(pairs, label, straggler_label(method), names) if setting else "—",
                contrast_cell(view, setting) if setting else "—",
                difference_cell(pairs, *heads, heads),
                (difference_cell(pairs, label, straggler_label(method, **other),
                                 {label: setting_name(**setting), straggler_label(method, **other): setting_name(**other)})
                 if other else "—")]) + " |")
    return "\n".join(["# Stragglers and late workers", "", "`python scripts/straggler_table.py` writes this file.", "",
                      "## By setting", "", *lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="results/claims", help="the folder holding the claims' views")
    root = Path(parser.parse_args().root)
    (root / VIEW / "settings.md").write_text(settings_table(root))
    print(f"wrote {root / VIEW / 'settings.md'}")


if __name__ == "__main__":
    main()
