"""`isoloco launch`: start a multi-process run through torchrun, with no shell in between.

    isoloco launch --nproc 4 -- train quick workers=8
    isoloco launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- train ...

It first checks the command as the processes would (`isoloco train`: the config, the run
directory, the layout on this many processes, a resumed run's checkpoint, the data) and
refuses with one line and exit status 2, starting nothing. Then it replaces itself (exec) with `python -m torch.distributed.run ... -m isoloco <command>`,
so signals reach torchrun directly and its exit status is the job's (non-zero if any
process failed). One machine rendezvouses on 127.0.0.1 at a free port unless an address
is named; several machines need `--master-addr` (node 0's address, reachable from every
node). Anything else torchrun offers is available by calling torchrun directly.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Callable

from isoloco.errors import UsageError

DEFAULT_PORT = 29500


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
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
            f"--master-addr={addr}", f"--master-port={port}",
            "-m", "isoloco", *command]


def cmd_launch(args: argparse.Namespace) -> int:
    argv = torchrun_argv(args)
    # torchrun reports a process's refusal as its own failure (status 1 and a traceback).
    args.check_command(launched_command(args), args.nproc * args.nnodes)
    sys.stdout.flush()
    os.execv(argv[0], argv)


def add_launch_command(subparsers: argparse._SubParsersAction,
                       check_command: Callable[[list[str], int], None]) -> argparse.ArgumentParser:
    """Register `launch`; `check_command(command, processes)` raises what the processes would
    refuse (a `UserError`), before any starts."""
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
    launch.set_defaults(func=cmd_launch, check_command=check_command)
    return launch
