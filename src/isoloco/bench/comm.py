"""Communication: bytes per worker per round of each merge rule, against the all-gather
of every full delta that the paper's released code does.

The rules run on the distributed engine: `PROCESSES` gloo processes on this machine, each
holding R / PROCESSES workers, merging through `TorchCommunicator` exactly as a multi-node
job does. The figures are its counters (`Communicator.bytes_sent_per_worker`, reset per
round): every collective adds what one worker hands to it — the tensor of an all-reduce,
its own block of an all-gather. The baseline hands every worker R full deltas (R × 4 bytes
per parameter). Not counted: `TorchCommunicator.shard_map`'s broadcast of orthogonalised
matrices (Iso-C's correction split over processes), which is optional work sharing, not
part of the merge.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

import torch
import torch.multiprocessing as mp

from isoloco.bench.table import Table, megabytes, ratio
from isoloco.bench.workload import RULE_METHODS, method_sections, parameter_shapes, worker_deltas
from isoloco.config import resolve
from isoloco.distributed import Distributed, process_group
from isoloco.launch import free_port
from isoloco.outer import OuterStep

PROCESSES = 2
FULL = {"presets": ("tiny", "small"), "workers": (2, 8, 32, 128)}
QUICK = {"presets": ("tiny",), "workers": (2, 8)}


def _run_config(preset: str, workers: int) -> dict:
    return {"model": preset, "workers": workers, "global_batch": workers, "device": "cpu", "dist.backend": "gloo",
            "dist.timeout_s": 300}


def _count_bytes(rank: int, world_size: int, port: int, preset: str, workers_list: tuple[int, ...],
                 methods: tuple[str, ...], out: str) -> None:
    """One process of the job: merge every method's deltas once per R; rank 0 writes the counts."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    shapes = parameter_shapes(preset)
    counts: dict[str, dict[str, int]] = {}
    with process_group(resolve(None, _run_config(preset, workers_list[0]))):
        for workers in workers_list:
            comm = Distributed(resolve(None, _run_config(preset, workers))).comm
            deltas = worker_deltas(shapes, workers)
            local = {name: [tensors[w] for w in comm.local_worker_ids] for name, tensors in deltas.items()}
            counts[str(workers)] = {}
            for method in methods:
                merge, outer = method_sections(method)
                params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes]
                OuterStep(params, merge, outer, comm, seed=0).step(local, round=0)
                counts[str(workers)][method] = comm.reset_bytes()
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


def bytes_per_round(preset: str, workers: tuple[int, ...], methods: tuple[str, ...] = RULE_METHODS,
                    processes: int = PROCESSES) -> dict[int, dict[str, int]]:
    """Bytes per worker of one round, by R and method, counted on `processes` processes."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "counts.json"
        mp.start_processes(_count_bytes, args=(processes, free_port(), preset, workers, methods, str(out)),
                           nprocs=processes, start_method="spawn")
        counts = json.loads(out.read_text())
    return {int(r): by_method for r, by_method in counts.items()}


def model_bytes(preset: str) -> int:
    """One full delta in float32: what one all-reduce of the mean moves per worker."""
    return 4 * sum(shape.numel() for _, shape in parameter_shapes(preset))


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del repeats, device  # byte counts are exact, and the same on every device (gloo processes on the CPU)
    setting = QUICK if quick else FULL
    for preset in setting["presets"]:
        counts, full = bytes_per_round(preset, setting["workers"]), model_bytes(preset)
        table = Table(f"Communication on `{preset}`: bytes per worker per round (÷ the all-gather baseline)",
                      ["method (rule)"] + [f"R={r}" for r in setting["workers"]])
        for method in RULE_METHODS:
            table.add(f"{method} ({method_sections(method)[0].rule})",
                      *(f"{megabytes(counts[r][method])} ({ratio(counts[r][method] / (r * full))})"
                        for r in setting["workers"]))
        table.add("all-gather of full deltas (baseline)", *(f"{megabytes(r * full)} (1×)" for r in setting["workers"]))
        table.notes.append(
            f"Counted by `TorchCommunicator` on {PROCESSES} gloo processes (R/{PROCESSES} workers each); one full "
            f"delta is {megabytes(full)} (float32). Ratios are to R full deltas, what the paper's released code "
            "all-gathers to every worker for every rule.")
        yield table
