"""The recipe's settings: isoloco's outer step as torchtitan command-line flags (``--isoloco.*``).

torchtitan turns every field of its trainer config into a flag through tyro, with the
docstring under a field as its help, so `OuterSettings` is a plain dataclass of that form.
Its values become isoloco's own `MergeConfig` and `OuterConfig`, whose checks run unchanged;
their messages name the flags a torchtitan user typed (`--isoloco.lr`), not isoloco's keys.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from isoloco.errors import ConfigError
from isoloco.merge_config import MergeConfig
from isoloco.methods import METHODS
from isoloco.outer import OuterConfig, validate_combination
from isoloco.torchft import MEAN_RULES

#: The flag section: ``--isoloco.lr`` and so on.
SECTION = "isoloco"
#: The fast Iso-C mode (Newton–Schulz and the RMS scale): `isoloco_fast`'s merge keys.
FAST = {key.removeprefix("merge."): value for key, value in METHODS["isoloco_fast"].items()
        if key in ("merge.ortho", "merge.scale")}


@dataclass(kw_only=True, slots=True)
class OuterSettings:
    """IsoLoCo (or DiLoCo's mean) as the outer step of torchft's DiLoCo in torchtitan."""

    rule: str = "iso_c"
    """merge rule of the replica groups' pseudo-gradients, on torchft's all-reduce of their mean: iso_c (with
    nesterov: IsoLoCo) or mean (the rules that need more than the mean are refused: FSDP shards every tensor)"""

    optimizer: str = "nesterov"
    """outer optimizer: nesterov (Nesterov momentum) or sgd (no momentum)"""

    lr: float = 1.8
    """outer learning rate (IsoLoCo's 1.8; DiLoCo's mean with nesterov: 0.7)"""

    momentum: float = 0.8
    """Nesterov momentum (IsoLoCo's 0.8; DiLoCo's mean: 0.9); ignored by sgd"""

    placement: str = "gradient"
    """with rule iso_c: Iso-C-correct the mean pseudo-gradient before momentum (gradient, the paper's IsoLoCo) or
    the momentum update after it (update)"""

    fast: bool = False
    """with rule iso_c: Newton-Schulz orthogonalisation and the RMS scale instead of an exact SVD"""

    exclude: list[str] = field(default_factory=list)
    """comma-separated fnmatch patterns of parameter names whose matrices take the plain mean, e.g.
    tok_embeddings.weight,lm_head.weight (empty: Iso-C corrects every matrix)"""

    def merge_config(self) -> MergeConfig:
        """isoloco's merge settings these flags describe."""
        return MergeConfig(rule=self.rule, exclude=list(self.exclude), **(FAST if self.fast else {}))

    def outer_config(self) -> OuterConfig:
        """isoloco's outer optimizer settings these flags describe."""
        return OuterConfig(optimizer=self.optimizer, lr=self.lr, momentum=self.momentum, iso_placement=self.placement)

    def validate(self) -> None:
        """Raise `ConfigError`, naming the flag, for a value isoloco would refuse."""
        if self.fast and self.rule != "iso_c":
            raise ConfigError(f"{flag('fast')}=True is not allowed with {flag('rule')}={self.rule}: the fast mode is "
                              f"Iso-C's orthogonalisation; set {flag('rule')}=iso_c or drop {flag('fast')}")
        merge, outer = self.merge_config(), self.outer_config()
        try:
            merge.validate()
            outer.validate()
            validate_combination(merge, outer)
        except ConfigError as error:
            raise ConfigError(_in_flags(str(error))) from None
        if self.rule not in MEAN_RULES:  # isoloco.torchft.merge_in_quorum refuses DTensors
            raise ConfigError(f"{flag('rule')}={self.rule} is not allowed in torchtitan: its merge needs whole tensors, "
                              "and torchtitan shards every parameter with FSDP (DTensors), even in a group of one "
                              f"process; set {flag('rule')}=iso_c or mean (torchft's all-reduce, shard by shard), or "
                              "merge with that rule under torchft without torchtitan (isoloco.torchft)")


def flag(name: str) -> str:
    """The command-line flag of field `name`."""
    return f"--{SECTION}.{name}"


#: isoloco's keys → the fields of `OuterSettings` that set them.
_KEYS = {"merge.rule": "rule", "merge.exclude": "exclude", "outer.optimizer": "optimizer", "outer.lr": "lr",
         "outer.momentum": "momentum", "outer.iso_placement": "placement"}


def _in_flags(message: str) -> str:
    """`message` with isoloco's keys replaced by the recipe's flags."""
    for key in sorted(_KEYS, key=len, reverse=True):
        message = message.replace(key, flag(_KEYS[key]))
    return message


def check_fault_tolerance(enable: bool, semi_sync_method: str) -> None:
    """Raise `ConfigError` for torchtitan's fault-tolerance settings the recipe cannot run with."""
    if not enable:
        raise ConfigError("--fault-tolerance.enable=False is not allowed: isoloco's outer step runs inside torchft's "
                          "DiLoCo; set --fault-tolerance.enable (and a lighthouse: TORCHFT_LIGHTHOUSE)")
    if semi_sync_method != "diloco":
        raise ConfigError(f"--fault-tolerance.semi-sync-method={semi_sync_method} is not allowed: isoloco's outer "
                          "step is DiLoCo's; set --fault-tolerance.semi-sync-method diloco")


def check_flags(argv: list[str]) -> None:
    """Raise `ConfigError` for a setting the recipe refuses, read from torchtitan's command line
    `argv` before torchtitan is imported (seconds, and on a machine without CUDA an import
    error): the ``--isoloco.*`` flags on their defaults, and the fault-tolerance flags given.
    What it cannot read (a value tyro will refuse itself) it leaves to torchtitan, which runs
    the same checks again on the parsed config (`isoloco.torchtitan.trainer.check_recipe`)."""
    given = _flags(argv)
    types = typing.get_type_hints(OuterSettings)
    values = {}
    for name, raw in given.items():
        section, _, key = name.partition(".")
        if section != SECTION:
            continue
        negated = key.startswith("no_") and types.get(key[3:]) is bool
        key = key[3:] if negated else key
        if key not in types:
            return  # an unknown flag: tyro says so
        value = _typed(types[key], raw, negated)
        if value is None:
            return
        values[key] = value
    enable = _typed(bool, given.get("fault_tolerance.enable", []), False)
    if given.get("fault_tolerance.no_enable") is not None:
        enable = False
    method = given.get("fault_tolerance.semi_sync_method")
    check_fault_tolerance(True if enable is None else enable, method[0] if method else "diloco")
    OuterSettings(**values).validate()


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """`--name value ...` and `--name=value` items of `argv`, by name with `-` read as `_` (tyro
    takes both), each with the words that follow it up to the next flag."""
    flags: dict[str, list[str]] = {}
    name = None
    for word in argv:
        if word.startswith("--"):
            name, sep, value = word[2:].partition("=")
            name = name.replace("-", "_")
            flags[name] = [value] if sep else []
        elif name is not None:
            flags[name].append(word)
    return flags


def _typed(tp, words: list[str], negated: bool):
    """A flag's words as a value of type `tp`, or None where they are not one (tyro will say so)."""
    if tp is bool:
        if not words:
            return not negated
        if len(words) == 1 and words[0].lower() in ("true", "false"):
            return (words[0].lower() == "true") != negated
        return None
    if typing.get_origin(tp) is list:
        return [item for word in words for item in word.split(",") if item]
    if len(words) != 1:
        return None
    try:
        return tp(words[0])
    except ValueError:
        return None
