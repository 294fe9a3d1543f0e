"""The frontier of final loss against bytes for the compress-science view (docs/claims.md,
"Compression at 100×"): one line per method through its settings, wire bytes per process per
round on a log axis, from the view's summary.csv and the cost model.

`python scripts/compress_frontier.py [--root results/claims]` writes
compress-science/frontier.png and compress-science/frontier.md (run `python
scripts/claim_reports.py compress-science` first). Bytes are one island's per synchronisation
with every worker an island (P = R = 8, as the simulator plays them), at the runs' model
(`tiny`, vocabulary 8192), from `isoloco.merge.wire_bytes_per_merge`: the counts the metrics'
`wire_bytes_cross_island` equals on gloo (tests/test_merge_compress.py). Beside each setting,
from the view's compare.md: its equivalence test against the method's exact runs, and IsoLoCo
− DiLoCo under it; then, per method, the largest compression whose test passes.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from claim_reports import compare_rows, compress_label, difference_cell  # noqa: E402  (scripts/, beside this file)
from isoloco.bench.workload import parameter_shapes  # noqa: E402
from isoloco.merge import MergeConfig, wire_bytes_per_merge  # noqa: E402

VIEW, ISLANDS, MODEL = "compress-science", 8, "tiny"
#: The keys a variant of the view names, as `MergeConfig` fields.
KEYS = {"merge.compress": ("compress", str), "merge.compress_rank": ("compress_rank", int),
        "merge.compress_density": ("compress_density", float), "merge.quantize": ("quantize", str),
        "merge.error_feedback": ("error_feedback", lambda text: text == "True")}


def merge_config(variant: str) -> MergeConfig:
    """The merge settings a summary.csv variant names (the others at their defaults)."""
    fields = {}
    for pair in variant.split():
        key, value = pair.split("=", 1)
        if key in KEYS:
            name, parse = KEYS[key]
            fields[name] = parse(value)
    return MergeConfig(**fields)


def setting_name(merge: MergeConfig) -> str:
    """A short name of a setting of the view: what crosses the link."""
    values = "float32" if merge.quantize == "none" else merge.quantize
    feedback = ", error feedback" if merge.error_feedback else ""
    if merge.compress == "lowrank":
        return f"low rank {merge.compress_rank}, {values} factors{feedback}"
    if merge.compress == "topk":
        return f"top-k {merge.compress_density:.0%}, {values} values{feedback}"
    return f"{values}{feedback}"


def frontier(root: Path) -> list[dict]:
    """One row per method and setting: its bytes, ×float32 and final loss (mean, sd, seeds), its
    equivalence test against the method's exact runs and IsoLoCo − DiLoCo under it ("—": not in
    the report yet)."""
    shapes = [shape for _, shape in parameter_shapes(MODEL)]
    float32 = wire_bytes_per_merge(shapes, MergeConfig(), ISLANDS)
    pairs = compare_rows(root / VIEW, ISLANDS)
    rows = []
    with open(root / VIEW / "summary.csv") as summary:
        for row in csv.DictReader(summary):
            if row["method"] == "dp" or row["R"] != str(ISLANDS):
                continue
            merge = merge_config(row["variant"])
            wire = wire_bytes_per_merge(shapes, merge, ISLANDS)
            to_exact = pairs.get(f"{row['method']} {row['variant']} − {compress_label(row['method'])}", {})
            methods = {f"{method} {row['variant']}": method for method in ("isoloco", "diloco")}
            rows.append({"method": row["method"], "variant": row["variant"], "setting": setting_name(merge),
                         "compress": merge.compress,
                         "bytes": wire, "ratio": float32 / wire,
                         "loss": float(row["final_val_loss_mean"]),
                         "sd": float(row["final_val_loss_std"] or 0),  # one seed has no spread
                         "seeds": row["seeds"], "diverged": int(row["runs_ended_above_unigram"]),
                         "to_exact": to_exact.get("equivalence (±1%)", "—"),
                         "head_to_head": difference_cell(pairs, *methods, methods)})
    return sorted(rows, key=lambda r: (r["method"], -r["bytes"]))


def largest_equivalent(rows: list[dict]) -> dict[str, dict]:
    """Per method, the setting with the most compression whose loss passed the equivalence test
    against the method's exact runs."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["to_exact"].endswith("pass") and r["ratio"] > best.get(r["method"], {"ratio": 0})["ratio"]:
            best[r["method"]] = r
    return best


def plot(rows: list[dict], path: Path) -> None:
    """One colour per method and one line per compressor (dense quantisation, low rank, top-k),
    each through its settings. Settings where a seed diverged (ended above the unigram baseline)
    are left off the lines and named at the top edge, so they do not flatten the others."""
    figure, axes = plt.subplots(figsize=(7.2, 4.6))
    colours = dict(zip(sorted({r["method"] for r in rows}), ("tab:blue", "tab:orange", "tab:green")))
    styles = {"none": ("-", "o", "dense"), "lowrank": ("--", "s", "low rank"), "topk": (":", "^", "top-k")}
    for method, colour in colours.items():
        for compress, (style, marker, family) in styles.items():
            kept = [r for r in rows if r["method"] == method and r["compress"] == compress and not r["diverged"]]
            axes.errorbar([r["bytes"] for r in kept], [r["loss"] for r in kept], yerr=[r["sd"] for r in kept],
                          linestyle=style, marker=marker, capsize=3, color=colour, label=f"{method}, {family}")
    diverged = [r for r in rows if r["diverged"]]
    for index, r in enumerate(diverged):
        axes.annotate(f"{r['method']}, {r['setting'].split(',')[0]}: {r['diverged']} of {r['seeds']} seeds diverged",
                      (r["bytes"], 1), xycoords=("data", "axes fraction"), textcoords="axes fraction",
                      xytext=(0.3, 0.95 - 0.05 * index), ha="left", fontsize=7, color=colours[r["method"]],
                      arrowprops={"arrowstyle": "-", "color": colours[r["method"]]})
    axes.set_xscale("log")
    axes.set_xlabel(f"wire bytes per process per round (P = {ISLANDS} islands, model {MODEL})")
    axes.set_ylabel("final validation loss (mean ± sd over seeds)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(figure)


def markdown(rows: list[dict]) -> str:
    lines = ["| method | setting | wire bytes per process per round | × fewer than float32 | final loss | seeds | "
             "diverged | − exact: equivalence (±1%) | isoloco − diloco: difference, call after BH |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['setting']} | {r['bytes']:,.0f} | {r['ratio']:.1f}× | "
                     f"{r['loss']:.4f} ± {r['sd']:.4f} | {r['seeds']} | {r['diverged']} | {r['to_exact']} | "
                     f"{r['head_to_head']} |")
    best = [f"- {method}: {r['setting']}, {r['ratio']:.1f}× fewer bytes than float32"
            for method, r in sorted(largest_equivalent(rows).items())]
    return "\n".join(["# Compression frontier", "", "`python scripts/compress_frontier.py` writes this file.", "",
                      "## By setting", "", *lines, "", "## The largest compression equivalent to exact within ±1% (TOST)", "",
                      *(best or ["- none yet"]), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="results/claims", help="the folder holding the claims' views")
    root = Path(parser.parse_args().root)
    rows = frontier(root)
    plot(rows, root / VIEW / "frontier.png")
    (root / VIEW / "frontier.md").write_text(markdown(rows))
    print(f"wrote {root / VIEW / 'frontier.png'} and frontier.md ({len(rows)} points)")


if __name__ == "__main__":
    main()
