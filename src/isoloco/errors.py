"""Every error isoloco reports to its user, and the exit status of each kind.

A command reports these as `error: ...` lines, one per line of the message, and exits with
the status of the kind (`EXIT_STATUS`, `describe`), without a traceback; any other exception
is a bug and keeps its traceback. Messages name what is wrong and how to fix it.
"""

from __future__ import annotations

import re

#: Exit status of a process stopped because another process of the run died, hung or failed.
EXIT_PEER_LOST = 3
#: Exit status after Ctrl-C: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Something the user can fix (an argument, a value, the data, a directory), not a bug."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


class UsageError(UserError, ValueError):
    """A command-line mistake that is not about a config value."""


class DataError(UserError, ValueError):
    """The data on disk (or the source named) is unusable; the message names the file and the fix."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, damaged, unwritable or belongs to a different run layout."""


class ReportError(ConfigError):
    """A report's input is unusable (no run directories, a malformed --compare)."""


class PeerLostError(RuntimeError):
    """Another process of the run died, hung or failed; the message names its rank."""


class CollectiveError(RuntimeError):
    """A torch.distributed collective failed: usually a peer died or stopped answering."""


class NonFiniteDeltaError(ValueError):
    """A worker's pseudo-gradient is not finite; the message names the worker, round and parameter."""


#: The exit status of each kind of error a command reports; the first kind that matches counts.
EXIT_STATUS: dict[type[BaseException], int] = {
    UserError: 2,
    PeerLostError: EXIT_PEER_LOST,
    CollectiveError: EXIT_PEER_LOST,
    NonFiniteDeltaError: 1,
    FloatingPointError: 1,
}
#: What a command reports without a traceback.
REPORTED = tuple(EXIT_STATUS)

#: A run stopped by a number that is not finite has written nothing since its last checkpoint.
_NUMERIC = (NonFiniteDeltaError, FloatingPointError)


def describe(error: BaseException, rank: int) -> tuple[list[str], int]:
    """The `error:` lines (without the prefix) that process `rank` of a job writes for `error`,
    one of the `REPORTED` kinds, and the exit status."""
    status = next(status for kind, status in EXIT_STATUS.items() if isinstance(error, kind))
    if isinstance(error, UserError) and rank != 0:
        # Every process of a torchrun job meets a user error alike (same arguments, same files),
        # and a process that meets its own posts it to the others: rank 0 alone reports it.
        return [], status
    message = f"{error}; the last checkpoint is intact" if isinstance(error, _NUMERIC) else str(error)
    return message.splitlines(), status


#: The source location C++ backends (gloo, c10) put before their messages: `[../third_party/gloo/...cc:534] `.
_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+\.(?:c|cc|cpp|cxx|h|hpp):\d+\]\s*")
#: The longest `first_line`.
FIRST_LINE_CHARS = 200


def first_line(error: BaseException) -> str:
    """A third-party exception as one short line, for messages that must fit on one line: its
    first line; from a C++ backend, its first sentence without the source location (gloo adds
    advice to check the remote worker's logs, which the message this goes into gives); cut at a
    word if still too long."""
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    if _SOURCE_LOCATION.match(line):
        line = _SOURCE_LOCATION.sub("", line).split(". ")[0]
    line = line or type(error).__name__
    if len(line) <= FIRST_LINE_CHARS:
        return line
    cut = line[:FIRST_LINE_CHARS - 4]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + " ..."
