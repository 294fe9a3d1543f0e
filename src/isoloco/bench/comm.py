"""Communication: the bytes each merge rule moves per round, counted by the distributed engine.

The rules run on `TorchCommunicator` in gloo processes on this machine, merging exactly as
a multi-node job does; the figures are its counters, reset per round. Two tables:

* bytes per worker (`Communicator.bytes_sent_per_worker`: every collective adds what one
  worker hands to it, the tensor of an all-reduce or its own block of an all-gather; the same
  in every layout), and the bytes each process puts on the wire (`comm.wire_bytes`), against
  the wire bytes of the all-gather of every full delta that the paper's released code makes.
* bytes per process over each link (`Distributed.link_bytes`: cross-island and in-island,
  averaged over processes, `shard_map`'s broadcasts of orthogonalised matrices included),
  for islands of G = 1, 2, 4 processes, before and after the split of the cross-island
  traffic among an island's G processes. "Before" is the same code given no island group,
  so each of the G processes sends its whole tensors across islands (and computes every one of
  Iso-C's orthogonalisations itself), as isoloco did before the split.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.multiprocessing as mp

from isoloco.bench.table import Table, megabytes, ratio
from isoloco.bench.workload import RULE_METHODS, method_sections, parameter_shapes, worker_deltas
from isoloco.comm import LINK_COUNTS, Communicator
from isoloco.sync.cost import wire_bytes
from isoloco.config import resolve
from isoloco.distributed import Distributed, process_group
from isoloco.launch import free_port
from isoloco.outer import OuterStep
from isoloco.torch_comm import TorchCommunicator

PROCESSES = 2
FULL = {"presets": ("tiny", "small"), "workers": (2, 8, 32, 128)}
QUICK = {"presets": ("tiny",), "workers": (2, 8)}
#: The link table: R = 8 workers on 8 processes, as 8, 4 or 2 islands of G processes.
LINK_PRESET, LINK_PROCESSES, ISLAND_SIZES = "tiny", 8, (1, 2, 4)


def job_config(preset: str, workers: int, gpus_per_worker: int = 1) -> dict:
    """The config of a merge-only job (the benchmark's processes train nothing)."""
    return {"model": preset, "workers": workers, "global_batch": workers * gpus_per_worker,
            "gpus_per_worker": gpus_per_worker, "device": "cpu", "dist.backend": "gloo", "dist.timeout_s": 300}


def join_job(rank: int, world_size: int, port: int) -> None:
    """What torchrun would set for process `rank` (the benchmark starts its processes itself)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _merge_once(comm: Communicator, shapes: list[tuple[str, torch.Size]], deltas: dict[str, list[torch.Tensor]],
                method: str) -> None:
    """One outer step of `method` on this process's workers' deltas."""
    local = {name: [tensors[w] for w in comm.local_worker_ids] for name, tensors in deltas.items()}
    merge, outer = method_sections(method)
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes]
    OuterStep(params, merge, outer, comm, seed=0).step(local, round=0)


#: How `spawn_job` starts its processes (the tests fork them from a server with torch imported).
START_METHOD = "spawn"


def spawn_job(fn: Callable[..., None], processes: int, *args: object) -> dict:
    """Run fn(rank, processes, port, *args, out) in `processes` gloo processes; rank 0 writes
    the JSON it returns to `out`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "counts.json"
        mp.start_processes(fn, args=(processes, free_port(), *args, str(out)), nprocs=processes,
                           start_method=START_METHOD)
        return json.loads(out.read_text())


def _count_bytes(rank: int, world_size: int, port: int, preset: str, workers_list: tuple[int, ...],
                 methods: tuple[str, ...], out: str) -> None:
    """One process of the job: merge every method's deltas once per R; rank 0 writes the counts."""
    join_job(rank, world_size, port)
    shapes = parameter_shapes(preset)
    counts: dict[str, dict[str, int]] = {}
    with process_group(resolve(None, job_config(preset, workers_list[0]))):
        for workers in workers_list:
            comm = Distributed(resolve(None, job_config(preset, workers))).comm
            deltas = worker_deltas(shapes, workers)
            counts[str(workers)] = {}
            for method in methods:
                comm.reset_link_bytes()
                _merge_once(comm, shapes, deltas, method)
                wire = dict(zip(LINK_COUNTS, comm.reset_link_bytes().tolist()))["wire_bytes_cross_island"]
                counts[str(workers)][method] = {"per_worker": comm.reset_bytes(), "wire": wire}
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


def bytes_per_round(preset: str, workers: tuple[int, ...], methods: tuple[str, ...] = RULE_METHODS,
                    processes: int = PROCESSES) -> dict[int, dict[str, dict[str, float]]]:
    """Bytes of one round by R and method, counted on `processes` processes: per worker
    (`per_worker`) and put on the wire by one process (`wire`)."""
    counts = spawn_job(_count_bytes, processes, preset, workers, methods)
    return {int(r): by_method for r, by_method in counts.items()}


def _count_link_bytes(rank: int, world_size: int, port: int, preset: str, island_sizes: tuple[int, ...],
                      methods: tuple[str, ...], out: str) -> None:
    """One process of the job: for each island size G, merge every method's deltas once with
    the cross-island traffic split (after) and unsplit (before); rank 0 writes the counts."""
    join_job(rank, world_size, port)
    shapes = parameter_shapes(preset)
    deltas = worker_deltas(shapes, world_size)
    counts: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    with process_group(resolve(None, job_config(preset, world_size))):
        for size in island_sizes:
            run = Distributed(resolve(None, job_config(preset, world_size, size)))
            unsplit = TorchCommunicator(run.layout, run.peers, island=None)
            counts[str(size)] = {}
            for when, comm in (("before", unsplit), ("after", run.comm)):
                for method in methods:
                    _merge_once(comm, shapes, deltas, method)
                    counts[str(size)].setdefault(method, {})[when] = run.link_bytes(comm)
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


def link_bytes_per_round(preset: str, processes: int, island_sizes: tuple[int, ...],
                         methods: tuple[str, ...] = RULE_METHODS) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
    """Bytes per process of one round over each link, by island size G, method and
    before/after the split: {G: {method: {"before"|"after": {"bytes_cross_island": ...,
    "bytes_in_island": ...}}}}, with R = `processes` workers on `processes` processes."""
    counts = spawn_job(_count_link_bytes, processes, preset, island_sizes, methods)
    return {int(size): by_method for size, by_method in counts.items()}


def model_bytes(preset: str) -> int:
    """One full delta in float32: what one all-reduce of the mean moves per worker."""
    return 4 * sum(shape.numel() for _, shape in parameter_shapes(preset))


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del repeats, device  # byte counts are exact, and the same on every device (gloo processes on the CPU)
    setting = QUICK if quick else FULL
    for preset in setting["presets"]:
        counts, full = bytes_per_round(preset, setting["workers"]), model_bytes(preset)
        table = Table(f"Communication on `{preset}`: bytes per round, per worker handed to collectives and per "
                      "process on the wire (÷ the all-gather of full deltas)",
                      ["method (rule)"] + [f"R={r}: per worker" for r in setting["workers"]]
                      + [f"R={r}: wire per process" for r in setting["workers"]])
        baseline = {r: wire_bytes("all_gather", r // PROCESSES * full, PROCESSES) for r in setting["workers"]}
        for method in RULE_METHODS:
            cells = [megabytes(counts[r][method]["per_worker"]) for r in setting["workers"]]
            cells += [f"{megabytes(counts[r][method]['wire'])} ({ratio(counts[r][method]['wire'] / baseline[r])})"
                      for r in setting["workers"]]
            table.add(f"{method} ({method_sections(method)[0].rule})", *cells)
        table.add("all-gather of full deltas", *(megabytes(r * full) for r in setting["workers"]),
                  *(f"{megabytes(baseline[r])} (1×)" for r in setting["workers"]))
        table.notes.append(
            f"Counted by `TorchCommunicator` on {PROCESSES} gloo processes (R/{PROCESSES} workers each, each process "
            f"its own island); one full delta is {megabytes(full)} (float32). Per worker: what a rule hands to its "
            "collectives for one worker, the same in every layout. Wire per process: what the collectives' "
            "algorithms put on the link for one process (a ring all-reduce 2(P−1)/P of its tensor, an all-gather "
            "its block to each of the P − 1 others), compared with the same count for an all-gather of every "
            "worker's full delta, which the paper's released code makes for every rule.")
        yield table
    yield link_table(link_bytes_per_round(LINK_PRESET, LINK_PROCESSES, ISLAND_SIZES))


def link_table(counts: dict[int, dict[str, dict[str, dict[str, float]]]]) -> Table:
    """The link counts as a table: cross-island bytes before → after the split, in-island after."""
    sizes = sorted(counts)
    columns = ["method (rule)"]
    for size in sizes:
        columns += [f"G={size}: cross-island, before → after", f"G={size}: in-island"]
    table = Table(f"Traffic per link on `{LINK_PRESET}`: bytes per process per round, R = {LINK_PROCESSES} on "
                  f"{LINK_PROCESSES} processes in islands of G", columns)
    for method in RULE_METHODS:
        cells = []
        for size in sizes:
            before, after = (counts[size][method][when] for when in ("before", "after"))
            cross = after["bytes_cross_island"]
            split = f"{megabytes(before['bytes_cross_island'])} → {megabytes(cross)} " \
                    f"({ratio(cross / before['bytes_cross_island'])})"
            cells += [split, megabytes(after["bytes_in_island"])]
        table.add(f"{method} ({method_sections(method)[0].rule})", *cells)
    table.notes.append(
        f"Counted by `TorchCommunicator` on {LINK_PROCESSES} gloo processes ({LINK_PROCESSES}/G islands of G "
        f"processes holding G workers each; one full delta is "
        f"{megabytes(model_bytes(LINK_PRESET))}), averaged over processes. Each process counts what it puts into "
        "a collective: an all-reduce its tensor, an all-gather its own block, a broadcast its tensor at the "
        "source. Before: each of an island's G processes sends its whole tensors across islands, and computes "
        "every orthogonalisation itself; after: process j of each island sends slice j, "
        "the island all-gathers the slices, and the orthogonalisations are shared inside the island. With "
        "G = 1 there is nothing to split: every process is its own island.")
    return table
