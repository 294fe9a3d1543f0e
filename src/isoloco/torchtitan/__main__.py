"""``python -m isoloco.torchtitan``: torchtitan's training entry point, with isoloco's errors in one line.

The same arguments as ``python -m torchtitan.train`` (``--module isoloco.torchtitan --config
llama3_isoloco_debugmodel --isoloco.lr 1.8 ...``); a setting the recipe refuses ends the process
with ``error: <what and how to fix it>`` and status 2, before torchft starts, instead of a
traceback.
"""

from __future__ import annotations

import os
import sys

from isoloco.errors import UserError, describe


def main() -> None:
    from torchtitan.train import main as train

    try:
        train()
    except UserError as error:
        lines, status = describe(error, int(os.environ.get("RANK", "0")))
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    main()
