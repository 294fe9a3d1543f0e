"""The distributed engine on gloo over 127.0.0.1: every layout trains the same numbers,
merges move the bytes the README promises, and a lost process stops the run, naming it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from isoloco import checkpoint as ckpt
from isoloco import rules
from isoloco.sync.compressed import ChunkPlan
from isoloco.sync.cost import wire_bytes
from isoloco.bench import comm as bench_comm
from isoloco.bench.workload import parameter_shapes
from isoloco.config import DEFAULT_PRESET, parse_overrides, resolve
from isoloco.train_config import TrainConfig
from isoloco.errors import ConfigError
from isoloco.comm import LINK_COUNTS
from isoloco.distributed import Distributed, process_group
from isoloco.launch import add_launch_command, free_port, torchrun_argv
from isoloco.layout import ProcessLayout
from isoloco.metrics import read_metrics
from isoloco.model import count_parameters
from isoloco.trainer import Trainer
from isoloco.torch_comm import TorchCommunicator, assign_owners

import helpers
from helpers import ONE_THREAD_ENV, SMALL_ARGS, assert_close_relative, final_params

pytestmark = pytest.mark.multiprocess

SMALL = {**helpers.SMALL, "steps": 6, "inner_steps": 3, "eval_every": 6, "device": "cpu"}

#: One case per merge rule (and IsoLoCo's two placements, and the dp baseline): run name -> overrides.
RULES = {
    "mean": {"method": "diloco"},
    "ties": {"method": "ties"},
    "dare": {"method": "dare"},
    "tsv": {"method": "tsv"},
    "iso_c": {"method": "isoloco"},
    "iso_c_update": {"method": "isoloco", "outer.iso_placement": "update"},
    "iso_cts": {"method": "isocts"},
    # One worker per island, as the simulator plays every worker by default (`played_islands`
    # below has islands of two, `islands=2`).
    "mean_int8_ef": {"method": "diloco", "merge.quantize": "int8", "merge.error_feedback": True, "workers": 2},
    # IsoLoCo with round 0's synchronisation in flight for one step of round 1 (its traffic
    # counts in round 1, beside round 1's own: `test_overlap_counts_each_synchronisation_once`).
    "overlap": {"method": "isoloco", "outer.overlap_steps": 1, "outer.overlap_alpha": 0.5},
}
#: The mean again behind an emulated slow link (1 Gbit/s, 150 ms): the same numbers, later.
SLOW_LINK = {"method": "diloco", "dist.emulate_link": "1,150"}
#: Stragglers: TSV weighted by tokens, with late workers carried. Seed 141 draws
#: workers 2 and 3 (all of process 1) late in round 0 and worker 2 again in round 1, so a
#: process with no worker merged sends zeros that the gather drops, and carried deltas join.
STRAGGLERS = {"method": "tsv", "seed": 141, "worker_speeds": "1,0.5", "merge.weighting": "tokens",
              "faults.late_rate": 0.4, "faults.late": "carry"}
#: Two islands of two workers with int8 sums: the simulator plays the job's islands (`islands=2`).
PLAYED_ISLANDS = {"method": "diloco", "merge.quantize": "int8", "merge.error_feedback": True, "islands": 2,
                  "seed": 141, "faults.late_rate": 0.4}
CASES = {**{name: {"workers": 4, **o} for name, o in
            {**RULES, "mean_slow_link": SLOW_LINK, "stragglers": STRAGGLERS, "played_islands": PLAYED_ISLANDS}.items()},
         "dp": {"method": "dp"}}


# -- running several processes ----------------------------------------------------------------


def _join_job(rank: int, world_size: int, port: int) -> None:
    """What torchrun would set for process `rank` (these tests start processes themselves)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _train_cases(rank: int, world_size: int, port: int, root: str, cases: dict) -> None:
    _join_job(rank, world_size, port)
    with process_group(resolve(None, {**SMALL, **next(iter(cases.values())), "dist.timeout_s": 60})):
        for name, overrides in cases.items():
            out = Path(root) / name
            out.mkdir(parents=True, exist_ok=True)
            Trainer(resolve(None, {**SMALL, **overrides}), out, progress=False).run()
        _check_shard_map(rank, world_size, Path(root))


def _check_shard_map(rank: int, world_size: int, root: Path) -> None:
    """Islands of one process each orthogonalise every matrix themselves (nothing crosses the
    slow link); one island of every process shares them out. Every process gets every result."""
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(8 + i, 6, generator=generator) for i in range(5)]
    computed: dict[int, list[int]] = {}
    for island in (1, world_size):
        comm = Distributed(resolve(None, {**SMALL, "workers": world_size // island, "gpus_per_worker": island})).comm
        assert isinstance(comm, TorchCommunicator)

        def orthogonalise(matrix: torch.Tensor) -> torch.Tensor:
            computed.setdefault(island, []).append(matrix.shape[0])
            return torch.linalg.qr(matrix).Q

        for matrix, result in zip(matrices, comm.shard_map(orthogonalise, matrices)):
            torch.testing.assert_close(result, torch.linalg.qr(matrix).Q, rtol=0, atol=0)
    (root / f"shard_map.{rank}.json").write_text(json.dumps(computed))


def run_processes(fn, world_size: int, *args, timeout: float = 300) -> None:
    """Run fn(rank, world_size, port, *args) in `world_size` fresh processes (one thread each),
    forked from the suite's server with torch and transformers imported (conftest.py)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        context = mp.start_processes(fn, args=(world_size, free_port(), *args), nprocs=world_size,
                                     join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world_size} processes did not finish within {timeout}s")


def single_process(tmp: Path, name: str, base: dict = SMALL, preset: str | None = None, **overrides) -> Trainer:
    trainer = Trainer(resolve(preset, {**base, **overrides}), tmp / name, progress=False)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    trainer.run()
    return trainer


def assert_run_close(run: Path, reference: Trainer, rtol: float) -> None:
    """A run directory's final θ against a trainer's global parameters, tensor by tensor."""
    names = [name for name, _ in reference.named_params]
    ours = final_params(run)
    assert set(ours) == set(names)
    assert_close_relative([ours[name] for name in names], reference.global_params, rtol, names)


# -- 2 processes x 2 workers == 1 process x 4 workers, every rule ------------------------------


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two-processes")
    run_processes(_train_cases, 2, str(root), CASES)
    return root


def train_in_this_process(root: Path, cases: dict) -> dict[str, Trainer]:
    """The runs of `cases` in this process, on one thread like the spawned processes (so the
    workers' own arithmetic is identical and only the merge's reduction order differs)."""
    with helpers.one_thread():
        return {name: single_process(root, name, **overrides) for name, overrides in cases.items()}


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> dict[str, Trainer]:
    return train_in_this_process(tmp_path_factory.mktemp("one-process"), CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_train_what_one_process_trains(two_process_runs, one_process_runs, case):
    """Every rule within 1e-6 (relative) of one process: the sums' order is the only difference."""
    reference = one_process_runs[case]
    assert_run_close(two_process_runs / case, reference, 1e-6)
    initial = Trainer(resolve(None, {**SMALL, **CASES[case]}), two_process_runs / "unused", progress=False)
    assert not torch.equal(initial.global_params[0], reference.global_params[0])  # training moved the weights
    # Train loss is averaged over all workers on all processes; val loss over all windows.
    ours, theirs = read_metrics(two_process_runs / case / "metrics.jsonl"), read_metrics(
        reference.out_dir / "metrics.jsonl")
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    assert [m["train_loss"] for m in ours] == pytest.approx([m["train_loss"] for m in theirs], rel=1e-6)
    assert ours[-1]["val_loss"] == pytest.approx(theirs[-1]["val_loss"], rel=1e-6)
    assert ckpt.verify(ckpt.latest_checkpoint(two_process_runs / case / "checkpoints"))["layout"]["processes"] == 2


def test_iso_cts_trains_the_same_bits_in_every_layout(two_process_runs, one_process_runs):
    """Iso-CTS's output swings with the rounding of its common sum (an ill-conditioned polar
    factor), so that sum passes from process to process in worker order: 2 processes x 2
    workers end two rounds with the bits of 1 x 4, which an all-reduce does not give."""
    reference = one_process_runs["iso_cts"]
    ours = final_params(two_process_runs / "iso_cts")
    assert all(torch.equal(ours[name], param) for (name, _), param in zip(reference.named_params,
                                                                         reference.global_params))
    assert len(counts(reference.out_dir, "workers_merged")) == 2  # two rounds


def test_the_simulator_playing_two_islands_trains_the_bits_of_a_two_island_job(two_process_runs, one_process_runs):
    """`islands=2`, 4 workers, int8 sums with error feedback, workers late: each island encodes
    its two workers' sum in the simulator as in a job of two processes, so the runs end with
    the same bits, and the simulator's modelled slow-link bytes are the job's measured ones."""
    reference = one_process_runs["played_islands"]
    ours = final_params(two_process_runs / "played_islands")
    assert all(torch.equal(ours[name], param) for (name, _), param in zip(reference.named_params,
                                                                         reference.global_params))
    assert counts(reference.out_dir, "slow_link_bytes") == counts(two_process_runs / "played_islands",
                                                                  "slow_link_bytes")
    late = [m.get("late_workers") for m in read_metrics(reference.out_dir / "metrics.jsonl")]
    assert any(late), "seed 141 draws late workers"


def test_late_workers_are_drawn_alike_in_every_layout(two_process_runs, one_process_runs):
    ours, theirs = (counts(run, "workers_merged") for run in (two_process_runs / "stragglers",
                                                              one_process_runs["stragglers"].out_dir))
    assert ours == theirs == [2, 3]
    assert counts(two_process_runs / "stragglers", "worker_steps") == [[3, 2, 3, 2]] * 2


def test_orthogonalisation_is_shared_inside_an_island_only(two_process_runs):
    shares = [json.loads((two_process_runs / f"shard_map.{rank}.json").read_text()) for rank in range(2)]
    assert all(sorted(share["1"]) == [8, 9, 10, 11, 12] for share in shares)  # islands of one: each its own
    assert sorted(shares[0]["2"] + shares[1]["2"]) == [8, 9, 10, 11, 12]  # one island: every matrix once
    assert shares[0]["2"] and shares[1]["2"]  # both processes worked


# -- bytes per worker per round ----------------------------------------------------------------


def bytes_per_round(run: Path) -> list[int]:
    return [m["bytes_per_worker"] for m in read_metrics(run / "metrics.jsonl") if "bytes_per_worker" in m]


def counts(run: Path, key: str) -> list[float]:
    return [m[key] for m in read_metrics(run / "metrics.jsonl") if key in m]


def link_bytes(run: Path, link: str) -> list[float]:
    return counts(run, link if link.startswith("wire_") else f"bytes_{link}")


@pytest.mark.parametrize("case", sorted(set(CASES) - {"dp", "overlap"}))
def test_a_synchronisation_makes_few_collectives(two_process_runs, case):
    """Buckets: one collective per phase of the rule, however many tensors (with 2 processes
    on gloo, at most 8 per synchronisation of this model)."""
    assert all(1 <= calls <= 8 for calls in counts(two_process_runs / case, "collectives"))


def test_overlap_counts_each_synchronisation_once(two_process_runs, island_runs):
    """Round 0's synchronisation lands in round 1, so round 1's line counts both; the totals
    are IsoLoCo's without overlap."""
    for runs in (two_process_runs, island_runs):
        for key in ("collectives", "bytes_cross_island", "wire_bytes_cross_island", "bytes_in_island"):
            ours, blocking = counts(runs / "overlap", key), counts(runs / "iso_c", key)
            assert ours == [0, sum(blocking)], (runs, key)
        assert counts(runs / "iso_c", "collectives")[0] > 0


def test_mean_and_iso_c_send_one_model_per_worker_per_round(two_process_runs, one_process_runs):
    model_bytes = 4 * count_parameters(one_process_runs["mean"].model)
    for case in ("mean", "iso_c", "iso_c_update"):
        assert bytes_per_round(two_process_runs / case) == [model_bytes, model_bytes]
        assert bytes_per_round(one_process_runs[case].out_dir) == [model_bytes, model_bytes]
        # G = 1: every process is an island and sends its whole sum across, in one all-reduce
        # (one bucket); each island computes its own orthogonalisations, so nothing else crosses.
        # A ring all-reduce over 2 processes puts 2·(2 − 1)/2 of the tensor on the wire.
        assert link_bytes(two_process_runs / case, "cross_island") == [model_bytes] * 2
        assert link_bytes(two_process_runs / case, "wire_bytes_cross_island") == [model_bytes] * 2
        assert link_bytes(two_process_runs / case, "in_island") == [0, 0]
        assert counts(two_process_runs / case, "collectives") == [1, 1]


def test_tsv_sends_less_than_every_full_matrix(two_process_runs, one_process_runs):
    trainer = one_process_runs["tsv"]
    workers = 4
    matrices = sum(p.numel() for p in trainer.global_params if p.ndim == 2)
    vectors = sum(p.numel() for p in trainer.global_params if p.ndim != 2)
    factors = sum((min(p.shape) // workers) * (sum(p.shape) + 1) for p in trainer.global_params if p.ndim == 2)
    measured = bytes_per_round(two_process_runs / "tsv")
    assert measured == [4 * (factors + vectors)] * 2  # top-k factors of each matrix, the mean of the rest
    assert measured[0] < workers * 4 * matrices
    assert measured == bytes_per_round(trainer.out_dir)


# -- gpus_per_worker: islands of processes, the slow link carrying 1/G each ---------------------

#: Every rule again with R = 2 workers; on 4 processes each worker is an island of 2. An
#: island averages its gradients over 2 processes, which rounds differently from one process
#: taking the whole batch; Iso-CTS's cut between common and per-worker directions amplifies
#: that by the inverse spectral gap at the cut: 1.3e-5 at the default f = 0.8 on this model,
#: 5.4e-6 at f = 0.6, which gathers 13 directions per worker of every rank-64 matrix.
ISLAND_CASES = {name: {**overrides, "workers": 2} for name, overrides in RULES.items()}
#: Iso-CTS one round, so that the second round's AdamW does not grow the island's rounding
#: further, with its range finder's early iterations in float32 (bfloat16 would flip roundings).
ISLAND_CASES["iso_cts"].update({"merge.common_fraction": 0.6, "steps": 3, "eval_every": 3,
                                "merge.finder_dtype": "float32"})
#: Where a rule's rounding-driven difference between the layouts exceeds 1e-5 (see the test).
ISLAND_TOLERANCE = {"mean_int8_ef": 1e-4, "ties": 1e-3, "iso_cts": 2e-5}


@pytest.fixture(scope="module")
def island_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("islands")
    run_processes(_train_cases, 4, str(root), {name: {**o, "gpus_per_worker": 2} for name, o in ISLAND_CASES.items()})
    return root


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory) -> dict[str, Trainer]:
    return train_in_this_process(tmp_path_factory.mktemp("two-workers"), ISLAND_CASES)


@pytest.mark.parametrize("case", sorted(ISLAND_CASES))
def test_two_islands_of_two_processes_train_what_two_simulated_workers_train(island_runs, two_worker_runs, case):
    reference = two_worker_runs[case]
    # The compressed merge is the same in every layout (bit for bit: tests/test_merge.py); here
    # the island's gradient average rounds differently from one process, and the
    # int8 grid turns an entry that rounding moves across a code boundary into a whole step.
    # TIES's trim threshold does the same to an entry that rounding moves across it (5.1e-4 on
    # this model with transformers 5.24); Iso-CTS's polar factor of its stacked V, solved as
    # the common block beside the workers' (`FactorSettings.polar_beside`), carries the cut's
    # amplified rounding a little further than orthogonalising the whole did (1.1e-5).
    assert_run_close(island_runs / case, reference, ISLAND_TOLERANCE.get(case, 1e-5))
    state = ckpt.verify(ckpt.latest_checkpoint(island_runs / case / "checkpoints"))
    assert state["layout"] == {"workers": 2, "processes": 4, "processes_per_worker": 2}
    in_flight = ["overlap.safetensors"] if case == "overlap" else []  # θ_t, which the workers' deltas point from
    assert sorted(state["checksums"]) == ["global.safetensors", "outer.safetensors", *in_flight,
                                          "workers-0.safetensors", "workers-1.safetensors"]


def sliced(floats: int, slices: int) -> int:
    """Bytes of one process's slice of `floats` float32 values cut into `slices` equal slices."""
    return 4 * -(-floats // slices)


def cross_island_floats(cfg: TrainConfig, shapes: list[torch.Size], workers_per_island: int) -> list[int]:
    """Per collective (this model is one bucket: one collective per phase of the rule and
    kind), what one island sends across islands per round: its sums (one model for mean, Iso-C
    and DARE; TIES: the trimmed sum, then the masked sum and count stacked) and its workers'
    factors (TSV: k triplets each, the other tensors' sum beside them; Iso-CTS: the mean,
    then s triplets each)."""
    rule = cfg.merge.rule
    def factors(shape: torch.Size, per_worker: int) -> int:
        return workers_per_island * per_worker * (sum(shape) + 1)

    numel = sum(shape.numel() for shape in shapes)
    matrices = [shape for shape in shapes if len(shape) == 2]
    if rule == "ties":
        return [numel, 2 * numel]
    if rule == "tsv":
        rest = numel - sum(shape.numel() for shape in matrices)
        return [rest, sum(factors(shape, rules.tsv_components(min(shape), cfg.workers)) for shape in matrices)]
    if rule == "iso_cts":
        split = [rules.iso_cts_split(min(shape), cfg.workers, cfg.merge.common_fraction)[1] for shape in matrices]
        return [numel, sum(factors(shape, s) for shape, s in zip(matrices, split))]
    return [numel]


@pytest.mark.parametrize("case", sorted(set(ISLAND_CASES) - {"overlap"}))
def test_each_process_sends_its_share_of_one_island_copy_across_islands(island_runs, two_worker_runs, case):
    """1/G of a model per process for mean, Iso-C and DARE; 1/G of the analytic count for
    the others (every slice padded to equal width). Inside the island each process sends its
    slice back to the others, and Iso-C's island-shared orthogonalisations broadcast the
    island's matrices once (1/G per process)."""
    cfg = two_worker_runs[case].cfg
    shapes = [p.shape for p in two_worker_runs[case].global_params]
    if cfg.merge.quantize == "none":
        cross = sum(sliced(floats, 2) for floats in cross_island_floats(cfg, shapes, workers_per_island=1))
    else:  # the cost model's count of the compressed sum, for 2 islands of 2 processes
        cross = ChunkPlan.of(shapes, cfg.merge.quantization, islands=2, slices=2).wire_bytes()
    rounds = cfg.steps // cfg.inner_steps
    assert link_bytes(island_runs / case, "cross_island") == [cross] * rounds
    # Two islands: a ring all-reduce puts 2·(2 − 1)/2 of a slice on the wire, an all-gather
    # (2 − 1) blocks; either way what a process hands in.
    assert link_bytes(island_runs / case, "wire_bytes_cross_island") == [cross] * rounds
    if case in ("mean", "dare", "iso_c"):
        assert cross == 4 * sum(shape.numel() for shape in shapes) // 2
    if case in ("mean", "dare", "ties"):
        assert link_bytes(island_runs / case, "in_island") == [cross] * rounds
    if case == "mean_int8_ef":  # int8 codes and a scale per 256 entries against float32
        # Inside the island each process's decoded slice comes back as float32, as the mean's does.
        mean = link_bytes(island_runs / "mean", "in_island")
        assert all(theirs <= ours <= 1.01 * theirs for ours, theirs in zip(link_bytes(island_runs / case, "in_island"),
                                                                          mean))
        float32 = link_bytes(island_runs / "mean", "wire_bytes_cross_island")
        assert all(ours <= 0.3 * theirs for ours, theirs in zip(link_bytes(island_runs / case, "wire_bytes_cross_island"),
                                                               float32))
    if case.startswith("iso_c_") or case == "iso_c":
        matrices = sum(4 * shape.numel() for shape in shapes if len(shape) == 2)
        assert link_bytes(island_runs / case, "in_island") == [cross + matrices / 2] * rounds
    # All workers in one process: nothing crosses any link.
    assert link_bytes(two_worker_runs[case].out_dir, "cross_island") == [0] * rounds


def test_the_split_divides_each_processs_cross_island_bytes_by_g(monkeypatch):
    """The communication benchmark's before/after on 4 processes: R = 4 as 4 islands of 1 or 2
    islands of 2; "before" is each process sending its whole tensors across islands."""
    monkeypatch.setattr(bench_comm, "START_METHOD", "forkserver")  # conftest.py: torch already imported
    counts = bench_comm.link_bytes_per_round("tiny", processes=4, island_sizes=(1, 2),
                                             methods=("diloco", "tsv", "isoloco"))
    shapes = [shape for _, shape in parameter_shapes("tiny")]
    model = 4 * sum(shape.numel() for shape in shapes)
    matrices = 4 * sum(shape.numel() for shape in shapes if len(shape) == 2)
    cross = {size: {method: {when: links["bytes_cross_island"] for when, links in by_when.items()}
                    for method, by_when in by_method.items()} for size, by_method in counts.items()}
    assert cross[1]["diloco"] == {"before": model, "after": model}
    assert cross[2]["diloco"] == {"before": model, "after": model / 2}
    assert counts[2]["diloco"]["after"]["bytes_in_island"] == model / 2  # each process's slice, all-gathered
    assert cross[2]["tsv"]["after"] == cross[2]["tsv"]["before"] / 2 < model / 2
    # Iso-C: nothing but the sum crosses islands; with G = 2 the orthogonalised matrices are
    # shared inside the island (half each, over the fast link).
    assert cross[1]["isoloco"] == {"before": model, "after": model}
    assert cross[2]["isoloco"] == {"before": model, "after": model / 2}
    assert counts[2]["isoloco"]["after"]["bytes_in_island"] == model / 2 + matrices / 2


# -- a lost process stops the run ---------------------------------------------------------------

TIMEOUT_S = 5
CLI_RUN = [*SMALL_ARGS, "steps=30", "inner_steps=5", "workers=2", "eval_every=20", "checkpoint_every=10",
           "method=isoloco", f"dist.peer_silence_s={TIMEOUT_S}"]
ENV = ONE_THREAD_ENV


def start_rank(rank: int, world_size: int, port: int, *args: str) -> subprocess.Popen:
    """`isoloco train` as process `rank` of a job, with the environment torchrun would give it."""
    env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "isoloco", "train", *args, "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lose_a_process(run: Path, how: signal.Signals) -> tuple[subprocess.Popen, str, float]:
    """Start 2 processes, send `how` to rank 1 once the first checkpoint exists; return rank 0,
    its stderr and how long it took to stop after that."""
    port = free_port()
    ranks = [start_rank(rank, 2, port, *CLI_RUN, "--out", str(run)) for rank in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not list((run / "checkpoints").glob("step_00000010")):
            assert time.monotonic() < deadline, "the run never wrote its first checkpoint"
            assert all(p.poll() is None for p in ranks), [p.communicate() for p in ranks]
            time.sleep(0.05)
        lost = time.monotonic()
        ranks[1].send_signal(how)
        _, stderr = ranks[0].communicate(timeout=TIMEOUT_S + 60)
        return ranks[0], stderr, time.monotonic() - lost
    finally:
        for process in ranks:
            process.kill()
            process.communicate()


def assert_stopped_naming_rank_1(rank0: subprocess.Popen, stderr: str, seconds: float, run: Path) -> None:
    assert rank0.returncode == 3, stderr
    assert "rank 1 stopped answering" in stderr and "died or hung" in stderr, stderr
    assert seconds < TIMEOUT_S + 10, f"rank 0 took {seconds:.1f}s to stop"
    assert not (run / "summary.json").exists(), "the run finished before it lost a process"
    path, state = ckpt.load_latest(run / "checkpoints")  # the last complete checkpoint verifies
    assert state["step"] >= 10 and state["layout"]["processes"] == 2
    assert ckpt.load_tensors(path, "global") and ckpt.load_tensors(path, "workers-1") is not None


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, subprocess.Popen, str, float]:
    run = tmp_path_factory.mktemp("killed") / "run"
    return (run, *lose_a_process(run, signal.SIGKILL))


def test_a_killed_process_stops_the_others_and_its_checkpoint_survives(killed):
    run, rank0, stderr, seconds = killed
    assert_stopped_naming_rank_1(rank0, stderr, seconds, run)


def test_a_hung_process_stops_the_others_after_the_peer_silence(tmp_path):
    # The collectives keep their default 600 s timeout: only the watchdog's silence threshold
    # (dist.peer_silence_s) can stop rank 0 this soon.
    run = tmp_path / "run"
    rank0, stderr, seconds = lose_a_process(run, signal.SIGSTOP)
    assert_stopped_naming_rank_1(rank0, stderr, seconds, run)
    assert f"no heartbeat for {TIMEOUT_S:.1f}s" in stderr and "(dist.peer_silence_s)" in stderr, stderr


FAILING_RANK = """
import sys
from isoloco.config import resolve
from isoloco.distributed import Distributed, process_group
from isoloco.errors import EXIT_PEER_LOST, PeerLostError

cfg = resolve(None, {"workers": 2, "global_batch": 8, "device": "cpu", "dist.timeout_s": 60})
try:
    with process_group(cfg):
        group = Distributed(cfg)
        if group.rank == 1:
            raise ValueError("boom")
        group.barrier()
except PeerLostError as err:
    print(err, file=sys.stderr)
    sys.exit(EXIT_PEER_LOST)
"""


def test_a_failing_process_stops_the_others_at_once_quoting_its_error():
    port = free_port()
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [subprocess.Popen([sys.executable, "-c", FAILING_RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [process.communicate(timeout=120) for process in ranks]
    assert ranks[1].returncode == 1 and "ValueError: boom" in outputs[1][1]
    assert ranks[0].returncode == 3, outputs[0][1]
    assert "rank 1 failed: ValueError: boom" in outputs[0][1]  # well within the 60 s timeout


#: `isoloco train` in which rank 1's share of an in-flight stage overflows: one island of two
#: processes (Iso-C's orthogonalisations shared out between them), round 0's synchronisation in
#: flight for 3 of round 1's 5 steps. Rank 1 also refuses to post any collective once its stage
#: has failed: kept for the landing, the error would let it train on and post a gradient
#: all-reduce on the island group where rank 0 posts the stage's broadcasts.
FAILING_STAGE = """
import os
import sys
import torch.distributed as dist
from isoloco.cli import main
from isoloco.torch_comm import TorchCommunicator

failed = []
if os.environ["RANK"] == "1":
    shard_map_async = TorchCommunicator.shard_map_async

    def overflowing(matrix):
        failed.append(matrix.shape)
        raise FloatingPointError("overflow in rank 1's orthogonalisation (injected)")

    TorchCommunicator.shard_map_async = lambda self, fn, tensors: shard_map_async(self, overflowing, tensors)

    def refused_after_the_failure(name):
        collective = getattr(dist, name)

        def posted(*args, **kwargs):
            assert not failed, f"rank 1 called dist.{name} after its stage failed"
            return collective(*args, **kwargs)

        return posted

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single",
                 "broadcast", "barrier"):
        if hasattr(dist, name):
            setattr(dist, name, refused_after_the_failure(name))
sys.exit(main(sys.argv[1:]))
"""


def test_a_stage_failing_in_flight_on_one_rank_stops_every_process_naming_it(tmp_path):
    port = free_port()
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = [*SMALL_ARGS, "method=isoloco", "workers=1", "gpus_per_worker=2", "steps=10", "inner_steps=5",
            "eval_every=10", "outer.overlap_steps=3", f"dist.peer_silence_s={TIMEOUT_S}", "--out",
            str(tmp_path / "run"), "--quiet"]
    ranks = [subprocess.Popen([sys.executable, "-c", FAILING_STAGE, "train", *args],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        _, failing = ranks[1].communicate(timeout=180)
        failed_at = time.monotonic()
        _, stopped = ranks[0].communicate(timeout=TIMEOUT_S + 60)
        seconds = time.monotonic() - failed_at
    finally:
        for process in ranks:
            process.kill()
            process.communicate()
    assert ranks[1].returncode == 1, failing
    assert "overflow in rank 1's orthogonalisation" in failing and "after its stage failed" not in failing, failing
    assert ranks[0].returncode == 3, stopped
    assert "rank 1 failed: FloatingPointError: overflow in rank 1's orthogonalisation" in stopped, stopped
    assert seconds < TIMEOUT_S, f"rank 0 took {seconds:.1f}s to stop after rank 1 failed"


def test_resume_after_a_lost_process_matches_an_uninterrupted_run(killed, tmp_path):
    killed_run = killed[0]
    # Another layout is refused with a clear error and exit status 2.
    alone = subprocess.run([sys.executable, "-m", "isoloco", "train", "--resume", str(killed_run), "--quiet"],
                           capture_output=True, text=True, env=ENV)
    assert alone.returncode == 2, alone.stderr
    assert "written by 2 workers on 2 processes" in alone.stderr, alone.stderr
    # The same layout resumes (through `isoloco launch`, i.e. torchrun) to the same numbers.
    resumed = subprocess.run([sys.executable, "-m", "isoloco", "launch", "--nproc", "2", "--", "train", "--resume",
                              str(killed_run), "--quiet"], capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    # What `isoloco train` with these items (no preset) resolves to.
    reference = single_process(tmp_path, "reference", base=parse_overrides(CLI_RUN), preset=DEFAULT_PRESET)
    assert_run_close(killed_run, reference, 1e-5)
    assert [m["step"] for m in read_metrics(killed_run / "metrics.jsonl")] == list(range(1, 31))


# -- layout and launcher arithmetic -----------------------------------------------------------


def layout(world_size: int, rank: int = 0, **overrides) -> ProcessLayout:
    return ProcessLayout.for_run(resolve(None, {**SMALL, **overrides}), world_size, rank)


def test_layout_places_workers_in_islands_of_consecutive_ranks():
    islands = layout(8, rank=5, workers=8, global_batch=32, gpus_per_worker=2)
    assert (islands.islands, islands.island, islands.island_rank) == (4, 2, 1)
    assert islands.local_worker_ids == [4, 5]
    assert islands.island_ranks(2) == [4, 5] and islands.peer_ranks(1) == [1, 3, 5, 7]
    assert islands.rows_per_process(32) == 2
    dp = layout(4, rank=3, method="dp")
    assert (dp.islands, dp.group_size, dp.local_worker_ids, dp.rows_per_process(8)) == (1, 4, [0], 2)


@pytest.mark.parametrize("world_size, overrides, words", [
    (3, {"workers": 4, "gpus_per_worker": 2}, "does not divide the 3 processes"),
    (4, {"workers": 3, "global_batch": 6}, "set workers to a multiple of 4"),
    (4, {"workers": 2, "gpus_per_worker": 2, "global_batch": 6}, "multiple of 4"),
    (3, {"method": "dp"}, "multiple of 3"),
    (2, {"workers": 2, "gpus_per_worker": 2, "micro_batch": 3, "global_batch": 8}, "micro_batch=3"),
    (2, {"workers": 4, "islands": 4}, r"this job's 2 islands .*isoloco launch --nproc 4"),
    (4, {"workers": 2, "gpus_per_worker": 2, "islands": 1}, r"launch 2 processes \(isoloco launch --nproc 2\)"),
])
def test_layouts_that_do_not_fit_are_config_errors(world_size, overrides, words):
    with pytest.raises(ConfigError, match=words):
        layout(world_size, **overrides)


@pytest.mark.parametrize("overrides, words", [
    ({"method": "dp", "islands": 2}, "dist.islands=2 is not allowed with algorithm=dp"),
    ({"workers": 6, "global_batch": 12, "islands": 4}, "set dist.islands to a divisor of 6"),
    ({"islands": -1}, "dist.islands"),
])
def test_islands_that_cannot_be_played_are_refused_before_training(overrides, words):
    with pytest.raises(ConfigError, match=words):
        resolve(None, {**SMALL, **overrides})


def test_one_process_with_gpus_per_worker_says_how_to_launch(tmp_path):
    with pytest.raises(ConfigError, match="isoloco launch --nproc"):
        Trainer(resolve(None, {**SMALL, "gpus_per_worker": 2}), tmp_path, progress=False)


def test_owners_balance_the_work_deterministically():
    owners = assign_owners([9, 1, 1, 8, 1], processes=2)
    assert owners == [0, 1, 0, 1, 1]  # loads 9+1 and 8+1+1
    assert assign_owners([5.0] * 3, processes=4) == [0, 1, 2]


def launch_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_launch_command(parser.add_subparsers(), preflight=lambda command, processes: None)
    return parser.parse_args(["launch", *argv])


def test_launch_runs_torchrun_on_localhost_unless_told_otherwise():
    argv = torchrun_argv(launch_args("--nproc", "2", "--", "train", "quick", "workers=8"))
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--master-addr=127.0.0.1" in argv and "--nproc-per-node=2" in argv
    assert argv[-5:] == ["-m", "isoloco", "train", "quick", "workers=8"]
    several = torchrun_argv(launch_args("--nproc", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                        "10.0.0.1", "--", "train"))
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(several)
    with pytest.raises(ValueError, match="--master-addr"):
        torchrun_argv(launch_args("--nproc", "8", "--nnodes", "2", "--", "train"))
    with pytest.raises(ValueError, match="after --"):
        torchrun_argv(launch_args("--nproc", "2"))


def test_the_emulated_link_delays_each_cross_island_collective(two_process_runs):
    """One all-reduce per round crosses islands; the emulation makes it last at least the
    link's latency, and training waits for all of it (nothing overlaps the merge)."""
    slow, plain = (counts(two_process_runs / case, "sync_s") for case in ("mean_slow_link", "mean"))
    assert len(slow) == len(plain) == 2 and all(seconds >= 0.15 for seconds in slow)
    assert counts(two_process_runs / "mean_slow_link", "sync_exposed_s") == slow


def test_emulated_link_seconds_and_bad_values():
    from isoloco.distributed import DistConfig

    link = DistConfig(emulate_link="0.1,20").link()
    # The cost model's latency steps: 2(P − 1) for an all-reduce, P − 1 for an all-gather.
    seconds = link.link.collective_seconds
    assert seconds("all_reduce", 0, 2) == pytest.approx(0.04)
    assert seconds("all_gather", 1.25e6, 4) == pytest.approx(3 * 0.02 + 0.1)  # 10 Mbit at 0.1 Gbit/s
    # A sum in worker order over 4: three sends of the whole 1.25 MB one after another, then the
    # last process's broadcast of it to three; each process's share is the all-reduce's.
    share = wire_bytes("chain_sum", 1.25e6, 4)
    assert share == wire_bytes("all_reduce", 1.25e6, 4) == pytest.approx((3 + 3) * 1.25e6 / 4)
    assert seconds("chain_sum", share, 4) == pytest.approx((3 + 3) * 0.1 + 6 * 0.02)
    # Collectives started together share the link: the second is delivered after the first.
    first, second = link.deliver_at("all_reduce", 1.25e6, 2), link.deliver_at("all_to_all", 1.25e6, 3)
    assert second - first == pytest.approx(0.1 + 2 * 0.02)
    # The planning tables charge what the emulation charges.
    assert link.link.seconds("all_reduce", 1.25e6, 2) == pytest.approx(seconds("all_reduce", 1.25e6, 2))
    assert DistConfig().link() is None
    for bad in ("fast", "0,20", "1", "1,-5", "1,2,3"):
        with pytest.raises(ConfigError, match="dist.emulate_link"):
            DistConfig(emulate_link=bad).validate()


def test_a_collective_holds_the_tensors_it_was_handed_until_its_wait():
    """A stage on the side stream may drop the last reference to a tensor the main stream
    allocated while its collective still reads it: the handle keeps it until the wait."""
    import weakref

    from isoloco.torch_comm import _post

    class Work:
        def wait(self) -> None:
            pass

    handed = torch.ones(4)
    kept = weakref.ref(handed)
    handle = _post("a test collective", [handed], Work)
    del handed
    assert kept() is not None
    handle.wait()
    assert kept() is None


def _gather_in_pieces(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    from isoloco.torch_comm import all_gather_blocks

    _join_job(rank, world_size, port)
    dist.init_process_group("gloo")
    try:
        parts = {"float rows": torch.arange(10.0).reshape(2, 5) + 100 * rank,  # 40 bytes: pieces of 3, 3, 3, 1
                 "odd bytes": torch.arange(11, dtype=torch.uint8) + 20 * rank,
                 "one piece": torch.tensor([rank], dtype=torch.int64)}
        for what, part in parts.items():
            work, gathered = all_gather_blocks(what, part, dist.group.WORLD, world_size, piece_bytes=12)
            work.wait()
            assert gathered.shape == (world_size, *part.shape), what
            for member in range(world_size):
                expected = part - (100 if what == "float rows" else 20 if what == "odd bytes" else 1) * (rank - member)
                assert torch.equal(gathered[member], expected), (what, member, gathered[member])
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_gloo_all_gathers_go_in_pieces_that_land_where_one_call_would_put_them():
    """A block is cut into pieces of at most `piece_bytes` (the last shorter); every member's
    block lands whole, in member order, whatever its dtype and shape."""
    run_processes(_gather_in_pieces, 3, timeout=120)


# -- many islands: the compressed sum in every layout, and no collective off the main thread ----

#: Six processes: 6 islands of one (the exchange route), 3 islands of 2 processes (the exchange,
#: each island's traffic split in 2), 2 islands of 3 (the all-gather route, split in 3).
MANY_ISLANDS = {"processes": 6, "workers": 6, "layouts": (1, 2, 3), "formats": ("int8", "int4")}
COMPRESSED_SHAPES = {"wide.weight": (24, 300), "tall.weight": (130, 7), "norm.weight": (24,)}
COLLECTIVES = tuple(name for name in ("all_reduce", "all_gather", "all_to_all_single", "broadcast",
                                      "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                                      "barrier")
                    if hasattr(torch.distributed, name))  # all_gather_single: torch >= 2.13


#: merge.compress settings the six processes merge in every layout, two rounds each (warm start, residuals).
STRUCTURED = {
    "lowrank": {"merge.compress": "lowrank", "merge.compress_rank": 2, "merge.quantize": "int8",
                "merge.error_feedback": True},
    "topk": {"merge.compress": "topk", "merge.compress_density": 0.1, "merge.compress_chunk": 64,
             "merge.quantize": "int8", "merge.error_feedback": True},
}


def worker_deltas(workers: int, seed: int = 5) -> dict[str, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {name: [torch.randn(shape, generator=generator) for _ in range(workers)]
            for name, shape in COMPRESSED_SHAPES.items()}


def _watch_threads(root: Path, rank: int) -> None:
    """Record every torch.distributed collective started off the main thread."""
    import threading

    def watched(name, original):
        def call(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                with open(root / f"off-main.{rank}.txt", "a") as found:
                    found.write(f"{name} from {threading.current_thread().name}\n")
            return original(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(torch.distributed, name, watched(name, getattr(torch.distributed, name)))


def _many_islands(rank: int, world_size: int, port: int, root: str) -> None:
    from isoloco.merge import Merger

    _join_job(rank, world_size, port)
    root = Path(root)
    _watch_threads(root, rank)
    workers = MANY_ISLANDS["workers"]
    base = {**SMALL, "method": "diloco", "workers": workers, "global_batch": 36, "dist.timeout_s": 60}
    with process_group(resolve(None, base)):
        deltas = worker_deltas(workers)
        results = {}
        for gpus in MANY_ISLANDS["layouts"]:
            for fmt in MANY_ISLANDS["formats"]:
                cfg = resolve(None, {**base, "gpus_per_worker": gpus, "merge.quantize": fmt})
                comm = Distributed(cfg).comm
                local = {name: [ds[w] for w in comm.local_worker_ids] for name, ds in deltas.items()}
                merged = Merger(cfg.merge, comm, seed=0).merge_all(local)
                results[f"{gpus}-{fmt}"] = {"merged": merged, "counts": comm.reset_link_bytes()}
            for structured, keys in STRUCTURED.items():
                cfg = resolve(None, {**base, "gpus_per_worker": gpus, **keys})
                comm = Distributed(cfg).comm
                merger = Merger(cfg.merge, comm, seed=0)
                residuals = {name: [torch.zeros_like(ds[w]) for w in comm.local_worker_ids]
                             for name, ds in deltas.items()}
                results[f"{gpus}-{structured}"] = [merger.merge_all(
                    {name: [ds[w] for w in comm.local_worker_ids] for name, ds in worker_deltas(workers, t).items()},
                    t, residuals=residuals) for t in range(2)]
        torch.save(results, root / f"merged.{rank}.pt")
        # A short overlapped, compressed run of islands of 2: its collectives too stay on the main thread.
        overlapped = resolve(None, {**base, "gpus_per_worker": 2, "merge.quantize": "int8",
                                    "merge.error_feedback": True, "outer.overlap_steps": 1, "checkpoint_every": 3})
        out, resumed = root / "overlapped", root / "resumed"
        out.mkdir(exist_ok=True)
        Trainer(overlapped, out, progress=False).run()
        # The checkpoint at step 3 was taken with round 0's synchronisation in flight; islands 1
        # and 2 wrote their workers' Δ and residuals from ranks 2 and 4. Resume from it.
        if rank == 0:
            shutil.copytree(out, resumed)
            shutil.rmtree(resumed / "checkpoints" / "step_00000006")
        Distributed(overlapped).barrier()
        Trainer(overlapped, resumed, progress=False).run(resume=True)


@pytest.fixture(scope="module")
def many_islands(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many-islands")
    run_processes(_many_islands, MANY_ISLANDS["processes"], str(root))
    return root


def test_the_compressed_sum_over_many_islands_is_the_reference_and_within_its_bound(many_islands):
    """Every layout against a float64 sum of the workers' deltas (the stated rounding bound) and
    the one-process reference of its islands (the same bits); every process ends alike, and
    each one's cross-island wire bytes are the cost model's."""
    from isoloco.sync.codec import Quantization, dequantize, error_bound, quantize
    from isoloco.sync.compressed import choose_route
    from helpers import reference_sum

    processes, workers = MANY_ISLANDS["processes"], MANY_ISLANDS["workers"]
    ranks = [torch.load(many_islands / f"merged.{rank}.pt") for rank in range(processes)]
    deltas = worker_deltas(workers)
    shapes = [torch.Size(shape) for shape in COMPRESSED_SHAPES.values()]
    for gpus in MANY_ISLANDS["layouts"]:
        islands = processes // gpus
        per_island = workers // islands
        route = choose_route(islands)
        for fmt in MANY_ISLANDS["formats"]:
            q = Quantization(fmt)
            key = f"{gpus}-{fmt}"
            for name, ds in deltas.items():
                sums = []
                for i in range(islands):
                    total = ds[i * per_island].clone()
                    for d in ds[i * per_island + 1:(i + 1) * per_island]:
                        total.add_(d)
                    sums.append(total)
                merged = ranks[0][key]["merged"][name]
                assert all(torch.equal(r[key]["merged"][name], merged) for r in ranks), (key, name)
                assert torch.equal(merged, reference_sum(sums, q, route).div_(workers)), (key, name)
                exact = torch.stack([d.double() for d in ds]).sum(0)
                stated = sum(error_bound(quantize(x, q), x).double() for x in sums)
                if route == "exchange":
                    total = sum(dequantize(quantize(x, q)) for x in sums)
                    stated = stated + error_bound(quantize(total, q), total).double()
                assert ((merged.double() * workers - exact).abs() <= stated + 1e-5).all(), (key, name)
            wire = [dict(zip(LINK_COUNTS, r[key]["counts"].tolist()))["wire_bytes_cross_island"] for r in ranks]
            predicted = ChunkPlan.of(shapes, q, islands, gpus).wire_bytes()
            assert sum(wire) / processes == pytest.approx(predicted), key
            float32 = 2 * (islands - 1) / islands * 4 * sum(s.numel() for s in shapes) / gpus
            assert max(wire) <= {"int8": 0.3, "int4": 0.17}[fmt] * float32, key


@pytest.mark.parametrize("structured", STRUCTURED)
def test_low_rank_and_top_k_give_every_split_of_an_island_the_same_bits(many_islands, structured):
    """Over two rounds (warm start, residuals), islands of G = 1, 2 and 3 gloo processes end
    with the bits of the same islands played by one thread each (the split of an island's
    traffic, and for top-k its all-gather of slices inside the island, change nothing)."""
    from isoloco.merge_config import MergeConfig
    from test_compressed import island_mergers, run_islands

    processes, workers = MANY_ISLANDS["processes"], MANY_ISLANDS["workers"]
    ranks = [torch.load(many_islands / f"merged.{rank}.pt") for rank in range(processes)]
    cfg = MergeConfig(**{key.removeprefix("merge."): value for key, value in STRUCTURED[structured].items()})
    for gpus in MANY_ISLANDS["layouts"]:
        islands = processes // gpus
        mergers = island_mergers(cfg, islands, workers)
        residuals = {name: [torch.zeros_like(d) for d in ds] for name, ds in worker_deltas(workers).items()}
        for t in range(2):
            expected = run_islands(cfg, worker_deltas(workers, t), islands, residuals, mergers, round=t)[0]
            for name in COMPRESSED_SHAPES:
                assert all(torch.equal(r[f"{gpus}-{structured}"][t][name], expected[name]) for r in ranks), (
                    gpus, t, name)


def test_a_checkpoint_with_a_synchronisation_in_flight_resumes_to_the_same_bits(many_islands):
    """Three islands of two processes: the island leaders 2 and 4 save their workers' state with
    a synchronisation in flight; the resumed run ends on the uninterrupted run's bits, and its
    landing round reports the drained synchronisation's traffic as the uninterrupted run did."""
    straight, resumed = (many_islands / name for name in ("overlapped", "resumed"))
    state = ckpt.verify(ckpt.latest_checkpoint(resumed / "checkpoints"))
    assert {"workers-1.safetensors", "workers-2.safetensors", "overlap.safetensors"} <= set(state["checksums"])
    first, second = final_params(straight), final_params(resumed)
    assert all(torch.equal(first[name], second[name]) for name in first)
    keys = ("bytes_per_worker", "wire_bytes_cross_island", "collectives")
    rounds = [[[line[k] for k in keys] for line in read_metrics(run / "metrics.jsonl") if "sync_s" in line]
              for run in (resumed, straight)]
    # (a checkpoint keeps the round's mean over processes, which is averaged again: float rounding)
    assert rounds[0] == [pytest.approx(counts, rel=1e-12) for counts in rounds[1]]


def test_no_collective_starts_off_the_main_thread(many_islands):
    assert not list(many_islands.glob("off-main.*.txt")), [p.read_text() for p in many_islands.glob("off-main.*")]
    steps = [line["step"] for line in read_metrics(many_islands / "overlapped" / "metrics.jsonl")]
    assert steps == list(range(1, 7))  # the overlapped run trained to its end
