"""`isoloco sweep`: a grid of training runs, one directory each, that resumes where it stopped.

A sweep is methods × workers (R) × inner steps (H) × seeds, plus `key=value` overrides that
apply to every run. The grid comes from a preset's `sweep:` section and/or the command-line
flags (a flag replaces that axis of the preset). Every grid point is validated before the
first run starts, so a typo costs nothing.

Each run is its own `isoloco train` process (no shell): a crash of one run never takes the
sweep down, each directory is exactly what `isoloco train` makes (so `--resume` and
`isoloco export` work on it), and parallel jobs share nothing but the output folder.

The data-parallel baseline does not depend on R, and on H only through when it evaluates,
so it runs once per seed (with the smallest H, for the finest validation curve) and is the
reference for every R and H.

Stopping and resuming: a run directory with `summary.json` is finished and skipped; one
without is continued with `isoloco train --resume` (which starts over when no checkpoint was
written yet). A run is claimed by an exclusive lock on `OUT/logs/NAME.lock` that its
training process inherits, so when a sweep is killed outright its surviving children keep
their locks until they end, and a rerun waits for them instead of training one directory
twice. SIGINT/SIGTERM are forwarded once to the running children, which checkpoint at their
next synchronisation and exit; a second signal stops them at once.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from isoloco import report
from isoloco.cliargs import add_items, parse_late
from isoloco.config import (DEFAULT_PRESET, EXECUTION_KEYS, flatten, from_dict, load_preset, parse_overrides, resolve,
                            split_items, to_dict)
from isoloco.errors import ConfigError, DataError
from isoloco.logs import NOTICE
from isoloco.methods import METHODS
from isoloco.rundir import CONFIG_FILE, SUMMARY_FILE, SWEEP_MANIFEST

logger = logging.getLogger(__name__)

#: Grid axes: name in the preset's `sweep:` section -> the run config key it sets.
AXES = {"methods": "method", "workers": "workers", "inner_steps": "inner_steps", "seeds": "seed"}
LOG_DIR = "logs"
POLL_S = 0.5


@dataclass(frozen=True)
class Grid:
    """The axes of a sweep, each a list of distinct values in the order runs are made."""

    methods: list[str]
    workers: list[int]
    inner_steps: list[int]
    seeds: list[int]


@dataclass(frozen=True)
class Run:
    """One grid point: its directory name, its `isoloco train` arguments and resolved config."""

    name: str
    items: tuple[str, ...]  # preset (if any) and key=value arguments of `isoloco train`
    config: dict[str, Any]  # to_dict of the resolved config, to recognise the directory later


# ---------------------------------------------------------------------------------------
# The grid


def _axis_values(label: str, raw: Any, integer: bool, minimum: int | None) -> list:
    """A list from `a,b,c`, a YAML list or a scalar; duplicates dropped, order kept."""
    items = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else [raw]
    values: list = []
    for item in items:
        text = str(item).strip()
        if integer:
            if isinstance(item, bool) or not text.lstrip("-").isdigit():
                raise ConfigError(f"{label}: {text!r} is not an integer (example: 1,2,4,8)")
            value: Any = int(text)
            if minimum is not None and value < minimum:
                raise ConfigError(f"{label}: {value} is not allowed: values must be >= {minimum}")
        else:
            value = text
        if value not in values:
            values.append(value)
    if not values:
        raise ConfigError(f"{label} is empty: give at least one value")
    return values


def build_grid(preset: str | None, overrides: dict[str, Any], flags: dict[str, str | None]) -> Grid:
    """Axes from the flags, else the preset's `sweep:` section, else the single resolved value."""
    preset_values = load_preset(preset) if preset else {}
    section = {k.removeprefix("sweep."): v for k, v in preset_values.items() if k.startswith("sweep.")}
    unknown = sorted(set(section) - set(AXES))
    if unknown:
        raise ConfigError(f"preset {preset!r}: unknown key sweep.{unknown[0]}; the sweep section takes "
                          f"{', '.join(AXES)}")
    for key in AXES.values():
        if key in overrides:
            axis = next(a for a, k in AXES.items() if k == key)
            flag = f"--{axis.replace('_', '-')} {overrides[key]}"
            raise ConfigError(f"{key}={overrides[key]} is a sweep axis: use {flag} (or sweep.{axis} in the preset) "
                              "instead of a key=value override")
    base = None
    axes: dict[str, list] = {}
    for axis, key in AXES.items():
        if flags.get(axis) is not None:
            label, raw = f"--{axis.replace('_', '-')}", flags[axis]
        elif axis in section:
            label, raw = f"sweep.{axis} in preset {preset!r}", section[axis]
        else:
            if base is None:
                base = resolve(preset, overrides)
            label, raw = f"{key} of the resolved config", getattr(base, key)
        axes[axis] = _axis_values(label, raw, integer=axis != "methods",
                                  minimum={"workers": 1, "inner_steps": 1}.get(axis))
        strangers = [m for m in axes[axis] if axis == "methods" and m not in METHODS]
        if strangers:
            raise ConfigError(f"{label}: unknown method {strangers[0]!r}; choose from {', '.join(METHODS)}")
    return Grid(**axes)


def run_name(method: str, workers: int, inner_steps: int, seed: int) -> str:
    """A sweep's directory name for one run; dp's names neither R nor H, which it ignores."""
    if METHODS[method]["algorithm"] == "dp":
        return f"{method}-s{seed}"
    return f"{method}-R{workers}-H{inner_steps}-s{seed}"


def plan_runs(preset: str | None, raw_overrides: list[str], grid: Grid) -> list[Run]:
    """Every run of the grid, resolved and validated; dp once per seed (seeds outermost)."""
    runs: list[Run] = []
    for seed in grid.seeds:
        for method in grid.methods:
            if METHODS[method]["algorithm"] == "dp":
                points = [(run_name(method, 1, 0, seed), 1, min(grid.inner_steps))]
            else:
                points = [(run_name(method, r, h, seed), r, h) for r in grid.workers for h in grid.inner_steps]
            for name, workers, inner_steps in points:
                keys = [f"method={method}", f"workers={workers}", f"inner_steps={inner_steps}", f"seed={seed}",
                        *raw_overrides]
                try:
                    cfg = resolve(preset, parse_overrides(keys))
                except ConfigError as err:
                    raise ConfigError(f"run {name}: {err}") from None
                runs.append(Run(name, (*([preset] if preset else []), *keys), to_dict(cfg)))
    return runs


def check_data(runs: list[Run]) -> None:
    """Every run's data problems (a budget beyond the corpus, a short validation split) before
    the first run starts, once per distinct data setting: one DataError naming the first run
    that has them."""
    from isoloco.trainer import load_run_data  # torch and the data stack: only once a grid is planned

    checked = set()
    for run in runs:
        cfg = from_dict(run.config)
        key = (repr(cfg.data), cfg.seq_len, cfg.global_batch, cfg.train_steps)
        if key in checked:
            continue
        checked.add(key)
        try:
            load_run_data(cfg)
        except DataError as err:
            raise DataError(f"run {run.name}: {err}") from None


# ---------------------------------------------------------------------------------------
# Run directories


def config_changes(run_dir: Path, config: dict[str, Any]) -> str:
    """How the config saved in `run_dir` differs from `config` ('' if not), e.g. `steps: run 6, sweep 8`."""
    saved = run_dir / CONFIG_FILE
    try:
        previous = flatten(to_dict(from_dict(yaml.safe_load(saved.read_text()))))
    except (ConfigError, yaml.YAMLError) as err:
        raise ConfigError(f"{saved} cannot be read ({err}); delete {run_dir} to run it again") from None
    wanted = flatten(config)
    changed = sorted(k for k in wanted if previous.get(k) != wanted[k] and k not in EXECUTION_KEYS)
    return "; ".join(f"{k}: run {previous.get(k)!r}, sweep {wanted[k]!r}" for k in changed[:3])


def check_run_dir(run_dir: Path, config: dict[str, Any]) -> None:
    """Refuse a directory that is not this run's: foreign files or a different config."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} exists but is not an isoloco run directory (no {CONFIG_FILE}); move it away "
                          "or choose another --out")
    changes = config_changes(run_dir, config)
    if changes:
        raise ConfigError(f"{run_dir} was trained with another config ({changes}); use another --out, or delete "
                          "that directory to train it again")


def is_finished(run_dir: Path) -> bool:
    return (run_dir / SUMMARY_FILE).is_file()


def train_command(run: Run, run_dir: Path) -> list[str]:
    """`isoloco train` for a new run, or `--resume` for a started one (config.yaml written)."""
    base = [sys.executable, "-m", "isoloco", "train"]
    if (run_dir / CONFIG_FILE).is_file():
        return [*base, "--resume", str(run_dir), "--quiet"]
    return [*base, *run.items, "--out", str(run_dir), "--quiet"]


def claim(lock_path: Path) -> int | None:
    """An exclusive, non-blocking lock on `lock_path`: its descriptor, or None if held elsewhere."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release(lock_path: Path, fd: int, finished: bool) -> None:
    """Give up a claim. A finished run's lock file goes, removed while still held: whoever
    claims it afterwards (through the old file or a new one) finds the run finished and skips
    it. An unfinished run's stays, or two claimers could lock two different files."""
    if finished:
        lock_path.unlink(missing_ok=True)
    os.close(fd)


# ---------------------------------------------------------------------------------------
# Parallel jobs


def visible_gpus() -> list[str]:
    """CUDA device ids this process may use, as CUDA_VISIBLE_DEVICES entries."""
    import torch

    count = torch.cuda.device_count()
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def job_environments(jobs: int, gpus: list[str], cores: int, environ: dict[str, str]) -> list[dict[str, str]]:
    """One environment per parallel job: its own GPU, or an equal share of the CPU cores.

    An OMP_NUM_THREADS the user set is kept; otherwise each job gets cores // jobs threads so
    parallel runs do not oversubscribe the CPU.
    """
    envs = []
    for job in range(jobs):
        env = dict(environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // jobs)))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[job % len(gpus)]
        envs.append(env)
    return envs


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class _Active:
    run: Run
    process: subprocess.Popen
    lock_fd: int
    log: Any


def _drift(run_dir: Path, config: dict[str, Any]) -> str:
    """How a run's own config differs from the planned one, '' if not (or if it never started).

    Each run resolves its config when it starts; if the installed code or the preset changed
    after the sweep planned the grid, the grid is no longer one experiment, and the user
    should know which runs are affected.
    """
    if not (run_dir / CONFIG_FILE).is_file():
        return ""
    try:
        return config_changes(run_dir, config)
    except ConfigError as err:  # e.g. a key this (older) sweep process does not know
        return str(err)


def _log_tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "\n".join(f"    {line}" for line in text[-lines:])


def execute(runs: list[Run], out: Path, envs: list[dict[str, str]]) -> list[str]:
    """Train every unfinished run, len(envs) at a time; return the names of runs that failed."""
    from tqdm import tqdm

    from isoloco.stop import GracefulStop

    logs = out / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    pending = [run for run in runs if not is_finished(out / run.name)]
    failed: list[str] = []
    active: dict[int, _Active] = {}  # job slot -> its run
    bar = tqdm(total=len(runs), initial=len(runs) - len(pending), unit="run", dynamic_ncols=True,
               desc="sweep", smoothing=0)
    stop = GracefulStop()
    forwarded = False

    def launch(slot: int) -> None:
        """Start the first pending run nobody else holds; skip ones that turn out finished."""
        for run in list(pending):
            fd = claim(logs / f"{run.name}.lock")
            if fd is None:
                continue  # a process of an earlier, killed sweep is still training it
            pending.remove(run)
            run_dir = out / run.name
            if is_finished(run_dir):  # that process has finished it meanwhile
                release(logs / f"{run.name}.lock", fd, finished=True)
                bar.update(1)
                continue
            log = open(logs / f"{run.name}.log", "a")
            process = subprocess.Popen(train_command(run, run_dir), env=envs[slot], stdout=log,
                                       stderr=subprocess.STDOUT, pass_fds=(fd,), start_new_session=True)
            active[slot] = _Active(run, process, fd, log)
            return

    try:
        while (pending and not stop.requested) or active:
            for slot, job in list(active.items()):
                if job.process.poll() is None:
                    continue
                del active[slot]
                job.log.close()
                run_dir = out / job.run.name
                release(logs / f"{job.run.name}.lock", job.lock_fd, finished=is_finished(run_dir))
                drift = _drift(run_dir, job.run.config)
                if drift:
                    logger.warning("%s resolved to another config than planned (%s): the code or the preset "
                                   "changed while the sweep ran", job.run.name, drift)
                if is_finished(run_dir):
                    bar.update(1)
                elif not stop.requested:
                    failed.append(job.run.name)
                    log_file = logs / f"{job.run.name}.log"
                    logger.warning("run %s failed (exit %d); last lines of %s:\n%s", job.run.name,
                                   job.process.returncode, log_file, _log_tail(log_file))
            if not stop.requested:
                for slot in range(len(envs)):
                    if slot not in active:
                        launch(slot)
            elif not forwarded:
                for job in active.values():
                    job.process.send_signal(stop.signum)
                forwarded = True
            status = (", ".join(job.run.name for job in active.values())
                      or ("waiting for runs held by another process" if pending and not stop.requested else ""))
            if status != bar.postfix:
                bar.set_postfix_str(status)
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # a second signal: stop the children at once, then leave
        for job in active.values():
            job.process.send_signal(stop.signum or signal.SIGINT)
            job.process.wait()
        raise
    finally:
        stop.restore()
        bar.close()
    if stop.requested:
        logger.log(NOTICE, "sweep stopped by %s; the running runs wrote a checkpoint; rerun the same command "
                   "to continue", signal.Signals(stop.signum).name)
        raise KeyboardInterrupt
    return failed


# ---------------------------------------------------------------------------------------
# The command


def sweep_manifest(path: Path, preset: str, raw_overrides: list[str], grid: Grid) -> dict[str, Any]:
    """What `sweep.yaml` at `path` records: the sweep's preset, overrides and axes. Where an earlier
    sweep of the same grid but other seeds wrote it (seeds run a few at a time into one directory),
    its seeds stay listed, this sweep's added after them: the directory holds the runs of both."""
    manifest = {"preset": preset, "overrides": raw_overrides, **asdict(grid)}
    earlier = yaml.safe_load(path.read_text()) if path.is_file() else None
    same_grid = lambda record: {key: value for key, value in record.items() if key != "seeds"}
    if isinstance(earlier, dict) and same_grid(earlier) == same_grid(manifest):
        seeds = list(earlier.get("seeds") or [])
        manifest["seeds"] = [*seeds, *(seed for seed in grid.seeds if seed not in seeds)]
    return manifest


def cmd_sweep(args: argparse.Namespace) -> int:
    args = parse_late(args, _add_options, prog="isoloco sweep", usage=SWEEP_USAGE, description=SWEEP_DESCRIPTION)
    named, raw_overrides = split_items(args.items)
    preset = named or DEFAULT_PRESET  # what each run's `isoloco train` would default to
    overrides = parse_overrides(raw_overrides)
    flags = {"methods": args.methods, "workers": args.workers, "inner_steps": args.inner_steps, "seeds": args.seeds}
    grid = build_grid(preset, overrides, flags)
    runs = plan_runs(preset, raw_overrides, grid)
    check_data(runs)
    out = Path(args.out) if args.out else Path("runs") / Path(preset).stem
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs} is not allowed: use 1 or more")
    for run in runs:
        check_run_dir(out / run.name, run.config)
    done = sum(is_finished(out / run.name) for run in runs)
    if args.dry_run:
        for run in runs:
            run_dir = out / run.name
            if is_finished(run_dir):
                print(f"{run.name:<32} finished")
            else:
                state = "resume" if (run_dir / CONFIG_FILE).is_file() else "new"
                print(f"{run.name:<32} {state:<8} isoloco {' '.join(train_command(run, run_dir)[3:])}")
        return 0

    gpus = visible_gpus()
    jobs = args.jobs or max(1, len(gpus))
    logger.info("sweep: %d runs in %s (%d finished), %d at a time on %s", len(runs), out, done, jobs,
                "GPUs " + ",".join(gpus) if gpus else f"{available_cores()} CPU cores")
    out.mkdir(parents=True, exist_ok=True)
    manifest = sweep_manifest(out / SWEEP_MANIFEST, preset, raw_overrides, grid)
    (out / SWEEP_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    failed = execute(runs, out, job_environments(jobs, gpus, available_cores(), dict(os.environ)))
    if not args.no_report:
        report.write_report(out)
        logger.info("report in %s", out / report.MARKDOWN_FILE)
    if failed:
        logger.error("%d of %d runs failed (%s); their logs are in %s; rerun the same command to retry them",
                     len(failed), len(runs), ", ".join(failed), out / LOG_DIR)
        return 1
    return 0


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", metavar="M,..", help="methods, comma-separated (e.g. dp,diloco,isoloco)")
    parser.add_argument("--workers", metavar="R,..", help="numbers of workers R, comma-separated (e.g. 1,2,4,8)")
    parser.add_argument("--inner-steps", metavar="H,..", help="inner steps H between synchronisations")
    parser.add_argument("--seeds", metavar="S,..", help="seeds, comma-separated")
    parser.add_argument("--out", metavar="DIR", help="sweep directory (default runs/PRESET)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="runs in parallel (default: one per visible GPU, else 1); on CPU each run gets "
                             "cores/N threads unless OMP_NUM_THREADS is set")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands; train nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")


SWEEP_USAGE = ("isoloco sweep [PRESET|FILE.yaml] [key=value ...] [--methods M,..] [--workers R,..] "
               "[--inner-steps H,..] [--seeds S,..] [--out DIR] [--jobs N] [--dry-run] [--no-report]")
SWEEP_DESCRIPTION = (
    f"With no preset or file, the runs take the `{DEFAULT_PRESET}` preset, as `isoloco train` does. "
    "Each run trains in OUT/NAME with `isoloco train`; finished runs are skipped, so rerunning the same command "
    "after an interruption finishes the grid. A flag replaces that axis of the preset's sweep: section; key=value "
    "overrides apply to every run. The dp method runs once per seed and is the reference of every R and H. "
    "Ends with `isoloco report OUT`.")


def add_sweep_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `sweep` and `report` on the main CLI's subparsers."""
    sweep = subparsers.add_parser("sweep", help="run a grid of methods x workers x inner steps x seeds, resumable",
                                  usage=SWEEP_USAGE, description=SWEEP_DESCRIPTION)
    _add_options(sweep)
    add_items(sweep)  # the preset, the overrides and any options among them
    sweep.set_defaults(func=cmd_sweep)
    report.add_report_command(subparsers)
