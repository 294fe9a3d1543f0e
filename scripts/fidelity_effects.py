"""How far isoloco's deliberate deviations from the paper's code move a merge.

Real pseudo-gradients: the tiny model on the embedded corpus trains one round of H inner
steps at R workers from the same θ (repro-cpu's batch, sequence length and inner lr), and
every merge rule is applied to those deltas two ways: isoloco's, and the paper's code's
semantics where isoloco deliberately differs. Printed per R: the relative difference
‖ours − theirs‖ / ‖theirs‖ over all matrices the rule touches, and for Iso-CTS the size of
the change that aligned it with the paper's code (isoloco's earlier semantics against
today's). docs/fidelity.md holds the table this prints.

    OMP_NUM_THREADS=1 python scripts/fidelity_effects.py --workers 2,4,8,16
"""

from __future__ import annotations

import argparse
import math

import torch

from isoloco import merge_functions, rules
from isoloco.ortho import IsoSettings
from isoloco.bench.workload import trained_deltas


def real_deltas(workers: int, rounds: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Round `rounds` of DiLoCo at R = `workers` with repro-cpu's batch, H and inner lr."""
    return trained_deltas(rounds, model="tiny", method="diloco", workers=workers, global_batch=16, seq_len=64,
                          inner_steps=30, steps=30 * rounds, seed=seed, **{"inner.lr": 0.016})


def relative(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    diff = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(ours, theirs)))
    return diff / math.sqrt(sum(float(b.square().sum()) for b in theirs))


def polar(matrix: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def iso_c_theirs(deltas: list[torch.Tensor]) -> torch.Tensor:
    """The paper's code: every singular direction of the mean kept, null ones included."""
    u, s, vh = torch.linalg.svd(torch.stack(deltas).mean(0), full_matrices=False)
    return (u * s.mean()) @ vh


def iso_cts_before(deltas: list[torch.Tensor], fraction: float = 0.8) -> torch.Tensor:
    """isoloco's Iso-CTS before it followed the paper's code: s = ⌊(r − ⌊f·r⌋)/R⌋ and the
    residual factors of the unscaled Δ_r."""
    workers, mean = len(deltas), torch.stack(deltas).mean(0)
    rank = min(mean.shape)
    per_worker = (rank - int(fraction * rank)) // workers
    common = rank - workers * per_worker
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    us, ss, vs = [u[:, :common]], [s[:common]], [vh[:common].mT]
    for delta in deltas:
        residual = delta - us[0] @ (us[0].mT @ delta)
        ru, rs, rvh = torch.linalg.svd(residual, full_matrices=False)
        us.append(ru[:, :per_worker]), ss.append(rs[:per_worker]), vs.append(rvh[:per_worker].mT)
    return polar(torch.cat(us, 1)) * torch.cat(ss).mean() @ polar(torch.cat(vs, 1)).mT


def ties_theirs(deltas: list[torch.Tensor], density: float = 0.9) -> torch.Tensor:
    """The paper's code: the elected sign of a zero sum is 0, so no entry agrees there."""
    trimmed = torch.stack([rules.trim(d, density) for d in deltas])
    agree = torch.sign(trimmed) == torch.sign(trimmed.sum(0))
    return (trimmed * agree).sum(0) / agree.sum(0).clamp_min(1)


def dare_count_deviation(matrices: list[list[torch.Tensor]], drop_rate: float = 0.1) -> float:
    """The largest relative deviation of the number of entries a Bernoulli mask keeps from
    (1 − p)·n, over every worker's mask of every matrix (the paper's code keeps that count
    exactly)."""
    g = torch.Generator().manual_seed(0)
    return max(abs(float(torch.bernoulli(torch.full_like(d, 1 - drop_rate), generator=g).sum())
                   / ((1 - drop_rate) * d.numel()) - 1)
               for deltas in matrices for d in deltas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8,16", help="values of R, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="the deltas of this round are merged")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| R | Iso-CTS: before vs the paper's code | Iso-C: null directions | TIES: zero-sum sign "
          "| TIES entries with a zero sum | DARE: largest kept-count deviation |")
    print("|---|---|---|---|---|---|")
    for workers in [int(r) for r in args.workers.split(",")]:
        deltas = real_deltas(workers, args.rounds, args.seed)
        matrices = [d for d in deltas.values() if d[0].ndim == 2]
        everything = list(deltas.values())
        cts_now = [merge_functions.iso_cts(d) for d in matrices]
        zero_sums = sum(int((torch.stack([rules.trim(x, 0.9) for x in d]).sum(0) == 0).sum()) for d in everything)
        entries = sum(d[0].numel() for d in everything)
        print(f"| {workers} | {relative([iso_cts_before(d) for d in matrices], cts_now):.2%} "
              f"| {relative([merge_functions.iso_c(d, IsoSettings(ortho='svd')) for d in matrices], [iso_c_theirs(d) for d in matrices]):.1e} "
              f"| {relative([merge_functions.ties(d) for d in everything], [ties_theirs(d) for d in everything]):.1e} "
              f"| {zero_sums} of {entries} "
              f"| {dare_count_deviation(matrices):.2%} |")


if __name__ == "__main__":
    main()
