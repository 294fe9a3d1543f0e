"""Goodput: how much of the machines' time ends up in the model when replica groups die and
workers miss rounds, for the mean, Iso-C and TSV under the same faults.

`python -m isoloco.bench --only goodput [--quick]` prints two tables. What the runs themselves
write (torchft's lighthouse and managers, their HTTP access lines, torch's and isoloco's
warnings) goes to a log file, named on stderr before the runs start, so the tables fit on one screen.

**Killed replica groups (torchft).** Two replica groups train the `tiny` model under torchft's
DiLoCo (`isoloco.torchft.replica`, gloo on this machine) behind a lighthouse that lets one group
commit alone (min_replicas = 1). On a fixed schedule, group 1 is SIGKILLed after inner step
`KILL_AT` and restarted at once; the survivor trains on alone, and the new process heals from
it at its first synchronisation; the run is stopped `ROUNDS_BACK` rounds later. Every inner
step's end is timed in its process. A life's steps of one round count as productive when the
round's synchronisation committed them into θ: the life went on to the next round. The killed
life's unfinished round and the restarted life's own first round (replaced by the survivor's
state when it heals) do not. Goodput is Meta's effective training time ratio (ETTR): the
productive step seconds of both groups ÷ (2 × the wall clock from the first step's start to the
end of the last committed step).

**Late workers (simulator).** R workers, each missing a round's deadline with probability
`faults.late_rate`, drawn from the seed (the same draws for every rule), their pseudo-gradient
dropped or carried to their next arrival (`faults.late`). Under a deadline a round lasts as long
whatever arrives, so a late worker-round is time spent for nothing when it is dropped, and
kept when it is carried to a round the worker arrives in.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from isoloco.bench.table import Table, percent
from isoloco.config import resolve
from isoloco.train_config import TrainConfig
from isoloco.data import load_token_data
from isoloco.trainer import Trainer

logger = logging.getLogger(__name__)

#: The rules compared, by the method that runs each.
METHODS = {"mean": "diloco", "Iso-C": "isoloco", "TSV": "tsv"}
#: The runs' model and data: the tests' tiny setting.
SMALL = {"model": "tiny", "seq_len": 32, "global_batch": 8, "eval_batch": 8, "data.vocab_size": 512,
         "data.val_tokens": 1024, "checkpoint_every": 0, "device": "cpu", "seed": 0}
#: torchft: inner steps per round, the step after which group 1 dies, and the rounds (full,
#: quick) the groups train together after the restarted one is back, when the run is stopped.
#: The stop, not a step count, ends the run: a restart's length depends on the machine's load,
#: and the survivor must still be training when the new process comes back.
TORCHFT_H, KILL_AT, ROUNDS_BACK = 3, 4, {False: 20, True: 5}
#: A cap on the run's rounds that the stop comes well before.
MAX_ROUNDS = 30_000
#: The checkpoint-restart baseline checkpoints every this many rounds.
CHECKPOINT_ROUNDS = 2
#: The lighthouse drops a group this long after its last heartbeat.
HEARTBEAT_MS = 1000
#: Simulator: workers, inner steps per round, rounds (full, quick), the late rate and what is
#: done with a late pseudo-gradient ("none": the same run without faults).
LATE_WORKERS, LATE_H, LATE_ROUNDS, LATE_RATE = 4, 6, {False: 8, True: 4}, 0.3
LATE_MODES = ("none", "drop", "carry")
SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 900  # bounds a hang; a run here takes a minute or two


# ----------------------------------------------------------------- killed replica groups


class _Clock:
    """A replica group's `on_step`: appends each inner step's (end time, step, loss) to a file,
    waits at its first step for the other group (a launcher's barrier: both start in the first
    quorum), and SIGKILLs its process after step `kill_at`."""

    def __init__(self, path: Path, kill_at: int | None, barrier: Any | None) -> None:
        self.path = path
        self.kill_at = kill_at
        self.barrier = barrier

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if self.barrier is not None:  # before the clock: the wait is no step's
            self.barrier.wait(JOIN_S)
            self.barrier = None
        with self.path.open("a") as times:
            times.write(json.dumps([time.monotonic(), step, loss]) + "\n")
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _life(cfg: TrainConfig, replica: int, lighthouse: str, out: Path, name: str, clock: _Clock) -> None:
    """One process's life of a replica group."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's [INFO] lines: read once, at its import
    torch.set_num_threads(1)
    from isoloco.torchft.replica import run_replica_group

    run_replica_group(cfg, replica, lighthouse, on_step=clock).save(out / name)


def kept_steps(steps: list[int], inner_steps: int) -> list[bool]:
    """Which of a life's inner steps (global step numbers, in the order trained) ended in θ: those
    of a whole round after which the life went on to the next round. A round cut short (a kill,
    or the run's stop), retried (a failed commit) or replaced (a heal) is not kept."""
    segments: list[list[int]] = []  # consecutive indices of one attempt at one round
    for index, step in enumerate(steps):
        if segments and step == steps[index - 1] + 1 and step % inner_steps:
            segments[-1].append(index)
        else:
            segments.append([index])
    kept = [False] * len(steps)
    for number, segment in enumerate(segments):
        first = steps[segment[0]]
        after = steps[segments[number + 1][0]] if number + 1 < len(segments) else None
        whole = first % inner_steps == 0 and len(segment) == inner_steps
        if whole and after == first + inner_steps:
            for index in segment:
                kept[index] = True
    return kept


def healed_at(steps: list[int]) -> int | None:
    """The index of a restarted life's first step after it healed from a live group (where its
    step numbers jump ahead to the survivor's), or None if it never did."""
    return next((i for i in range(1, len(steps)) if steps[i] > steps[i - 1] + 1), None)


def _read_life(path: Path) -> list[list[float]]:
    """A life's (end time, step, loss) per inner step, as its `_Clock` has written them so far
    (whole lines only: the process may be writing the next one)."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def killed_group_run(method: str, quick: bool, out: Path) -> dict[str, Any]:
    """Train `method` with 2 torchft replica groups, group 1 killed after `KILL_AT` and restarted,
    until the groups have trained `ROUNDS_BACK` rounds together again; returns the figures of the
    killed-groups table (see the module's docstring)."""
    from isoloco.torchft.replica import start_lighthouse

    steps = MAX_ROUNDS * TORCHFT_H
    cfg = resolve(None, {**SMALL, "method": method, "workers": 2, "inner_steps": TORCHFT_H, "steps": steps,
                         "eval_every": steps})
    load_token_data(cfg.data, progress=False)  # prepared once, before the groups read it
    server, address = start_lighthouse(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS)
    barrier = SPAWN.Barrier(2)

    def start(replica: int, name: str, kill_at: int | None, meet: Any | None):
        clock = _Clock(out / f"{name}.times", kill_at, meet)
        process = SPAWN.Process(target=_life, args=(cfg, replica, address, out, name, clock))
        process.start()
        return process

    processes = []
    try:
        processes += [start(0, "survivor", None, barrier), start(1, "killed", KILL_AT, barrier)]
        processes[1].join(JOIN_S)
        processes.append(start(1, "restarted", None, None))
        end = time.monotonic() + JOIN_S
        while processes[0].is_alive() and time.monotonic() < end:
            steps = [step for _, step, _ in _read_life(out / "restarted.times")]
            healed = healed_at(steps)
            if healed is not None and len(steps) - healed > ROUNDS_BACK[quick] * TORCHFT_H:
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(JOIN_S)
        server.shutdown()
    if [p.exitcode for p in processes] != [-signal.SIGKILL] * 3:
        raise RuntimeError(f"{method}: the replica groups exited with {[p.exitcode for p in processes]} before "
                           "the restarted one was back for the rounds asked")
    lives = {name: _read_life(out / f"{name}.times") for name in ("survivor", "killed", "restarted")}
    step_s = statistics.median(b[0] - a[0] for life in lives.values() for a, b in zip(life, life[1:]))
    steps = {name: [step for _, step, _ in life] for name, life in lives.items()}
    healed = healed_at(steps["restarted"])
    productive, start_s, end_s = 0.0, [], []
    for name, life in lives.items():
        times = [life[0][0] - step_s] + [t for t, _, _ in life]
        kept = kept_steps(steps[name], TORCHFT_H)
        if name == "restarted":  # what it trained before healing is lost
            kept = [keep and index >= healed for index, keep in enumerate(kept)]
        productive += sum(b - a for a, b, keep in zip(times, times[1:], kept) if keep)
        start_s.append(times[0])
        end_s += [t for t, keep in zip(times[1:], kept) if keep]
    wall = max(end_s) - min(start_s)  # to the last committed step: the stop cut the rounds after it
    # What the restart itself cost: from the kill to the new life's first step starting.
    restart_s = lives["restarted"][0][0] - step_s - lives["killed"][-1][0]
    checkpoint = (KILL_AT + 1) // (CHECKPOINT_ROUNDS * TORCHFT_H) * CHECKPOINT_ROUNDS * TORCHFT_H
    baseline_lost = 2 * (restart_s + (KILL_AT + 1 - checkpoint) * step_s)
    work = 2 * sum(kept_steps(steps["survivor"], TORCHFT_H)) * step_s
    return {"wall_s": wall, "step_s": step_s, "goodput": productive / (2 * wall), "lost_s": 2 * wall - productive,
            "restart_s": restart_s, "rejoined": steps["restarted"][healed], "baseline_lost_s": baseline_lost,
            "baseline_goodput": work / (work + baseline_lost), "start": min(start_s), "survivor": lives["survivor"]}


def loss_at(survivor: list[list[float]], start: float, seconds: float) -> float:
    """The survivor's training loss at `seconds` of wall clock: the mean over its last round's
    worth of steps ended by then."""
    losses = [loss for t, _, loss in survivor if t - start <= seconds][-TORCHFT_H:]
    return statistics.fmean(losses) if losses else float("nan")


def killed_groups_table(quick: bool) -> Table:
    with tempfile.TemporaryDirectory(prefix="isoloco-goodput-") as tmp:
        runs = {}
        for rule, method in METHODS.items():
            (Path(tmp) / method).mkdir()
            runs[rule] = killed_group_run(method, quick, Path(tmp) / method)
    equal = min(run["wall_s"] for run in runs.values())
    table = Table(f"Goodput with a killed replica group (torchft): 2 groups, H = {TORCHFT_H}, group 1 SIGKILLed "
                  f"after step {KILL_AT} and restarted, stopped {ROUNDS_BACK[quick]} rounds after it is back",
                  ["rule", "wall clock", "median step", "goodput (ETTR)", "group-seconds lost",
                   "restart", "back at step", f"train loss at {equal:.1f} s", "checkpoint-restart: lost",
                   "checkpoint-restart: ETTR"])
    for rule, run in runs.items():
        table.add(rule, f"{run['wall_s']:.1f} s", f"{run['step_s']:.3f} s", percent(run["goodput"]),
                  f"{run['lost_s']:.1f} s", f"{run['restart_s']:.1f} s",
                  run["rejoined"],
                  f"{loss_at(run['survivor'], run['start'], equal):.4f}", f"{run['baseline_lost_s']:.1f} s",
                  percent(run["baseline_goodput"]))
    table.notes.append(
        "The `tiny` model, global batch 8 × 32 tokens, one process per group on this machine's CPUs (gloo), "
        f"the lighthouse's min_replicas = 1 and heartbeat timeout {HEARTBEAT_MS} ms. Goodput: the seconds of "
        "the inner steps that ended in θ (a step's seconds: from the previous step's end in its process; the "
        "first step of a life: the median step), summed over both groups, ÷ 2 × the wall clock from the first "
        "step's start to the end of the last step of a committed round. Group-seconds lost: 2 × wall clock − "
        "those seconds (the dead group's idle slot, the discarded rounds, the synchronisations and quorum waits). "
        "Restart: from the "
        "killed step's end to the new process's first step's start (process start, imports, model, joining). "
        "Back at step: the step from which the new process trained on after healing from the survivor. "
        "Train loss at equal wall clock: the survivor's training loss averaged over its last H steps ended "
        "within the shortest run's wall clock. Checkpoint-restart (a model, not a run): a job that stops every "
        f"group at a failure, checkpoints every {CHECKPOINT_ROUNDS} rounds and loses, per group, the measured "
        "restart plus the steps since its last checkpoint redone at the median step; its ETTR counts only that "
        "loss (no synchronisation or start-up), so it is an upper bound for such a job.")
    return table


# ---------------------------------------------------------------------- late workers


def late_config(method: str, mode: str, quick: bool) -> TrainConfig:
    """The simulator run of `method` with late workers dropped or carried (`mode`), or none."""
    steps = LATE_ROUNDS[quick] * LATE_H
    faults = {} if mode == "none" else {"faults.late_rate": LATE_RATE, "faults.late": mode}
    return resolve(None, {**SMALL, "method": method, "workers": LATE_WORKERS, "inner_steps": LATE_H,
                          "steps": steps, "eval_every": steps, **faults})


def work_kept(cfg: TrainConfig) -> float:
    """The share of worker-rounds whose pseudo-gradient reaches θ: a late one is lost when dropped,
    and kept when carried to a later round its worker arrives in."""
    rounds = cfg.train_steps // cfg.inner_steps
    late = [[cfg.faults.is_late(cfg.seed, r, w) for w in range(cfg.workers)] for r in range(rounds)]
    kept = 0
    for r in range(rounds):
        for w in range(cfg.workers):
            arrives_later = any(not late[later][w] for later in range(r + 1, rounds))
            kept += not late[r][w] or (cfg.faults.late == "carry" and arrives_later)
    return kept / (rounds * cfg.workers)


def late_workers_table(quick: bool) -> Table:
    rounds = LATE_ROUNDS[quick]
    table = Table(f"Goodput with late workers (simulator): R = {LATE_WORKERS}, {rounds} rounds of H = {LATE_H}, "
                  f"faults.late_rate = {LATE_RATE}",
                  ["rule", "late", "worker-rounds kept", "val loss", "val loss without faults", "seconds"])
    with tempfile.TemporaryDirectory(prefix="isoloco-goodput-") as tmp:
        for rule, method in METHODS.items():
            losses: dict[str, float] = {}
            for mode in LATE_MODES:
                cfg = late_config(method, mode, quick)
                out = Path(tmp) / f"{method}-{mode}"
                out.mkdir()
                began = time.perf_counter()
                losses[mode] = Trainer(cfg, out, progress=False).run()["final_val_loss"]
                seconds = time.perf_counter() - began
                if mode != "none":
                    table.add(rule, mode, percent(work_kept(cfg)), f"{losses[mode]:.4f}", f"{losses['none']:.4f}",
                              f"{seconds:.1f} s")
    table.notes.append(
        "The `tiny` model, global batch 8 × 32 tokens, seed 0: every rule meets the same late draws. Under a "
        "deadline a round lasts the same whoever arrives, so runs of equal rounds take equal wall clock and "
        "the validation losses compare at equal wall clock. Worker-rounds kept: the goodput of the workers' "
        "time, the share of worker-rounds whose pseudo-gradient reaches θ (dropped: lost; carried: kept "
        "when the worker arrives in a later round, down-weighted by faults.stale_weight per round waited). "
        "Seconds: the simulated run's own, all workers in one process, for scale only.")
    return table


@contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send what this process and the processes it starts write to stdout and stderr to `path`,
    by file descriptor, so that the writes of torchft's Rust and torch's C++ go there too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del repeats, device  # one run per case, on the CPU (torchft's groups talk over gloo)
    handle, name = tempfile.mkstemp(prefix="isoloco-goodput-", suffix=".log")
    os.close(handle)
    log = Path(name)
    logger.info("goodput: the runs' own output (torchft's lighthouse and managers, warnings) goes to %s", log)
    for table in (killed_groups_table, late_workers_table):
        with output_to(log):
            computed = table(quick)
        yield computed
