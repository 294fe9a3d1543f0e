"""The private parts of torchft that isoloco relies on, in one place.

torchft's `DiLoCo` has no public hook to replace a fragment's all-reduce of the mean, nor to
read the pseudo-gradients it has just taken, so `isoloco.torchft.quorum` goes through these
private names of its fragments, which are torchft 0.2.0's (the version the extra pins):
``DiLoCo._fragments``; and of each fragment ``_model_fragment``, ``_manager``, ``_grads``,
``_allreduce_work`` and ``_average_grads``. `check_version` refuses another torchft, and
every name is read here, so a name that moved is a one-line error, not an AttributeError deep
in a synchronisation. No torchft import: the version comes from the package metadata.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

from isoloco.errors import ConfigError

#: The torchft release whose private names are the ones below.
SUPPORTED_VERSION = "0.2.0"
_INSTALL = f"pip install 'torchft=={SUPPORTED_VERSION}' (or pip install 'isoloco[torchft]')"


def installed_version() -> str | None:
    """The installed torchft's version, or None."""
    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


def check_version() -> None:
    """Refuse, in one line, a torchft whose private names may not be the ones used here."""
    installed = installed_version()
    if installed != SUPPORTED_VERSION:
        found = f"torchft {installed} is installed" if installed else "torchft is not installed"
        raise ConfigError(f"{found}, but isoloco's torchft integration supports torchft {SUPPORTED_VERSION} only "
                          f"(it relies on private parts of its DiLoCo); install it with {_INSTALL}")


def _private(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise ConfigError(f"torchft {installed_version()}'s {type(owner).__name__} has no {name}, which isoloco's "
                          f"torchft integration relies on (torchft {SUPPORTED_VERSION}'s); install it with "
                          f"{_INSTALL}") from None


def fragments(diloco: Any) -> list[Any]:
    """The model fragments of a torchft `DiLoCo`, each synchronised on its own."""
    return list(_private(diloco, "_fragments"))


def fragment_model(fragment: Any) -> Any:
    """The module whose parameters `fragment` synchronises."""
    return _private(fragment, "_model_fragment")


def fragment_manager(fragment: Any) -> Any:
    """The torchft Manager `fragment` synchronises through."""
    return _private(fragment, "_manager")


def pseudo_gradients(fragment: Any) -> dict[str, Any]:
    """The pseudo-gradients θ − θ_r `fragment` has just taken, by its parameter names; what is
    left here is what torchft's outer step reads."""
    return _private(fragment, "_grads")


def add_pending_work(fragment: Any, work: Any) -> None:
    """Hand `fragment` a collective its synchronisation waits for before the outer step."""
    _private(fragment, "_allreduce_work").append(work)


def replace_average(fragment: Any, average: Callable[[], None]) -> None:
    """Have `fragment` call `average` where it would start its all-reduce of the mean."""
    _private(fragment, "_average_grads")  # present, so replacing it takes effect
    fragment._average_grads = average
