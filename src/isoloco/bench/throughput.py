"""Simulator throughput: tokens/s of DiLoCo with R simulated workers over tokens/s of a
plain PyTorch training loop on the same model and micro-batch; and the simulator's cost at
many workers against data-parallel training on the same global batch.

The plain loop is the simplest loop on the simulator's own model and data: read the batch,
forward, cross-entropy, backward, clip, AdamW (foreach), zero the gradients, with the
micro-batch one worker sees (global_batch / R sequences). A sequential simulator runs R·H
such steps per round plus the copies in and out of the compute model and the outer step,
so it can at best match the loop (ratio 1.0). One simulator round and as many plain steps
alternate, and the ratio of their median times is reported.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import simulator
from isoloco.inner import InnerOptimizer
from isoloco.trainer import Trainer

#: The aim: the simulator may cost at most 5% over the plain loop at R = 8.
AIM = 0.95
#: The aims at many workers: CPU seconds per token at most this multiple of dp's, by R.
SCALE_AIMS = {16: 1.1, 128: 1.3}


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


@dataclass(frozen=True)
class ScaleCase:
    """One run of the many-workers table: a method at R, with AdamW's kernel, a micro-batch, and
    the model compiled or eager."""
    method: str
    workers: int
    kernel: str = "fused"
    micro_batch: int = 0
    compile: bool = False

    @property
    def label(self) -> str:
        micro = f", micro-batch {self.micro_batch}" if self.micro_batch else ""
        return f"{self.method}{micro}{', compiled' if self.compile else ''}"


#: dp twice (its whole batch at once, as the grids run it, and in micro-batches of 16, its
#: cheapest on a CPU), DiLoCo at R = 1, 16 and 128, R = 128 on the foreach kernel of before, and
#: dp and R = 128 with the model compiled (`compile=true`).
SCALE_CASES = [ScaleCase("dp", 1), ScaleCase("dp", 1, micro_batch=16), ScaleCase("diloco", 1),
               ScaleCase("diloco", 16), ScaleCase("diloco", 128), ScaleCase("diloco", 128, kernel="foreach"),
               ScaleCase("dp", 1, compile=True), ScaleCase("diloco", 128, compile=True)]


def seconds_per_token(cases: list[ScaleCase], global_batch: int, seq_len: int, h: int, repeats: int, device: str,
                      **overrides) -> dict[ScaleCase, float]:
    """CPU seconds per token of each case on `tiny`: one round of H steps per repeat, every case
    in turns, timed on this process's CPU clock. `overrides` go to every run config."""
    trainers = {case: simulator("tiny", case.method, case.workers, global_batch, seq_len, h, steps=h * (repeats + 2),
                                device=device, micro_batch=case.micro_batch, compile=case.compile,
                                **{"inner.kernel": case.kernel}, **overrides)
                for case in cases}
    starts = {case: itertools.count(0, h) for case in cases}

    def one_round(case: ScaleCase) -> Callable[[], None]:
        def run() -> None:
            start = next(starts[case])
            trainers[case].train_round(start, start + h)
        return run

    timings = interleaved({case: one_round(case) for case in cases}, repeats, clock=time.process_time)
    return {case: timing.median / (h * global_batch * seq_len) for case, timing in timings.items()}


def scale_tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    """CPU seconds per token of DiLoCo at R = 1, 16 and 128 ÷ dp's, on `tiny` with a global batch
    of 128 sequences (one per worker at R = 128), of 64 tokens and of the R-to-128 preset's 32;
    then whether batching the workers' passes would remove what R = 128 costs beyond dp."""
    for seq_len in (64, 32):
        yield scale_table(128, seq_len, 3 if quick else 10, repeats, device)
    yield batched_passes_table(128, 32, repeats, device)


def batched_passes_table(workers: int, seq_len: int, repeats: int, device: str, **overrides) -> Table:
    """Forward and backward passes of `workers` workers on one sequence each: one worker after
    another (as the simulator steps them) and all at once (`torch.func.vmap` of the gradient over
    the workers' stacked parameters), against dp's passes over the same sequences in
    micro-batches of 16; CPU seconds, median of `repeats` interleaved repeats. `overrides` go to
    the run config."""
    from torch.func import functional_call, grad, vmap

    trainer = simulator("tiny", "dp", 1, workers, seq_len, 1, steps=1, device=device, **overrides)
    model = trainer.model
    # vmap needs a batching rule for every operation of the backward pass, and SDPA's has none:
    # the batched passes take the eager attention of the same weights.
    model.config._attn_implementation = "eager"
    tokens = trainer.batches.rows(0, 0, workers).to(trainer.device)
    stacked = {name: param.detach().expand(workers, *param.shape).clone() for name, param in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (rows[:, :-1],), {"use_cache": False}).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))

    def passes(chunks: tuple[torch.Tensor, ...]) -> None:
        for rows in chunks:
            loss(dict(model.named_parameters()), rows).backward()
        model.zero_grad(set_to_none=True)

    batched = vmap(grad(loss))
    timings = interleaved({"looped": lambda: passes(tokens.split(1)), "dp": lambda: passes(tokens.split(16)),
                           "batched": lambda: batched(stacked, tokens.unsqueeze(1))}, repeats,
                          clock=time.process_time)
    dp = timings["dp"].median
    table = Table(f"Batching the workers' passes: forward and backward of R = {workers} workers on one sequence of "
                  f"{seq_len} tokens each, CPU seconds ÷ dp's on the same sequences",
                  ["passes", "CPU seconds", "÷ dp (micro-batch 16)"])
    for name, label in (("dp", "dp, micro-batches of 16"), ("looped", "one worker after another (the simulator)"),
                        ("batched", "all workers at once (vmap over stacked parameters)")):
        table.add(label, f"{timings[name].median:.3f}", ratio(timings[name].median / dp))
    table.notes.append(f"tiny, device {device}, eager attention in every row (vmap has no batching rule for SDPA's "
                       "backward); no optimizer step. Each worker's passes read its own parameters and write its own "
                       "gradients, where dp's read and write one copy: batching the passes removes per-call "
                       "overhead, not that traffic.")
    return table


def optimizer_step_seconds(repeats: int, device: str, kernel: str = "fused", steps: int = 20, **overrides) -> float:
    """CPU seconds of one inner optimizer step of a `tiny` worker (clipping and AdamW, as a worker
    steps), its gradients set: the median of `repeats` rounds of `steps` steps."""
    trainer = simulator("tiny", "diloco", 1, 8, 32, 1, steps=1, device=device, **{"inner.kernel": kernel, **overrides})
    grads = [torch.randn_like(param) for param in trainer.params]
    optimizer = InnerOptimizer(trainer.named_params, trainer.cfg.inner, steps)

    def stepped() -> None:
        for step in range(steps):
            for param, grad in zip(trainer.params, grads):  # the step clears them, as a backward fills them
                param.grad = grad
            optimizer.step(step)

    return interleaved({"step": stepped}, repeats, clock=time.process_time)["step"].median / steps


def scale_table(global_batch: int, seq_len: int, h: int, repeats: int, device: str) -> Table:
    per_token = seconds_per_token(SCALE_CASES, global_batch, seq_len, h, repeats, device)
    whole, micro = per_token[SCALE_CASES[0]], per_token[SCALE_CASES[1]]
    compiled = next(per_token[case] for case in SCALE_CASES if case.method == "dp" and case.compile)
    step = optimizer_step_seconds(repeats, device)
    tokens = global_batch * seq_len
    table = Table(f"Simulator cost at many workers: CPU seconds per token ÷ dp's, tiny, global batch "
                  f"{global_batch} × {seq_len}",
                  ["method", "R", "AdamW kernel", "CPU µs per token", "÷ dp (whole batch)",
                   "÷ dp (micro-batch 16)", "÷ dp compiled", "aim (÷ dp, whole batch, same compile)",
                   "floor (÷ dp, whole batch)"])
    for case in SCALE_CASES:
        # Like for like: a compiled run against compiled dp, an eager one against eager dp.
        reference = compiled if case.compile else whole
        aim = SCALE_AIMS.get(case.workers) if case.method != "dp" and case.kernel == "fused" else None
        verdict = "" if aim is None else f"≤ {aim}: {'yes' if per_token[case] / reference <= aim else '**no**'}"
        # R workers step their optimizers R times per global step, where dp steps once: even with
        # forward and backward as cheap as dp's, the other R − 1 steps stay.
        floor = ratio(1 + (case.workers - 1) * step / (reference * tokens)) if aim is not None else ""
        table.add(case.label, case.workers if case.method != "dp" else "–", case.kernel,
                  f"{per_token[case] * 1e6:.1f}", ratio(per_token[case] / whole), ratio(per_token[case] / micro),
                  ratio(per_token[case] / compiled), verdict, floor)
    table.notes.append(f"Device {device}; one round of H = {h} steps per case and repeat, median of {repeats} "
                       "interleaved repeats after one untimed round, on the process's CPU clock. dp (whole batch) "
                       "computes its 128 sequences at once; in micro-batches of 16 (as the R-to-128 preset runs it) "
                       "it is cheaper on a CPU, and the column beside holds the simulator against that. The "
                       "foreach row runs AdamW's foreach kernel, as runs made before `inner.kernel` do; the compiled "
                       "rows compile the model (`compile=true`; the compile falls in the untimed round), and their "
                       "aim and floor are against compiled dp, like for like. "
                       f"Floor: 1 + (R − 1) × one worker's optimizer step (clipping and fused AdamW on tiny's "
                       f"parameters: {step * 1e3:.2f} ms of CPU, median of {repeats}) ÷ dp's CPU time per global "
                       "step, what R costs if its forward and backward passes cost what dp's do: each worker "
                       "steps its own optimizer at every global step, dp once.")
    return table
