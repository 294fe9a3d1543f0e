"""How far isoloco's SparseLoCo is from tplr-ai/templar's deployed recipe, and what it sends.

Real pseudo-gradients: the tiny model on the embedded corpus trained by `method=sparseloco`
(repro-cpu's batch, sequence length and inner lr, H = 30), the deltas of its rounds 1 and 2.
Both rounds are merged from zero accumulators by isoloco (float32, `OuterStep`) and by the
float64 oracle of the released functions (tests/sparseloco_reference.py); printed per R, the
relative difference of the two updates, ‖ours − theirs‖ / ‖theirs‖ over every tensor, at
outer lr 1 (the deployed value) and at lr 0.5, where the reference's accumulator takes lr·Δ
and isoloco's Δ (so isoloco at lr η is the reference at √η). Then the bytes one worker sends
per round: isoloco's wire, the reference's payload (a uint8 per 2-bit code) and float32.
docs/fidelity.md holds the tables this prints.

    OMP_NUM_THREADS=1 python scripts/sparseloco_effects.py --workers 2,4,8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sparseloco_reference import ref_round  # noqa: E402  (tests/, the oracle the suite checks against)
from isoloco.bench.workload import parameter_shapes, trained_deltas  # noqa: E402
from isoloco.comm import LocalCommunicator  # noqa: E402
from isoloco.merge_config import MergeConfig  # noqa: E402
from isoloco.outer import OuterConfig, OuterStep  # noqa: E402
from isoloco.sync.sparseloco import HEADER_FLOATS, Tiling  # noqa: E402

DECAY, TILE, TOPK = 0.95, 64, 64


def real_deltas(workers: int, round: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Round `round` of method=sparseloco at R = `workers`, as float32 deltas."""
    deltas = trained_deltas(round, model="tiny", method="sparseloco", workers=workers, global_batch=16, seq_len=64,
                            inner_steps=30, steps=30 * round, seed=seed, **{"inner.lr": 0.016})
    return {name: [delta.float() for delta in per_worker] for name, per_worker in deltas.items()}


def tied(accumulators: dict[str, list[torch.Tensor]], deltas: dict[str, list[torch.Tensor]],
         tiling: Tiling) -> set[str]:
    """The tensors of which some worker's next accumulator has a tile whose k-th and (k+1)-th
    magnitudes are equal: which of those entries are sent is unspecified (`torch.topk`), so
    the reference and the oracle may keep different ones."""
    names = set()
    for name, kept in accumulators.items():
        layout = tiling.layout(kept[0].shape)
        if layout.kept == layout.entries:
            continue
        for accumulator, delta in zip(kept, deltas[name]):
            ordered = layout.to_tiles(accumulator * DECAY + delta).abs().sort(dim=1, descending=True).values
            if bool((ordered[:, layout.kept - 1] == ordered[:, layout.kept]).any()):
                names.add(name)
    return names


def updates(rounds: list[dict[str, list[torch.Tensor]]], lr: float, reference_lr: float) -> tuple[float, float, int]:
    """Both implementations through `rounds` from zero accumulators: the relative difference
    of their total updates over every tensor, the largest over the tensors without a tie (see
    `tied`), and how many tensors had one."""
    names = list(rounds[0])
    workers = len(rounds[0][names[0]])
    params = {name: torch.nn.Parameter(torch.zeros_like(rounds[0][name][0])) for name in names}
    outer = OuterConfig(optimizer="sgd", lr=lr, momentum=0.0, transport="sparseloco", sparse_decay=DECAY,
                        sparse_tile=TILE, sparse_topk=TOPK)
    step = OuterStep(list(params.items()), MergeConfig(), outer, LocalCommunicator(workers), seed=0)
    accumulators = {name: [torch.zeros_like(params[name]) for _ in range(workers)] for name in names}
    theta = {name: np.zeros(params[name].shape) for name in names}
    errors = [{name: np.zeros(params[name].shape) for name in names} for _ in range(workers)]
    ties: set[str] = set()
    for number, deltas in enumerate(rounds):
        ties |= tied(accumulators, deltas, outer.tiling)
        step.step(deltas, number, residuals=accumulators)
        as_float64 = [{name: deltas[name][w].double().numpy() for name in names} for w in range(workers)]
        theta = ref_round(theta, errors, as_float64, TILE, TOPK, DECAY, reference_lr, range(workers))
    diffs = {n: float(np.square(params[n].detach().double().numpy() - theta[n]).sum()) for n in names}
    norms = {n: float(np.square(theta[n]).sum()) for n in names}
    untied = max(math.sqrt(diffs[n] / norms[n]) for n in names if n not in ties and norms[n] > 0)
    return math.sqrt(sum(diffs.values()) / sum(norms.values())), untied, len(ties)


def bytes_table() -> list[str]:
    """Bytes per worker and round, by model preset."""
    tiling = Tiling(TILE, TOPK)
    lines = ["| model | isoloco's wire | the reference's payload | float32 | ×float32 (isoloco) | "
             "×float32 (reference) |", "|---|---|---|---|---|---|"]
    for preset in ("tiny", "178m"):
        shapes = [shape for _, shape in parameter_shapes(preset)]
        ours = sum(tiling.layout(shape).nbytes for shape in shapes)
        counts = [tiling.layout(shape).count for shape in shapes]
        # 12-bit indices (1.5 bytes), a uint8 per value, the shift and the 4-entry table as float32.
        theirs = sum(math.ceil(1.5 * count) + count + 4 * HEADER_FLOATS for count in counts)
        float32 = 4 * sum(math.prod(shape) for shape in shapes)
        lines.append(f"| {preset} | {ours:,} | {theirs:,} | {float32:,} | {float32 / ours:.1f} | "
                     f"{float32 / theirs:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8", help="comma-separated R values")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| R | every tensor, lr 1 | tensors with a tie | the largest of the others, lr 1 | every tensor, ours "
          "at lr 0.5 vs the reference at lr √0.5 |")
    print("|---|---|---|---|---|")
    for workers in (int(w) for w in args.workers.split(",")):
        rounds = [real_deltas(workers, round, args.seed) for round in (1, 2)]
        same, untied, ties = updates(rounds, 1.0, 1.0)
        reparametrised, _, _ = updates(rounds, 0.5, math.sqrt(0.5))
        print(f"| {workers} | {same:.1e} | {ties} of {len(rounds[0])} | {untied:.1e} | {reparametrised:.1e} |")
    print()
    print("\n".join(bytes_table()))


if __name__ == "__main__":
    main()
