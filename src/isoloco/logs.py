"""The messages of a command: the package logger `isoloco`, written to stderr.

Modules log through `logging.getLogger(__name__)`; a command calls `setup` when it starts
(and again once it knows its `--quiet`). Messages read as a command-line tool's: info as it
is, `warning: ...`, `error: ...`. They are written above any progress bar rather than
through it. What a command produces (tables, listings, the config it would use, where its
results are) is not a message: it goes to stdout with `print`.

Levels: INFO says what is going on (start-up lines, a resume), and `--quiet` silences it;
NOTICE says how a command ended early (a stop by signal, an interrupt, a resumed run that had
already finished), printed as is even with `--quiet`; WARNING and ERROR as usual. In a
torchrun job rank 0 says everything; the other processes only their own warnings and errors
(e.g. an SVD retried on the share of the orthogonalisations one process computes), marked
`[rank N]`. A progress bar is drawn only on a terminal (`interactive`).
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from isoloco.errors import EXIT_INTERRUPTED

PACKAGE = "isoloco"
NOTICE = logging.INFO + 5
logging.addLevelName(NOTICE, "NOTICE")

_PREFIXES = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = job_rank()
        return _PREFIXES.get(record.levelno, "") + (f"[rank {rank}] " if rank else "") + super().format(record)


class _StderrAboveBars(logging.Handler):
    """Writes to the stderr of the moment (a test's capture, a redirection), clearing and
    redrawing tqdm bars around the message, and flushes: the process may `os._exit` next."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # logging's convention: a failing handler never raises into the caller
            self.handleError(record)


def interactive() -> bool:
    """Whether stdout and stderr are both terminals: only then is a progress bar redrawn in
    place. Otherwise (a log file, a pipe, `make demo > log`) a bar's carriage-return updates would
    pile up in the file, and progress is said in occasional plain lines instead."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def job_rank() -> int:
    """This process's rank in a torchrun job; 0 outside one."""
    return int(os.environ.get("RANK", "0"))


def interrupted() -> int:
    """Say that Ctrl-C interrupted the command where it had nothing to finish first, and return
    the exit status a shell gives it (`errors.EXIT_INTERRUPTED`)."""
    logging.getLogger(PACKAGE).log(NOTICE, "interrupted")
    return EXIT_INTERRUPTED


def setup(quiet: bool = False) -> None:
    """Write the package's messages to stderr at the level this process and `quiet` allow;
    calling it again changes only the level."""
    logger = logging.getLogger(PACKAGE)
    if not any(isinstance(handler, _StderrAboveBars) for handler in logger.handlers):
        handler = _StderrAboveBars()
        handler.setFormatter(_PrefixFormatter())
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if job_rank() != 0 else NOTICE if quiet else logging.INFO)
