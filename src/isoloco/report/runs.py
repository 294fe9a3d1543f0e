"""Loading runs: what the report reads of each run directory (`RunResult`), the variant that sets
a run apart from the other runs of its method, the dp run each gap is to, and the groups of runs
that differ only in their seed."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from isoloco.config import EXECUTION_KEYS, flatten, from_dict, to_dict
from isoloco.train_config import TrainConfig
from isoloco.errors import ReportError
from isoloco.methods import METHODS
from isoloco.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE


@dataclass(frozen=True)
class RunResult:
    """What the report needs of one run directory; workers and inner_steps are None for dp."""

    name: str
    method: str
    workers: int | None
    inner_steps: int | None
    seed: int
    model: str
    tokens: int
    final_val_loss: float | None  # None until the run has finished (summary.json)
    unigram_baseline: float | None  # the loss of predicting the token frequencies (summary.json)
    wall_time_s: float | None
    cpu_time_s: float | None  # the training process's CPU time in rounds (absent from older runs)
    curve: tuple[tuple[int, float], ...]  # (tokens, validation loss) at each evaluation
    settings: tuple[tuple[str, Any], ...] = ()  # what the run computes: config keys and processes
    variant: str = ""  # the settings that set it apart from other runs of its method, `key=value ...`
    gap_pct: float | None = None
    peak: tuple[int, float] | None = None  # (step, validation loss) of its highest evaluation
    # Above the unigram baseline at an evaluation after its first: not a model still learning the
    # token frequencies, but one that lost them again (or never learnt them).
    above_after_first: bool = False
    wire_bytes: float | None = None  # cross-island bytes over the run, all processes (newer runs only)
    # Slow-link bytes per process per round (measured in a job, modelled in the simulator) and how
    # many times fewer than float32's for the same model and layout (newer runs only).
    slow_link_bytes: float | None = None
    fewer_than_float32: float | None = None
    exposed_sync_s: float | None = None  # synchronisation seconds training waited for (newer runs only)
    # (step, workers merged) of each round (runs that record `workers_merged`): fewer than R with late workers.
    participation: tuple[tuple[int, int], ...] = ()
    # The variant, plus its values of the settings other methods vary that apply to it: what the
    # tables show, so that a method run with one setting does not read as "—" beside the others.
    shown_variant: str = ""
    # Its values of the settings a search chose at each R (the report's `tuned` keys that vary):
    # shown, but not part of the variant, so that a tuned method's runs at every R are one series.
    tuned: str = ""

    @property
    def label(self) -> str:
        """The method, and its variant when it has one: what `--compare` names."""
        return f"{self.method} {self.variant}" if self.variant else self.method

    @property
    def settings_shown(self) -> str:
        """The variant and the tuned settings: every setting that sets the run apart but its seed."""
        return " ".join(part for part in (self.variant, self.tuned) if part)

    @property
    def unstable(self) -> bool:
        """Ended above the unigram baseline: training diverged, so its loss supports no comparison."""
        return None not in (self.final_val_loss, self.unigram_baseline) and self.final_val_loss > self.unigram_baseline

    @property
    def rose_above_unigram(self) -> bool:
        """Above the unigram baseline at some evaluation (early, before the model has learnt the token
        frequencies, or later, diverging): the verdicts that rest on such a run say so."""
        return None not in (self.peak, self.unigram_baseline) and self.peak[1] > self.unigram_baseline

    @property
    def is_dp(self) -> bool:
        return self.workers is None

    @property
    def budget(self) -> tuple[str, int]:
        return self.model, self.tokens


def _method_rank(method: str) -> tuple[int, str]:
    order = list(METHODS)
    return (order.index(method), "") if method in order else (len(order), method)


def sort_key(run: RunResult) -> tuple:
    return (_method_rank(run.method), run.workers or 0, run.inner_steps or 0, run.model, run.tokens, run.variant,
            run.seed, run.name)


def _records(path: Path) -> list[dict[str, Any]]:
    """The lines of metrics.jsonl; a torn last line of a run in progress is skipped, and so is a missing file."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _read_curve(records: list[dict[str, Any]]) -> tuple[tuple[int, int, float], ...]:
    """(step, tokens, validation loss) of each evaluation."""
    return tuple((int(r["step"]), int(r["tokens"]), float(r["val_loss"])) for r in records if "val_loss" in r)


#: Every config key at its default, for configs written before a key existed.
DEFAULT_SETTINGS = flatten(to_dict(TrainConfig()))


def _is_setting(key: str) -> bool:
    """Whether a config key is one of a run's settings: it changes what the run computes, and it is
    neither the seed nor an axis of the tables."""
    return key not in EXECUTION_KEYS and key not in ("seed", "method", "workers", "inner_steps")


#: The settings of a run at its defaults: what --tuned may name.
TUNABLE_KEYS = frozenset(filter(_is_setting, DEFAULT_SETTINGS))


def load_run(run_dir: Path) -> RunResult:
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    summary = json.loads((run_dir / SUMMARY_FILE).read_text()) if (run_dir / SUMMARY_FILE).is_file() else {}
    dp = cfg["algorithm"] == "dp"
    # Everything that changes what the run computes, but the seed and the axes of the tables.
    # A key an older config lacks has its default value, not a value of its own.
    saved = {**DEFAULT_SETTINGS, **flatten(cfg)}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                if _is_setting(k)}
    settings["processes"] = summary.get("processes", 1)
    records = _records(run_dir / METRICS_FILE)
    evaluations = _read_curve(records)
    peak = max(evaluations, key=lambda point: point[2], default=None)
    unigram = summary.get("unigram_baseline")
    return RunResult(
        name=run_dir.name, method=cfg["method"], workers=None if dp else cfg["workers"],
        inner_steps=None if dp else cfg["inner_steps"], seed=cfg["seed"], model=cfg["model"],
        # The budget a run was given: what a finished one scheduled (older runs: what they trained, the
        # same without slow workers); an unfinished one is counted by its plan.
        tokens=summary.get("tokens_scheduled") or summary.get("tokens")
        or from_dict(cfg).train_steps * cfg["global_batch"] * cfg["seq_len"],
        final_val_loss=summary.get("final_val_loss"), unigram_baseline=unigram,
        wall_time_s=summary.get("wall_time_s"), cpu_time_s=summary.get("cpu_time_s"),
        curve=tuple((tokens, loss) for _, tokens, loss in evaluations),
        peak=None if peak is None else (peak[0], peak[2]),
        above_after_first=unigram is not None and any(loss > unigram for *_, loss in evaluations[1:]),
        wire_bytes=summary.get("cross_island_wire_bytes"), exposed_sync_s=summary.get("exposed_sync_seconds"),
        slow_link_bytes=summary.get("slow_link_bytes_per_round"),
        fewer_than_float32=summary.get("slow_link_fewer_than_float32"),
        participation=tuple((int(r["step"]), int(r["workers_merged"])) for r in records if "workers_merged" in r),
        settings=tuple(sorted(settings.items())))


def load_runs(directory: Path, repeats: list[tuple[RunResult, RunResult]] | None = None,
              tuned: Sequence[str] = ()) -> list[RunResult]:
    """Every run directly under `directory`, sorted, each with its gap to the matching dp run. Of
    two runs of one point with the same seed, the first by name is kept; `repeats`, when given,
    receives each (left out, kept) pair. `tuned`: settings a search chose per point (R, H and
    budget), so that a method's runs that differ only in them form one series."""
    unknown = [key for key in tuned if key not in TUNABLE_KEYS]
    if unknown:
        raise ReportError(f"--tuned {','.join(unknown)}: not a setting a run's config can vary; give config keys "
                          "such as --tuned outer.lr,outer.momentum")
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory: give the folder a sweep wrote its runs to")
    runs = [load_run(p) for p in directory.iterdir() if (p / CONFIG_FILE).is_file()]
    if not runs:
        raise ReportError(f"{directory} holds no run directories (folders with {CONFIG_FILE}); give the --out "
                          "folder of `isoloco sweep` or a folder of `isoloco train` runs")
    runs = sorted(runs, key=lambda run: run.name)  # in name order, so that an error names the same runs each time
    runs = _drop_repeats(sorted(_with_variants(runs, tuned), key=sort_key), repeats if repeats is not None else [])
    # The reference of a run: the dp run of its budget and seed, of the strongest dp variant.
    strongest = {budget: variants[0] for budget, variants in dp_variants(runs).items()}
    reference = {(r.budget, r.seed): r.final_val_loss for r in runs if r.is_dp and r.final_val_loss is not None
                 and r.variant == strongest[r.budget]}
    return [replace(r, gap_pct=_gap(r.final_val_loss, reference.get((r.budget, r.seed)))) for r in runs]


def _drop_repeats(runs: list[RunResult], repeats: list[tuple[RunResult, RunResult]]) -> list[RunResult]:
    """One run per point and seed: a second run of the same seed is the same sample again (a rerun,
    or one run linked twice), so averaging both would count one seed as two and shrink the spread."""
    kept: dict[tuple, RunResult] = {}
    for run in runs:
        key = (run.method, run.workers, run.inner_steps, run.budget, run.variant, run.seed)
        if key in kept:
            repeats.append((run, kept[key]))
        else:
            kept[key] = run
    return list(kept.values())


def dp_variants(runs: list[RunResult]) -> dict[tuple, list[str]]:
    """Budget -> the variants of its finished dp runs, lowest mean final loss first. The gaps are to
    the first: where dp ran with several settings at one budget (an lr search), the strongest
    baseline, the same one for every seed."""
    means: dict[tuple, list[tuple[float, str]]] = {}
    for group in group_runs([r for r in runs if r.is_dp and r.final_val_loss is not None]):
        means.setdefault(group.first.budget, []).append(
            (statistics.fmean(group.values("final_val_loss")), group.first.variant))
    return {budget: [variant for _, variant in sorted(found)] for budget, found in means.items()}


def show_setting(value: Any) -> str:
    """A setting as `key=value` writes it on the command line (lists comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


#: Keys some method's defaults set (merge.density: TIES's): a method that does not set one ignores it.
_METHOD_KEYS = {key for values in METHODS.values() for key in values}


def applies(key: str, method: str) -> bool:
    """Whether `key` can change what `method` computes: dp has no merge and no outer step, and a
    key that only some methods' defaults set (a merge rule's parameter) belongs to those."""
    if METHODS.get(method, {}).get("algorithm") == "dp" and key.startswith(("merge.", "outer.")):
        return False
    return key not in _METHOD_KEYS or key in METHODS.get(method, {})


def _written(run: RunResult, keys: Iterable[str]) -> str:
    """The run's values of `keys`, `key=value ...`."""
    own = dict(run.settings)
    return " ".join(f"{key}={show_setting(own.get(key))}" for key in keys)


def _with_variants(runs: list[RunResult], tuned: Sequence[str] = ()) -> list[RunResult]:
    """Each run with its variant: the settings whose values differ between the runs of its method,
    but the `tuned` ones, which go to its `tuned` field and must take one value per point; and what
    the tables show of it: those, and its values of the settings other methods vary."""
    by_method: dict[str, list[RunResult]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)
    varying: dict[str, list[str]] = {}
    for method, members in by_method.items():
        values: dict[str, set] = {}
        for run in members:
            for key, value in run.settings:
                values.setdefault(key, set()).add(value)
        varying[method] = sorted(key for key, seen in values.items() if len(seen) > 1)
    anywhere = sorted({key for keys in varying.values() for key in keys})
    labelled = []
    for method, members in by_method.items():
        shown = sorted({*varying[method], *(key for key in anywhere if applies(key, method))})
        first_at: dict[tuple, RunResult] = {}  # point -> its first run
        for run in members:
            run = replace(run, variant=_written(run, (k for k in varying[method] if k not in tuned)),
                          tuned=_written(run, (k for k in varying[method] if k in tuned)),
                          shown_variant=_written(run, shown))
            point = (run.workers, run.inner_steps, run.budget, run.variant)
            earlier = first_at.setdefault(point, run)
            if earlier.tuned != run.tuned:
                raise ReportError(
                    f"{earlier.name} ({earlier.tuned}) and {run.name} ({run.tuned}) are runs of one point with "
                    f"different tuned settings: --tuned takes settings chosen once per R and H; leave "
                    f"{', '.join(tuned)} out of --tuned, or report the runs apart")
            labelled.append(run)
    return labelled


def _gap(loss: float | None, dp_loss: float | None) -> float | None:
    return None if loss is None or dp_loss is None else 100.0 * (loss - dp_loss) / dp_loss


@dataclass(frozen=True)
class Group:
    """The runs of one (method, R, H, budget, variant) over seeds."""

    runs: tuple[RunResult, ...]

    @property
    def first(self) -> RunResult:
        return self.runs[0]

    def values(self, field: str) -> list[float]:
        return [getattr(r, field) for r in self.runs if getattr(r, field) is not None]

    @property
    def unstable(self) -> bool:
        return any(r.unstable for r in self.runs)

    @property
    def rose_above_unigram(self) -> bool:
        return any(r.rose_above_unigram for r in self.runs)

    @property
    def peak_loss(self) -> float | None:
        """The highest validation loss any of its runs reached."""
        return max((r.peak[1] for r in self.runs if r.peak is not None), default=None)


def group_runs(runs: list[RunResult]) -> list[Group]:
    groups: dict[tuple, list[RunResult]] = {}
    for run in runs:  # already sorted, and seed is the last key but the name: groups stay in order
        groups.setdefault((run.method, run.workers, run.inner_steps, run.budget, run.variant), []).append(run)
    return [Group(tuple(members)) for members in groups.values()]


def finished_runs(runs: list[RunResult]) -> list[RunResult]:
    """The runs that have a final validation loss (summary.json)."""
    return [r for r in runs if r.final_val_loss is not None]
