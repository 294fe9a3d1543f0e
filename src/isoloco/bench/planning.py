"""Planning: the wall-clock of a round of data parallelism against DiLoCo/IsoLoCo, as the
slow link between islands gets faster.

`python -m isoloco.bench.planning [--preset P --workers R --gpus-per-worker G ...] [--plot PNG]`

A model, not a measurement of a multi-island job (this machine has no slow link to time).
R islands of G processes (one worker per island) train H inner steps of B tokens per step
at a compute throughput per process that is measured here when not given (a plain training
loop of the preset on this machine's CPU, one thread). Each island reaches the others through
one slow link (bandwidth per island, latency); its processes share a fast one. Collectives
cost what the one cost model says (`isoloco.sync.cost`: ring algorithms, each latency-bound
step charged one latency; the emulated link charges the same): an all-reduce of n bytes over
k members moves 2(k−1)/k·n bytes through each member's link in 2(k−1) steps, an all-gather
half that. A step's gradient buckets overlap (one latency chain per step); the merge's
collectives, one per bucket of `merge.bucket_mb` (64 MiB), run one after another (a chain
each). Times per round:

* data parallel, at its best (a hierarchical all-reduce that carries one copy over the slow
  link): every step, compute + the gradient all-reduce inside the island and across islands;
* DiLoCo/IsoLoCo: every step, compute + the gradient all-reduce inside the island; once per
  round, the merge: one all-reduce of the model per bucket across islands, with
  the island's G processes each carrying 1/G of it (then an all-gather inside the island),
  or, before that split, all G carrying all of it over the island's one slow link.

Left out: overlap of compute and communication (`outer.overlap_steps` hides up to τ steps of
it: see `isoloco.bench.link`), compressed pseudo-gradients (`merge.quantize`), the merge's own
compute (Iso-C's orthogonalisations; see the outer-step table), and TIES's or TSV's
different merge sizes (the mean's one model is modelled). `isoloco.bench.link` checks the
model against an emulated slow link.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from isoloco.bench.table import Table
from isoloco.bench.throughput import plain_loop
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import parameter_shapes, simulator
from isoloco.sync.cost import Link
from isoloco.sync.plan import buckets
from isoloco.merge_config import MergeConfig
from isoloco.model import MODEL_PRESETS

#: Bytes per value of a gradient or pseudo-gradient (float32).
VALUE_BYTES = 4
#: The slow-link bandwidths of the table, in bit/s (the plot sweeps 1 Mbit/s to 1 Tbit/s).
TABLE_BANDWIDTHS = (1e8, 1e9, 1e10, 1e11)


@dataclass(frozen=True)
class Scenario:
    """Everything a round's time depends on; see the module docstring for the model."""

    preset: str
    islands: int  # R: one worker per island
    gpus_per_worker: int  # G
    inner_steps: int  # H
    tokens_per_step: int  # B, all workers together
    tokens_per_s: float  # compute throughput of one process
    fast: Link
    slow_latency: float  # seconds

    @property
    def model_bytes(self) -> int:
        return VALUE_BYTES * sum(shape.numel() for _, shape in parameter_shapes(self.preset))

    @property
    def merge_collectives(self) -> int:
        """The merge's all-reduces per round: one per bucket of `merge.bucket_mb`."""
        sizes = [(VALUE_BYTES * shape.numel(), torch.float32) for _, shape in parameter_shapes(self.preset)]
        return len(buckets(sizes, int(MergeConfig.bucket_mb * 2**20)))

    def compute(self) -> float:
        """Seconds of one step's forward and backward: B/R tokens per island over its G processes."""
        return self.tokens_per_step / (self.islands * self.gpus_per_worker * self.tokens_per_s)

    def round_seconds(self, slow_bandwidth: float) -> dict[str, float]:
        """Seconds per round of H steps at a slow link of `slow_bandwidth` bytes/s per island,
        for compute alone, data parallel and DiLoCo before and after the split."""
        slow, size, g, islands = Link(slow_bandwidth, self.slow_latency), self.model_bytes, self.gpus_per_worker, \
            self.islands
        # A step's gradient buckets are all-reduced asynchronously: their latencies overlap.
        in_island = self.fast.seconds("all_reduce", size, g, 1)
        dp_step = in_island + slow.seconds("all_reduce", size, islands, 1)
        # The merge runs one blocking collective per bucket: a latency chain each.
        gather = self.fast.seconds("all_gather", size, g, self.merge_collectives)
        steps = self.inner_steps * (self.compute() + in_island)
        return {
            "compute": self.inner_steps * self.compute(),
            "dp": self.inner_steps * (self.compute() + dp_step),
            # Before: the island's G processes each all-reduce the whole model over its one slow link.
            "diloco, G copies across": steps + slow.seconds("all_reduce", g * size, islands, self.merge_collectives),
            "diloco, split": steps + slow.seconds("all_reduce", size, islands, self.merge_collectives) + gather,
        }


def measured_tokens_per_s(preset: str, sequences: int, seq_len: int, repeats: int = 3) -> float:
    """Tokens/s of one process (this thread) training `preset` on `sequences` × `seq_len`
    tokens per step: a plain loop of 2 steps, median of `repeats` after a warm-up."""
    trainer = simulator(preset, "diloco", 1, sequences, seq_len, inner_steps=2, steps=2 * (repeats + 1))
    train, starts = plain_loop(trainer, sequences), iter(range(0, 2 * (repeats + 1), 2))

    def two_steps() -> None:
        start = next(starts)
        train(start, start + 2)

    return 2 * sequences * seq_len / interleaved({"steps": two_steps}, repeats)["steps"].median


def table(scenario: Scenario, measured: bool) -> Table:
    rows = Table(f"Seconds per round of H = {scenario.inner_steps} steps: `{scenario.preset}`, R = {scenario.islands} "
                 f"islands of G = {scenario.gpus_per_worker}", ["slow link", "compute", "data parallel",
                                                               "DiLoCo, G copies across", "DiLoCo, split"])
    for bits in TABLE_BANDWIDTHS:
        times = scenario.round_seconds(bits / 8)
        rows.add(f"{bits / 1e9:g} Gbit/s", *(f"{t:.3g} s" for t in times.values()))
    source = "measured on this machine, one CPU thread" if measured else "given"
    rows.notes.append(
        f"Inputs: {scenario.model_bytes / 2**20:,.1f} MiB of float32 per model, merged in "
        f"{scenario.merge_collectives} bucket{'s' if scenario.merge_collectives != 1 else ''}; "
        f"B = {scenario.tokens_per_step:,} tokens per step; {scenario.tokens_per_s:,.0f} tokens/s per process "
        f"({source}); fast link {scenario.fast.bandwidth * 8 / 1e9:g} Gbit/s and {scenario.fast.latency * 1e6:g} µs, "
        f"slow link latency {scenario.slow_latency * 1e3:g} ms (assumed). Model: `isoloco.bench.planning`.")
    return rows


def plot(scenario: Scenario, path: Path) -> None:
    """Seconds per round against the slow link's bandwidth (log-log), one line per schedule."""
    import matplotlib.style
    from matplotlib.figure import Figure

    bits = np.logspace(6, 12, 61)
    series = [scenario.round_seconds(b / 8) for b in bits]
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for name, style in zip(series[0], (":", "-", "--", "-")):
            ax.plot(bits, [s[name] for s in series], style, label=name, color="grey" if name == "compute" else None)
        ax.set(xscale="log", yscale="log", xlabel="slow link, bit/s per island", ylabel="seconds per round",
               title=f"{scenario.preset}: R = {scenario.islands} islands × G = {scenario.gpus_per_worker}, "
                     f"H = {scenario.inner_steps}, {scenario.tokens_per_s:,.0f} tokens/s per process")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
        fig.savefig(path, dpi=110, metadata={"Software": None})


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused (exit 2, one line) unless > 0."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not allowed: it must be > 0")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isoloco.bench.planning", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help=f"model: {', '.join(MODEL_PRESETS)} (default small)")
    parser.add_argument("--workers", type=positive(int), default=4, help="R: islands, one worker each (default 4)")
    parser.add_argument("--gpus-per-worker", type=positive(int), default=2, help="G: processes per island (default 2)")
    parser.add_argument("--inner-steps", type=positive(int), default=30, help="H (default 30)")
    parser.add_argument("--global-batch", type=positive(int), default=64, help="sequences per step, all workers")
    parser.add_argument("--seq-len", type=positive(int), default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--tokens-per-s", type=positive(float), default=None,
                        help="compute throughput of one process; default: measured here on one CPU thread")
    parser.add_argument("--fast-gbps", type=positive(float), default=40.0, help="fast link, Gbit/s (default 40)")
    parser.add_argument("--fast-latency-us", type=positive(float), default=10.0, help="fast link latency, µs")
    parser.add_argument("--slow-latency-ms", type=positive(float), default=10.0, help="slow link latency, ms")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot to this PNG file")
    args = parser.parse_args(argv)
    if args.preset not in MODEL_PRESETS:
        parser.error(f"--preset {args.preset} is not a model preset: choose one of {', '.join(MODEL_PRESETS)}")
    per_process = args.global_batch // (args.workers * args.gpus_per_worker)
    if per_process < 1 or args.global_batch % (args.workers * args.gpus_per_worker):
        parser.error(f"--global-batch {args.global_batch} does not split evenly over R·G = "
                     f"{args.workers * args.gpus_per_worker} processes")
    measured = args.tokens_per_s is None
    if measured:
        torch.set_num_threads(1)
    scenario = Scenario(
        args.preset, args.workers, args.gpus_per_worker, args.inner_steps, args.global_batch * args.seq_len,
        measured_tokens_per_s(args.preset, per_process, args.seq_len) if measured else args.tokens_per_s,
        Link(args.fast_gbps * 1e9 / 8, args.fast_latency_us * 1e-6), args.slow_latency_ms * 1e-3)
    print(table(scenario, measured).markdown())
    if args.plot:
        plot(scenario, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
