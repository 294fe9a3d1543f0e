"""IsoLoCo under torchft: 2 replica groups on one CPU machine, gloo, a lighthouse on 127.0.0.1.

    python examples/torchft_isoloco.py                                # IsoLoCo, tiny model, embedded corpus
    python examples/torchft_isoloco.py method=isoloco_fast            # the fast Newton-Schulz mode
    python examples/torchft_isoloco.py outer.iso_placement=update     # Iso-C after the momentum
    python examples/torchft_isoloco.py method=diloco --fragments 2    # Streaming DiLoCo, 2 fragments

Items are isoloco's `key=value` overrides on top of the quick preset (and of this example's
defaults: 2 workers, 60 steps, H = 20). The script starts the lighthouse, then one process per
replica group; each trains isoloco's worker r under torchft's DiLoCo with isoloco's outer
optimizer, and this script prints every round's training loss and where the groups ended.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

import torch

from isoloco.config import TrainConfig, parse_overrides, resolve
from isoloco.errors import ConfigError
from isoloco.data import load_token_data
from isoloco.torchft.replica import GroupRun, check_group_config, run_replica_group, start_lighthouse

DEFAULTS = {"workers": 2, "steps": 60, "inner_steps": 20, "checkpoint_every": 0}


def group_main(cfg: TrainConfig, replica: int, lighthouse: str, fragments: int, out: Path) -> None:
    """One replica group's process: train, then leave the result in `out` for the parent."""
    torch.set_num_threads(1)  # the groups share the machine's cores
    run_replica_group(cfg, replica, lighthouse, fragments=fragments).save(out / f"group-{replica}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", help="isoloco key=value overrides (e.g. method=isoloco_fast)")
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments (default 1)")
    args = parser.parse_args(argv)
    try:
        cfg = resolve("quick", {**DEFAULTS, **parse_overrides(args.items)})
        for replica in range(cfg.workers):
            check_group_config(cfg, replica, args.fragments)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    data = load_token_data(cfg.data)  # prepares the corpus once, before the groups read it
    print(f"{cfg.method}: {cfg.workers} replica groups, {cfg.train_steps} steps, H = {cfg.inner_steps}, "
          f"{args.fragments} fragment(s), outer lr {cfg.outer.lr}, merge.ortho={cfg.merge.ortho}, "
          f"outer.iso_placement={cfg.outer.iso_placement}")
    server, address = start_lighthouse(min_replicas=cfg.workers)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        groups = [context.Process(target=group_main, args=(cfg, r, address, args.fragments, Path(out)))
                  for r in range(cfg.workers)]
        try:
            for group in groups:
                group.start()
            for group in groups:
                group.join()
        finally:
            server.shutdown()
        failed = [r for r, group in enumerate(groups) if group.exitcode != 0]
        if failed:
            print(f"error: replica group(s) {failed} failed (exit codes "
                  f"{[groups[r].exitcode for r in failed]}); their output is above", file=sys.stderr)
            return 1
        runs = [GroupRun.load(Path(out) / f"group-{r}") for r in range(cfg.workers)]
    # A round torchft retried (a failed commit) repeats its steps: its last attempt counts.
    trained = [dict(zip(run.steps, run.losses)) for run in runs]
    for start in range(0, cfg.train_steps, cfg.inner_steps):
        losses = [sum(loss[s] for s in range(start, start + cfg.inner_steps)) / cfg.inner_steps for loss in trained]
        print(f"round {start // cfg.inner_steps}: train loss " + ", ".join(f"group {r}: {loss:.3f}"
                                                                          for r, loss in enumerate(losses)))
    gap = max((a - b).abs().max().item() for a, b in zip(runs[0].params.values(), runs[1].params.values()))
    # With several fragments only the last one was synchronised at the last step; the others
    # have trained locally since their own last synchronisation.
    which = "final parameters" if args.fragments == 1 else "final parameters (only the last fragment just synced)"
    print(f"outer steps committed: {[run.outer_steps for run in runs]}; largest difference between the groups' "
          f"{which}: {gap:.3g}; unigram baseline of the corpus: {data.unigram_loss:.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
