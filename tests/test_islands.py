"""The slow-link engine's promises where they are made: error feedback that loses nothing at any
number of islands, the simulator and processes on one code path (late workers included), and
stages that never stop the host to read a tensor.

The oracles are float64 sums of what the workers meant and plain loops (`helpers.reference_sum`);
the processes are threads (`helpers.ProcessGroup`), islands of one or two of them."""

import pytest
import torch

from isoloco.comm import LocalCommunicator
from isoloco.merge import MergeConfig, Merger, Participation
from isoloco.sync.codec import Quantization, shard_ranges
from isoloco.sync.compressed import choose_route
from isoloco.sync.handles import run_to_end

from helpers import ProcessGroup, reference_sum, run_threads

SHAPES = {"wide.weight": (12, 40), "tall.weight": (30, 6), "norm.weight": (7,)}
#: Each compressor with int8 or int4 values and error feedback.
COMPRESSORS = {
    "dense": {},
    "lowrank": {"compress": "lowrank", "compress_rank": 2},
    "topk": {"compress": "topk", "compress_density": 0.2, "compress_chunk": 64},
}


def config(compressor: str, fmt: str, **extra) -> MergeConfig:
    return MergeConfig(rule="mean", quantize=fmt, error_feedback=True, **COMPRESSORS[compressor], **extra)


def round_deltas(workers: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Pseudo-gradients of a shared low-rank part plus noise, rows of very different sizes
    (absmax scales then matter)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        rows = torch.logspace(-1, 0, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
        common = torch.randn(shape, generator=g) if len(shape) == 1 else (
            torch.randn(shape[0], 2, generator=g) @ torch.randn(2, shape[1], generator=g))
        out[name] = [(common + 0.3 * torch.randn(shape, generator=g)) * rows for _ in range(workers)]
    return out


def zeros(workers: int) -> dict[str, list[torch.Tensor]]:
    return {name: [torch.zeros(shape) for _ in range(workers)] for name, shape in SHAPES.items()}


def simulate(cfg: MergeConfig, workers: int, rounds: int, arrived=None, fetch=None, seed: int = 0):
    """The simulator (every worker an island, played in this process) over `rounds` rounds.
    Yields (round, deltas, merged, residuals) after each round; `arrived(t)` names the workers
    that arrive in round t (all by default)."""
    merger = Merger(cfg, LocalCommunicator(workers), seed=3)
    residuals = zeros(workers)
    for t in range(rounds):
        deltas = round_deltas(workers, seed * 1000 + t)
        came = arrived(t) if arrived else None
        participation = Participation(tuple(came)) if came else None
        merged = run_to_end(merger.start(deltas, t, fetch=fetch, residuals=residuals,
                                         participation=participation).steps)
        yield t, deltas, merged, residuals


# -- lossless error feedback -----------------------------------------------------------------------


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("islands", [2, 3, 4, 8])
def test_error_feedback_loses_nothing_over_fifty_rounds(compressor, fmt, islands):
    """Over T = 50 rounds Σ delivered = Σ meant − Σ_i e_i(T), in float64: every rounding on the
    way (each island's encode, each owner's re-encode on the exchange route, the factors of low
    rank, the values of top-k) is kept by some island. A rounding left out walks away by about
    its size every round."""
    meant = delivered = None
    for t, deltas, merged, residuals in simulate(config(compressor, fmt), islands, 50):
        meant_t = {name: sum(d.double() for d in ds) for name, ds in deltas.items()}
        got_t = {name: merged[name].double() * islands for name in SHAPES}
        meant = meant_t if meant is None else {n: meant[n] + meant_t[n] for n in SHAPES}
        delivered = got_t if delivered is None else {n: delivered[n] + got_t[n] for n in SHAPES}
    for name in SHAPES:
        kept = sum(r.double() for r in residuals[name])
        scale = meant[name].abs().max()
        assert (delivered[name] + kept - meant[name]).abs().max() <= 1e-5 * scale * 50, (name, compressor, fmt)


@pytest.mark.parametrize("islands", [4, 8])
def test_the_simulators_delivered_sum_stays_within_one_residual_of_the_meant_sum(islands):
    """|Σ delivered − Σ meant| is the residuals held now: flat in T, where a leak grows like √T
    (about 2.3× from round 15 to round 80)."""
    gaps, meant, delivered = {}, 0, 0
    for t, deltas, merged, _ in simulate(config("dense", "int4"), islands, 80, seed=islands):
        meant = meant + sum(d.double() for d in deltas["wide.weight"])
        delivered = delivered + merged["wide.weight"].double() * islands
        if t + 1 in (15, 80):
            gaps[t + 1] = (delivered - meant).abs().max().item()
    assert gaps[80] <= 1.5 * gaps[15], gaps


def test_the_simulator_is_the_plain_loop_bit_for_bit_with_late_workers():
    """Four islands over six rounds, workers late at random, int8 with error feedback: the merge
    and every residual are the plain loop's (`reference_sum`) bits. An island none of whose
    workers arrived sends zeros, adds nothing to its residual, and keeps its owned chunk's rounding."""
    q, workers = Quantization("int8"), 4
    expected = zeros(workers)
    late = {0: [1], 1: [1, 2], 2: [], 3: [0, 3], 4: [2], 5: [1]}
    for t, deltas, merged, residuals in simulate(config("dense", "int8"), workers, 6,
                                                 arrived=lambda t: [w for w in range(workers) if w not in late[t]]):
        arrived = [w for w in range(workers) if w not in late[t]]
        for name, ds in deltas.items():
            before = [r.clone() for r in expected[name]]
            total = reference_sum([ds[w] if w in arrived else torch.zeros_like(ds[w]) for w in range(workers)], q,
                                  choose_route(workers), expected[name], arrived)
            assert torch.equal(merged[name], total.div_(len(arrived))), (t, name)
            assert all(torch.equal(a, b) for a, b in zip(residuals[name], expected[name])), (t, name)
            for w in late[t]:  # a late island's residual moved on its owned chunk only
                start, stop = shard_ranges(ds[w].numel(), q.group_size(ds[w].shape), workers)[w]
                moved = (expected[name][w] - before[w]).reshape(-1).ne(0).nonzero().flatten()
                assert all(start <= int(i) < stop for i in moved), (t, name, w)


def test_an_island_that_did_not_arrive_keeps_its_residual_on_the_gather_route():
    """P = 2: no owner re-encodes, so a late island's residual stays exactly as it was."""
    for t, _, _, residuals in simulate(config("dense", "int4"), 2, 2, arrived=lambda t: [0] if t else [0, 1]):
        if t == 0:
            kept = [r.clone() for r in residuals["wide.weight"]]
    assert torch.equal(residuals["wide.weight"][1], kept[1]) and not torch.equal(residuals["wide.weight"][0], kept[0])


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_offloaded_residuals_are_stored_back(compressor):
    """A fetch that copies (offloaded workers) gives the bits of one that does not: every
    residual the merge changed went back to where it is stored."""
    runs = [list(simulate(config(compressor, "int8"), 3, 3, fetch=fetch)) for fetch in (None, torch.clone)]
    for (_, _, a, ra), (_, _, b, rb) in zip(*runs):
        for name in SHAPES:
            assert torch.equal(a[name], b[name]) and all(torch.equal(x, y) for x, y in zip(ra[name], rb[name]))
    assert any(r.abs().sum() > 0 for r in runs[1][-1][3]["wide.weight"])


# -- one code path ------------------------------------------------------------------------------------


def thread_rounds(cfg: MergeConfig, islands: int, slices: int, rounds: int, arrived) -> list:
    """Islands of `slices` thread-processes each (one worker per island) over `rounds` rounds:
    each process's merged tensors and residuals, per round."""
    comms = ProcessGroup(islands * slices).communicators(1, slices)
    mergers = [Merger(cfg, comm, seed=3) for comm in comms]
    residuals = [zeros(islands) for _ in comms]  # each process holds its own copy of every island's
    out: list = [[None] * len(comms) for _ in range(rounds)]

    def run(rank: int) -> None:
        ids = comms[rank].local_worker_ids
        for t in range(rounds):
            deltas = round_deltas(islands, t)
            mine = {name: [ds[w] for w in ids] for name, ds in deltas.items()}
            kept = {name: [rs[w] for w in ids] for name, rs in residuals[rank].items()}
            merged = run_to_end(mergers[rank].start(mine, t, residuals=kept,
                                                    participation=Participation(tuple(arrived(t)))).steps)
            out[t][rank] = (merged, {name: [r.clone() for r in rs] for name, rs in kept.items()})

    run_threads(run, len(comms))
    return out


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("slices", [1, 2])
def test_processes_give_the_simulators_bits_with_late_workers(compressor, fmt, slices):
    """Four islands of one or two processes each, two of four workers arrived in alternate
    rounds: every process ends every round with the simulator's merge and its island's
    residuals, bit for bit (the route follows the islands, not the arrivals; with two processes
    per island each carries half the chunks, and every one keeps the whole residual)."""
    cfg = config(compressor, fmt)
    arrived = (lambda t: [0, 2] if t % 2 else [1, 2, 3])
    spread = thread_rounds(cfg, 4, slices, 3, arrived)
    for t, _, merged, residuals in simulate(cfg, 4, 3, arrived=arrived):
        for rank, (got, kept) in enumerate(spread[t]):
            island = rank // slices
            for name in SHAPES:
                assert torch.equal(got[name], merged[name]), (t, rank, name)
                assert torch.equal(kept[name][0], residuals[name][island]), (t, rank, name)


# -- stages that never stop the host ------------------------------------------------------------------


CONVERSIONS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_no_stage_reads_a_tensor_on_the_host(compressor, monkeypatch):
    """A GPU stage that converts a tensor to a Python value waits for the side stream and so
    cannot overlap training: once the merge has started (its one finiteness check per bucket
    done), no stage converts one."""
    merger = Merger(config(compressor, "int8"), LocalCommunicator(4), seed=3)
    sync = merger.start(round_deltas(4, 0), 0, residuals=zeros(4))

    def refuse(*_, **__):
        raise AssertionError("a stage converted a tensor to a Python value")

    for name in CONVERSIONS:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    result = run_to_end(sync.steps)
    monkeypatch.undo()
    assert set(result) == set(SHAPES)


# -- four gloo processes ---------------------------------------------------------------------------


GLOO_CASES = {f"{compressor}-{fmt}": config(compressor, fmt) for compressor, fmt in
              [("dense", "int8"), ("dense", "int4"), ("lowrank", "int8"), ("topk", "int4")]}


def gloo_arrivals(t: int) -> list[int]:
    return [1, 2, 3] if t % 2 == 0 else [0, 2]  # two of four workers arrive in odd rounds


def _gloo_islands(rank: int, world_size: int, port: int, root: str) -> None:
    from isoloco.config import resolve
    from isoloco.distributed import Distributed, process_group
    from test_distributed import SMALL, _join_job

    _join_job(rank, world_size, port)
    cfg = resolve(None, {**SMALL, "method": "diloco", "workers": world_size, "dist.timeout_s": 60})
    out = {}
    with process_group(cfg):
        for case, merge_cfg in GLOO_CASES.items():
            comm = Distributed(cfg).comm
            merger = Merger(merge_cfg, comm, seed=3)
            residuals = zeros(world_size)
            ids = comm.local_worker_ids
            for t in range(3):
                deltas = round_deltas(world_size, t)
                kept = {name: [rs[w] for w in ids] for name, rs in residuals.items()}
                merged = run_to_end(merger.start({name: [ds[w] for w in ids] for name, ds in deltas.items()}, t,
                                                 residuals=kept,
                                                 participation=Participation(tuple(gloo_arrivals(t)))).steps)
                out[(case, t)] = (merged, {name: [r.clone() for r in rs] for name, rs in kept.items()})
    torch.save(out, f"{root}/islands.{rank}.pt")


@pytest.mark.multiprocess
def test_four_gloo_processes_give_the_simulators_bits_with_late_workers(tmp_path):
    """Four islands of one gloo process each against the simulator, two of four workers arrived
    in odd rounds, int8 and int4 dense sums, low rank and top-k, with error feedback: the same
    merged bits and residuals on every process, every round."""
    from test_distributed import run_processes

    run_processes(_gloo_islands, 4, str(tmp_path))
    ranks = [torch.load(tmp_path / f"islands.{rank}.pt") for rank in range(4)]
    for case, merge_cfg in GLOO_CASES.items():
        for t, _, merged, residuals in simulate(merge_cfg, 4, 3, arrived=gloo_arrivals):
            for rank, got in enumerate(ranks):
                merged_here, kept = got[(case, t)]
                for name in SHAPES:
                    assert torch.equal(merged_here[name], merged[name]), (case, t, rank, name)
                    assert torch.equal(kept[name][0], residuals[name][rank]), (case, t, rank, name)
