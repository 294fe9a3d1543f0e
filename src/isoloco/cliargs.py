"""Commands whose options and items (a preset, key=value overrides) mix in any order.

argparse's subcommand parser stops at the first option that follows an item. Such a command
collects everything from its first item on with `add_items`, and `parse_late` reads that
again with the command's options, intermixed, as users type them.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable


def add_items(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def parse_late(args: argparse.Namespace, add_options: Callable[[argparse.ArgumentParser], None],
               **parser_options: Any) -> argparse.Namespace:
    """`args` with the options found among its items applied and the items left over."""
    late = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, **parser_options)
    add_options(late)
    late.add_argument("items", nargs="*", help=argparse.SUPPRESS)
    return argparse.Namespace(**{**vars(args), "items": [], **vars(late.parse_intermixed_args(args.items))})
