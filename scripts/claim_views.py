"""Link the runs each claim of docs/claims.md compares into one folder per claim, so that one
`isoloco report` (and its --compare) sees them side by side.

The runs stay where their sweeps wrote them (a sweep resumes only into its own folder); a
view holds relative symbolic links, renamed where two sweeps used the same run name. Run it
again after the sweeps add runs: it replaces the view's links and leaves its reports.

    python scripts/claim_views.py            # then: isoloco report results/claims/claim6 --compare ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# view -> [(sweep folder, run-name pattern, prefix for the link's name)]
VIEWS: dict[str, list[tuple[str, str, str]]] = {
    "claim4": [("main", "dp-s*", ""), ("main", "diloco-R*-H30-s*", ""), ("main", "diloco_sgd-R*", ""),
               ("main", "isoc-R*", ""), ("main", "isoloco-R*-H30-s*", ""), ("isoc-lr3", "isoc-R*", "lr3-")],
    "claim6": [("main", "dp-s*", ""), ("main", "diloco_sgd-R8-*", ""), ("main", "isoc-R8-*", ""),
               ("rules", "*-R8-H30-s*", ""), ("ties-d0.5", "ties-*", "d0.5-"), ("ties-d0.2", "ties-*", "d0.2-"),
               ("dare-p0.5", "dare-*", "p0.5-"), ("dare-p0.8", "dare-*", "p0.8-")],
    "claim7": [("main", "dp-s*", ""), ("main", "isoloco-R8-H30-s*", ""), ("main", "isoloco_fast-R8-*", ""),
               ("fast-pe-inner", "isoloco_fast-*", "pe-inner-"), ("exact-gram", "isoloco-*", "gram-")],
    "tune-fast-r8": [("main", "dp-s0", ""), ("main", "isoloco-R8-H30-s0", ""), ("main", "isoloco_fast-R8-H30-s0", ""),
                     ("tune/isoloco_fast-lr0.6", "isoloco_fast-*", "lr0.6-"),
                     ("tune/isoloco_fast-lr0.9", "isoloco_fast-*", "lr0.9-")],
}


def link_view(root: Path, view: str) -> int:
    folder = root / view
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        if old.is_symlink():
            old.unlink()
    count = 0
    for sweep, pattern, prefix in VIEWS[view]:
        for run in sorted((root / sweep).glob(pattern)):
            if run.is_dir() and (run / "config.yaml").is_file():
                (folder / f"{prefix}{run.name}").symlink_to(os.path.relpath(run, folder))
                count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="results/claims", help="the folder holding the claims' sweeps")
    args = parser.parse_args()
    for view in VIEWS:
        print(f"{view}: {link_view(Path(args.root), view)} runs linked")


if __name__ == "__main__":
    main()
