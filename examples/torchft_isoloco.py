"""IsoLoCo under torchft: replica groups on one or several CPU machines, gloo, a torchft lighthouse.

    python examples/torchft_isoloco.py                                # IsoLoCo, tiny model, embedded corpus
    python examples/torchft_isoloco.py method=isoloco_fast            # the fast Newton-Schulz mode
    python examples/torchft_isoloco.py method=ties                    # any rule: dare, ties, tsv, isocts, ...
    python examples/torchft_isoloco.py outer.iso_placement=update     # Iso-C after the momentum
    python examples/torchft_isoloco.py method=diloco --fragments 2    # Streaming DiLoCo, 2 fragments
    python examples/torchft_isoloco.py --fragments 2 --sync-delay 5   # each all-reduce overlaps 5 steps
    python examples/torchft_isoloco.py --torchft-logs                 # with torchft's own [INFO] lines

    # two machines: A (10.0.0.1) runs the lighthouse and group 0, B (10.0.0.2) group 1
    python examples/torchft_isoloco.py --groups 0 --host 10.0.0.1 --lighthouse-bind 10.0.0.1:29510   # on A
    python examples/torchft_isoloco.py --groups 1 --host 10.0.0.2 --lighthouse http://10.0.0.1:29510 # on B

Items are isoloco's `key=value` overrides on top of the quick preset (and of this example's
defaults: 2 workers, 60 steps, H = 20). The script starts the lighthouse (unless given one),
then one process per replica group it runs; each trains isoloco's worker r under torchft's
DiLoCo with isoloco's outer optimizer (and, for DARE, TIES, TSV and Iso-CTS, isoloco's merge
over torchft's quorum), and the script prints every round's training loss of its groups,
where they ended and each one's validation loss (isoloco's evaluation, as `isoloco train`
reports it). A bad option is refused in one line, exit status 2, before anything starts,
and so is a key torchft does not carry (`isoloco.torchft.quorum.UNCARRIED`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from isoloco.config import parse_overrides, resolve
from isoloco.train_config import TrainConfig
from isoloco.errors import ConfigError
from isoloco.data import load_token_data
from isoloco.model import MODEL_PRESETS
from isoloco.torchft.quorum import refuse_uncarried
from isoloco.trainer import Trainer

if TYPE_CHECKING:
    from isoloco.torchft.replica import GroupRun

DEFAULTS = {"workers": 2, "steps": 60, "inner_steps": 20, "checkpoint_every": 0}

def check_example_config(cfg: TrainConfig, fragments: int) -> None:
    """Refuse, in one line, what this example would silently not do, before torchft starts."""
    refuse_uncarried(cfg)
    layers = MODEL_PRESETS[cfg.model].layers
    if not 1 <= fragments <= layers:
        raise ConfigError(f"--fragments {fragments} is not allowed: choose 1 to {layers} (a fragment is a block of "
                          f"model={cfg.model}'s {layers} layers)")


def torchft_replica(show_logs: bool) -> ModuleType:
    """`isoloco.torchft.replica`, imported only now: torchft's Rust side reads RUST_LOG once, when
    torchft is imported, so without `show_logs` its [INFO] lines are quieted first (the groups'
    processes inherit the setting), and so are its Python warnings."""
    if not show_logs:
        os.environ["RUST_LOG"] = "error"
        logging.getLogger("torchft").setLevel(logging.ERROR)
    from isoloco.torchft import replica

    return replica


def group_main(cfg: TrainConfig, replica: int, lighthouse: str, args: argparse.Namespace, out: Path) -> None:
    """One replica group's process: train, then leave the result in `out` for the parent."""
    torch.set_num_threads(1)  # the groups share the machine's cores
    run = torchft_replica(args.torchft_logs).run_replica_group(cfg, replica, lighthouse, fragments=args.fragments,
                                                               sync_delay=args.sync_delay, host=args.host)
    run.save(out / f"group-{replica}")


def local_groups(text: str | None, workers: int) -> list[int]:
    """The replica groups named by --groups (all of them when None)."""
    if text is None:
        return list(range(workers))
    try:
        groups = sorted({int(item) for item in text.split(",")})
    except ValueError:
        raise ConfigError(f"--groups {text} is not a comma-separated list of group numbers, e.g. 0 or 0,1") from None
    if not groups or not all(0 <= g < workers for g in groups):
        raise ConfigError(f"--groups {text} is not allowed: choose among 0 to {workers - 1} (workers={workers})")
    return groups


def digest(params: dict[str, torch.Tensor]) -> str:
    """A short fingerprint of a group's parameters: equal on every machine when the groups agree."""
    sha = hashlib.sha256()
    for name in sorted(params):
        sha.update(params[name].contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", help="isoloco key=value overrides (e.g. method=isoloco_fast)")
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments (default 1)")
    parser.add_argument("--sync-delay", type=int, default=0,
                        help="inner steps each fragment's all-reduce overlaps (torchft's fragment_sync_delay; "
                             "default 0)")
    parser.add_argument("--groups", help="the replica groups this machine runs, e.g. 0 or 0,1 (default: all)")
    parser.add_argument("--host", help="this machine's address, reachable from the other machines (default 127.0.0.1)")
    lighthouse = parser.add_mutually_exclusive_group()
    lighthouse.add_argument("--lighthouse", metavar="URL",
                            help="join this running lighthouse, e.g. http://10.0.0.1:29510 (default: start one)")
    lighthouse.add_argument("--lighthouse-bind", metavar="HOST:PORT",
                            help="where the lighthouse started here listens (default 127.0.0.1, a free port)")
    parser.add_argument("--torchft-logs", action="store_true",
                        help="show torchft's own log lines (its lighthouse's and managers' [INFO] lines, its "
                             "warnings); by default only its errors")
    args = parser.parse_args(argv)
    try:
        cfg = resolve("quick", {**DEFAULTS, **parse_overrides(args.items)})
        check_example_config(cfg, args.fragments)
        groups = local_groups(args.groups, cfg.workers)
        replica_module = torchft_replica(args.torchft_logs)
        args.host = args.host or replica_module.LOCALHOST
        for replica in groups:
            replica_module.check_group_config(cfg, replica, args.fragments, args.sync_delay)
        replica_module.check_machine_groups(cfg, groups)
        server, address = (None, args.lighthouse) if args.lighthouse else replica_module.start_lighthouse(
            min_replicas=cfg.workers, bind=args.lighthouse_bind or f"{replica_module.LOCALHOST}:0")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        data = load_token_data(cfg.data)  # prepares the corpus once, before the groups read it
        iso = (f" (merge.ortho={cfg.merge.ortho}, outer.iso_placement={cfg.outer.iso_placement})"
               if cfg.merge.rule == "iso_c" else "")
        print(f"{cfg.method}: {cfg.workers} replica groups ({', '.join(map(str, groups))} here), "
              f"{cfg.train_steps} steps, H = {cfg.inner_steps}, {args.fragments} fragment(s), sync delay "
              f"{args.sync_delay}, merge.rule={cfg.merge.rule}{iso}, outer lr {cfg.outer.lr}; lighthouse {address}",
              flush=True)
        runs = run_groups(cfg, groups, address, args)
    finally:
        if server is not None:
            server.shutdown()
    if runs is None:
        return 1
    # A round torchft retried (a failed commit) repeats its steps: its last attempt counts.
    trained = {r: dict(zip(run.steps, run.losses)) for r, run in runs.items()}
    for start in range(0, cfg.train_steps, cfg.inner_steps):
        losses = {r: sum(loss[s] for s in range(start, start + cfg.inner_steps)) / cfg.inner_steps
                  for r, loss in trained.items()}
        print(f"round {start // cfg.inner_steps}: train loss " + ", ".join(f"group {r}: {loss:.3f}"
                                                                          for r, loss in losses.items()))
    print(f"outer steps committed: {[run.outer_steps for run in runs.values()]}; final parameters' sha256: "
          + ", ".join(f"group {r}: {digest(run.params)}" for r, run in runs.items()))
    if len(runs) > 1:
        first, *others = runs.values()
        gap = max((a - b).abs().max().item() for other in others
                  for a, b in zip(first.params.values(), other.params.values()))
        # With several fragments only the last one was synchronised at the last step; the others
        # have trained locally since their own last synchronisation.
        which = "final parameters" if args.fragments == 1 else "final parameters (only the last fragment just synced)"
        print(f"largest difference between the groups' {which}: {gap:.3g}")
    scored = validation_losses(cfg, runs)
    print("validation loss: " + ", ".join(f"group {r}: {loss:.4f}" for r, loss in scored.items())
          + f" (unigram baseline of the corpus: {data.unigram_loss:.4f})")
    return 0


def validation_losses(cfg: TrainConfig, runs: dict[int, GroupRun]) -> dict[int, float]:
    """Each group's final parameters scored by isoloco's own evaluation (`Trainer.evaluate`:
    the run's held-out windows, token-weighted), so it reads as `isoloco train`'s."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, Path(out), progress=False)
        losses = {}
        for replica, run in runs.items():
            with torch.no_grad():
                for (name, _), param in zip(trainer.named_params, trainer.global_params, strict=True):
                    param.copy_(run.params[name])
            losses[replica] = trainer.evaluate()
        return losses


def run_groups(cfg: TrainConfig, groups: list[int], lighthouse: str,
               args: argparse.Namespace) -> dict[int, GroupRun] | None:
    """Run each group in its own process; their results, or None (saying so) if any failed."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        processes = {r: context.Process(target=group_main, args=(cfg, r, lighthouse, args, Path(out)))
                     for r in groups}
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.join()
        failed = {r: p.exitcode for r, p in processes.items() if p.exitcode != 0}
        if failed:
            print(f"error: replica group(s) {sorted(failed)} failed (exit codes {list(failed.values())}); their "
                  "output is above", file=sys.stderr)
            return None
        return {r: torchft_replica(args.torchft_logs).GroupRun.load(Path(out) / f"group-{r}") for r in groups}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
