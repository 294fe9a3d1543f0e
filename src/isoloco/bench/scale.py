"""Scale: what one merge costs as the number of workers grows, at the paper's shapes.

Three tables:

* **Peak memory of merging one parameter**, in units of one delta, per rule at K = 8, 32 and
  128 workers in one process (the simulator with offloaded workers). The stored deltas stand
  for host memory and are not counted; each fetch makes a fresh copy, as a host-to-device
  copy does, and those copies, the rule's buffers and its result are. Every (rule, K) runs
  in a fresh process; CPU: the resident high-water mark (VmHWM) over the merge minus the
  resident memory before it; CUDA: `torch.cuda.max_memory_allocated` over the merge.
* **Merge seconds per round at K = 16** on the 178M model's matrices: one matrix of each
  distinct shape is merged (interleaved repeats), and the times are summed with the number
  of such matrices in the model as weights; the median round, and the spread of one
  repeat's ratio to Iso-C.
* **DARE's masks**: seconds to draw one 32.8M-entry mask with the counter-based generator
  and, for reference, with `torch.bernoulli` (the generator the masks used before).

* **Restores**: the peak host memory of `isoloco train --resume` over the state it loads
  (`isoloco.bench.restore`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Iterator

import torch

from isoloco import rules
from isoloco.bench.factors import RULE_NAMES, paths_taken
from isoloco.bench.memory import in_fresh_processes, peak, start_span
from isoloco.bench.restore import restore_peak_ratio
from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import parameter_shapes
from isoloco.comm import LocalCommunicator, nbytes
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig
from isoloco.factors import FactorSettings
from isoloco.ortho import iso_correct

FULL = {"memory_shape": (32000, 1024), "memory_workers": (8, 32, 128), "timing_workers": 16, "vocab": True,
        "restore_workers": (16, 64)}
QUICK = {"memory_shape": (8192, 1024), "memory_workers": (8, 32), "timing_workers": 16, "vocab": False,
         "restore_workers": (16,)}


class _Copies:
    """K stored deltas that share one storage, and a fetch that returns worker k's delta as
    a fresh tensor (a common low-rank part plus noise at k's own scale), made in one
    operation so the fetch itself holds no temporary."""

    def __init__(self, shape: tuple[int, int], workers: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        rank = 16
        self.common = (torch.randn(shape[0], rank, generator=g) @ torch.randn(rank, shape[1], generator=g)).to(device)
        self.noise = torch.randn(shape, generator=g).to(device)
        self.stored = [self.common.view(shape) for _ in range(workers)]
        self.index = {id(view): k for k, view in enumerate(self.stored)}

    def fetch(self, stored: torch.Tensor) -> torch.Tensor:
        k = self.index[id(stored)]
        return torch.add(self.common, self.noise, alpha=0.5 + 0.01 * k)


#: The compressed merge's rows: the mean with each integer codec and error feedback.
COMPRESSED = {f"mean, {fmt} + error feedback": {"quantize": fmt, "error_feedback": True} for fmt in ("int8", "int4")}


def merge_peak(rule: str, shape: tuple[int, int], workers: int, device: str,
               keys: dict | None = None) -> tuple[float, Counter]:
    """Peak extra memory of merging one `shape` parameter from `workers` workers, in deltas
    (`keys`: more `merge.*` settings; with error feedback the workers' residuals are stored
    state, fetched as copies like the deltas), and the paths its workers' factors took (TSV,
    Iso-CTS). Meant to run in a process of its own (`fresh_process_peaks`)."""
    device = torch.device(device)
    cfg = MergeConfig(rule=rule, **(keys or {}))
    merger = Merger(cfg, LocalCommunicator(workers), seed=0)

    def measured(copies: _Copies) -> float:
        """The peak growth of one merge of `copies`, in bytes."""
        residuals = {"weight": [torch.zeros_like(copies.common) for _ in range(workers)]} if cfg.error_feedback \
            else None
        before = start_span(device)
        merged = merger.merge_all({"weight": copies.stored}, round=0, residuals=residuals,
                                  fetch=lambda stored: copies.fetch(stored) if id(stored) in copies.index
                                  else stored.clone())
        growth = peak(device) - before
        assert torch.isfinite(merged["weight"]).all()
        return growth

    # A first small merge loads what the rule's code paths load once (kernels, LAPACK, numpy).
    measured(_Copies((64, 48), workers, device))
    merger.factor_paths.clear()
    copies = _Copies(shape, workers, device)
    return measured(copies) / nbytes(copies.common), merger.factor_paths


#: glibc raises its mmap threshold after large frees, after which freed tensors stay in the
#: heap and the resident high-water mark counts memory no longer held. A fixed threshold
#: (the tunable's documented environment variable) keeps every tensor of 1 MiB or more
#: mapped and returned on free.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def ortho_peak(shape: tuple[int, int], device: str) -> float:
    """Peak extra memory of Iso-C's orthogonalisation (the default settings) of one fetched
    `shape` matrix, in deltas: the yardstick of the spectral rules' peaks."""
    device = torch.device(device)
    iso_correct(torch.randn(64, 48, device=device))  # load its code paths first
    copies = _Copies(shape, 1, device)
    before = start_span(device)
    iso_correct(copies.fetch(copies.stored[0]))
    return (peak(device) - before) / nbytes(copies.common)


def fresh_process_peaks(configs: list[tuple]) -> list[tuple[float, Counter]]:
    """`merge_peak(*config)` for each config, each in a new process, one at a time."""
    return in_fresh_processes([(merge_peak, config) for config in configs], MALLOC_ENV)


def paper_matrices(vocab: bool) -> Counter:
    """The 178M model's matrix shapes and how many of each it has (vocabulary ones optional)."""
    shapes = Counter(tuple(shape) for _, shape in parameter_shapes("178m") if len(shape) == 2)
    return Counter({shape: count for shape, count in shapes.items() if vocab or max(shape) < 8192})


def merge_seconds(shapes: Counter, workers: int, repeats: int,
                  device: str) -> tuple[dict[str, list[float]], dict[str, Counter]]:
    """Seconds per round of each rule in each repeat: one matrix of each shape timed, weighted
    by its count (the rules take turns within a repeat, so repeat i of two rules ran alike);
    and the paths of a round's factorisations (TSV, Iso-CTS), weighted alike."""
    total = {rule: [0.0] * repeats for rule in RULE_NAMES}
    paths = {rule: Counter() for rule in RULE_NAMES}
    for shape, count in shapes.items():
        copies = _Copies(shape, workers, torch.device(device))
        deltas = [copies.fetch(stored) for stored in copies.stored]
        mergers = {rule: Merger(MergeConfig(rule=rule), LocalCommunicator(workers), 0) for rule in RULE_NAMES}
        cases = {rule: (lambda m=merger: m.merge("w", deltas)) for rule, merger in mergers.items()}
        for rule, timing in interleaved(cases, repeats).items():
            for repeat, seconds in enumerate(timing.samples):
                total[rule][repeat] += count * seconds
            # Every call, the warm-up's too, took the same paths: a round's are one call's.
            paths[rule].update({path: count * n // (repeats + 1) for path, n in mergers[rule].factor_paths.items()})
        del deltas
    return total, paths


def mask_seconds(entries: int, repeats: int, device: str) -> dict[str, float]:
    key, keep = rules.mask_key(0, 0, 0, "weight"), 0.9
    chunk = rules.MASK_CHUNK.get(torch.device(device).type, rules.MASK_CHUNK["default"])

    def counter_based() -> None:
        for start in range(0, entries, chunk):
            rules.keep_mask(key, start, min(start + chunk, entries), keep, torch.device(device))

    def bernoulli() -> None:
        torch.bernoulli(torch.full((entries,), keep, device=device), generator=None)

    timings = interleaved({"counter-based": counter_based, "torch.bernoulli": bernoulli}, repeats)
    return {name: timing.median for name, timing in timings.items()}


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    setting = QUICK if quick else FULL
    shape, counts = setting["memory_shape"], setting["memory_workers"]
    memory = Table(f"Scale: peak extra memory of merging one {shape[0]}×{shape[1]} parameter, in deltas",
                   ["rule", *(f"K = {k}" for k in counts), f"K = {counts[-1]} − K = {counts[0]}",
                    "auto's paths, by K"])
    rows = [(rule, rule, None) for rule in RULE_NAMES] + [(name, "mean", keys) for name, keys in COMPRESSED.items()]
    peaks = iter(fresh_process_peaks([(rule, shape, k, device, keys) for _, rule, keys in rows for k in counts]))
    for label, _, _ in rows:
        row, paths = zip(*(next(peaks) for _ in counts))
        memory.add(label, *(f"{p:.2f}" for p in row), f"{row[-1] - row[0]:+.2f}",
                   "; ".join(paths_taken(taken, 1) for taken in paths) if any(paths) else "—")
    (alone,) = in_fresh_processes([(ortho_peak, (shape, device))], MALLOC_ENV)
    memory.add("Iso-C's orthogonalisation alone", *([f"{alone:.2f}"] * len(counts)), "—", "—")
    memory.notes.append(
        "K workers in one process with offloaded deltas: each delta is fetched as a fresh copy, one at a time "
        "and once per phase of the rule; the stored deltas (and residuals, with error feedback) are not counted. "
        "The compressed rows are the simulator's: every worker an island of its own. Default settings of every rule "
        "(TSV and Iso-CTS: `merge.factors=auto`). Each cell in a fresh process; CPU: resident high-water mark "
        "minus the resident memory before the merge, which includes memory the allocator keeps; CUDA: "
        "allocated memory.")
    yield memory

    workers = setting["timing_workers"]
    shapes = paper_matrices(setting["vocab"])
    seconds, paths = merge_seconds(shapes, workers, repeats, device)
    timing = Table(f"Scale: merge seconds per round at K = {workers} on the 178M model's matrices",
                   ["rule", "seconds per round", "÷ Iso-C", "÷ Iso-C, lowest – highest repeat",
                    "auto's paths per round"])
    for rule in RULE_NAMES:
        ratios = [mine / theirs for mine, theirs in zip(seconds[rule], seconds["iso_c"])]
        timing.add(rule, f"{statistics.median(seconds[rule]):.2f}",
                   ratio(statistics.median(seconds[rule]) / statistics.median(seconds["iso_c"])),
                   f"{ratio(min(ratios))} – {ratio(max(ratios))}", paths_taken(paths[rule], 1))
    listed = ", ".join(f"{count} × {m}×{n}" for (m, n), count in shapes.items())
    early = FactorSettings().early_dtype(torch.device(device))
    timing.notes.append(
        f"Matrices: {listed}; one of each shape is merged per repeat, the rules in turns, and weighted by its "
        f"count; the median of {repeats} repeats, and the lowest and highest ratio of one repeat. The 1-D "
        "tensors, which every rule averages, are left out. Default settings of every rule: TSV's and Iso-CTS's "
        f"range finder ran its early iterations in {str(early).removeprefix('torch.')} (`merge.finder_dtype=auto` "
        "on this device).")
    yield timing

    entries = 32_768_000 if not quick else 4_194_304
    masks = mask_seconds(entries, repeats, device)
    table = Table(f"Scale: DARE's masks, seconds per {entries:,}-entry mask",
                  ["generator", "seconds", "÷ torch.bernoulli"])
    for name, value in masks.items():
        table.add(name, f"{value:.3f}", ratio(value / masks["torch.bernoulli"]))
    table.notes.append(
        "The counter-based generator is the one the masks use (the same bits on every device); "
        "`torch.bernoulli` is what they used before, for reference.")
    yield table

    restore = Table("Scale: peak host memory of a restore ÷ the state it loads", ["R", "ratio"])
    for workers in setting["restore_workers"]:
        restore.add(workers, ratio(restore_peak_ratio(workers=workers)))
    restore.notes.append(
        "`isoloco train --resume`'s restore of a tiny-model DiLoCo checkpoint (AdamW, offloaded workers) in a "
        "fresh process; the state is the workers' optimizer state and the outer momentum "
        "(`isoloco.bench.restore` says how it is measured).")
    yield restore
