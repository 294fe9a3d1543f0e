"""The compressed sum (`isoloco.sync.compressed`) against a float64 sum, in every layout: the
simulator (every worker an island), and islands of one or several workers talking through an
all-to-all and an all-gather (threads standing in for processes)."""

import pytest
import torch

from isoloco import merge, merge_config
from isoloco.comm import LocalCommunicator
from isoloco.sync.codec import Quantization, dequantize, error_bound, quantize
from isoloco.sync.compressed import ChunkPlan, choose_route
from isoloco.sync.cost import wire_bytes
from helpers import ProcessGroup, reference_sum, run_threads

FORMATS = ["none", "bf16", "int8", "int4"]
SHAPES = {"wide.weight": (10, 300), "tall.weight": (90, 8), "norm.weight": (8,)}


def deltas_of(workers: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    # Rows of very different sizes, as a pseudo-gradient's: absmax scales then matter.
    return {name: [torch.randn(shape, generator=generator) * torch.logspace(-2, 0, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
                   for _ in range(workers)] for name, shape in SHAPES.items()}


def bound(island_sums: list[torch.Tensor], quantization: Quantization, route: str) -> torch.Tensor:
    """The stated error of the compressed sum per entry: each island's rounding, plus the
    owner's rounding of the total on the exchange route (`error_bound` of each wire)."""
    decoded, total = [], 0
    for x in island_sums:
        wire = quantize(x, quantization)
        decoded.append(error_bound(wire, x).double())
        total = total + dequantize(wire)
    stage_two = error_bound(quantize(total, quantization), total).double() if route == "exchange" else 0
    return sum(decoded) + stage_two


def exact_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double() for t in tensors]).sum(0)


def islands_of(deltas: list[torch.Tensor], per_island: int) -> list[torch.Tensor]:
    """Each island's float32 sum of its workers' deltas, in worker order."""
    sums = []
    for start in range(0, len(deltas), per_island):
        total = deltas[start].clone()
        for d in deltas[start + 1:start + per_island]:
            total.add_(d)
        sums.append(total)
    return sums


def test_the_route_is_the_cheaper_one():
    assert choose_route(2) == "gather"
    assert all(choose_route(p) == "exchange" for p in (3, 4, 8, 64))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("route", ["gather", "exchange"])
def test_the_reference_sum_is_within_its_bound_of_the_float64_sum(fmt, route):
    q = Quantization(fmt)
    inputs = deltas_of(5, seed=3)["wide.weight"]
    error = (reference_sum(inputs, q, route).double() - exact_sum(inputs)).abs()
    slack = 1e-6 * exact_sum([x.abs() for x in inputs])  # float32 additions
    assert (error <= bound(inputs, q, route) + slack).all()
    if fmt == "none":
        assert error.max() < 1e-5


def island_mergers(cfg: merge_config.MergeConfig, islands: int, workers: int, seed: int = 0) -> list[merge.Merger]:
    """One merger per simulated process of `islands`, of workers / islands workers each."""
    return [merge.Merger(cfg, comm, seed) for comm in ProcessGroup(islands).communicators(workers // islands)]


def run_islands(cfg: merge_config.MergeConfig, deltas: dict[str, list[torch.Tensor]], islands: int,
                residuals: dict[str, list[torch.Tensor]] | None = None, mergers: list[merge.Merger] | None = None,
                round: int = 0) -> list[dict[str, torch.Tensor]]:
    """Merge `deltas` (R per parameter) on `islands` simulated processes of R / islands workers
    each (on `mergers`, which keep their state across rounds, when given)."""
    workers = len(next(iter(deltas.values())))
    mergers = mergers or island_mergers(cfg, islands, workers)
    comms = [m.comm for m in mergers]
    results: list = [None] * islands

    def run(rank: int) -> None:
        ids = comms[rank].local_worker_ids
        mine = {name: [ds[i] for i in ids] for name, ds in deltas.items()}
        kept = None if residuals is None else {name: [rs[i] for i in ids] for name, rs in residuals.items()}
        results[rank] = mergers[rank].merge_all(mine, round, residuals=kept)

    run_threads(run, islands)
    return results


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("islands, per_island", [(2, 1), (2, 3), (3, 2), (4, 1), (4, 2)])
def test_every_layout_is_within_the_bound_of_the_float64_sum(fmt, islands, per_island):
    """Islands of several workers add theirs up first; every island ends with the same bits,
    which are the reference's on the islands' sums and within the stated bound of the exact sum."""
    q = Quantization(fmt)
    workers = islands * per_island
    deltas = deltas_of(workers, seed=islands * 10 + per_island)
    results = run_islands(merge_config.MergeConfig(rule="mean", quantize=fmt), deltas, islands)
    route = choose_route(islands)
    for name, ds in deltas.items():
        sums = islands_of(ds, per_island)
        summed = results[0][name].double() * workers
        slack = 1e-6 * exact_sum([d.abs() for d in ds]) + 1e-7
        assert ((summed - exact_sum(ds)).abs() <= bound(sums, q, route) + slack).all(), name
        assert all(torch.equal(r[name], results[0][name]) for r in results), name
        assert torch.equal(results[0][name], reference_sum(sums, q, route).div_(workers)), name


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_simulator_plays_every_worker_as_an_island(fmt):
    """One process of R workers gives the bits of R islands of one worker each."""
    q = Quantization(fmt)
    deltas = deltas_of(4, seed=7)
    simulated = merge.Merger(merge_config.MergeConfig(rule="mean", quantize=fmt), LocalCommunicator(4), 0).merge_all(deltas)
    spread = run_islands(merge_config.MergeConfig(rule="mean", quantize=fmt), deltas, 4)
    for name, ds in deltas.items():
        assert torch.equal(simulated[name], spread[0][name]), name
        summed = simulated[name].double() * 4
        assert ((summed - exact_sum(ds)).abs() <= bound(ds, q, "exchange") + 1e-6).all(), name


def test_error_feedback_keeps_each_islands_loss_with_its_first_worker():
    """Over rounds, what the merge delivered adds up to what the workers meant minus the islands'
    residuals; an island's residual lives with its first worker, the others stay zero."""
    cfg = merge_config.MergeConfig(rule="mean", quantize="int4", error_feedback=True)
    residuals = {name: [torch.zeros(shape) for _ in range(4)] for name, shape in SHAPES.items()}
    meant = delivered = 0
    for t in range(6):
        deltas = deltas_of(4, seed=100 + t)
        delivered = delivered + run_islands(cfg, deltas, 2, residuals)[0]["wide.weight"].double() * 4
        meant = meant + exact_sum(deltas["wide.weight"])
    # The owners' re-encoding has no residual: its errors stay, bounded, on top.
    lost = exact_sum(residuals["wide.weight"])
    assert (delivered - (meant - lost)).abs().max() < 1e-4  # P = 2: the gather route, one rounding
    kept = residuals["wide.weight"]
    assert kept[0].abs().sum() > 0 and kept[2].abs().sum() > 0
    assert kept[1].abs().sum() == 0 and kept[3].abs().sum() == 0


@pytest.mark.parametrize("islands", [3, 4, 8, 16])
def test_wire_bytes_per_process_are_flat_in_the_islands(islands):
    """Against float32's ring all-reduce of the same bucket, at every P: ≈ w/4 of it."""
    shapes = [torch.Size((1024, 1024)), torch.Size((1024,))]
    entries = sum(s.numel() for s in shapes)
    float32 = wire_bytes("all_reduce", 4 * entries, islands)
    ratios = {fmt: ChunkPlan.of(shapes, Quantization(fmt), islands, 1).wire_bytes() / float32
              for fmt in ("bf16", "int8", "int4")}
    assert ratios["bf16"] == pytest.approx(0.5, rel=1e-3)
    assert ratios["int8"] == pytest.approx((1 + 4 / 256) / 4, rel=5e-3) and ratios["int8"] <= 0.3
    assert ratios["int4"] == pytest.approx((0.5 + 4 / 256) / 4, rel=5e-3) and ratios["int4"] <= 0.17
    # The old layout (every worker's codes gathered) grows with P; this one does not.
    assert ChunkPlan.of(shapes, Quantization("none"), islands, 1).wire_bytes() == pytest.approx(float32, rel=1e-3)


@pytest.mark.parametrize("fmt, scales", [("int8", "block"), ("int4", "block"), ("int4", "row")])
def test_a_runs_bytes_per_worker_are_its_tensors_codes_and_scales(tmp_path, fmt, scales):
    """What a run reports each worker sent in a round, against a count made here from the
    parameters' shapes and the codec's layout: per tensor, its codes (a byte per entry for int8,
    half a byte for int4, rounded up) and a float32 scale per group (100 entries, the last group
    shorter; or a matrix row, a vector being one row)."""
    import json

    from isoloco.config import resolve
    from isoloco.trainer import Trainer
    from helpers import SMALL

    cfg = resolve(None, {**SMALL, "method": "diloco", "workers": 2, "steps": 2, "inner_steps": 2, "eval_every": 2,
                         "merge.quantize": fmt, "merge.quantize_scales": scales, "merge.quantize_block": 100})
    trainer = Trainer(cfg, tmp_path, progress=False)
    trainer.run()
    expected = 0
    for _, param in trainer.named_params:
        entries = param.numel()
        codes = entries if fmt == "int8" else (entries + 1) // 2
        groups = -(-entries // 100) if scales == "block" else param.shape[0] if param.ndim == 2 else 1
        expected += codes + 4 * groups
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["bytes_per_worker"] for line in lines if "bytes_per_worker" in line] == [expected]
    assert {param.ndim for _, param in trainer.named_params} == {1, 2}  # both kinds of row counted
