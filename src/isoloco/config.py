"""The run configuration resolved: presets as YAML files, `key=value` overrides, the keys and
their typed values, and which given keys would be ignored.

Resolution order (later wins): field defaults, the method's values (`isoloco.methods`),
the preset's keys, its `per_method.<method>` keys; for a YAML file, the same of the file on
top of the shipped preset it names with `preset:` (`quick` when it names none, as for
key=value items alone); command-line overrides. Every value is validated before any work starts.
The config's sections are `isoloco.train_config`; the checks against the model,
`isoloco.config_checks`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from isoloco.config_checks import check_exclude_patterns, spelled
from isoloco.configbase import check_choice
from isoloco.errors import ConfigError
from isoloco.methods import METHODS
from isoloco.rules import RULES
from isoloco.train_config import TrainConfig


# ---------------------------------------------------------------------------------------
# Keys, values and overrides


@dataclass(frozen=True)
class Key:
    """One settable key: dotted name, Python type, default, doc and allowed values."""

    name: str
    type: Any
    default: Any
    doc: str
    choices: tuple | None


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def list_keys(cls: type = TrainConfig, prefix: str = "") -> list[Key]:
    """Every leaf key of the config, in declaration order."""
    hints = typing.get_type_hints(cls)
    keys: list[Key] = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            keys.extend(list_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(Key(prefix + f.name, tp, getattr(defaults, f.name), f.metadata.get("doc", ""),
                            f.metadata.get("choices")))
    return keys


#: Keys that change how a run executes, not what it computes: a finished run is the same run
#: whatever they were (a sweep may split a grid over machines with other values), and a report
#: does not tell runs apart by them.
EXECUTION_KEYS = frozenset({"device", "offload_workers", "micro_batch", "eval_batch", "checkpoint_every",
                            "keep_checkpoints", "log.tensorboard", "log.wandb", "log.wandb_project", "log.spectra",
                            "dist.gpus_per_worker", "dist.backend", "dist.timeout_s",
                            "dist.peer_silence_s", "dist.emulate_link"})

#: `data=X` is short for `data.source=X`, the one data key people set most; `gpus_per_worker=G`
#: and `islands=P` for `dist.gpus_per_worker=G` and `dist.islands=P`, the layout keys.
ALIASES = {"data": "data.source", "gpus_per_worker": "dist.gpus_per_worker", "islands": "dist.islands"}


def _coerce(key: Key, raw: Any) -> Any:
    """Turn a YAML-parsed value into the key's type, or raise naming the key."""
    tp = key.type
    expected = getattr(tp, "__name__", str(tp))
    if typing.get_origin(tp) is list:
        numbers = typing.get_args(tp) == (float,)
        if numbers and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            raw = [raw]  # one number is a list of one
        if isinstance(raw, str):
            # `a,b` or `[a, b]` (YAML cannot read the bracket form when an item starts with `*`).
            text = raw.strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            raw = [item.strip().strip("'\"") for item in text.split(",") if item.strip()]
        if not isinstance(raw, list):
            raise ConfigError(f"{key.name}={raw!r} is not allowed: expected a list (comma-separated)")
        if numbers:
            return [_number(key, item, raw) for item in raw]
        return [str(item) for item in raw]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw):
            return float(raw)
    elif tp is str:
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    raise ConfigError(f"{key.name}={raw!r} is not allowed: expected {expected}")


def _number(key: Key, item: Any, items: list) -> float:
    """One item of a list of numbers, or the error naming the whole list."""
    if not isinstance(item, bool):
        try:
            return float(item)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{key.name}={','.join(map(str, items))} is not allowed: expected numbers separated by commas "
                      "(e.g. 1,0.5)")


def _keys_by_name() -> dict[str, Key]:
    return {k.name: k for k in list_keys()}


def typed_values(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (aliases resolved) with their values in the keys' types, as `key=value`
    reads them; unknown keys and ill-typed values raise ConfigError."""
    keys = _keys_by_name()
    typed = {}
    for name, raw in values.items():
        name = ALIASES.get(name, name)
        if name not in keys:
            raise ConfigError(f"unknown key {name!r}{_did_you_mean(name, keys)}")
        typed[name] = _coerce(keys[name], raw)
    return typed


def apply_values(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """Set dotted keys on `cfg`; unknown keys and ill-typed values raise ConfigError."""
    for name, value in typed_values(values).items():
        target = cfg
        *sections, leaf = name.split(".")
        for section in sections:
            target = getattr(target, section)
        setattr(target, leaf, value)


def _did_you_mean(name: str, keys: dict[str, Key]) -> str:
    """A hint for a misspelt key: the keys with this leaf name, else the closest spellings."""
    close = [k for k in keys if k.split(".")[-1] == name.split(".")[-1]]
    if not close:
        # A leaf alone (`worker`) or a full dotted name (`inner.lrr`) may be the misspelt part.
        names = {**{k.split(".")[-1]: k for k in keys}, **{k: k for k in keys}, **ALIASES}
        close = sorted({names[m] for m in difflib.get_close_matches(name, names, n=3, cutoff=0.75)})
    if close:
        return f" (did you mean {', '.join(close)}?)"
    return "; see `isoloco train --help` for every key"


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings; values are read as YAML scalars (`1e-3`, `true`, `a,b`)."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r} is not a key=value override (example: workers=8)")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            values[key.strip()] = raw
    return values


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested YAML mappings to dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "per_method":
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe_keys(cfg: TrainConfig) -> str:
    """The `--help` listing: every key with its value in `cfg`, allowed values and doc."""
    values = flatten(to_dict(cfg))
    lines = []
    for key in list_keys():
        allowed = f" {{{', '.join(map(str, key.choices))}}}" if key.choices else ""
        lines.append(f"  {key.name} = {values[key.name]!r}{allowed}\n      {key.doc}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Presets and saved configs


#: What `isoloco train` runs when no preset or file is named; overrides apply on top of it.
DEFAULT_PRESET = "quick"


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """A command line's optional preset (its first item, when it has no '=') and its key=value items."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items



def preset_names() -> list[str]:
    folder = resources.files("isoloco") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


#: The key of a config file that names the shipped preset the file applies on top of.
BASE_KEY = "preset"


def _is_file(name_or_path: str) -> bool:
    # A folder that happens to share a preset's name (a run's --out) does not hide the preset.
    return name_or_path.endswith((".yaml", ".yml")) or Path(name_or_path).is_file()


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset by name (shipped with the package) or a YAML file path, as dotted keys."""
    if _is_file(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"preset file {name_or_path!r} does not exist")
        text = path.read_text()
    else:
        if name_or_path not in preset_names():
            raise ConfigError(f"preset {name_or_path!r} is not known: choose one of {', '.join(preset_names())} "
                              "or give a .yaml file")
        text = (resources.files("isoloco") / "presets" / f"{name_or_path}.yaml").read_text()
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"preset {name_or_path!r} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"preset {name_or_path!r} must be a mapping of keys to values")
    return flatten(tree)


def preset_layers(name_or_path: str) -> list[tuple[str, dict[str, Any]]]:
    """What a run of `isoloco train PRESET|FILE` resolves from, base first, as (name, dotted
    keys): a shipped preset alone; a file on top of the shipped preset its `preset:` key names,
    `DEFAULT_PRESET` if none, as key=value items apply on top of it (a file and the same keys
    typed as items give the same run)."""
    values = load_preset(name_or_path)
    if not _is_file(name_or_path):
        return [(name_or_path, values)]
    base = values.pop(BASE_KEY, DEFAULT_PRESET)
    if base not in preset_names():
        raise ConfigError(f"{BASE_KEY}: {base!r} in {name_or_path} is not a shipped preset: choose one of "
                          f"{', '.join(preset_names())} (the file applies on top of it; {DEFAULT_PRESET} if the "
                          f"file names none)")
    return [(base, load_preset(base)), (name_or_path, values)]


def preset_said(name_or_path: str | None) -> str:
    """The preset (and file) a run of `isoloco train [PRESET|FILE]` starts from, in words."""
    if name_or_path is None:
        return f"preset {DEFAULT_PRESET} (the default)"
    (base, _), *file = preset_layers(name_or_path)
    return f"{name_or_path} on preset {base}" if file else f"preset {base}"


def resolve(preset: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Build and validate the full config (see the module docstring for the order)."""
    layers = preset_layers(preset) if preset else []
    for _, values in layers:
        for key in [k for k in values if k.startswith("sweep.")]:
            values.pop(key)
    per_methods = [values.pop("per_method", {}) or {} for _, values in layers]
    method = overrides.get("method", next((values["method"] for _, values in reversed(layers) if "method" in values),
                                          TrainConfig.method))
    check_choice("method", method, METHODS)
    cfg = TrainConfig()
    apply_values(cfg, METHODS[method])
    # What the user wrote: the overrides, and a file's keys off the defaults (a file may write every
    # key: a run's config.yaml). A shipped preset's keys serve every method, so one a method ignores
    # is not the user's doing.
    written: dict[str, Any] = {}
    for (name, values), per_method in zip(layers, per_methods):
        values = {**values, **flatten(per_method.get(method, {}) or {})}
        apply_values(cfg, {**values, **predated(values)})  # a run's config.yaml retrains as it ran
        if _is_file(name):
            written.update(values)
    apply_values(cfg, overrides)
    cfg.method = method
    defaults = flatten(to_dict(TrainConfig()))
    given = [*(key for key, value in written.items() if value != defaults.get(ALIASES.get(key, key))), *overrides]
    cfg.validate()
    _one_model(cfg, given)
    refuse_ignored_keys(cfg, given)
    check_exclude_patterns(cfg)
    return cfg


def _one_model(cfg: TrainConfig, given: list[str]) -> None:
    """The data-parallel baseline trains one model: refuse more workers given for it, and record
    the one it trains, whatever a preset or the default says."""
    if cfg.algorithm != "dp":
        return
    if "workers" in given and cfg.workers != 1:
        raise ConfigError(f"workers={cfg.workers} is ignored with algorithm=dp (method={cfg.method}): the "
                          "data-parallel baseline trains one model on the global batch; drop workers, or choose a "
                          "DiLoCo method (e.g. method=diloco)")
    cfg.workers = 1


#: Keys whose default changed the numerics after runs were saved: a config.yaml written before
#: the key existed lacks it, and its run used this value.
BEFORE_KEY = {"inner.kernel": "foreach"}


def predated(values: dict[str, Any]) -> dict[str, Any]:
    """The `BEFORE_KEY` values of a saved config that predates them: `values` (dotted keys)
    lacks the key but holds every other key of its section, as a config.yaml written by
    `to_dict` before the key existed does (a hand-written file or a preset names only some)."""
    keys = [key.name for key in list_keys()]
    found = {}
    for key, value in BEFORE_KEY.items():
        section = key.rsplit(".", 1)[0] + "."
        siblings = [k for k in keys if k.startswith(section) and k != key]
        if key not in values and all(k in values for k in siblings):
            found[key] = value
    return found


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved with `to_dict` (e.g. a run's config.yaml), validated; a key it
    predates takes the value its run used (`predated`), so it retrains bit for bit."""
    cfg = TrainConfig()
    values = flatten(tree)
    apply_values(cfg, {**values, **predated(values)})
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------------------
# Keys given that would be ignored


#: Keys that act only under some values of another key: key -> (that key, those values). Given
#: without one of them, such a key would be ignored (`refuse_ignored_keys`); a report's labels
#: leave it out of the runs it does not act in.
ACTS_ONLY_WITH = {"merge.compress_rank": ("merge.compress", ("lowrank",)),
                  "merge.compress_density": ("merge.compress", ("topk",)),
                  "merge.compress_chunk": ("merge.compress", ("topk",)),
                  "merge.exclude": ("merge.rule", tuple(name for name, rule in RULES.items() if rule.spectral)),
                  "inner.kernel": ("inner.optimizer", ("adamw", "muon")),  # Muon steps its vectors with AdamW
                  "outer.sparse_decay": ("outer.transport", ("sparseloco",)),
                  "outer.sparse_tile": ("outer.transport", ("sparseloco",)),
                  "outer.sparse_topk": ("outer.transport", ("sparseloco",))}

#: Sections whose every key acts only under some values of another key: the data-parallel
#: baseline has no merge and no outer step.
SECTION_ACTS_ONLY_WITH = {"merge.": ("algorithm", ("diloco",)), "outer.": ("algorithm", ("diloco",))}


def _needs(key: str) -> list[tuple[str, tuple[Any, ...]]]:
    """What `key` needs to act: (key, the values it acts under) pairs, the section's first."""
    return ([needs for section, needs in SECTION_ACTS_ONLY_WITH.items() if key.startswith(section)]
            + ([ACTS_ONLY_WITH[key]] if key in ACTS_ONLY_WITH else []))


def acts(key: str, settings: dict[str, Any]) -> bool:
    """Whether `key` acts in a run of these flat `settings` (see `ACTS_ONLY_WITH` and
    `SECTION_ACTS_ONLY_WITH`)."""
    return all(settings.get(needs) in values for needs, values in _needs(key))


def refuse_ignored_keys(cfg: TrainConfig, given: list[str]) -> None:
    """Refuse a key the user gave (a file's or an override) that `cfg` would ignore. Only
    given keys count: a saved config.yaml holds every key, at its default where not given."""
    values = flatten(to_dict(cfg))
    for key in dict.fromkeys(ALIASES.get(key, key) for key in given):
        for needs, acting in _needs(key):
            if values.get(needs) in acting:
                continue
            shown = spelled(values[key]) if isinstance(values[key], list) else values[key]
            if needs == "algorithm":
                raise ConfigError(f"{key}={shown} is ignored with algorithm={values[needs]} (method={cfg.method}): "
                                  f"the data-parallel baseline has no merge and no outer step; drop {key}, or "
                                  "choose a DiLoCo method (e.g. method=diloco)")
            if len(acting) == 1:
                method = " (method=sparseloco sets it)" if needs == "outer.transport" else ""
                only, fix = f"{needs}={acting[0]}", f"add {needs}={acting[0]}{method}"
            else:
                listed = f"{', '.join(map(str, acting[:-1]))} or {acting[-1]}"
                only, fix = f"{needs}={listed}", f"set {needs} to {listed}"
            raise ConfigError(f"{key}={shown} is ignored with {needs}={values[needs]}: it applies "
                              f"only with {only}; {fix}, or drop {key}")
