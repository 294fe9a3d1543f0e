"""The frontier of final loss against bytes for the compress-science view (docs/claims/compression.md,
"Compression at 100×"): per R, one line per method and compressor through its settings, slow-link
bytes per process per round on a log axis, and each setting's runs that were above the unigram
loss mid-run.

`python scripts/compress_frontier.py [--root results/claims] [--view compress-science]` writes
the view's frontier.png and frontier.md (run `python scripts/claim_reports.py VIEW` first). The
settings, R and methods are the view's (results.csv and summary.csv); what a setting sends is
read from its runs' config.yaml (SparseLoCo's tiles, parameters kept whole included). Bytes are
the runs' own `slow_link_bytes_per_round` (summary.json) where they record it, and otherwise the
cost model's figure for their merge with every worker an island (P = R, as the simulator plays
them), `isoloco.algorithms.SlowLinkModel` (SparseLoCo's all-gather, or the merge's collectives): the counts the metrics' `wire_bytes_cross_island`
equals on gloo (tests/test_merge_compress.py). Beside each setting, from the view's compare.md:
its equivalence test against the method's exact runs (SparseLoCo's against DiLoCo's, its Iso-C
against IsoLoCo's), and the merging-aware method against its baseline under it (IsoLoCo − DiLoCo,
SparseLoCo's Iso-C − SparseLoCo); then, per method and R, the largest compression whose test
passes, and every merging-aware setting against every baseline within 1.5× of its bytes. Mid-run stability comes from each run's
evaluations (metrics.jsonl) against its corpus's unigram loss (summary.json's `unigram_baseline`)
and ln(vocabulary), the loss of a uniform guess.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from claim_reports import compare_rows, compress_label, difference_cell  # noqa: E402  (scripts/, beside this file)
from isoloco.algorithms import SlowLinkModel  # noqa: E402
from isoloco.bench.workload import parameter_shapes  # noqa: E402
from isoloco.config import from_dict  # noqa: E402
from isoloco.train_config import TrainConfig

#: The view the page quotes; a later grid's view is named with --view.
VIEW = "compress-science"
#: Whose exact runs a method's compressed runs are held against (SparseLoCo's methods have no
#: uncompressed form: DiLoCo's and IsoLoCo's at their tuned steps stand in), and the method each
#: merging-aware method meets head to head under the same compressor.
EXACT_OF = {"sparseloco": "diloco", "sparseloco_isoc": "isoloco"}
PARTNER = {"isoloco": "diloco", "sparseloco_isoc": "sparseloco"}
#: A merging-aware variant and a baseline are at matched bytes within this factor of each other.
MATCHED_BYTES = 1.5
#: The keys of a variant that say what crosses the link (`setting_name` names them); the others
#: (an outer step, say) are shown as they are.
LINK_KEYS = ("merge.compress", "merge.quantize", "merge.error_feedback", "outer.transport", "outer.sparse_")


@dataclass(frozen=True)
class Stability:
    """What one run's evaluations say beside the unigram loss: whether it was above it after its
    first evaluation, whether it rose to it there (its loss went up from one evaluation to the
    next, to above the unigram loss: a divergence for a while, whether or not it had been below
    it before), its highest loss after the first evaluation, whether its first evaluation was above
    ln(vocabulary) (worse than a uniform guess: not a model still learning the token
    frequencies), and whether it ended above the unigram loss."""

    above_mid_run: bool
    rose_mid_run: bool
    peak_mid_run: float | None
    first_above_uniform: bool
    first_loss: float
    ended_above: bool


def stability(losses: list[float], unigram: float, vocab: int) -> Stability:
    """The `Stability` of a run whose evaluations gave `losses`, in order."""
    later = losses[1:]
    rose = any(loss > unigram and loss > before for before, loss in zip(losses, later))
    return Stability(above_mid_run=any(loss > unigram for loss in later), rose_mid_run=rose,
                     peak_mid_run=max(later, default=None), first_above_uniform=losses[0] > math.log(vocab),
                     first_loss=losses[0], ended_above=losses[-1] > unigram)


@dataclass(frozen=True)
class Run:
    """One run of the view: its seed, what it sent per round, the unigram loss and its stability."""

    seed: int
    bytes: float
    float32: float
    unigram: float
    stability: Stability


def read_run(run_dir: Path) -> tuple[Run, TrainConfig]:
    """A run directory's `Run`, and its config (what it sent)."""
    cfg = from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [record["val_loss"] for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "val_loss" in record]
    names, shapes = zip(*parameter_shapes(cfg.model))
    model = SlowLinkModel.of(cfg, list(names), list(shapes), cfg.workers, 1)
    sent = summary.get("slow_link_bytes_per_round") or model.bytes
    float32 = summary.get("slow_link_float32_bytes_per_round") or model.float32
    unigram = summary["unigram_baseline"]
    return Run(cfg.seed, sent, float32, unigram, stability(losses, unigram, cfg.data.vocab_size)), cfg


def setting_name(cfg: TrainConfig, variant: str) -> str:
    """A short name of what a run of the view sends, then the variant's other settings."""
    merge, tiling = cfg.merge, cfg.outer.tiling
    values = "float32" if merge.quantize == "none" else merge.quantize
    feedback = ", error feedback" if merge.error_feedback else ""
    # Matrices that skip the structured compressor cross the link whole, under merge.quantize.
    whole = f", {' '.join(merge.compress_exclude)} whole as {values}" if merge.compress_exclude else ""
    if tiling is not None:
        name = f"SparseLoCo top-{tiling.topk} of {tiling.tile}×{tiling.tile} tiles"
    elif merge.compress == "lowrank":
        name = f"low rank {merge.compress_rank}, {values} factors{feedback}{whole}"
    elif merge.compress == "topk":
        name = f"top-k {merge.compress_density:.0%}, {values} values{feedback}{whole}"
    else:
        name = f"{values}{feedback}"
    others = [pair for pair in variant.split() if not pair.startswith(LINK_KEYS)]
    return f"{name} ({' '.join(others)})" if others else name


def run_label(method: str, cfg: TrainConfig) -> str:
    """What the view's --compare pairs call a run of `method` with `cfg`'s compression."""
    merge = cfg.merge
    return compress_label(method, merge.compress, merge.compress_rank, merge.compress_density, merge.quantize,
                          merge.error_feedback)


def compressor(cfg: TrainConfig) -> str:
    """The family a setting's line in the plot belongs to."""
    return "sparseloco" if cfg.outer.tiling is not None else cfg.merge.compress


def mid_run_cell(runs: list[Run]) -> str:
    """How many runs were above the unigram loss after their first evaluation; of them, how many
    rose to it, and the highest loss there."""
    above = [run.stability for run in runs if run.stability.above_mid_run]
    if not above:
        return "0"
    return f"{len(above)} ({sum(s.rose_mid_run for s in above)} rose; peak {max(s.peak_mid_run for s in above):.2f})"


def frontier(view: Path) -> list[dict]:
    """One row per method, R and setting of the view folder `view`: its bytes, ×float32, final
    loss (mean, sd, seeds), its runs' stability, its equivalence test against the method's exact
    runs and IsoLoCo − DiLoCo under it ("—": not in the report yet)."""
    runs: dict[tuple[str, str, str], list[tuple[Run, TrainConfig]]] = {}
    with open(view / "results.csv") as results:
        for row in csv.DictReader(results):
            if row["method"] != "dp" and row["status"] == "finished":
                runs.setdefault((row["method"], row["R"], row["variant"]), []).append(read_run(view / row["run"]))
    rows = []
    with open(view / "summary.csv") as summary:
        for row in csv.DictReader(summary):
            key = (row["method"], row["R"], row["variant"])
            if key not in runs:  # dp
                continue
            group, cfg = [run for run, _ in runs[key]], runs[key][0][1]
            pairs = compare_rows(view, int(row["R"]))
            method = row["method"]
            label = run_label(method, cfg)
            to_exact = pairs.get(f"{label} − {compress_label(EXACT_OF.get(method, method))}", {})
            merging = next((m for m, partner in PARTNER.items() if method in (m, partner)), None)
            methods = {run_label(m, cfg): m for m in (merging, PARTNER.get(merging))} if merging else {}
            sent = sum(run.bytes for run in group) / len(group)
            rows.append({"method": row["method"], "R": int(row["R"]), "setting": setting_name(cfg, row["variant"]),
                         "compressor": compressor(cfg), "bytes": sent, "ratio": group[0].float32 / sent,
                         "loss": float(row["final_val_loss_mean"]),
                         "sd": float(row["final_val_loss_std"] or 0),  # one seed has no spread
                         "seeds": len(group), "runs": sorted(group, key=lambda run: run.seed),
                         "ended_above": sum(run.stability.ended_above for run in group),
                         "rose": sum(run.stability.rose_mid_run for run in group),
                         "mid_run": mid_run_cell(group),
                         "first_above_uniform": sum(run.stability.first_above_uniform for run in group),
                         "to_exact": to_exact.get("equivalence (±1%)", "—"),
                         "label": label, "pairs": pairs,
                         "head_to_head": difference_cell(pairs, *methods, methods) if methods else "—"})
    return sorted(rows, key=lambda r: (r["R"], r["method"], -r["bytes"]))


def largest_equivalent(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """Per R and method, the setting with the most compression whose loss passed the equivalence
    test against the method's exact runs."""
    best: dict[tuple[int, str], dict] = {}
    for r in rows:
        key = (r["R"], r["method"])
        if r["to_exact"].endswith("pass") and r["ratio"] > best.get(key, {"ratio": 0})["ratio"]:
            best[key] = r
    return best


def matched_bytes(rows: list[dict]) -> list[str]:
    """Per R, each compressed merging-aware row (IsoLoCo, SparseLoCo's Iso-C) against each compressed
    baseline row (DiLoCo, SparseLoCo) within `MATCHED_BYTES` of its bytes that the view's report
    pairs: both losses, and the paired difference with its call after BH."""
    lines = []
    for count in sorted({r["R"] for r in rows}):
        here = [r for r in rows if r["R"] == count and r["ratio"] > 1.0]
        for variant in sorted((r for r in here if r["method"] in PARTNER), key=lambda r: r["loss"]):
            for base in sorted((r for r in here if r["method"] in PARTNER.values()), key=lambda r: r["loss"]):
                if max(variant["bytes"], base["bytes"]) > MATCHED_BYTES * min(variant["bytes"], base["bytes"]):
                    continue
                names = {variant["label"]: variant["method"], base["label"]: base["method"]}
                if f"{variant['label']} − {base['label']}" not in variant["pairs"]:
                    continue
                lines.append(f"| {count} | {variant['method']}, {variant['setting']} ({variant['ratio']:.1f}×) | "
                             f"{variant['loss']:.4f} ± {variant['sd']:.4f} | {base['method']}, {base['setting']} "
                             f"({base['ratio']:.1f}×) | {base['loss']:.4f} ± {base['sd']:.4f} | "
                             f"{difference_cell(variant['pairs'], variant['label'], base['label'], names)} |")
    header = ["| R | merging-aware (× fewer than float32) | final loss | baseline (× fewer than float32) | final loss | "
              "difference, call after BH |", "|---|---|---|---|---|---|"]
    return header + lines if lines else ["No merging-aware setting has a paired baseline within "
                                         f"{MATCHED_BYTES}× of its bytes yet."]


def plot(rows: list[dict], path: Path) -> None:
    """A panel per R; in each, one colour per method and one line per compressor, through its
    settings. Settings where a run ended above the unigram loss are left off the lines and named
    at the top edge, so they do not flatten the others; an open marker is a setting where a run
    rose above it mid-run."""
    counts = sorted({r["R"] for r in rows})
    figure, panels = plt.subplots(1, len(counts), figsize=(7.2 * len(counts), 5.6), squeeze=False)
    colours = {method: f"C{index}" for index, method in enumerate(sorted({r["method"] for r in rows}))}
    styles = {"none": ("-", "o", "dense"), "lowrank": ("--", "s", "low rank"), "topk": (":", "^", "top-k"),
              "sparseloco": ("-.", "D", "SparseLoCo")}
    for axes, count in zip(panels[0], counts):
        here = [r for r in rows if r["R"] == count]
        for method, colour in colours.items():
            for family, (style, marker, label) in styles.items():
                kept = [r for r in here if r["method"] == method and r["compressor"] == family and not r["ended_above"]]
                if not kept:
                    continue
                axes.errorbar([r["bytes"] for r in kept], [r["loss"] for r in kept], yerr=[r["sd"] for r in kept],
                              linestyle=style, marker=marker, capsize=3, color=colour, label=f"{method}, {label}")
                rose = [r for r in kept if r["rose"]]
                axes.plot([r["bytes"] for r in rose], [r["loss"] for r in rose], linestyle="none", marker=marker,
                          markersize=9, markerfacecolor="white", color=colour)
        for index, r in enumerate(r for r in here if r["ended_above"]):
            axes.annotate(f"{r['method']}, {r['setting'].split(',')[0]}: {r['ended_above']} of {r['seeds']} runs "
                          "ended above the unigram loss", (r["bytes"], 1), xycoords=("data", "axes fraction"),
                          textcoords="axes fraction", xytext=(0.3, 0.95 - 0.05 * index), ha="left", fontsize=7,
                          color=colours[r["method"]], arrowprops={"arrowstyle": "-", "color": colours[r["method"]]})
        axes.set_xscale("log")
        axes.set_title(f"R = {count} (open marker: a run rose above the unigram loss mid-run)", fontsize=9)
        axes.set_xlabel(f"slow-link bytes per process per round (P = {count} islands)")
        axes.set_ylabel("final validation loss (mean ± sd over seeds)")
        axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(figure)


def footnote(rows: list[dict]) -> list[str]:
    """What the stability columns count, with the runs whose first evaluation was above
    ln(vocabulary) named."""
    runs = [run for r in rows for run in r["runs"]]
    unigrams = ", ".join(f"{value:.2f}" for value in sorted({run.unigram for run in runs}))
    uniform = [f"{r['method']} {r['setting']} at R = {r['R']}, seed {run.seed} ({run.stability.first_loss:.2f})"
               for r in rows for run in r["runs"] if run.stability.first_above_uniform]
    return [
        f"The unigram loss (summary.json's `unigram_baseline`, {unigrams} here) is the loss of predicting each "
        "token by its frequency in the corpus; a model starts near ln(vocabulary), a uniform guess, and falls "
        "through the unigram loss as it learns the frequencies. So a run above the unigram loss at its first "
        "evaluation is expected, unless it is above ln(vocabulary) there: then it was worse than a uniform guess, "
        "its first merges had overshot, and it was not still learning the frequencies "
        f"(\"first evaluation above ln(vocab)\"; {len(uniform)} of {len(runs)} runs: {'; '.join(uniform) or 'none'}). "
        "\"Above the unigram loss after the first evaluation\" counts the runs above it at any later evaluation; "
        "of them, those that *rose* to it (their loss went up from one evaluation to the next, to above the "
        "unigram loss, whether or not they had been below it before) diverged for a while, and the others were "
        "still falling towards it, learning slowly; the peak is the highest such loss. \"Ended above\" counts "
        "the runs whose final loss is above the unigram loss (a setting with one gets no call). In all, "
        f"{sum(run.stability.above_mid_run for run in runs)} of the {len(runs)} runs were above the unigram loss "
        f"after their first evaluation, {sum(run.stability.rose_mid_run for run in runs)} of them having risen "
        f"to it, and {sum(run.stability.ended_above for run in runs)} ended above it."]


def markdown(rows: list[dict]) -> str:
    lines = ["| R | method | setting | slow-link bytes per process per round | × fewer than float32 | final loss | "
             "seeds | above the unigram loss after the first evaluation (rose; peak) | first evaluation above "
             "ln(vocab) | ended above the unigram loss | − exact: equivalence (±1%) | "
             "merging-aware − its baseline: difference, call after BH |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['R']} | {r['method']} | {r['setting']} | {r['bytes']:,.0f} | {r['ratio']:.1f}× | "
                     f"{r['loss']:.4f} ± {r['sd']:.4f} | {r['seeds']} | {r['mid_run']} | {r['first_above_uniform']} | "
                     f"{r['ended_above']} | {r['to_exact']} | {r['head_to_head']} |")
    best = [f"- {method} at R = {count}: {r['setting']}, {r['ratio']:.1f}× fewer bytes than float32"
            for (count, method), r in sorted(largest_equivalent(rows).items())]
    return "\n".join(["# Compression frontier", "", "`python scripts/compress_frontier.py` writes this file.", "",
                      "## By setting", "", *lines, "", *footnote(rows), "",
                      "## The largest compression equivalent to exact within ±1% (TOST)", "",
                      *(best or ["- none yet"]), "",
                      f"## Merging-aware against the compressed baselines at matched bytes (within {MATCHED_BYTES}×)",
                      "", *matched_bytes(rows), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="results/claims", help="the folder holding the claims' views")
    parser.add_argument("--view", default=VIEW, help="the view whose runs to draw (a folder under --root)")
    args = parser.parse_args()
    view = Path(args.root) / args.view
    rows = frontier(view)
    plot(rows, view / "frontier.png")
    (view / "frontier.md").write_text(markdown(rows))
    print(f"wrote {view / 'frontier.png'} and frontier.md ({len(rows)} points)")


if __name__ == "__main__":
    main()
