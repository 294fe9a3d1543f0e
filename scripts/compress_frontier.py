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

from claim_reports import compress_label, table_rows  # noqa: E402  (scripts/, beside this file)
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


def frontier(root: Path) -> list[dict]:
    """One row per method and setting: its bytes, ×float32 and final loss (mean, sd, seeds), its
    equivalence test against the method's exact runs and IsoLoCo − DiLoCo under it ("—": not in
    the report yet)."""
    shapes = [shape for _, shape in parameter_shapes(MODEL)]
    float32 = wire_bytes_per_merge(shapes, MergeConfig(), ISLANDS)
    pairs = {row["A − B"]: row for row in table_rows(root / VIEW / "compare.md", "Every pair")
             if row["R"] == str(ISLANDS)}
    rows = []
    with open(root / VIEW / "summary.csv") as summary:
        for row in csv.DictReader(summary):
            if row["method"] == "dp" or row["R"] != str(ISLANDS):
                continue
            wire = wire_bytes_per_merge(shapes, merge_config(row["variant"]), ISLANDS)
            to_exact = pairs.get(f"{row['method']} {row['variant']} − {compress_label(row['method'])}", {})
            head_to_head = pairs.get(f"isoloco {row['variant']} − diloco {row['variant']}", {})
            rows.append({"method": row["method"], "variant": row["variant"], "bytes": wire, "ratio": float32 / wire,
                         "loss": float(row["final_val_loss_mean"]), "sd": float(row["final_val_loss_std"] or 0),  # one seed: no spread
                         "seeds": row["seeds"], "to_exact": to_exact.get("equivalence (±1%)", "—"),
                         "head_to_head": " ".join(head_to_head.get(k, "—") for k in ("A − B (final loss)",
                                                                                     "call after BH"))})
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
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method]
        axes.errorbar([r["bytes"] for r in mine], [r["loss"] for r in mine], yerr=[r["sd"] for r in mine],
                      marker="o", capsize=3, label=method)
    axes.set_xscale("log")
    axes.set_xlabel(f"wire bytes per process per round (P = {ISLANDS} islands, model {MODEL})")
    axes.set_ylabel("final validation loss (mean ± sd over seeds)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(figure)


def markdown(rows: list[dict]) -> str:
    lines = ["| method | setting | wire bytes per process per round | × fewer than float32 | final loss | seeds | "
             "− exact: equivalence (±1%) | isoloco − diloco: difference, call after BH |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['variant'] or 'float32'} | {r['bytes']:,.0f} | {r['ratio']:.1f}× | "
                     f"{r['loss']:.4f} ± {r['sd']:.4f} | {r['seeds']} | {r['to_exact']} | {r['head_to_head']} |")
    best = [f"- {method}: {r['variant']}, {r['ratio']:.1f}× fewer bytes than float32"
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
