r"""Write the report of every folder docs/claims quotes, after linking the runs each claim
compares into one folder per claim (a *view*), so that one `isoloco report` and its --compare
see them side by side.

The runs stay where their sweeps wrote them (a sweep resumes only into its own folder); a
view holds relative symbolic links, renamed where two sweeps used the same run name. Run it
again after the sweeps add runs: it replaces the views' links and rewrites the reports (and
the tables and plots scripts beside it derive from a few of them, `DERIVED`).

    python scripts/claim_reports.py          # every view and report
    python scripts/claim_reports.py main     # one folder's report (and its view, if it is one)
    python scripts/claim_reports.py --doc docs/claims     # then copy the tables into the pages
    python scripts/claim_reports.py --tests docs/claims   # every test the pages quote, adjusted together;
                                                          # then their contrasts, adjusted together
    python scripts/claim_reports.py --check docs/claims   # exit 1 if a report, page-tests.md or a table is stale
    python scripts/claim_reports.py --check docs/claims main   # only main's report regenerated and compared

--check regenerates every report (or each FOLDER's) into a scratch folder from the runs as they
are, and compares it with the committed one byte for byte: results.md, results.csv, summary.csv,
compare.md, contrast.md, spectra.md, plots/*.png and what the DERIVED scripts write from them (a
report of the same runs is the same bytes, plots included, on one matplotlib version), and a view's
links with the runs it links now; then page-tests.md with what --tests writes, and every table of
the page with its committed report. It prints one line per stale file or table and exits 1 if
there is one, 0 if none (--tables-only: the tables alone, in a second; every report takes minutes).
So after the runs change: the reports, then --doc and --tests, and --check passes.

--doc, --check and --tests take one page (docs/results.md) or a folder of pages (docs/claims): its
index, README.md, and then every page the index links to, in the order of their first link there
(the order --tests counts the tests in); a page of the folder the index does not link to is an
error. A folder's pages count as one page: a row two of them quote is one test.

A table of a page is copied from a report when the line two above it is a marker naming
the file and the section (the `## ` heading the table follows), and optionally a regular
expression that picks the rows: `<!-- table: results/claims/main/compare.md "isoloco − diloco" -->`
or `<!-- table: results/claims/main/results.md "By method, R and H" rows: ^\| (dp|isoloco) \| -->`.
A row the report marks (†: ended unstable; ‡: above the unigram baseline at an evaluation) brings
along the footnote under the report's table that says what its mark means.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

# view -> [(sweep folder or pattern of folders, run-name pattern, prefix for the link's name)]
VIEWS: dict[str, list[tuple[str, str, str]]] = {
    # The README's plot: dp and both methods at H = 30 over seeds 0-2, the seeds DiLoCo ran at every R, so
    # that the plot draws the gaps the README's verdict pairs by seed (IsoLoCo's seeds 3-4 would move them).
    "headline": [("main", "dp-s[012]", ""), ("main", "diloco-R*-H30-s[012]", ""),
                 ("main", "isoloco-R*-H30-s[012]", "")],
    "claim4": [("main", "dp-s*", ""), ("main", "diloco-R*-H30-s*", ""), ("main", "diloco_sgd-R*", ""),
               ("main", "isoc-R*", ""), ("main", "isoloco-R*-H30-s*", ""), ("isoc-lr3", "isoc-R*", "lr3-")],
    "claim6": [("main", "dp-s*", ""), ("main", "diloco_sgd-R8-*", ""), ("main", "isoc-R8-*", ""),
               ("rules", "*-R8-H30-s*", ""), ("ties-d0.5", "ties-*", "d0.5-"), ("ties-d0.2", "ties-*", "d0.2-"),
               ("dare-p0.5", "dare-*", "p0.5-"), ("dare-p0.8", "dare-*", "p0.8-")],
    "claim7": [("main", "dp-s*", ""), ("main", "isoloco-R8-H30-s*", ""), ("main", "isoloco-R16-H30-s*", ""),
               ("main", "isoloco_fast-R8-*", ""), ("main", "isoloco_fast-R16-*", ""),
               ("fast-pe-inner", "isoloco_fast-*", "pe-inner-"), ("exact-gram", "isoloco-*", "gram-"),
               ("fast-lr0.9", "isoloco_fast-*", "lr0.9-")],
    # The outer-lr searches at R = 8, seed 0, beside the runs at each method's default lr.
    "tune-r8": [("main", "dp-s0", ""), ("main", "diloco_sgd-R8-H30-s0", ""), ("main", "isoc-R8-H30-s0", ""),
                ("main", "isoloco-R8-H30-s0", ""),
                *[(f"tune/isoc-lr{lr}", "isoc-*", f"lr{lr}-") for lr in ("1.0", "1.4", "3.0", "4.0", "5.5")],
                *[(f"tune/diloco_sgd-lr{lr}", "diloco_sgd-*", f"lr{lr}-") for lr in ("0.8", "1.1", "2.4")]],
    "tune-fast-r8": [("main", "dp-s0", ""), ("main", "isoloco-R8-H30-s0", ""), ("main", "isoloco_fast-R8-H30-s0", ""),
                     ("tune/isoloco_fast-lr0.6", "isoloco_fast-*", "lr0.6-"),
                     ("tune/isoloco_fast-lr0.9", "isoloco_fast-*", "lr0.9-")],
    "claim8": [("main", "dp-s*", ""), ("main", "isoloco-R16-H30-s*", ""), ("main", "muloco-R16-*", ""),
               ("main", "isoloco_muon-R16-*", ""), ("muon-tuned", "*-R16-*", "tuned-")],
    # tiny (main) and small at its own tuned inner lr: one dp per model, so each gap is to its own model's dp.
    "claim9": [("main", "dp-s*", "tiny-"), ("main", "diloco-R8-H30-s*", "tiny-"), ("main", "isoloco-R8-H30-s*", "tiny-"),
               ("small-lr0.004", "*-s*", "small-")],
    # DiLoCo at R = 1 taken apart: its outer step with dp's inner settings, and dp with DiLoCo's.
    "regime-r1": [("main", "dp-s*", ""), ("main", "diloco-R1-H30-s*", ""), ("main", "diloco_sgd-R1-*", ""),
                  ("r1-plain", "diloco_sgd-*", "lr1-"), ("r1-dp-inner", "diloco-*", "dp-inner-")],
    "tune-small": [("small", "dp-s0", "lr0.016-"),
                   *[(f"tune/small-dp-lr{lr}", "dp-s0", f"lr{lr}-") for lr in ("0.008", "0.004", "0.002", "0.001")]],
    # The outer-optimizer searches of scripts/strongest_baseline.sh: one sweep folder per setting.
    "strongest-search": [("main", "dp-s0", ""), ("strongest/*", "*-R*-H30-s0", "{sweep}-")],
    # 3 seeds at each method's best outer setting from strongest-search (scripts/strongest_seeds.sh),
    # beside dp, Iso-C and both methods at the preset's outer settings.
    "strongest-seeds": [("main", "dp-s*", ""), ("main", "diloco-R*-H30-s*", ""), ("main", "isoloco-R*-H30-s*", ""),
                        ("main", "isoc-R*-H30-s*", ""), *((f"strongest/{best}", "*-R*-H30-s*", "tuned-")
                                                        for best in ("diloco-mu0.3-lr1.0", "isoloco-mu0.6-lr1.5"))],
    # R = 1, where nothing is merged: IsoLoCo (the preset's and the tuned outer step) against DiLoCo's
    # best R = 1 setting in the page's grids, outer SGD at lr 1 (FedAvg), and against the tuned DiLoCo.
    "r1-fedavg": [("main", "dp-s*", ""), ("main", "isoloco-R1-H30-s*", ""), ("r1-plain", "diloco_sgd-*", "lr1-"),
                  *((f"strongest/{best}", "*-R1-H30-s*", "tuned-") for best in ("diloco-mu0.3-lr1.0",
                                                                                "isoloco-mu0.6-lr1.5"))],
    # The tuned IsoLoCo against Iso-C at the paper's outer lr (2.1) and at its own best (3.0), R = 8 and 16.
    "claim4-tuned": [("main", "dp-s*", ""), ("main", "isoc-R8-H30-s*", ""), ("main", "isoc-R16-H30-s*", ""),
                     ("isoc-lr3", "isoc-R*", "lr3-"), ("strongest/isoloco-mu0.6-lr1.5", "*-R8-H30-s*", "tuned-"),
                     ("strongest/isoloco-mu0.6-lr1.5", "*-R16-H30-s*", "tuned-")],
    # Compressed and delayed pseudo-gradients (scripts/link_science.sh), one sweep folder per setting.
    "link-science": [("main", "dp-s*", ""), ("link/*", "*-R8-H30-s*", "{sweep}-")],
    # The compressed sum (scripts/tuned_science.sh compressed): tuned DiLoCo and IsoLoCo at R = 8 and 16,
    # exact and compressed, seeds 1-3 (seed 0 chose the tuned settings).
    "compressed-science": [("main", "dp-s[123]", ""), ("compressed/*", "*-s*", "{sweep}-")],
    # The compressed grid's error-feedback settings rerun on the engine whose error feedback is
    # lossless at every number of islands (OUT=results/claims/compressed-lossless ONLY="int8-ef
    # int4-ef" scripts/tuned_science.sh compressed), against the same exact runs.
    "lossless-science": [("main", "dp-s[123]", ""), ("compressed/*-exact", "*-s*", "{sweep}-"),
                         ("compressed-lossless/*", "*-s*", "{sweep}-")],
    # Compression at 100× (scripts/tuned_science.sh compress): R = 8 (and 16 where the verdict
    # hinges), against the compressed grid's exact and int8 / int4 (with error feedback) runs of the
    # same methods, R and seeds.
    "compress-science": [("main", "dp-s[123]", ""), ("compressed/*-exact", "*-s*", "{sweep}-"),
                         ("compressed/*-int[48]-ef", "*-s*", "{sweep}-"), ("compress/*", "*-s*", "{sweep}-")],
    # The tuned-per-compressor grid (scripts/compress_tuned.py): each compressor x method x R at the
    # outer step seed 0 chose for it, seeds 1-3, against the compressed grid's exact runs.
    "compressors-science": [("main", "dp-s[123]", ""), ("compressed/*-exact", "*-s*", "{sweep}-"),
                            ("compress-tuned/*-R*", "*-s[123]", "{sweep}-")],
    # Stragglers and late workers (scripts/tuned_science.sh stragglers): R = 8, against the compressed
    # grid's exact runs of the same methods and seeds (fault-free, every worker at full speed).
    "stragglers-science": [("main", "dp-s[123]", ""), ("compressed/*-exact", "*-R8-*", "{sweep}-"),
                           ("stragglers/*", "*-R8-*", "{sweep}-")],
    # IsoLoCo's first rounds against the budget, and its robust variants (scripts/early_budget.sh):
    # the `quick` runs of every budget in one view (dp pairs by budget), repro-cpu's in another.
    "early-quick": [("early-budget/steps*", "*-s*", "{sweep}-")],
    "early-long": [("main", "dp-s[012]", ""), ("main", "isoloco-R8-H30-s[012]", ""),
                   ("early-budget/repro-cpu-*", "*-R8-H30-s*", "{sweep}-")],
    # 1,800 steps instead of 480 (scripts/long_horizon.sh).
    "long-horizon": [("long-horizon/*", "*-s*", "{sweep}-")],
    # The R-to-128 grid (scripts/r128_grid.py): dp and both methods at each R, seeds 1-3.
    "r128-grid": [("r128/dp", "dp-s[123]", ""), ("r128/diloco-R*", "diloco-R*-s[123]", ""),
                  ("r128/isoloco-R*", "isoloco-R*-s[123]", "")],
    # The same runs at the two R the outer steps were searched at, 16 and 128: how IsoLoCo − DiLoCo
    # changes between the two points where both methods ran at their own choice.
    "r128-searched": [("r128/dp", "dp-s[123]", ""), ("r128/diloco-R1[26]*", "diloco-R*-s[123]", ""),
                      ("r128/isoloco-R1[26]*", "isoloco-R*-s[123]", "")],
    "tune-muon-r8": [("main", "dp-s0", ""), ("main", "isoloco-R8-H30-s0", ""), ("tune/muon-r8", "*-R8-H30-s0", ""),
                     *[(f"tune/isoloco_muon-lr{lr}", "isoloco_muon-*", f"lr{lr}-") for lr in ("0.4", "0.7", "1.2")],
                     *[(f"tune/muloco-lr{lr}", "muloco-*", f"lr{lr}-") for lr in ("0.4", "1.0", "1.4", "2.0")]],
}


def view_runs(root: Path, view: str) -> dict[str, Path]:
    """The runs a view links: its link's name -> the run's folder (under `root`)."""
    runs: dict[str, Path] = {}
    for sweeps, pattern, prefix in VIEWS[view]:
        for sweep in sorted(root.glob(sweeps)):  # a folder, or a pattern of folders ({sweep}: each one's name)
            if sweep.parent == root / view and sweep.is_symlink():  # the view's own link (its sweeps inside it)
                continue
            for run in sorted(sweep.glob(pattern)):
                # Finished runs only: a view is read (and committed) while its sweeps still run.
                if run.is_dir() and (run / "summary.json").is_file():
                    name = f"{prefix.format(sweep=sweep.name)}{run.name}"
                    if name in runs:
                        raise SystemExit(f"error: view {view} links two runs as {name}: give one a prefix in VIEWS")
                    runs[name] = run
    return runs


def link_view(root: Path, view: str) -> int:
    folder = root / view
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        if old.is_symlink():
            old.unlink()
    runs = view_runs(root, view)
    for name, run in runs.items():
        (folder / name).symlink_to(os.path.relpath(run, folder))
    return len(runs)


NS_RMS = "isoloco_fast merge.ortho=newton_schulz merge.scale=rms"


#: folder -> the settings its grid chose per R (`isoloco report --tuned`): the R-to-128 grid runs each
#: method at the outer step searched at R = 16 or at R = 128 (results/claims/r128/selection.md), so a
#: method's runs at every R are one series.
TUNED = {"r128-grid": "outer.lr,outer.momentum", "r128-searched": "outer.lr,outer.momentum"}
#: Gaps to data-parallel training the paper publishes, drawn beside a report's gap against R:
#: its 178M model at R = 128, IsoLoCo +9.7% and DiLoCo +16.5% ("Can Model Merging Improve
#: Aggregation in DiLoCo?", 2026).
PUBLISHED = {"r128-grid": ["isoloco (paper, 178M)@128=9.7", "diloco (paper, 178M)@128=16.5"]}
#: Each method's best outer setting in strongest-search, as the strongest-seeds report labels it.
TUNED_DILOCO, TUNED_ISOLOCO = "diloco outer.lr=1.0 outer.momentum=0.3", "isoloco outer.lr=1.5 outer.momentum=0.6"


def link_label(method: str, quantize: str = "none", feedback: bool = False, overlap: int = 0) -> str:
    """A run label of the link-science view, whose runs differ in these three settings."""
    return f"{method} merge.error_feedback={feedback} merge.quantize={quantize} outer.overlap_steps={overlap}"


def early_label(steps: int | None = 60, power: float = 0.0, floor: float = 0.0, exclude: str = "") -> str:
    """An IsoLoCo run label of the early-rounds views (steps=None: repro-cpu's, one budget)."""
    budget = "" if steps is None else f" steps={steps}"
    return f"isoloco merge.exclude={exclude} merge.iso_floor={floor} merge.iso_power={power}{budget}"


#: scripts/early_budget.sh's variants, as `early_label` arguments.
EARLY_VARIANTS = ({"power": 0.5}, {"floor": 0.1}, {"exclude": "*embed_tokens*,lm_head.weight"})
def compressed_label(method: str, quantize: str = "none", feedback: bool = False) -> str:
    """A run label of the compressed-science view (each method at its tuned outer step, which
    its runs share, so the label leaves it out)."""
    return f"{method} merge.error_feedback={feedback} merge.quantize={quantize}"


def compress_label(method: str, compress: str = "none", rank: int = 4, density: float = 0.03, quantize: str = "none",
                   feedback: bool = False) -> str:
    """A run label of the compress-science view (the keys its runs vary, each method at its tuned
    outer step)."""
    return (f"{method} merge.compress={compress} merge.compress_density={density} merge.compress_rank={rank} "
            f"merge.error_feedback={feedback} merge.quantize={quantize}")


def straggler_label(method: str, speeds: str = "", weighting: str = "equal", late: str = "drop",
                    rate: float = 0.0, stale: float = 0.5) -> str:
    """A run label of the stragglers-science view (the keys its runs vary, each method at its tuned
    outer step; no speeds: every worker at full speed)."""
    return (f"{method} faults.late={late} faults.late_rate={rate} faults.stale_weight={stale} "
            f"merge.weighting={weighting} worker_speeds={speeds}")


#: scripts/tuned_science.sh stragglers's settings, as `straggler_label` arguments (the fault-free
#: runs are the reference).
STRAGGLER_SETTINGS = (
    *({"speeds": "1.0,0.25", "weighting": w} for w in ("equal", "tokens")),
    *({"rate": r, "late": late} for r in (0.1, 0.3) for late in ("drop", "carry")),
    {"rate": 0.3, "late": "carry", "stale": 1.0},
)

#: Each remedy's setting and the setting it is held against, as `straggler_label` arguments: token
#: weights against equal ones, a carried late delta against a dropped one, and one carried in full
#: against one down-weighted (the staleness correction).
STRAGGLER_REMEDIES = (
    ({"speeds": "1.0,0.25", "weighting": "tokens"}, {"speeds": "1.0,0.25", "weighting": "equal"}),
    *(({"rate": r, "late": "carry"}, {"rate": r, "late": "drop"}) for r in (0.1, 0.3)),
    ({"rate": 0.3, "late": "carry", "stale": 1.0}, {"rate": 0.3, "late": "carry"}),
)


def tuned_pairs(label: Callable[..., str], settings: tuple[dict, ...], head_to_head: bool = True) -> list[str]:
    """The --compare pairs of a tuned-science view: what each setting costs each method against
    its reference runs (`label(method)`), the two costs contrasted, IsoLoCo against DiLoCo under
    each setting (`head_to_head`), and at the reference."""
    return [*(f"{label(m, **kw)}:{label(m)}" for kw in settings for m in ("isoloco", "diloco")),
            *(f"{label('isoloco', **kw)}:{label('isoloco')}::{label('diloco', **kw)}:{label('diloco')}"
              for kw in settings),
            *(f"{label('isoloco', **kw)}:{label('diloco', **kw)}" for kw in settings if head_to_head),
            f"{label('isoloco')}:{label('diloco')}"]


#: scripts/tuned_science.sh compress's settings, and the compressed grid's it reuses, as
#: `compress_label` arguments (the exact runs are the reference).
COMPRESS_SETTINGS = (
    *({"quantize": q, "feedback": True} for q in ("int8", "int4")),
    *({"compress": "lowrank", "rank": r, "quantize": "int8", "feedback": True} for r in (8, 4, 2, 1)),
    *({"compress": "topk", "density": d, "quantize": "int8", "feedback": True} for d in (0.1, 0.03, 0.01)),
)
#: scripts/compress_tuned.py's settings of DiLoCo and IsoLoCo, as `compress_label` arguments: low rank 4
#: with int8 factors and error feedback, then its variants (the hidden matrices only, the embeddings
#: and head whole at int4; without error feedback; float32 factors).
TUNED_LOWRANK = {"compress": "lowrank", "quantize": "int8", "feedback": True}
TUNED_COMPRESS_SETTINGS = (TUNED_LOWRANK, {**TUNED_LOWRANK, "quantize": "int4"}, {**TUNED_LOWRANK, "feedback": False},
                           {**TUNED_LOWRANK, "quantize": "none"})
#: The baselines and IsoLoCo's merging-aware variants of that grid at about the same bytes, each
#: method's label (SparseLoCo's methods send their own tiles: their merge.* keys are the defaults).
COMPRESSED_BASELINES = (compress_label("diloco", **TUNED_LOWRANK), compress_label("sparseloco"))
MERGING_VARIANTS = (compress_label("isoloco", **TUNED_LOWRANK), compress_label("sparseloco_isoc"))
#: scripts/tuned_science.sh compressed's settings other than the exact one, as `compressed_label` arguments.
COMPRESSED_SETTINGS = ({"quantize": "int8"}, {"quantize": "int8", "feedback": True}, {"quantize": "int4"},
                       {"quantize": "int4", "feedback": True})
#: scripts/link_science.sh's settings other than the exact one, as `link_label` arguments.
LINK_SETTINGS = ({"quantize": "int8"}, {"quantize": "int8", "feedback": True}, {"quantize": "int4"},
                 {"quantize": "int4", "feedback": True}, {"overlap": 5})
#: folder -> the --compare pairs of its report (docs/claims quotes them).
REPORTS: dict[str, list[str]] = {
    "headline": ["isoloco:diloco"],
    "main": ["isoloco:diloco", "isoloco:dp", "diloco:dp", "isoc:diloco", "isoloco:isoc", "isoloco_fast:isoloco",
             "isoloco_muon:muloco", "isoloco:muloco", "isoloco_muon:isoloco"],
    "claim4": ["isoc outer.lr=2.1:diloco", "isoc outer.lr=3.0:diloco", "isoloco:isoc outer.lr=2.1",
               "isoloco:isoc outer.lr=3.0", "isoc outer.lr=2.1:diloco_sgd"],
    "claim6": [*(f"ties merge.density={d}:diloco_sgd" for d in ("0.9", "0.5", "0.2")),
               *(f"dare merge.drop_rate={p}:diloco_sgd" for p in ("0.1", "0.5", "0.8")),
               "tsv:diloco_sgd", "isocts:diloco_sgd", "isocts:isoc", "isoc:diloco_sgd"],
    "claim7": [f"{NS_RMS} outer.lr=1.2:isoloco merge.ortho=auto", f"{NS_RMS} outer.lr=0.9:isoloco merge.ortho=auto",
               "isoloco_fast merge.ortho=polar_express merge.scale=inner outer.lr=1.2:isoloco merge.ortho=auto",
               "isoloco merge.ortho=gram:isoloco merge.ortho=auto", f"{NS_RMS} outer.lr=0.9:{NS_RMS} outer.lr=1.2"],
    "claim8": ["isoloco_muon outer.lr=0.7:muloco outer.lr=1.0", "isoloco:muloco outer.lr=1.0",
               "isoloco_muon outer.lr=0.7:isoloco", "isoloco_muon outer.lr=1.8:muloco outer.lr=0.7",
               "isoloco:muloco outer.lr=0.7", "isoloco_muon outer.lr=1.8:isoloco"],
    "small": ["isoloco:diloco", "isoloco:dp", "diloco:dp"],
    "small-lr0.004": ["isoloco:diloco", "isoloco:dp", "diloco:dp"],
    "small-lr0.002": ["isoloco:diloco", "isoloco:dp", "diloco:dp"],
    "claim9": [f"isoloco {size}:diloco {size}" for size in ("inner.lr=0.016 model=tiny", "inner.lr=0.004 model=small")],
    "regime-r1": ["diloco_sgd outer.lr=1.0:dp", "diloco inner.grad_clip=0.0 inner.weight_decay=0.15:dp",
                  "diloco inner.grad_clip=1.0 inner.weight_decay=0.1:dp", "diloco_sgd outer.lr=1.6:dp"],
    "strongest-seeds": [f"{TUNED_ISOLOCO}:{TUNED_DILOCO}", f"{TUNED_DILOCO}:dp", f"{TUNED_ISOLOCO}:dp",
                        f"isoc:{TUNED_DILOCO}", f"{TUNED_ISOLOCO}:isoc",
                        f"{TUNED_DILOCO}:diloco outer.lr=0.7 outer.momentum=0.9",
                        f"{TUNED_ISOLOCO}:isoloco outer.lr=1.2 outer.momentum=0.8"],
    # What each setting costs each method against its exact runs, then the two costs contrasted.
    "link-science": [*(f"{link_label(m, **kw)}:{link_label(m)}" for kw in LINK_SETTINGS for m in ("isoloco", "diloco")),
                     *(f"{link_label('isoloco', **kw)}:{link_label('isoloco')}::{link_label('diloco', **kw)}:"
                       f"{link_label('diloco')}" for kw in LINK_SETTINGS)],
    # IsoLoCo against DiLoCo and dp at every budget, then each variant at the short budget and
    # the long one against plain IsoLoCo, and the variant that helped against DiLoCo and dp.
    "early-quick": [*(f"{early_label(steps)}:{base} steps={steps}" for steps in (60, 120, 210)
                      for base in ("diloco", "dp")),
                    *(f"{early_label(**kw)}:{early_label()}" for kw in EARLY_VARIANTS),
                    f"{early_label(power=0.5)}:diloco steps=60", f"{early_label(power=0.5)}:dp steps=60"],
    "early-long": [f"{early_label(None, **kw)}:{early_label(None)}" for kw in EARLY_VARIANTS],
    "long-horizon": ["isoloco:diloco", "diloco:dp", "isoloco:dp"],
    "r1-fedavg": [f"{TUNED_ISOLOCO}:diloco_sgd", "isoloco outer.lr=1.2 outer.momentum=0.8:diloco_sgd",
                  f"diloco_sgd:{TUNED_DILOCO}", "diloco_sgd:dp"],
    "claim4-tuned": ["isoloco:isoc outer.lr=2.1", "isoloco:isoc outer.lr=3.0"],
    "r128-grid": ["isoloco:diloco", "diloco:dp", "isoloco:dp"],
    "r128-searched": ["isoloco:diloco"],
    "compressed-science": tuned_pairs(compressed_label, COMPRESSED_SETTINGS, head_to_head=False),
    "compress-science": tuned_pairs(compress_label, COMPRESS_SETTINGS),
    "lossless-science": tuned_pairs(compressed_label, tuple(kw for kw in COMPRESSED_SETTINGS if kw.get("feedback"))),
    # What each compressor costs its method against exact (SparseLoCo against DiLoCo's exact runs, its
    # Iso-C against IsoLoCo's), IsoLoCo against DiLoCo under each, every merging-aware variant against
    # every compressed baseline, the two baselines against each other, and what error feedback and
    # int8 factors are worth.
    "compressors-science": [*tuned_pairs(compress_label, TUNED_COMPRESS_SETTINGS),
                            f"{compress_label('sparseloco')}:{compress_label('diloco')}",
                            f"{compress_label('sparseloco_isoc')}:{compress_label('isoloco')}",
                            *(f"{variant}:{baseline}" for variant in MERGING_VARIANTS for baseline in COMPRESSED_BASELINES
                              if (variant, baseline) != MERGING_VARIANTS[:1] + COMPRESSED_BASELINES[:1]),
                            f"{COMPRESSED_BASELINES[0]}:{COMPRESSED_BASELINES[1]}",  # the best compressed baseline
                            *(f"{compress_label(m, **kw)}:{compress_label(m, **TUNED_LOWRANK)}"
                              for kw in TUNED_COMPRESS_SETTINGS[2:] for m in ("isoloco", "diloco"))],
    # Then each remedy against the setting it is held against (`STRAGGLER_REMEDIES`; the late draws
    # are the same in both, seed by seed).
    "stragglers-science": [*tuned_pairs(straggler_label, STRAGGLER_SETTINGS),
                           *(f"{straggler_label(m, **remedy)}:{straggler_label(m, **plain)}"
                             for remedy, plain in STRAGGLER_REMEDIES for m in ("isoloco", "diloco"))],
    "tune-r8": [], "tune-fast-r8": [], "tune-muon-r8": [], "tune-small": [], "strongest-search": [], "spectra": [],
}


MARKER = re.compile(r'^<!-- table: (?P<file>\S+) "(?P<section>[^"]+)"(?: rows: (?P<rows>.+?))? -->$')
#: What `isoloco report` marks runs with (unstable; above the unigram baseline at an evaluation); the
#: footnote saying what a mark means starts with it too.
FOOTNOTE_MARKS = ("†", "‡")


def footnotes(lines: list[str], end: int, marks: tuple[str, ...] = FOOTNOTE_MARKS) -> list[str]:
    """The footnotes of the table that ends before `lines[end]` (a blank line, then the lines that
    start with a mark) for the given marks; [] when there are none."""
    if lines[end:end + 1] != [""]:
        return []
    last = end + 1
    while last < len(lines) and lines[last].startswith(FOOTNOTE_MARKS):
        last += 1
    kept = [line for line in lines[end + 1:last] if line.startswith(marks)]
    return [""] + kept if kept else []


def report_table(file: Path, section: str, rows: str | None) -> list[str] | None:
    """The first table after the `## section` heading of a report, with the rows `rows` matches
    (and its footnote when one of them is marked); None when the report has no such section or no
    table in it."""
    lines = file.read_text().splitlines() if file.is_file() else []
    if f"## {section}" not in lines:
        return None
    start = lines.index(f"## {section}") + 1
    while start < len(lines) and not lines[start].startswith(("|", "## ")):
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = lines[start:end]
    if not table:
        return None
    body = [line for line in table[2:] if rows is None or re.search(rows, line)]
    marks = tuple(mark for mark in FOOTNOTE_MARKS if any(mark in line for line in body))
    return table[:2] + body + (footnotes(lines, end, marks) if marks else [])


#: The index page of a folder of pages (docs/claims): GitHub shows it for the folder.
INDEX = "README.md"


def doc_pages(doc: Path) -> list[Path]:
    """The pages of `doc`: the page itself, or for a folder its index and then every page of the
    folder the index links to, in the order of their first link; a page the index does not link
    to is an error (its tables would count in no order)."""
    if not doc.is_dir():
        return [doc]
    index = doc / INDEX
    pages = [index]
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)\s]*)?\)", index.read_text()):
        page = doc / target
        if page.parent == doc and page.is_file() and page not in pages:
            pages.append(page)
    unlinked = sorted(set(doc.glob("*.md")) - set(pages))
    if unlinked:
        raise SystemExit(f"error: {index} does not link to {', '.join(map(str, unlinked))}: link every page of "
                         f"{doc} from its index, where the order of first links is the order its tests count in")
    return pages


def doc_lines(doc: Path) -> list[str]:
    """The lines of every page of `doc` (`doc_pages`), one page after another."""
    return [line for page in doc_pages(doc) for line in page.read_text().splitlines()]


def sync_doc(doc: Path, write: bool) -> list[tuple[str, str]]:
    """`sync_tables` on every page of `doc`; each stale marker is named with its page."""
    return [(f"{page}: {marker}" if page != doc else marker, problem)
            for page in doc_pages(doc) for marker, problem in sync_tables(page, write)]


def sync_tables(doc: Path, write: bool) -> list[tuple[str, str]]:
    """Replace every marked table of `doc` by its report's (when `write`); return each stale
    marker with what is wrong with its table."""
    lines = doc.read_text().splitlines()
    out: list[str] = []
    stale: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        marker = MARKER.match(lines[i])
        i += 1
        if not marker:
            continue
        if i + 1 >= len(lines) or lines[i] != "" or not lines[i + 1].startswith("|"):
            print(f"error: {doc}:{i}: a table marker must be followed by one blank line and the table",
                  file=sys.stderr)
            raise SystemExit(2)
        out.append("")
        i += 1
        old = []
        while i < len(lines) and lines[i].startswith("|"):
            old.append(lines[i])
            i += 1
        note = footnotes(lines, i)
        old += note
        i += len(note)
        new = report_table(Path(marker["file"]), marker["section"], marker["rows"])
        if new is None:
            stale.append((marker.group(0), "its report has no such table: table left as it is"))
            new = old
        elif new != old:
            stale.append((marker.group(0), "updated" if write else "differs from its report"))
        out += new
    if write:
        doc.write_text("\n".join(out) + "\n")
    return stale


#: Where --tests writes its table of the page's tests (under --root).
PAGE_TESTS = "page-tests.md"
#: The false discovery rate of the page-wide Benjamini–Hochberg adjustment.
FDR = 0.05


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(file: Path, section: str, rows: str | None = None) -> list[dict[str, str]]:
    """The rows of a report's table (`report_table`'s arguments) as {column: cell}; [] without it."""
    table = report_table(file, section, rows) or []
    header = _cells(table[0]) if table else []
    return [dict(zip(header, _cells(row))) for row in table[2:] if row.startswith("|")]


def compare_rows(report: Path, workers: int) -> dict[str, dict[str, str]]:
    """A report folder's paired tests at R = `workers`, by their "A − B" label."""
    return {row["A − B"]: row for row in table_rows(report / "compare.md", "Every pair") if row["R"] == str(workers)}


def difference_cell(pairs: dict[str, dict[str, str]], a: str, b: str, names: dict[str, str]) -> str:
    """"A − B, the call after BH" for the pair `a` − `b` of `compare_rows`, the call's labels
    shortened to `names`; "—" while the report lacks the pair."""
    row = pairs.get(f"{a} − {b}")
    if row is None:
        return "—"
    call = row["call after BH"]
    for label, name in names.items():
        call = call.replace(f"{label} lower", f"{name} lower")
    return f"{row['A − B (final loss)']}, {call}"


#: A row of a compare or contrast table as the table prints it: the pair ("A − B") or contrast, R, H,
#: the seeds and the difference (or contrast).
RowKey = tuple[str, str, str, str, str]


def _split_pair(name: str) -> tuple[str, str]:
    """"A − B" as the report's headings write a pair: its two labels (a label has no " − ")."""
    parts = name.split(" − ")
    if len(parts) != 2:
        raise ValueError(f"{name!r} is not a pair A − B")
    return parts[0], parts[1]


@functools.cache
def unrounded_p(report: Path) -> dict[RowKey, float | None]:
    """The p of every row of a report's compare.md or contrast.md, unrounded: recomputed from the
    runs of the report's folder, for the pairs (or contrasts) its `## ` headings name, by the
    functions that wrote the tables (a row that makes no test: None)."""
    from isoloco.report import SUMMARY_SECTIONS, compare_tests, contrast_tests, load_runs

    headings = [line[3:] for line in report.read_text().splitlines() if line.startswith("## ")]
    runs = load_runs(report.parent)
    if report.name == "contrast.md":
        rows = contrast_tests(runs, [tuple(_split_pair(side.strip("()")) for side in heading.split(") − ("))
                                     for heading in headings])
    else:
        rows = compare_tests(runs, [_split_pair(heading) for heading in headings if heading not in SUMMARY_SECTIONS])
    found: dict[RowKey, float | None] = {}
    for row in rows:
        key = (row.name, row.workers, row.inner_steps, row.seeds, row.value)
        if found.setdefault(key, row.p) != row.p:
            raise SystemExit(f"error: {report}: two rows read {' | '.join(key)} with different p-values; "
                             "their tests cannot be told apart")
    return found


def quoted_p(report: Path, key: RowKey) -> float:
    """The unrounded p of a quoted row (`unrounded_p`); an error when the runs no longer give that row."""
    p = unrounded_p(report).get(key)
    if p is None:
        raise SystemExit(f"error: {report}: its runs give no test {' | '.join(key)}; the report is out of date: "
                         f"run python scripts/claim_reports.py {report.parent.name}")
    return p


#: The column of a test table in a compare table's shape that no `isoloco report` writes (a
#: script's pre-registered test): its p unrounded, which the page-wide adjustment reads as is.
UNROUNDED_P = "p (unrounded)"


def quoted_tests(doc: Path) -> list[dict[str, str | float]]:
    """Every paired test in the compare tables `doc` quotes (the rows its markers keep), and in the
    tables with a column `UNROUNDED_P`, once: a row two tables share (the same R, H, seeds,
    difference and interval) counts once. A row without a p-value (one seed, an unstable run) is no
    test. "p" is the printed p, "exact" the unrounded one (`unrounded_p`, or the row's own)."""
    tests: dict[tuple, dict[str, str | float]] = {}
    for line in doc_lines(doc):
        marker = MARKER.match(line)
        if not marker:
            continue
        rows = table_rows(Path(marker["file"]), marker["section"], marker["rows"])
        if not marker["file"].endswith("compare.md") and not (rows and UNROUNDED_P in rows[0]):
            continue
        for cells in rows:
            # A point's p is "raw (adjusted within its report)"; a change with R's is raw alone.
            printed_p = cells.get("p (BH)", cells.get("p", "—"))
            if printed_p == "—":
                continue
            # The difference and equivalence columns are named after the pair and the margin (a change
            # with R has no equivalence test).
            difference = next(value for name, value in cells.items() if name.endswith("(final loss)"))
            equivalence = next((value for name, value in cells.items() if name.startswith("equivalence")), "")
            key = (cells["R"], cells["H"], cells["seeds"], difference, equivalence)
            if key in tests:
                continue
            pair = cells.get("A − B", marker["section"])
            exact = (float(cells[UNROUNDED_P]) if UNROUNDED_P in cells
                     else quoted_p(Path(marker["file"]), (pair, cells["R"], cells["H"], cells["seeds"], difference)))
            tests[key] = {"report": marker["file"], "pair": pair, "R": cells["R"], "H": cells["H"],
                          "seeds": cells["seeds"], "difference": difference, "p": printed_p.split()[0],
                          "call": cells["call"], "exact": exact}
    return list(tests.values())


def quoted_contrasts(doc: Path) -> list[dict[str, str | float]]:
    """Every contrast (a difference of two paired differences) in the contrast tables of `isoloco
    report` that `doc` quotes (their column "contrast (final loss)"), once, with its two-sided p: the
    paired t-test's of the contrasts against 0 over the seeds, which contrast.md does not print,
    recomputed from the runs unrounded (`unrounded_p`). A row with an unstable run or one seed is no
    test."""
    tests: dict[tuple, dict[str, str | float]] = {}
    for line in doc_lines(doc):
        marker = MARKER.match(line)
        if not marker or not marker["file"].endswith("contrast.md"):
            continue
        rows = table_rows(Path(marker["file"]), marker["section"], marker["rows"])
        if rows and "contrast (final loss)" not in rows[0]:
            continue  # a script's own table (scripts/claim2_settle.py's contrast at every evaluation)
        for cells in rows:
            if " ± " not in cells["contrast (final loss)"] or cells["call"].startswith("unstable"):
                continue
            key = (marker["file"], marker["section"], cells["R"], cells["H"])
            if key in tests:
                continue
            tests[key] = {"report": marker["file"], "contrast": marker["section"], "R": cells["R"], "H": cells["H"],
                          "seeds": cells["seeds"], "value": cells["contrast (final loss)"], "call": cells["call"],
                          "p": quoted_p(Path(marker["file"]), (marker["section"], cells["R"], cells["H"],
                                                               cells["seeds"], cells["contrast (final loss)"]))}
    return list(tests.values())


def page_tests_markdown(doc: Path) -> str:
    """The page's tests adjusted together: how many are called before and after a Benjamini–Hochberg
    adjustment over all of them (their unrounded p-values), and the calls it drops."""
    from isoloco.report import benjamini_hochberg, is_call

    tests = quoted_tests(doc)
    adjusted = benjamini_hochberg([float(test["exact"]) for test in tests])
    called = [(test, adj) for test, adj in zip(tests, adjusted) if is_call(str(test["call"]))]
    dropped = [(test, adj) for test, adj in called if adj >= FDR]

    def rows(chosen):
        return [f"| {t['report']} | {t['pair']} | {t['R']} | {t['H']} | {t['seeds']} | {t['difference']} | {t['p']} | "
                f"{adj:.4f} | {t['call']} |" for t, adj in chosen]

    header = ["| report | A − B | R | H | seeds | A − B (final loss) | p | p (BH over the page) | call |",
              "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join([
        f"# The tests {doc} quotes", "",
        f"{len(tests)} paired tests in the compare tables the page quotes and its pre-registered tests (a row two "
        "tables share counted once), "
        f"{len(called)} of them called. With the Benjamini–Hochberg adjustment over all {len(tests)} at a false "
        f"discovery rate of {FDR:g}, {len(called) - len(dropped)} stay called. p is printed as the reports print it "
        "(three decimals, two significant digits below 0.001); the adjustment starts from the unrounded p-values, "
        "recomputed from each report's runs (a pre-registered test's as its script wrote it), and the adjusted "
        "ones are given to four decimals; "
        "`python scripts/claim_reports.py --tests "
        f"{doc}` writes this file.", "",
        "## Called, but not after the page-wide adjustment", "",
        *([*header, *rows(dropped)] if dropped else ["None."]), "",
        "## Every test, by adjusted p", "",
        *header, *rows(sorted(zip(tests, adjusted), key=lambda pair: pair[1])), "",
        *contrasts_markdown(doc)])


def contrasts_markdown(doc: Path) -> list[str]:
    """The contrasts `doc` quotes, adjusted together (Benjamini–Hochberg) apart from the paired tests:
    each asks whether a setting costs one method more than another, a question of its own."""
    from isoloco.report import benjamini_hochberg

    contrasts = quoted_contrasts(doc)
    adjusted = benjamini_hochberg([float(c["p"]) for c in contrasts])
    called = sum(adj < FDR for c, adj in zip(contrasts, adjusted) if c["call"].endswith(" lower"))
    return ["## The contrasts, adjusted together", "",
            f"{len(contrasts)} contrasts in the contrast tables the page quotes (a row two tables share counted "
            f"once), {sum(c['call'].endswith(' lower') for c in contrasts)} of them called (unadjusted). With the "
            f"Benjamini–Hochberg adjustment over the {len(contrasts)} at a false discovery rate of {FDR:g}, "
            f"{called} stay called. p is the paired t-test's of the contrasts over the seeds, recomputed from the "
            "reports' runs (contrast.md prints the interval, not p), to three decimals; the adjustment starts from "
            "the unrounded p-values.", "",
            "| report | contrast | R | H | seeds | contrast (final loss) | p | p (BH over the page's contrasts) | call |",
            "|---|---|---|---|---|---|---|---|---|",
            *(f"| {c['report']} | {c['contrast']} | {c['R']} | {c['H']} | {c['seeds']} | {c['value']} | "
              f"{float(c['p']):.3f} | {adj:.4f} | {c['call']} |"
              for c, adj in sorted(zip(contrasts, adjusted), key=lambda pair: pair[1])), ""]


def report_command(folder: str, directory: Path) -> list[str]:
    """The `isoloco report` command line that writes `folder`'s report (`REPORTS`) into `directory`."""
    # "A:B" compares two methods; "A:B::C:D" contrasts two such differences.
    compare = [arg for pair in REPORTS[folder] for arg in ("--contrast" if "::" in pair else "--compare", pair)]
    published = [arg for points in PUBLISHED.get(folder, []) for arg in ("--published", points)]
    tuned = ["--tuned", TUNED[folder]] if folder in TUNED else []
    return [sys.executable, "-m", "isoloco", "report", str(directory), *compare, *published, *tuned]


#: folder -> the scripts beside this one that write more of its report from it (run with `--root`
#: after the report), each with its arguments and the files it writes into the folder.
DERIVED: dict[str, list[tuple[list[str], tuple[str, ...]]]] = {
    "compress-science": [(["compress_frontier.py", "--view", "compress-science"], ("frontier.md", "frontier.png"))],
    "compressors-science": [(["compress_frontier.py", "--view", "compressors-science"],
                             ("frontier.md", "frontier.png"))],
    "stragglers-science": [(["straggler_table.py"], ("settings.md",))],
}


def derived_commands(folder: str, root: Path) -> list[list[str]]:
    """The command lines of `folder`'s `DERIVED` scripts, writing into `root`/`folder`."""
    here = Path(__file__).resolve().parent
    return [[sys.executable, str(here / script), *args, "--root", str(root)] for (script, *args), _ in
            DERIVED.get(folder, [])]


#: What `isoloco report` writes into a folder (and the plots under PLOTS): the files --check regenerates,
#: with the folder's `DERIVED` files.
REPORT_FILES = ("results.md", "results.csv", "summary.csv", "compare.md", "contrast.md", "spectra.md")
PLOTS = "plots"


def report_files(folder: Path, name: str) -> dict[str, Path]:
    """The files of report `name` (a key of `REPORTS`) in `folder`, by their path relative to it."""
    derived = [file for _, written in DERIVED.get(name, []) for file in written]
    files = [folder / file for file in (*REPORT_FILES, *derived)] + sorted((folder / PLOTS).glob("*.png"))
    return {str(file.relative_to(folder)): file for file in files if file.is_file()}


def regenerate(root: Path, folder: str, scratch: Path) -> Path:
    """Write `folder`'s report afresh into `scratch`/`folder` (the same name: the report's title) from
    the runs it reads now: a view's runs as `link_view` would link them, a sweep folder's every entry
    but its report's files. Return that folder."""
    out = scratch / folder
    out.mkdir(parents=True)
    if folder in VIEWS:
        entries = view_runs(root, folder)
    else:
        written = set(report_files(root / folder, folder)) | {PLOTS}
        entries = {entry.name: entry for entry in (root / folder).iterdir() if entry.name not in written}
    for name, target in entries.items():
        (out / name).symlink_to(target.resolve())
    for command in [report_command(folder, out), *derived_commands(folder, scratch)]:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: the report of {root / folder} failed when regenerated: {' '.join(command)}\n"
                             f"{done.stdout}{done.stderr}")
    return out


def stale_reports(root: Path, folders: list[str]) -> list[str]:
    """Regenerate each folder's report into a scratch folder and compare it with the committed one,
    byte for byte (the plots too: a report of the same runs is the same bytes); one line for each
    file that differs, that the report no longer writes or that is missing, and for a view whose
    committed links are not the runs it links now."""
    import tempfile

    stale = []
    with tempfile.TemporaryDirectory(prefix="claim-reports-") as scratch:
        for folder in folders:
            committed = root / folder
            redo = f"run python scripts/claim_reports.py {folder}"
            if not committed.is_dir():
                stale.append(f"stale: {committed}: no such folder: {redo}")
                continue
            if folder in VIEWS:
                linked = {link.name: link.resolve() for link in committed.iterdir() if link.is_symlink()}
                runs = {name: run.resolve() for name, run in view_runs(root, folder).items()}
                if linked != runs:
                    new = len(runs.keys() - linked.keys())
                    gone = len(linked.keys() - runs.keys())
                    moved = sum(linked[name] != runs[name] for name in linked.keys() & runs.keys())
                    stale.append(f"stale: {committed}: its links are not the runs the view links now ({new} new, "
                                 f"{gone} gone, {moved} pointing elsewhere): {redo}")
            old, new = report_files(committed, folder), report_files(regenerate(root, folder, Path(scratch)), folder)
            for name in sorted(old.keys() | new.keys()):
                if name not in new:
                    stale.append(f"stale: {committed / name}: its report no longer writes it: delete it")
                elif name not in old:
                    stale.append(f"stale: {committed / name} is missing: {redo}")
                elif old[name].read_bytes() != new[name].read_bytes():
                    stale.append(f"stale: {committed / name} differs from its report regenerated now: {redo}")
    return stale


def stale_page_tests(root: Path, doc: Path) -> list[str]:
    """A line when `root`/page-tests.md is `doc`'s (its title names it) and differs from what --tests
    writes now from the committed reports; [] otherwise."""
    committed = root / PAGE_TESTS
    if not committed.is_file() or committed.read_text().splitlines()[:1] != [f"# The tests {doc} quotes"]:
        return []
    if committed.read_text() == page_tests_markdown(doc):
        return []
    return [f"stale: {committed} differs from the tests {doc} quotes now: run python scripts/claim_reports.py "
            f"--tests {doc}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", metavar="FOLDER",
                        help=f"the folders to report, or with --check to regenerate and compare (default: all of "
                             f"{', '.join(REPORTS)})")
    parser.add_argument("--root", default="results/claims", help="the folder holding the claims' sweeps")
    parser.add_argument("--doc", metavar="PAGE", help="copy every marked table of PAGE (a page, or a folder of "
                                                      "pages such as docs/claims) from its report (no reports run)")
    parser.add_argument("--check", metavar="PAGE", help="exit 1 when a committed report differs from the one its runs "
                                                        "give now (each FOLDER's, default all of them, regenerated "
                                                        "into a scratch folder and compared byte for byte: tables, "
                                                        "comparisons, CSV files and plots; a view's links too), when "
                                                        f"{PAGE_TESTS} is PAGE's and differs from what --tests "
                                                        "writes, or when a marked table of PAGE (a page or a folder "
                                                        "of pages) differs from its committed report; one line per "
                                                        "stale file or table")
    parser.add_argument("--tables-only", action="store_true", help="with --check: compare PAGE's tables with the "
                                                                   "committed reports alone (no report regenerated)")
    parser.add_argument("--tests", metavar="PAGE", help=f"write {PAGE_TESTS} under --root: every test of the compare "
                                                        "tables PAGE (a page or a folder of pages, counted as one) "
                                                        "quotes, adjusted together (Benjamini–Hochberg), then its "
                                                        "contrasts, adjusted together")
    args = parser.parse_args()
    if args.tests:
        (Path(args.root) / PAGE_TESTS).write_text(page_tests_markdown(Path(args.tests)))
        print(f"wrote {Path(args.root) / PAGE_TESTS}")
        return
    unknown = [folder for folder in args.folders if folder not in REPORTS]
    if unknown:
        parser.error(f"no report is defined for {', '.join(unknown)}; choose from {', '.join(REPORTS)}")
    root = Path(args.root)
    stale_files = []
    if args.check and not args.tables_only:
        doc_pages(Path(args.check))  # a folder of pages its index does not all link to fails first, in a second
        stale_files = stale_reports(root, args.folders or list(REPORTS))
        stale_files += stale_page_tests(root, Path(args.check))
        for line in stale_files:
            print(line)
    if args.doc or args.check:
        stale = sync_doc(Path(args.doc or args.check), write=bool(args.doc))
        for marker, problem in stale:
            print(f"{problem}: {marker}")
        raise SystemExit(1 if (stale or stale_files) and args.check else 0)
    for folder in args.folders or REPORTS:
        if folder in VIEWS:
            print(f"{folder}: {link_view(root, folder)} runs linked")
        for command in [report_command(folder, root / folder), *derived_commands(folder, root)]:
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
