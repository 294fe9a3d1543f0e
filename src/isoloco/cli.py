"""Command line: `isoloco train | launch | data prepare | export`.

User errors (bad keys or values, bad data, an occupied output directory) print one line
`error: ...` and exit with status 2 before any work starts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

from isoloco.checkpoint import CheckpointError, write_json_atomic, write_text_atomic
from isoloco.config import TrainConfig, describe_keys, from_dict, parse_overrides, preset_names, resolve, to_dict
from isoloco.configbase import ConfigError
from isoloco.data import DataError
from isoloco.data.cli import add_data_commands
from isoloco.distributed import CollectiveError, Distributed, process_group
from isoloco.launch import add_launch_command
from isoloco.merge import NonFiniteDeltaError
from isoloco.stop import StopRequested
from isoloco.sweep import add_sweep_commands
from isoloco.watchdog import EXIT_PEER_LOST, PeerLostError

USER_ERRORS = (ConfigError, DataError, CheckpointError)
CONFIG_FILE = "config.yaml"
RUN_TOKENIZER = "tokenizer.json"


class UsageError(ValueError):
    """A command-line mistake that is not about a config value."""


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """The optional preset (first item without '=') and the key=value overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _check_out_dir(out: Path, force: bool) -> None:
    """Refuse an occupied run directory unless --force, and never delete a foreign one."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UsageError(f"{out} already exists and is not empty: pass --resume {out} to continue that run, "
                             "--force to overwrite it, or choose another --out")
        if not (out / CONFIG_FILE).exists():
            raise UsageError(f"{out} is not an isoloco run directory (no {CONFIG_FILE}); refusing to delete it "
                             "even with --force; choose another --out")


def _prepare_out_dir(out: Path, force: bool) -> None:
    _check_out_dir(out, force)
    if out.is_dir() and any(out.iterdir()):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _load_run_config(run_dir: Path) -> TrainConfig:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILE} there; is it a run directory made by isoloco train?")
    return from_dict(yaml.safe_load(path.read_text()))


def cmd_train(args: argparse.Namespace) -> int:
    say = (lambda _msg: None) if args.quiet else print
    if args.resume:
        if args.items:
            raise UsageError("--resume continues a run with its saved config; drop the preset and key=value "
                             "arguments (start a new run with --out to change them)")
        out = Path(args.resume)
        cfg = _load_run_config(out)
    else:
        preset, items = _split_args(args.items)
        cfg = resolve(preset if preset is not None else ("quick" if not items else None), parse_overrides(items))
        out = Path(args.out) if args.out else Path("runs") / f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}"
        _check_out_dir(out, args.force)
    # Under torchrun every process runs this; one process alone joins nothing.
    with process_group(cfg):
        return _train(args, cfg, out, say)


def _train(args: argparse.Namespace, cfg: TrainConfig, out: Path, say) -> int:
    from isoloco.trainer import Trainer  # heavy imports only once arguments are known good

    dist = Distributed(cfg)
    say = say if dist.is_main else (lambda _msg: None)  # rank 0 speaks and writes the run's files
    out = dist.broadcast_object(out)  # a default name holds a timestamp: take rank 0's
    # Building the trainer loads and checks the data and the device: fail before touching `out`.
    trainer = Trainer(cfg, out, dist=dist, progress=not args.quiet and dist.is_main, say=say)
    dist.barrier()  # every process checked `out` before rank 0 changes it
    if dist.is_main:
        if not args.resume:
            _prepare_out_dir(out, args.force)
            write_text_atomic(out / CONFIG_FILE, yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if not (out / RUN_TOKENIZER).exists():
            # The run directory carries its tokenizer, so `isoloco export` needs nothing else.
            write_text_atomic(out / RUN_TOKENIZER, Path(trainer.data.tokenizer_path).read_text())
    dist.barrier()
    processes = f" x {dist.world_size} processes" if dist.world_size > 1 else ""
    say(f"{cfg.method} ({cfg.algorithm}): model {cfg.model} with {trainer.num_params:,} parameters, "
        f"R={cfg.num_workers}, H={cfg.inner_steps}, {cfg.steps} steps on {trainer.device}{processes}")
    try:
        summary = trainer.run(resume=bool(args.resume))
    except StopRequested as stopped:
        if dist.is_main:
            print(f"{stopped}; continue with: isoloco train --resume {out}", file=sys.stderr)
        return 128 + stopped.signum
    if dist.is_main:
        summary["unigram_baseline"] = trainer.data.unigram_loss
        write_json_atomic(out / "summary.json", summary)
        print(f"results in {out}")
        print(f"final validation loss {summary['final_val_loss']:.4f} "
              f"(unigram baseline {summary['unigram_baseline']:.4f})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from isoloco.export import export

    export(Path(args.checkpoint), Path(args.out_dir))
    print(f"wrote a Hugging Face model directory to {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isoloco", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train", help="train a model (dp baseline or DiLoCo with a merge rule)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="isoloco train [PRESET|FILE.yaml] [key=value ...] [--out DIR | --resume DIR] [--force] [--quiet]",
        description="With no arguments, runs the `quick` preset. Presets: " + ", ".join(preset_names()) + ".",
        epilog="keys (key = default {allowed}):\n" + describe_keys() + "\n\n`data=X` is short for `data.source=X`, "
               "`gpus_per_worker=G` for `dist.gpus_per_worker=G`.")
    train.add_argument("items", nargs="*", help=argparse.SUPPRESS)
    train.add_argument("--out", help="run directory (default runs/METHOD-TIMESTAMP)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    train.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    train.add_argument("--quiet", action="store_true", help="no progress bar or start-up lines")
    train.set_defaults(func=cmd_train)

    add_data_commands(commands)
    add_launch_command(commands)
    add_sweep_commands(commands)

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    export.add_argument("out_dir", help="directory for save_pretrained output")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (*USER_ERRORS, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (PeerLostError, CollectiveError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_PEER_LOST
    except (NonFiniteDeltaError, FloatingPointError) as err:
        print(f"error: {err}; the last checkpoint is intact", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
