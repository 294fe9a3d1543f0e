"""The parts of torchtitan the recipe relies on that are not a public interface, in one place.

torchtitan 0.3.0 (the version the extra pins) chooses torchft's outer optimizer inside
``experiments/torchft/manager.py::maybe_semi_sync_training``, which
``experiments/torchft/trainer.py`` imports by name and calls from ``FaultTolerantTrainer.train``;
its Llama 3 shapes are built by private helpers of ``torchtitan.models.llama3``. `check_version`
refuses another torchtitan in one line, and `bound` replaces a module's name and says so in one
line when it has moved, rather than failing deep inside a training run.
"""

from __future__ import annotations

from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any, Iterator

from isoloco.errors import ConfigError

#: The torchtitan release whose names are the ones used here.
SUPPORTED_VERSION = "0.3.0"
_INSTALL = "pip install 'isoloco[torchtitan]'"


def check_version() -> None:
    """Refuse, in one line, a torchtitan other than `SUPPORTED_VERSION`."""
    try:
        installed = f"torchtitan {version('torchtitan')} is installed"
    except PackageNotFoundError:
        installed = "torchtitan is not installed"
    if installed != f"torchtitan {SUPPORTED_VERSION} is installed":
        raise ConfigError(f"{installed}, but isoloco's torchtitan recipe supports torchtitan {SUPPORTED_VERSION} "
                          f"only (it replaces a function torchtitan's torchft trainer imports by name); install it "
                          f"with {_INSTALL}")


@contextmanager
def bound(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """`module.name` is `value` inside the block, and what it was again after it."""
    if not hasattr(module, name):
        raise ConfigError(f"{module.__name__} has no {name}, which isoloco's torchtitan recipe replaces (torchtitan "
                          f"{SUPPORTED_VERSION}'s); install it with {_INSTALL}")
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
