"""``python -m isoloco.torchtitan``: torchtitan's training entry point, with isoloco's errors in one line.

The same arguments as ``python -m torchtitan.train`` (``--module isoloco.torchtitan --config
llama3_isoloco_debugmodel --isoloco.lr 1.8 ...``); a setting the recipe refuses ends the process
with ``error: <what and how to fix it>`` and status 2, instead of a traceback: the ``--isoloco.*``
and fault-tolerance flags are checked before torchtitan is imported, the rest before torchft
starts. torchtitan 0.3.0 does not import without triton (CUDA builds of torch bring it): that too
is one line, not a traceback.
"""

from __future__ import annotations

import os
import sys

from isoloco.errors import UsageError, UserError, describe
from isoloco.torchtitan.settings import check_flags


def main() -> None:
    try:
        check_flags(sys.argv[1:])
        try:
            from torchtitan.train import main as train
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            raise UsageError("torchtitan 0.3.0 cannot be imported here: it imports triton, which is not installed "
                             "(CUDA builds of torch bring it). The recipe runs on CUDA GPUs; there is no command "
                             "that runs it on a CPU (its tests do, with test-only patches: pytest -m torchtitan, "
                             "tests/torchtitan_cpu.py)") from None
        train()
    except UserError as error:
        lines, status = describe(error, int(os.environ.get("RANK", "0")))
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    main()
