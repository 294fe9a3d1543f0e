"""Shared machinery for typed configs: a documented field and range checks.

Each component owns a dataclass config whose fields are declared with `option`, which
keeps the one-line doc beside the default so `isoloco train --help` can list every key.
A bad value raises `ConfigError` (`isoloco.errors`), naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Iterable

from isoloco.errors import ConfigError


def option(default: Any, doc: str, choices: Iterable[Any] | None = None) -> Any:
    """A dataclass field with its one-line doc (and allowed values, when a closed set)."""
    metadata = {"doc": doc}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value!r} is not allowed: it must be > 0")


def check_at_least(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value!r} is not allowed: it must be >= {minimum}")


def check_range(key: str, value: float, low: float, high: float, *, low_open: bool, high_open: bool) -> None:
    """Check low <(=) value <(=) high; the message shows the interval in math notation."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{key}={value!r} is not allowed: it must be in {interval}")


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"{key}={value!r} is not allowed: choose one of {allowed}")


def check_choices(section: str, config: Any) -> None:
    """Check every field of `config` declared with `choices` (keys named `section.field`)."""
    for field in dataclasses.fields(config):
        if "choices" in field.metadata:
            key = f"{section}.{field.name}" if section else field.name
            check_choice(key, getattr(config, field.name), field.metadata["choices"])


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether parameter `name` matches one of the fnmatch `patterns` (case-sensitive): what
    `merge.exclude` and `merge.compress_exclude` name."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
