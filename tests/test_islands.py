"""The slow-link engine's promises where they are made: error feedback that loses nothing at any
number of islands, the simulator and processes on one code path (late workers included), and
stages that never stop the host to read a tensor.

The oracles are float64 sums of what the workers meant and plain loops (`helpers.reference_sum`);
the processes are threads (`helpers.ProcessGroup`), islands of one or two of them."""

import dataclasses
import itertools

import pytest
import torch

from isoloco.comm import LINK_COUNTS, LocalCommunicator
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig, Participation
from isoloco.sync.slowlink import mean_wire_bytes
from isoloco.sync.codec import Quantization, shard_ranges
from isoloco.sync.compressed import choose_route
from isoloco.sync.handles import Sync, run_to_end
from isoloco.sync.sparseloco import Tiling, sparseloco_mean

from helpers import ProcessGroup, one_thread, reference_sum, run_threads

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


def simulate(cfg: MergeConfig, workers: int, rounds: int, arrived=None, fetch=None, seed: int = 0, islands: int = 0):
    """The simulator (`islands` islands of consecutive workers, by default every worker an
    island, played in this process) over `rounds` rounds. Yields (round, deltas, merged,
    residuals) after each round; `arrived(t)` names the workers that arrive in round t (all by
    default); the residuals of an island are its first worker's."""
    merger = Merger(cfg, LocalCommunicator(workers, islands=islands), seed=3)
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


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_islands_of_several_workers_lose_nothing_with_late_workers(compressor, fmt):
    """Three played islands of two workers over thirty rounds, some workers late (an island
    with one of its two, an island with none): Σ delivered = Σ meant by the arrived − Σ of the
    islands' residuals (their first workers'), in float64; the others' residuals are never
    touched."""
    late = {0: [1], 1: [2, 3], 2: [], 3: [0, 5]}
    came = (lambda t: [w for w in range(6) if w not in late[t % 4]])
    meant = delivered = 0
    for t, deltas, merged, residuals in simulate(config(compressor, fmt), 6, 30, arrived=came, islands=3):
        arrived = came(t)
        meant = meant + sum(deltas["wide.weight"][w].double() for w in arrived)
        delivered = delivered + merged["wide.weight"].double() * len(arrived)
    kept = sum(residuals["wide.weight"][head].double() for head in (0, 2, 4))
    assert all(not residuals["wide.weight"][w].any() for w in (1, 3, 5))
    assert (delivered + kept - meant).abs().max() <= 1e-5 * meant.abs().max() * 30, (compressor, fmt)


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


class DeviceCopies:
    """Copies back to pinned host memory as on a GPU (`isoloco.sync.offload`), played on the
    CPU: every store counts as asynchronous and records an event on a stream that logs it, and
    `fetch` (a copy, as an offloaded worker's) checks that the stream waited for the last event
    of a stored tensor before fetching it."""

    def __init__(self, monkeypatch, stored: list[torch.Tensor]) -> None:
        from isoloco.sync import offload

        self.offload, self.log = offload, []
        self.addresses = {tensor.data_ptr() for tensor in stored}
        log = self.log

        class Event:
            def synchronize(self):
                log.append(("synchronize", self))

        class Stream:
            def record_event(self):
                log.append(("record", Event()))
                return log[-1][1]

            def wait_event(self, event):
                log.append(("wait", event))

        monkeypatch.setattr(offload, "_asynchronous", lambda stored, value: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    def fetch(self, stored: torch.Tensor) -> torch.Tensor:
        pending = self.offload._pending.get(stored.data_ptr())
        if stored.data_ptr() in self.addresses and pending is not None:
            assert self.log[-1] == ("wait", pending[0]), "a stored tensor was fetched before its copy back landed"
        return stored.clone()

    def check_settled(self) -> None:
        """Events were recorded and waited for; `settle` waits on the host for the last of each."""
        recorded = [event for what, event in self.log if what == "record"]
        assert recorded and any(what == "wait" for what, _ in self.log)
        self.offload.settle()
        synchronized = [event for what, event in self.log if what == "synchronize"]
        assert not self.offload._pending and set(synchronized) <= set(recorded)
        assert len(synchronized) == len(self.addresses)


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_offloaded_residuals_are_stored_back_without_the_host_waiting(compressor, monkeypatch):
    """Offloaded from a GPU (pinned host memory), a residual goes back with a copy the host does
    not wait for: each store records an event, and the next fetch of that residual first has its
    stream wait for the event (on the device); `offload.settle` waits on the host for them all.
    The same bits as the blocking copies."""
    blocking = [(t, deltas, merged, {name: [r.clone() for r in rs] for name, rs in kept.items()})
                for t, deltas, merged, kept in simulate(config(compressor, "int8"), 3, 3, fetch=torch.clone)]
    merger = Merger(config(compressor, "int8"), LocalCommunicator(3), seed=3)
    residuals = zeros(3)
    copies = DeviceCopies(monkeypatch, [r for rs in residuals.values() for r in rs])
    for t, deltas, merged, kept in blocking:
        got = run_to_end(merger.start(deltas, t, fetch=copies.fetch, residuals=residuals).steps)
        for name in SHAPES:
            assert torch.equal(got[name], merged[name]) and all(map(torch.equal, residuals[name], kept[name]))
    copies.check_settled()


def test_offloaded_sparseloco_accumulators_are_stored_back_without_the_host_waiting(monkeypatch):
    """SparseLoCo's accumulators go back to pinned host memory as the residuals do."""
    tiling, rounds = Tiling(8, 4), [round_deltas(3, t) for t in range(3)]
    expected, accumulators = zeros(3), zeros(3)
    merged = [run_to_end(sparseloco_mean(LocalCommunicator(3), deltas, expected, tiling, 0.95, fetch=torch.clone))
              for deltas in rounds]
    copies = DeviceCopies(monkeypatch, [a for accs in accumulators.values() for a in accs])
    for deltas, want in zip(rounds, merged):
        got = run_to_end(sparseloco_mean(LocalCommunicator(3), deltas, accumulators, tiling, 0.95, fetch=copies.fetch))
        assert all(torch.equal(got[name], want[name]) for name in SHAPES)
    assert all(torch.equal(a, b) for name in SHAPES for a, b in zip(accumulators[name], expected[name]))
    copies.check_settled()



@pytest.mark.parametrize("transport", ["error_feedback", "sparseloco"])
def test_a_checkpoint_waits_for_the_copies_back_before_it_reads_the_residuals(tmp_path, monkeypatch, transport):
    """A residual (or SparseLoCo accumulator) whose copy back to pinned host memory is still on
    its way when a checkpoint is written: the checkpoint waits for it (`offload.settle`) and holds
    what landed. Played on the CPU: the copy lands when its event is waited for."""
    from isoloco import checkpoint as ckpt
    from isoloco.config import resolve
    from isoloco.sync import offload
    from isoloco.trainer import Trainer
    from helpers import SMALL

    class Landing:
        """The event of a copy into `stored` that lands when the host waits for it."""

        def __init__(self, stored: torch.Tensor) -> None:
            self.stored = stored

        def synchronize(self) -> None:
            self.stored.fill_(7.0)

    keys = ({"merge.quantize": "int8", "merge.error_feedback": True} if transport == "error_feedback"
            else {"outer.transport": "sparseloco"})
    cfg = resolve(None, {**SMALL, "method": "diloco", "workers": 2, "steps": 2, "inner_steps": 2, "eval_every": 2,
                         **keys})
    trainer = Trainer(cfg, tmp_path, progress=False)
    save = Trainer.save

    def save_with_copies_on_their_way(trainer, *args):
        for worker in trainer.algorithm.workers:
            for residual in worker.residual:
                offload._pending[residual.data_ptr()] = (Landing(residual), torch.device("cpu"))
        return save(trainer, *args)

    monkeypatch.setattr(Trainer, "save", save_with_copies_on_their_way)
    monkeypatch.setattr(offload, "_pending", {})  # this test's copies only, whatever it ends with
    trainer.run()
    saved = ckpt.load_tensors(ckpt.latest_checkpoint(tmp_path / "checkpoints"), ckpt.workers_file(0))
    residuals = {key: tensor for key, tensor in saved.items() if ".residual." in key}
    assert residuals and all(bool((tensor == 7.0).all()) for tensor in residuals.values())
    assert not offload._pending

def test_low_rank_factors_are_made_where_the_merge_computes(monkeypatch):
    """Offloaded from a GPU, deltas and residuals are stored in pinned host memory and fetched to
    the GPU, where the merge computes: the first round's warm-start factors must be made there,
    not where the deltas are stored, or the first product X·Q mixes devices. Played here with
    deltas stored on the CPU and fetched to the meta device."""
    from isoloco.sync import slowlink

    made: list[str] = []
    island_phase = slowlink.island_phase

    def spy(link, island, plan, compression, factors):
        made.extend(factor.device.type for factor in factors.values())
        return island_phase(link, island, plan, compression, factors)

    monkeypatch.setattr(slowlink, "island_phase", spy)
    merger = Merger(MergeConfig(rule="mean", quantize="int8", **COMPRESSORS["lowrank"]), LocalCommunicator(4), seed=3)
    merged = run_to_end(merger.start(round_deltas(4, 0), 0, fetch=lambda stored: stored.to("meta")).steps)
    assert made and set(made) == {"meta"}, made
    assert {t.device.type for t in merged.values()} == {"meta"}
    assert {f.device.type for f in merger.link.factors.values()} == {"meta"}


# -- one code path ------------------------------------------------------------------------------------


def thread_rounds(cfg: MergeConfig, islands: int, slices: int, rounds: int, arrived, per_island: int = 1) -> list:
    """Islands of `slices` thread-processes each (`per_island` workers per island) over `rounds`
    rounds: each process's merged tensors and residuals, per round."""
    comms = ProcessGroup(islands * slices).communicators(per_island, slices)
    mergers = [Merger(cfg, comm, seed=3) for comm in comms]
    residuals = [zeros(islands * per_island) for _ in comms]  # each process holds its own copy of every worker's
    out: list = [[None] * len(comms) for _ in range(rounds)]

    def run(rank: int) -> None:
        ids = comms[rank].local_worker_ids
        for t in range(rounds):
            deltas = round_deltas(islands * per_island, t)
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


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_processes_of_two_workers_give_the_bits_of_the_simulator_playing_their_islands(compressor, fmt):
    """`islands=4` with 8 workers: the simulator plays 4 islands of 2 workers, and 4 processes of
    2 workers end every round with its merge and its islands' residuals, bit for bit, with an
    island of one arrived worker and one of none. Against every worker an island of its own
    the sums differ: the islands really are encoded whole."""
    cfg = config(compressor, fmt)
    arrived = (lambda t: [0, 3, 4, 5] if t % 2 else [1, 2, 3, 6, 7])
    spread = thread_rounds(cfg, 4, 1, 3, arrived, per_island=2)
    unplayed = list(simulate(cfg, 8, 3, arrived=arrived))
    for t, _, merged, residuals in simulate(cfg, 8, 3, arrived=arrived, islands=4):
        assert not all(torch.equal(merged[name], unplayed[t][2][name]) for name in SHAPES), t
        for rank, (got, kept) in enumerate(spread[t]):
            for name in SHAPES:
                assert torch.equal(got[name], merged[name]), (t, rank, name)
                assert torch.equal(kept[name][0], residuals[name][2 * rank]), (t, rank, name)


def test_the_simulators_compressed_merge_works_linearly_in_the_islands(monkeypatch):
    """Played islands add each island's part of the all-to-all once, decoded whole (not each of
    its P chunks into P folds), read chunk ranges from the plan they share, and orthonormalise
    each low-rank sum once for all: decodes grow as R, range computations and QRs not at all."""
    import isoloco.sync.compressed as compressed
    import isoloco.sync.lowrank as lowrank

    counts: dict[str, int] = {}
    for module, name in ((compressed, "dequantize"), (compressed, "shard_ranges"), (lowrank, "orthonormal")):
        def counted(*args, real=getattr(module, name), name=name, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    def one_merge(compressor: str, workers: int) -> dict[str, int]:
        counts.clear()
        list(simulate(config(compressor, "int8"), workers, rounds=1))
        return dict(counts)

    dense = {workers: one_merge("dense", workers) for workers in (4, 16)}
    assert dense[16]["dequantize"] == 4 * dense[4]["dequantize"]
    assert dense[16]["shard_ranges"] == dense[4]["shard_ranges"]
    matrices = sum(len(shape) == 2 for shape in SHAPES.values())
    assert [one_merge("lowrank", workers)["orthonormal"] for workers in (4, 16)] == [matrices] * 2


# -- one plan for stages and bytes ----------------------------------------------------------------------


#: Each compressor, its factors or values as float32 or int8, one matrix kept whole by merge.compress_exclude.
PLANNED = {"int8": {"quantize": "int8"}, "int4": {"quantize": "int4"},
           **{f"{compressor}-{fmt}": {**COMPRESSORS[compressor], "quantize": fmt,
                                      "compress_exclude": ["wide.weight"]}
              for compressor in ("lowrank", "topk") for fmt in ("none", "int8")}}


@pytest.mark.parametrize("case", sorted(PLANNED))
@pytest.mark.parametrize("islands", [2, 3])
@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("bucket_mb", [64.0, 1e-4])
def test_the_plan_counts_the_stages_run_and_the_bytes_measured(case, islands, slices, bucket_mb):
    """Islands of one or two thread-processes, every tensor in one bucket or each in its own (a
    bucket of top-k or low-rank matrices alone): the merge yields exactly the stages it
    announced, each waiting on a collective, and the bytes measured on the slow link, averaged
    over the processes, are the cost model's (`mean_wire_bytes`, with compress_exclude)."""
    cfg = MergeConfig(rule="mean", error_feedback=True, bucket_mb=bucket_mb, **PLANNED[case])
    comms = ProcessGroup(islands * slices).communicators(1, slices)
    deltas, residuals = round_deltas(islands, 0), zeros(islands)
    announced, run, measured = [0] * len(comms), [[] for _ in comms], [0.0] * len(comms)

    def merge(rank: int) -> None:
        ids = comms[rank].local_worker_ids
        sync = Merger(cfg, comms[rank], seed=3).start(
            {name: [ds[w] for w in ids] for name, ds in deltas.items()}, 0,
            residuals={name: [rs[w].clone() for w in ids] for name, rs in residuals.items()})
        announced[rank] = sync.stages
        run[rank] = [len(handles) for handles in sync.steps]
        measured[rank] = dict(zip(LINK_COUNTS, comms[rank].reset_link_bytes().tolist()))["wire_bytes_cross_island"]

    run_threads(merge, len(comms))
    for rank in range(len(comms)):
        assert len(run[rank]) == announced[rank] and all(run[rank]), (rank, announced[rank], run[rank])
    shapes, names = [torch.Size(shape) for shape in SHAPES.values()], list(SHAPES)
    modelled = mean_wire_bytes(shapes, cfg.lossy_compression, cfg.bucket_bytes, islands, names, slices)
    assert sum(measured) / len(measured) == pytest.approx(modelled, rel=1e-12), (measured, modelled)


# -- stages that never stop the host ------------------------------------------------------------------


CONVERSIONS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero")
#: torch.linalg's functions that check their result on the host (a sync on a GPU): torch raises
#: their errors from a status it reads back.
SYNCING_LINALG = ("svd", "svdvals", "eig", "eigvals", "eigh", "eigvalsh", "cholesky", "inv", "solve", "lstsq",
                  "pinv", "matrix_rank", "det", "slogdet")
#: Each rule and compressor whose stages may overlap training: the mean, and Iso-C (with a
#: compressor, one matrix kept whole, so its finalize stage follows the compressed sums).
NO_SYNC_CASES = {f"{rule}-{compressor}": (rule, compressor) for rule in ("mean", "iso_c") for compressor in COMPRESSORS}


class HostReads:
    """While `refused`, a tensor converted to a Python value or a synchronising linalg call
    raises: what would stop the host inside a stage on a GPU. `allowed(level)` lifts the
    conversions and the linalg ("all": a rule's pure finalize step) or the linalg alone
    ("linalg": the landing, after the last stage, which the host waits for anyway)."""

    def __init__(self, monkeypatch) -> None:
        self.lifted: set[str] = set()
        self._monkeypatch = monkeypatch
        for name in CONVERSIONS:
            monkeypatch.setattr(torch.Tensor, name, self._guard("conversion", f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in SYNCING_LINALG:
            monkeypatch.setattr(torch.linalg, name, self._guard("linalg", f"torch.linalg.{name}",
                                                                getattr(torch.linalg, name)))
        monkeypatch.setattr(torch, "svd", self._guard("linalg", "torch.svd", torch.svd))

    def _guard(self, kind: str, what: str, original):
        def guarded(*args, **kwargs):
            if kind not in self.lifted:
                raise AssertionError(f"a stage called {what}, which waits for the device")
            return original(*args, **kwargs)
        return guarded

    def allowed(self, level: str):
        lifted = {"conversion", "linalg"} if level == "all" else {"linalg"}
        reads = self

        class Lifted:
            def __enter__(self):
                self.before = set(reads.lifted)
                reads.lifted |= lifted

            def __exit__(self, *_):
                reads.lifted = self.before

        return Lifted()

    def drive(self, sync):
        """Run `sync`'s stages under the refusals, then its landing with the linalg allowed."""
        for _ in range(sync.stages):
            next(sync.steps)
        with self.allowed("linalg"):
            result = run_to_end(sync.steps)
        self._monkeypatch.undo()
        return result


@pytest.mark.parametrize("case", sorted(NO_SYNC_CASES))
def test_no_stage_reads_a_tensor_on_the_host(case, monkeypatch):
    """A GPU stage that converts a tensor to a Python value, or calls a linalg function that
    checks its result on the host (an SVD, an eigendecomposition), waits for the side stream and
    so cannot overlap training: once the merge has started (its one finiteness check per bucket
    done), no stage does, for the mean and Iso-C, dense, low rank and top-k. Only Iso-C's pure
    finalize step may, and the landing after the last stage may run an SVD (Iso-C in the span of
    low rank's factors), where the host waits for the synchronisation anyway."""
    rule, compressor = NO_SYNC_CASES[case]
    extra = {"compress_exclude": ["wide.weight"]} if rule == "iso_c" and compressor != "dense" else {}
    merger = Merger(dataclasses.replace(config(compressor, "int8", **extra), rule=rule), LocalCommunicator(4), seed=3)
    reads = HostReads(monkeypatch)
    if merger._rule.finalize is not None:
        finalize = merger._rule.finalize

        def pure(merged, knobs):
            with reads.allowed("all"):
                return finalize(merged, knobs)

        merger._rule = dataclasses.replace(merger._rule, finalize=pure)
    reads.lifted = {"conversion", "linalg"}  # the finiteness check, before the first stage
    sync = merger.start(round_deltas(4, 0), 0, residuals=zeros(4))
    reads.lifted = set()
    result = reads.drive(sync)
    assert set(result) == set(SHAPES)


def test_no_sparseloco_stage_reads_a_tensor_on_the_host(monkeypatch):
    """SparseLoCo's one stage (each worker's accumulator compressed: top-k, 2-bit values with a
    scale chosen on the device) converts no tensor to a Python value either."""
    deltas = round_deltas(4, 0)
    accumulators = zeros(4)
    reads = HostReads(monkeypatch)
    steps = sparseloco_mean(LocalCommunicator(4), deltas, accumulators, Tiling(8, 4), 0.95)
    result = reads.drive(Sync(steps, 1))
    assert set(result) == set(SHAPES) and all(torch.isfinite(t).all() for t in result.values())


# -- four gloo processes ---------------------------------------------------------------------------


GLOO_CASES = {f"{compressor}-{fmt}": config(compressor, fmt) for compressor, fmt in
              [("dense", "int8"), ("dense", "int4"), ("lowrank", "int8"), ("topk", "int4")]}


#: Workers per process: one (every worker an island), and two (`islands=4` with 8 workers).
GLOO_WORKERS = (1, 2)
#: Iso-CTS, whose common sum passes from island to island in worker order (`Phase.in_order`).
IN_ORDER = MergeConfig(rule="iso_cts", common_fraction=0.6)


def gloo_arrivals(t: int, per_island: int = 1) -> list[int]:
    if per_island == 1:
        return [1, 2, 3] if t % 2 == 0 else [0, 2]  # two of four workers arrive in odd rounds
    return [1, 2, 3, 6, 7] if t % 2 == 0 else [0, 3, 4, 5]  # island 3 has none in odd rounds, 0 one


def _gloo_islands(rank: int, world_size: int, port: int, root: str) -> None:
    from isoloco.config import resolve
    from isoloco.distributed import Distributed, process_group
    from test_distributed import SMALL, _join_job

    _join_job(rank, world_size, port)
    cfg = resolve(None, {**SMALL, "method": "diloco", "workers": world_size, "dist.timeout_s": 60})
    out = {}
    with process_group(cfg):
        for (case, merge_cfg), per_island in itertools.product(GLOO_CASES.items(), GLOO_WORKERS):
            workers = world_size * per_island
            comm = Distributed(dataclasses.replace(cfg, workers=workers, global_batch=workers)).comm
            merger = Merger(merge_cfg, comm, seed=3)
            residuals = zeros(workers)
            ids = comm.local_worker_ids
            for t in range(3):
                deltas = round_deltas(workers, t)
                kept = {name: [rs[w] for w in ids] for name, rs in residuals.items()}
                came = Participation(tuple(gloo_arrivals(t, per_island)))
                merged = run_to_end(merger.start({name: [ds[w] for w in ids] for name, ds in deltas.items()}, t,
                                                 residuals=kept, participation=came).steps)
                out[(case, per_island, t)] = (merged, {name: [r.clone() for r in rs] for name, rs in kept.items()})
        for per_island in GLOO_WORKERS:
            workers = world_size * per_island
            comm = Distributed(dataclasses.replace(cfg, workers=workers, global_batch=workers)).comm
            merger, ids = Merger(IN_ORDER, comm, seed=3), comm.local_worker_ids
            for t in range(3):
                came = Participation(tuple(gloo_arrivals(t, per_island)))
                out[("in_order", per_island, t)] = run_to_end(merger.start(
                    {name: [ds[w] for w in ids] for name, ds in round_deltas(workers, t).items()}, t,
                    participation=came).steps)
    torch.save(out, f"{root}/islands.{rank}.pt")


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory) -> list[dict]:
    """What each of four gloo processes merged (`_gloo_islands`), by rank."""
    from test_distributed import run_processes

    root = tmp_path_factory.mktemp("gloo-islands")
    run_processes(_gloo_islands, 4, str(root))
    return [torch.load(root / f"islands.{rank}.pt") for rank in range(4)]


@pytest.mark.multiprocess
def test_four_gloo_processes_give_the_simulators_bits_with_late_workers(gloo_ranks):
    """Four islands of one gloo process each, of one worker and of two, against the simulator
    playing those islands (`islands=4` with 8 workers), workers late in alternate rounds, int8
    and int4 dense sums, low rank and top-k, with error feedback: the same merged bits and
    island residuals on every process, every round."""
    for (case, merge_cfg), per_island in itertools.product(GLOO_CASES.items(), GLOO_WORKERS):
        for t, _, merged, residuals in simulate(merge_cfg, 4 * per_island, 3, islands=4,
                                                arrived=lambda t: gloo_arrivals(t, per_island)):
            for rank, got in enumerate(gloo_ranks):
                merged_here, kept = got[(case, per_island, t)]
                for name in SHAPES:
                    assert torch.equal(merged_here[name], merged[name]), (case, per_island, t, rank, name)
                    assert torch.equal(kept[name][0], residuals[name][rank * per_island]), (case, t, rank, name)


@pytest.mark.multiprocess
def test_four_gloo_processes_sum_in_worker_order_as_the_simulator_does(gloo_ranks):
    """Iso-CTS's common sum runs as a chain across four gloo processes, of one worker and of
    two, workers late (process 0 with none in round 0, process 3 with none in round 1): every
    process ends with the simulator's bits, which an all-reduce, adding in another order,
    does not give (a ring adds the processes' partial sums in its own order). One thread, as
    the processes run: a LAPACK call on more may round differently."""
    for per_island in GLOO_WORKERS:
        merger = Merger(IN_ORDER, LocalCommunicator(4 * per_island), seed=3)
        for t in range(3):
            came = Participation(tuple(gloo_arrivals(t, per_island)))
            with one_thread():
                merged = run_to_end(merger.start(round_deltas(4 * per_island, t), t, participation=came).steps)
            for rank, got in enumerate(gloo_ranks):
                for name in SHAPES:
                    assert torch.equal(got[("in_order", per_island, t)][name], merged[name]), (per_island, t, rank, name)
