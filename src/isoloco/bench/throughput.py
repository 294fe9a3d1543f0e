"""Simulator throughput: tokens/s of DiLoCo with R simulated workers over tokens/s of a
plain PyTorch training loop on the same model and micro-batch.

The plain loop is the simplest loop on the simulator's own model and data: read the batch,
forward, cross-entropy, backward, clip, AdamW (foreach), zero the gradients, with the
micro-batch one worker sees (global_batch / R sequences). A sequential simulator runs R·H
such steps per round plus the copies in and out of the compute model and the outer step,
so it can at best match the loop (ratio 1.0). One simulator round and as many plain steps
alternate, and the ratio of their median times is reported.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import simulator
from isoloco.trainer import Trainer

#: The aim: the simulator may cost at most 5% over the plain loop at R = 8.
AIM = 0.95


@dataclass(frozen=True)
class ThroughputCase:
    preset: str
    workers: int
    global_batch: int = 64
    seq_len: int = 32
    inner_steps: int = 30
    method: str = "diloco"


FULL = [ThroughputCase("tiny", 1), ThroughputCase("tiny", 8), ThroughputCase("tiny", 16), ThroughputCase("small", 8)]
QUICK = [ThroughputCase("tiny", 8, inner_steps=10)]


def plain_loop(trainer: Trainer, micro_batch: int) -> Callable[[int, int], None]:
    """A textbook training loop on the trainer's model and data: `train(start, end)` runs
    steps [start, end) on the first `micro_batch` sequences of each step's global batch."""
    model, device = trainer.model, trainer.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def train(start: int, end: int) -> None:
        for step in range(start, end):
            batch = trainer.batches.rows(step, 0, micro_batch).to(device)
            with trainer.autocast:  # bf16 on CUDA, as the simulator computes
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return train


def throughput_ratio(case: ThroughputCase, repeats: int, device: str = "auto", **overrides) -> float:
    """Tokens/s of the simulator ÷ tokens/s of the plain loop on the same tokens (the ratio
    of their median times, inverted), on `device`. `overrides` go to the run config."""
    h, r = case.inner_steps, case.workers
    trainer = simulator(case.preset, case.method, r, case.global_batch, case.seq_len, h, steps=h * (repeats + 1),
                        **{"device": device, **overrides})
    train = plain_loop(trainer, case.global_batch // r)
    round_starts, plain_starts = itertools.count(0, h), itertools.count(0, h * r)

    def simulator_round() -> None:
        start = next(round_starts)
        trainer.train_round(start, start + h)

    def plain_round() -> None:  # R·H plain steps: the tokens of one round
        start = next(plain_starts)
        train(start, start + h * r)

    timings = interleaved({"simulator": simulator_round, "plain": plain_round}, repeats)
    return timings["plain"].median / timings["simulator"].median


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    table = Table("Simulator throughput: DiLoCo with R workers ÷ a plain PyTorch loop",
                  ["preset", "R", "global batch × seq len", "H", "micro-batch", "throughput ratio", f"≥ {AIM}"])
    for case in QUICK if quick else FULL:
        value = throughput_ratio(case, repeats, device)
        table.add(case.preset, case.workers, f"{case.global_batch} × {case.seq_len}", case.inner_steps,
                  case.global_batch // case.workers, ratio(value), "yes" if value >= AIM else "**no**")
    table.notes.append(f"Method {QUICK[0].method} (mean merge, Nesterov outer step), device {device}; median of "
                       f"{repeats} interleaved repeats, each one simulator round and R·H plain steps on the "
                       "same tokens. The aim (≥ 0.95) is for R = 8.")
    yield table
