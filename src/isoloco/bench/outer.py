"""Outer step cost: each merge rule's outer step against R, as a fraction of one round.

A round of the simulator is R workers × H inner steps at global_batch / R sequences each,
then one outer step. The workers run one after another and alike, so a round's training
costs R·H inner steps of one worker at that micro-batch: that is what is timed here, as
blocks of `block_steps` steps of one worker scaled by R·H / block_steps (the throughput
table checks that a whole round costs no more than its steps). Interleaved with those
blocks, each rule's `OuterStep.step` — the merge through a `LocalCommunicator`, then the
outer optimizer — runs on the preset's parameters with R pseudo-gradients
(`workload.worker_deltas`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import torch

from isoloco.bench.table import Table, percent
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import RULE_METHODS, method_sections, simulator, worker_deltas
from isoloco.comm import LocalCommunicator
from isoloco.outer import OuterStep

#: The aim: IsoLoCo's fast mode costs at most 5% of a round at R = 16 on the CPU presets.
AIM_METHOD, AIM_WORKERS, AIM_FRACTION = "isoloco_fast", 16, 0.05


@dataclass(frozen=True)
class OuterSetting:
    presets: tuple[str, ...]
    workers: tuple[int, ...]
    global_batch: int = 128  # the most workers (128) need one sequence each
    seq_len: int = 32
    inner_steps: int = 30
    block_steps: int = 3


FULL = OuterSetting(("tiny", "small"), (1, 2, 4, 8, 16, 32, 64, 128))
QUICK = OuterSetting(("tiny",), (1, 4, 16), block_steps=2)


def outer_fractions(preset: str, workers: int, setting: OuterSetting, methods: tuple[str, ...], repeats: int,
                    device: str = "auto", **overrides) -> dict[str, float]:
    """Each method's outer step as a fraction of a round at R = `workers` (both timed in
    the same interleaved repeats), on `device`. `overrides` go to the run config."""
    block = setting.block_steps
    trainer = simulator(preset, "diloco", 1, setting.global_batch // workers, setting.seq_len,
                        setting.inner_steps, steps=block * (repeats + 1), **{"device": device, **overrides})
    worker, starts = trainer.workers[0], itertools.count(0, block)

    def worker_block() -> None:
        start = next(starts)
        trainer.take_turn(worker, start, start + block)

    deltas = {name: [d.to(trainer.device) for d in ds]
              for name, ds in worker_deltas([(n, p.shape) for n, p in trainer.named_params], workers).items()}
    cases = {"block": worker_block}
    for method in methods:
        merge, outer = method_sections(method)
        params = [(name, torch.nn.Parameter(param.detach().clone())) for name, param in trainer.named_params]
        step = OuterStep(params, merge, outer, LocalCommunicator(workers), seed=0)
        cases[method] = lambda step=step: step.step(deltas, round=0)
    timings = interleaved(cases, repeats)
    round_seconds = timings["block"].median * workers * setting.inner_steps / block
    return {method: timings[method].median / round_seconds for method in methods}


def tables(quick: bool, repeats: int, device: str, methods: tuple[str, ...] = RULE_METHODS) -> Iterator[Table]:
    setting = QUICK if quick else FULL
    for preset in setting.presets:
        table = Table(f"Outer step cost on `{preset}`: one outer step as a fraction of a round",
                      ["method (rule)"] + [f"R={r}" for r in setting.workers])
        fractions = {r: outer_fractions(preset, r, setting, methods, repeats, device) for r in setting.workers}
        for method in methods:
            table.add(f"{method} ({method_sections(method)[0].rule})", *(percent(fractions[r][method]) for r in setting.workers))
        table.notes.append(
            f"A round: H = {setting.inner_steps} inner steps of every worker at a fixed global batch of "
            f"{setting.global_batch} × {setting.seq_len} tokens (each worker takes {setting.global_batch}/R), timed as "
            f"blocks of {setting.block_steps} steps of one worker × R·H/{setting.block_steps}; the outer step: "
            f"`OuterStep.step` on R pseudo-gradients. Median of {repeats} interleaved repeats per R (the "
            "R values run one after another, so compare within a column); device {device}. TSV keeps "
            "max(1, ⌊rank/R⌋) components per worker and Iso-CTS round((rank − ⌊0.8·rank⌋)/R); where that is 0 "
            "Iso-CTS keeps only the common subspace.")
        if AIM_METHOD in methods and AIM_WORKERS in setting.workers:
            value = fractions[AIM_WORKERS][AIM_METHOD]
            verdict = "holds" if value <= AIM_FRACTION else "does **not** hold"
            table.notes.append(f"Aim ({AIM_METHOD} ≤ {percent(AIM_FRACTION)} of a round at R = {AIM_WORKERS}): "
                               f"{percent(value)}, {verdict}.")
        yield table
