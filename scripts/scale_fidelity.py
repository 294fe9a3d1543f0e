"""How far the merge's scale-driven changes move it, on real pseudo-gradients.

Two changes made the merge cheap at many workers, and this measures both on the tiny model
(repro-cpu's batch, H and inner lr; the deltas of round 2, as `fidelity_effects.py` takes them):

* TSV and Iso-CTS find each worker's top directions with a randomized range finder where a
  worker keeps at most 1/16 of the rank (`merge.factors=auto`), its early iterations in
  bfloat16 or float32 (`merge.finder_dtype`). Printed: the relative difference
  ‖ours − exact‖ / ‖exact‖ over all matrices, for `auto` (what runs by default) and for
  `randomized` everywhere, against `merge.factors=exact` (the full SVDs, as before).
* DARE's masks come from a counter-based hash instead of torch's CPU generator. Printed: the
  fraction of entries kept over every worker's mask of every tensor (expected 1 − p), and the
  mean of the merge over many seeds against the plain mean, entry by entry in standard
  errors of that mean (z): an unbiased merge with the stated variance gives a mean z² of 1
  and |z| > 3 in 0.27% of the entries.

    OMP_NUM_THREADS=1 python scripts/scale_fidelity.py --workers 2,4,8,16 --power-iters 1,2,3 \
        --finder-dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse

import torch

from isoloco import merge_config, merge_functions, rules
from fidelity_effects import real_deltas, relative


def factor_rows(workers: list[int], power_iters: list[int], finder_dtypes: list[str], seed: int) -> None:
    print("| R | subspace iterations | early iterations in | TSV, auto − exact | TSV, randomized − exact "
          "| Iso-CTS, auto − exact | Iso-CTS, randomized − exact |")
    print("|---|---|---|---|---|---|---|")
    for count in workers:
        matrices = [d for d in real_deltas(count, 2, seed).values() if d[0].ndim == 2]
        exact = {rule: [rule(d, factors="exact") for d in matrices] for rule in (merge_functions.tsv, merge_functions.iso_cts)}
        for iters in power_iters:
            for dtype in finder_dtypes:
                settings = dict(power_iters=iters, finder_dtype=dtype)
                cells = [f"{relative([rule(d, factors=f, **settings) for d in matrices], exact[rule]):.1e}"
                         for rule in exact for f in ("auto", "randomized")]
                print(f"| {count} | {iters} | {dtype} | " + " | ".join(cells) + " |", flush=True)


def dare_rows(workers: list[int], seed: int, draws: int, drop_rate: float = 0.1) -> None:
    print(f"| R | entries kept (expected {1 - drop_rate:.2f}) | mean z² over {draws} seeds (expected 1) "
          "| \\|z\\| > 3 (expected 0.27%) |")
    print("|---|---|---|---|")
    for count in workers:
        deltas = real_deltas(count, 2, seed)
        kept = total = 0
        z_squares = []
        for name, ds in deltas.items():
            numel = ds[0].numel()
            for worker in range(count):
                key = rules.mask_key(seed, worker, 0, name)
                kept += int(rules.keep_mask(key, 0, numel, 1 - drop_rate, torch.device("cpu")).sum())
                total += numel
            stacked = torch.stack(ds).double()
            average = sum(merge_functions.dare(stacked.unbind(0), drop_rate, seed=s) for s in range(draws)) / draws
            # Each entry's estimator has variance Σ_r Δ_r² · p/(1−p) / R²; its mean over the draws 1/draws of it.
            variance = stacked.pow(2).sum(0) * drop_rate / (1 - drop_rate) / count**2 / draws
            spread = variance > 0
            z_squares.append(((average - stacked.mean(0)).pow(2)[spread] / variance[spread]).flatten())
        z2 = torch.cat(z_squares)
        print(f"| {count} | {kept / total:.5f} | {float(z2.mean()):.3f} | {float((z2 > 9).double().mean()):.2%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8,16", help="values of R, comma-separated")
    parser.add_argument("--power-iters", default=str(merge_config.MergeConfig.power_iters),
                        help="the range finder's subspace iterations (merge.power_iters), comma-separated")
    parser.add_argument("--finder-dtypes", default="bfloat16,float32",
                        help="precisions of the early iterations (merge.finder_dtype), comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draws", type=int, default=40, help="DARE: seeds whose merges are averaged (0: no DARE table)")
    args = parser.parse_args()
    workers = [int(r) for r in args.workers.split(",")]
    factor_rows(workers, [int(q) for q in args.power_iters.split(",")], args.finder_dtypes.split(","), args.seed)
    if args.draws:
        print()
        dare_rows(workers, args.seed, args.draws)


if __name__ == "__main__":
    main()
