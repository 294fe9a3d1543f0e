"""Command line: `isoloco train | launch | sweep | report | data | export`.

User errors (bad keys or values, bad data, an occupied output directory) print one line
`error: ...` (one per problem) and exit with status 2 before any work starts; `main` reports
every error a user can act on this way (`isoloco.errors` has the exit status of each kind).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from isoloco import __version__, logs
from isoloco.checkpoint import latest_to_resume, write_json_atomic, write_text_atomic
from isoloco.cliargs import add_items, parse_late
from isoloco.comm import played_islands
from isoloco.config import (BASE_KEY, DEFAULT_PRESET, describe_keys, from_dict, parse_overrides, preset_names, preset_said,
                            resolve, split_items, to_dict)
from isoloco.config_checks import excluded_matrices, matrix_names, run_warnings
from isoloco.train_config import TrainConfig
from isoloco.data.cli import add_data_commands
from isoloco.distributed import Distributed, launched_world_size, process_group
from isoloco.errors import EXIT_INTERRUPTED, REPORTED, UsageError, describe
from isoloco.fileutil import output_dir_problem
from isoloco.launch import add_launch_command
from isoloco.stop import Interrupted, SecondSignal, StopAtOnce, StopRequested
from isoloco.layout import ProcessLayout
from isoloco.sweep import add_sweep_commands
from isoloco.rundir import CHECKPOINT_DIR, CONFIG_FILE, SUMMARY_FILE, TOKENIZER_FILE

logger = logging.getLogger(__name__)


def _check_out_dir(out: Path, force: bool) -> None:
    """Refuse an occupied run directory unless --force, never delete a foreign one, and refuse
    one that cannot be made or written."""
    problem = output_dir_problem(out)
    if problem:
        raise UsageError(f"--out {out} {problem}; choose another --out")
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
    if not run_dir.is_dir():
        raise UsageError(f"--resume {run_dir}: no such directory; name the run directory to continue "
                         "(the --out of the run)")
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILE} there; is it a run directory made by isoloco train?")
    return from_dict(yaml.safe_load(path.read_text()))


def _resolve_items(items: list[str]) -> TrainConfig:
    preset, overrides = split_items(items)
    return resolve(preset or DEFAULT_PRESET, parse_overrides(overrides))


def settle_run(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """The config and run directory of `isoloco train ARGS`; every refusal that needs no data
    is raised here, before any work (and, for `isoloco launch`, before any process starts)."""
    if args.resume:
        if args.items:
            raise UsageError("--resume continues a run with its saved config; drop the preset and key=value "
                             "arguments (start a new run with --out to change them)")
        if args.out:
            raise UsageError(f"--out {args.out} and --resume {args.resume} both name the run directory: a resumed "
                             "run continues in its own; drop --out")
        if args.force:
            raise UsageError(f"--force overwrites nothing with --resume {args.resume}: a resumed run continues from "
                             f"its last checkpoint; drop --force (to start over, use --out {args.resume} --force)")
        out = Path(args.resume)
        cfg = _load_run_config(out)
    else:
        cfg = _resolve_items(args.items)
        out = Path(args.out) if args.out else Path("runs") / f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}"
        _check_out_dir(out, args.force)
    cfg.log.check_installed()
    return cfg, out


def _train_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help, with the values of the given preset and method, and exit")
    parser.add_argument("--out", help="run directory (default runs/METHOD-TIMESTAMP)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    parser.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or start-up lines")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the run directory and the resolved config (what config.yaml will hold); "
                             "train nothing")


TRAIN_USAGE = ("isoloco train [PRESET|FILE.yaml] [key=value ...] [--out DIR | --resume DIR] [--force] [--quiet] "
               "[--dry-run]")


def _parse_train(args: argparse.Namespace) -> argparse.Namespace:
    """Options anywhere among the preset and key=value items, as users type them."""
    return parse_late(args, _train_options, prog="isoloco train", usage=TRAIN_USAGE, add_help=False)


def train_help(parser: argparse.ArgumentParser, cfg: TrainConfig, items: list[str]) -> str:
    shown = f"{preset_said(split_items(items)[0])} with method {cfg.method}"
    parser.epilog = (
        f"keys (key = value for {shown} {{allowed}}):\n" + describe_keys(cfg) + "\n\n"
        "Learning rates: each method sets the paper's values for its 178M model; the quick and repro-cpu "
        "presets replace them with values tuned for the tiny model (inner.lr 0.016; outer.lr 1.2 for isoloco). "
        "`isoloco train PRESET method=M --help` shows what a run would use.\n"
        "`data=X` is short for `data.source=X`, `gpus_per_worker=G` for `dist.gpus_per_worker=G`, `islands=P` "
        "for `dist.islands=P`.")
    return parser.format_help()


def cmd_train(args: argparse.Namespace) -> int:
    args = _parse_train(args)
    logs.setup(quiet=args.quiet)
    if args.help:
        print(train_help(args.parser, _load_run_config(Path(args.resume)) if args.resume
                         else _resolve_items(args.items), args.items))
        return 0
    cfg, out = settle_run(args)
    if args.dry_run:
        _print_dry_run(cfg, out, bool(args.resume))
        return 0
    # Until its first round, a run has nothing to finish or checkpoint: a signal stops it at once,
    # saying so (then trainer.run's GracefulStop finishes the round a signal arrives in).
    with StopAtOnce() as starting:
        try:
            # Under torchrun every process runs this; one process alone joins nothing.
            with process_group(cfg):
                return _train(args, cfg, out, starting)
        except Interrupted as stopped:
            logger.log(logs.NOTICE, "stopped by %s during start-up, before training began: %s",
                       signal.Signals(stopped.signum).name, _after_startup_stop(args, cfg, out))
            return 128 + stopped.signum


def _after_startup_stop(args: argparse.Namespace, cfg: TrainConfig, out: Path) -> str:
    """What a run stopped before its first round left, and the command that starts it again."""
    resume = _resume_command(out, launched_world_size())
    if args.resume:
        return f"nothing was trained since its last checkpoint; continue with: {resume}"
    config = out / CONFIG_FILE
    if config.is_file() and yaml.safe_load(config.read_text()) == to_dict(cfg):
        return f"{out} holds its config and nothing trained; continue with: {resume}"
    return "nothing was trained or written; run the same command to start it"


def _print_dry_run(cfg: TrainConfig, out: Path, resume: bool, layout: ProcessLayout | None = None) -> None:
    """What `--dry-run` prints: the run directory, the layout (under `isoloco launch`) and the
    resolved config, as config.yaml will hold it."""
    print(f"# isoloco train would {'continue' if resume else 'write'} {out}")
    if layout is not None:
        print(f"# layout: {ProcessLayout.in_words(layout.describe())}")
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


def preflight_launch(command: list[str], world_size: int) -> int | None:
    """For `isoloco launch`, before torchrun starts `world_size` processes: raise what `isoloco
    COMMAND` would refuse on them, and answer here what needs no processes (`--help`,
    `--dry-run`), returning its exit status; None when the processes must run it."""
    args = build_parser().parse_args(command)
    if getattr(args, "func", None) is not cmd_train:
        return None
    from isoloco.trainer import check_resume_layout, load_run_data

    train_args = _parse_train(args)
    if train_args.help:
        return cmd_train(args)
    cfg, out = settle_run(train_args)
    layout = ProcessLayout.for_run(cfg, world_size, rank=0)
    if train_args.dry_run:
        _print_dry_run(cfg, out, bool(train_args.resume), layout)
        return 0
    if train_args.resume:
        # The checkpoint rank 0 will resume from: the newest that verifies.
        found = latest_to_resume(out / CHECKPOINT_DIR)
        if found is not None:
            check_resume_layout(*found, layout.describe())
    load_run_data(cfg)
    return None


def _train(args: argparse.Namespace, cfg: TrainConfig, out: Path, starting: StopAtOnce) -> int:
    from isoloco.trainer import Trainer  # heavy imports only once arguments are known good

    dist = Distributed(cfg)
    out = dist.broadcast_object(out)  # a default name holds a timestamp: take rank 0's
    if dist.is_main:
        for line in run_warnings(cfg, dist.layout.islands):
            logger.warning(line)
    # Building the trainer loads and checks the data and the device: fail before touching `out`.
    trainer = Trainer(cfg, out, dist=dist, progress=not args.quiet and dist.is_main)
    dist.barrier()  # every process checked `out` before rank 0 changes it
    if dist.is_main:  # rank 0 writes the run's files
        if not args.resume:
            _prepare_out_dir(out, args.force)
            write_text_atomic(out / CONFIG_FILE, yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if not (out / TOKENIZER_FILE).exists():
            # The run directory carries its tokenizer, so `isoloco export` needs nothing else.
            write_text_atomic(out / TOKENIZER_FILE, Path(trainer.data.tokenizer_path).read_text())
    dist.barrier()
    processes = f" x {dist.world_size} processes" if dist.world_size > 1 else ""
    source = out / CONFIG_FILE if args.resume else preset_said(split_items(args.items)[0])
    logger.info("%s (%s): model %s with %s parameters, R=%d, H=%d, %d steps on %s%s, from %s", cfg.method,
                _recipe(cfg), cfg.model, f"{trainer.num_params:,}", cfg.num_workers, cfg.inner_steps, cfg.steps,
                trainer.device, processes, source)
    try:
        summary = trainer.run(resume=bool(args.resume))
    except StopRequested as stopped:
        logger.log(logs.NOTICE, "%s; continue with: %s", stopped, _resume_command(out, dist.world_size))
        return 128 + stopped.signum
    except SecondSignal as stopped:
        logger.log(logs.NOTICE, "stopped at once by a second %s, losing the work since the last checkpoint (or "
                   "the start, before the first); continue with: %s", stopped, _resume_command(out, dist.world_size))
        return EXIT_INTERRUPTED
    if dist.is_main:
        summary["unigram_baseline"] = trainer.data.unigram_loss
        write_json_atomic(out / SUMMARY_FILE, summary)
        print(f"results in {out}")
        print(final_line(summary, cfg))
    if starting.requested:  # kept since the loop ended (`StopAtOnce`): there was nothing left to stop
        logger.log(logs.NOTICE, "%s arrived as the run ended, after its final checkpoint: it is complete (nothing "
                   "to resume)", signal.Signals(starting.signum).name)
    return 0


def final_line(summary: dict[str, Any], cfg: TrainConfig) -> str:
    """The last line of a run: its loss beside the unigram baseline, its slow link beside
    float32's, the synchronisation seconds it waited for, and a divergence again if it had one."""
    parts = [f"final validation loss {summary['final_val_loss']:.4f} (unigram baseline "
             f"{summary['unigram_baseline']:.4f})"]
    if cfg.algorithm == "diloco":
        parts.append(_slow_link_said(summary, cfg))
    if summary["processes"] > 1:  # what crossed in all, measured: the simulator has no islands to cross
        parts.append(f"{summary['cross_island_wire_bytes']:,} bytes across islands")
    parts.append(f"{summary['exposed_sync_seconds']:.2f} s of synchronisation exposed")
    if "above_unigram_baseline_at_step" in summary:
        parts.append(f"WARNING: above the unigram baseline from step {summary['above_unigram_baseline_at_step']} "
                     f"(validation loss {summary['above_unigram_baseline_val_loss']:.4f} there)")
    return "; ".join(parts)


def _slow_link_said(summary: dict[str, Any], cfg: TrainConfig) -> str:
    """The slow link's bytes per process per round beside float32's, measured or modelled."""
    if "slow_link_bytes_per_round" not in summary:
        return f"slow-link bytes not modelled for merge.rule={cfg.merge.rule} (its collectives are not one sum)"
    fewer = summary["slow_link_fewer_than_float32"]
    if fewer is None:
        return "no slow link (one island)"
    source = summary["slow_link_bytes_source"]
    islands = played_islands(cfg.workers, cfg.dist.islands)
    each = "one worker" if islands == cfg.workers else f"{cfg.workers // islands} workers"
    where = f"{islands} islands of {each} each" if source == "modelled" else "this layout"
    sent, float32 = summary["slow_link_bytes_per_round"], summary["slow_link_float32_bytes_per_round"]
    saving = "no fewer than float32 (uncompressed)" if sent == float32 else f"{fewer:.1f}× fewer than float32"
    return (f"slow link {sent:,.0f} bytes per process per round ({source} for {where}; float32 {float32:,.0f}), "
            f"{saving}")


def _resume_command(out: Path, world_size: int) -> str:
    """The command that continues the run in `out` on the same number of processes."""
    if world_size == 1:
        return f"isoloco train --resume {out}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node == world_size:
        return f"isoloco launch --nproc {per_node} -- train --resume {out}"
    return (f"isoloco launch --nproc {per_node} --nnodes {world_size // per_node} --node-rank I --master-addr HOST "
            f"-- train --resume {out} on every machine I")


def _recipe(cfg: TrainConfig) -> str:
    """What a method does, in the banner: the merge, the optimizers and their learning rates,
    and every setting that changes the synchronisation or the workers (`_sync_settings`)."""
    inner = f"inner {cfg.inner.optimizer} lr {cfg.inner.lr:g}"
    if cfg.algorithm == "dp":
        return f"data-parallel baseline, {inner}"
    return ", ".join([f"merge {cfg.merge.rule}", f"outer {cfg.outer.optimizer} lr {cfg.outer.lr:g}", inner,
                      *_sync_settings(cfg)])


def _sync_settings(cfg: TrainConfig) -> list[str]:
    """The settings that change what crosses the slow link, when it lands, or what the workers
    bring to it, each as it is typed, with what it means where the value alone does not say."""
    merge, faults = cfg.merge, cfg.faults
    said = []
    if merge.compress == "lowrank":
        said.append(f"merge.compress=lowrank (low rank {merge.compress_rank})")
    elif merge.compress == "topk":
        said.append(f"merge.compress=topk (top-k: density {merge.compress_density:g} of every "
                    f"{merge.compress_chunk} entries)")
    if merge.compress_exclude:
        whole, matrices = len(excluded_matrices(cfg)), len(matrix_names(cfg.model))
        said.append(f"merge.compress_exclude={','.join(merge.compress_exclude)} ({whole} of {matrices} matrices "
                    "whole)")
    if cfg.outer.transport == "sparseloco":
        tile, outer = cfg.outer.sparse_tile, cfg.outer
        said.append(f"outer.transport=sparseloco (SparseLoCo: top {outer.sparse_topk} of every {tile}×{tile} tile, "
                    f"2-bit values, accumulator decay {outer.sparse_decay:g})")
    if merge.quantize != "none":
        said.append(f"merge.quantize={merge.quantize}")
    if merge.error_feedback:
        said.append("merge.error_feedback=true")
    if cfg.outer.overlap_steps:
        said.append(f"outer.overlap_steps={cfg.outer.overlap_steps} (α {cfg.outer.overlap_alpha:g})")
    if cfg.worker_speeds:
        said.append(f"worker_speeds={','.join(f'{speed:g}' for speed in cfg.worker_speeds)}")
    if merge.weighting != "equal":
        said.append(f"merge.weighting={merge.weighting}")
    if faults.late_rate:
        fate = ("dropped" if faults.late == "drop"
                else f"carried, ×{faults.stale_weight:g} per round waited")
        said.append(f"faults.late_rate={faults.late_rate:g} (late deltas {fate})")
    return said


def cmd_export(args: argparse.Namespace) -> int:
    from isoloco.export import export

    export(Path(args.checkpoint), Path(args.out_dir), args.force)
    print(f"wrote a Hugging Face model directory to {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isoloco", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"isoloco {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train", help="train a model (dp baseline or DiLoCo with a merge rule)", add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter, usage=TRAIN_USAGE,
        description=f"With no preset, runs the `{DEFAULT_PRESET}` preset; a YAML file of keys and key=value items "
                    f"apply on top of it (a file may name another preset to start from with `{BASE_KEY}: NAME`). "
                    "Presets: " + ", ".join(preset_names()) + ".")
    _train_options(train)
    add_items(train)
    train.set_defaults(func=cmd_train, parser=train)

    add_data_commands(commands)
    add_launch_command(commands, preflight_launch)
    add_sweep_commands(commands)

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    export.add_argument("out_dir", help="directory for save_pretrained output")
    export.add_argument("--force", action="store_true",
                        help="write into OUT_DIR although it holds files (files of the same names are replaced)")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its errors become `error:` lines and an exit status (`isoloco.errors`),
    any other exception is a bug and keeps its traceback."""
    logs.setup()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except REPORTED as error:
        lines, status = describe(error, logs.job_rank())
        for line in lines:
            logger.error(line)
        return status
    except KeyboardInterrupt:
        return logs.interrupted()
