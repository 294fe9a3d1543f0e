"""`isoloco launch`: start a multi-process run through torchrun, with no shell in between.

    isoloco launch --nproc 4 -- train quick workers=8
    isoloco launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- train ...

It first checks the command as the processes would (`isoloco train`: the config, the run
directory, the layout on this many processes, a resumed run's checkpoint, the data) and
refuses with one line and exit status 2, starting nothing; `--help` and `--dry-run` are
answered here, once, without starting processes. Then it becomes torchrun's agent on this
machine: the processes write to this terminal as `isoloco train` would, torchrun's own
output goes to a log file, and the job ends with the run's own exit status (0 done, 2 a user
error, 3 a process lost, 128 + N stopped by signal N) and, when it
failed, one line naming the process that ended it and that log file. One machine
rendezvouses on 127.0.0.1 at a free port unless an address is named; several machines need
`--master-addr` (node 0's address, reachable from every node). Nodes meet on torchrun's static
rendezvous (--master-addr, --node-rank), which resolves no host name, so it also works inside
network namespaces, where torchrun's c10d rendezvous times out. Anything else torchrun
offers is available by calling torchrun directly.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from isoloco.errors import EXIT_PEER_LOST, UsageError
from isoloco.logs import NOTICE

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
#: The command line that starts torchrun; `isoloco launch` runs what follows it in-process.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launched_command(args: argparse.Namespace) -> list[str]:
    """The isoloco command (after `--`) that every process runs."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("isoloco launch needs the isoloco command to run after --, "
                         "e.g. isoloco launch --nproc 2 -- train quick")
    return command


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for parsed `isoloco launch` arguments."""
    command = launched_command(args)
    if args.nproc < 1 or args.nnodes < 1:
        raise UsageError(f"--nproc {args.nproc} and --nnodes {args.nnodes} must both be >= 1")
    if args.nnodes > 1 and args.master_addr is None:
        raise UsageError(f"--nnodes {args.nnodes} needs --master-addr: the address of node 0, reachable from "
                         "every node (and the same --master-port on every node)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank {args.node_rank} is not allowed: it must be in [0, {args.nnodes})")
    addr = args.master_addr or "127.0.0.1"
    port = args.master_port or (free_port(addr) if args.nnodes == 1 else DEFAULT_PORT)
    return [*TORCHRUN, f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
            f"--master-addr={addr}", f"--master-port={port}",
            "-m", "isoloco", *command]


@contextmanager
def _torch_logs_to(path: Path) -> Iterator[None]:
    """Send what torch logs (torchrun's agent: its warnings, the processes it stops) to `path`
    instead of stderr, for the duration of the block."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    # torch gives these loggers their own stderr handlers; the others propagate to them.
    loggers = [logging.getLogger(name) for name in ("torch", "torch.distributed")]
    saved = [list(each.handlers) for each in loggers]
    for each in loggers:
        each.handlers = [handler]
    try:
        yield
    finally:
        for each, handlers in zip(loggers, saved):
            each.handlers = handlers
        handler.close()


def run_torchrun(torchrun_args: list[str]) -> int:
    """Be torchrun's agent for this machine's processes (`torchrun_args`: its command line, after
    the program). Returns the job's exit status; on failure says which process ended it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    with tempfile.NamedTemporaryFile("w", prefix="isoloco-launch-", suffix=".log", delete=False) as log:
        path = Path(log.name)
    sys.stdout.flush()  # what this process printed comes before what the processes print
    with _torch_logs_to(path):
        try:
            run(parse_args(torchrun_args))
        except ChildFailedError as failed:
            with path.open("a") as log:
                log.write(failed.format_msg() + "\n")
            return _job_status(failed, path)
        except SignalException as signalled:
            # The processes had the signal too and said how they stopped.
            path.unlink()
            return 128 + int(signalled.sigval)
    path.unlink()  # the job is done: nothing in it is worth keeping
    return 0


def _job_status(failed: ChildFailedError, log: Path) -> int:
    """The exit status of a job torchrun stopped because a process ended, with one line naming
    the process that ended first: its own status (it has said why), or, when a signal killed it
    and it could say nothing, EXIT_PEER_LOST, as its peers would report it."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, bool, int]:
        rank, failure = item
        # torchrun's times are whole seconds: within one, a process that stopped because of
        # another (status 3) or that torchrun stopped (SIGTERM) comes after the one that ended it.
        second_hand = failure.exitcode in (EXIT_PEER_LOST, -signal.SIGTERM)
        return failure.timestamp, second_hand, rank

    rank, failure = min(failed.failures.items(), key=order)
    if failure.exitcode < 0:
        logger.error("rank %d (pid %d) was killed by %s, and torchrun stopped the other processes; the run's "
                     "last complete checkpoint, if any, is intact (torchrun's output: %s)",
                     rank, failure.pid, failure.signal_name(), log)
        return EXIT_PEER_LOST
    logger.log(NOTICE, "rank %d exited with status %d, and torchrun stopped the other processes (torchrun's "
               "output: %s)", rank, failure.exitcode, log)
    return failure.exitcode


def cmd_launch(args: argparse.Namespace) -> int:
    argv = torchrun_argv(args)
    # torchrun would report a process's refusal as its own failure, once per process.
    answered = args.preflight(launched_command(args), args.nproc * args.nnodes)
    if answered is not None:
        return answered
    return run_torchrun(argv[len(TORCHRUN):])


def add_launch_command(subparsers: argparse._SubParsersAction,
                       preflight: Callable[[list[str], int], int | None]) -> argparse.ArgumentParser:
    """Register `launch`. `preflight(command, processes)` raises what the processes would refuse
    (a `UserError`) before any starts, and runs here what needs no processes (help, a dry run),
    returning its exit status; None when the processes must run the command."""
    launch = subparsers.add_parser(
        "launch", help="run an isoloco command on several processes / machines with torchrun",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="isoloco launch --nproc N [--nnodes M --node-rank I --master-addr HOST] [--master-port P] "
              "-- COMMAND ...",
        description=__doc__.split("\n\n", 1)[1])
    launch.add_argument("--nproc", type=int, required=True, help="processes on this machine (one per GPU)")
    launch.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default 0)")
    launch.add_argument("--master-addr", help="address of node 0 (default 127.0.0.1; required with --nnodes > 1)")
    launch.add_argument("--master-port", type=int,
                        help=f"rendezvous port on node 0 (default: a free port on one machine, {DEFAULT_PORT} on several)")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- then the isoloco command, e.g. -- train quick")
    launch.set_defaults(func=cmd_launch, preflight=preflight)
    return launch
