"""Memory: peak memory of a simulator round against R, with and without idle-worker offload.

Each configuration runs in a fresh process, so no peak carries over from another. The
span measured starts just before the trainer is built and ends after one round — all R
workers' inner steps and the outer step. On CPU (Linux) the figure is the kernel's
high-water mark of the process's resident memory (VmHWM, reset through
/proc/self/clear_refs at the start of the span) minus the resident memory then: it counts
what torch and the allocator really hold, including memory freed but not yet returned to
the system, and excludes the interpreter and the libraries already loaded (whose import
peak would otherwise hide a small run). On CUDA it is `torch.cuda.max_memory_allocated`
over the span.

What to expect: each worker keeps its pseudo-gradient and its AdamW moments between turns,
12 bytes per parameter, so the peak should grow by about 12·P per added worker.
`offload_workers` keeps that state in CPU memory while a worker is idle; on a CPU run it
already is there, so both columns must agree, and the option matters on a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from isoloco.bench.table import Table, megabytes, ratio
from isoloco.bench.workload import simulator

#: Bytes per parameter each idle worker keeps: Δ (fp32) plus AdamW's two moments (fp32).
WORKER_BYTES_PER_PARAM = 12
#: One sequence per forward pass (`micro_batch=1`) at every R, so activations do not change
#: with R and the growth is the workers' own; at a fixed global batch a smaller R would
#: otherwise run larger forward passes.
FULL = {"presets": {"tiny": (1, 4, 16, 64), "small": (1, 4, 16)}, "global_batch": 64, "seq_len": 32}
QUICK = {"presets": {"tiny": (1, 4)}, "global_batch": 64, "seq_len": 32}
METHOD = "isoloco"


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (given in kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: the CPU memory figure needs Linux")


def start_span(device: torch.device) -> int:
    """Reset the peak and return the memory in use now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the resident high-water mark
    return _status_bytes("VmRSS")


def peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_bytes("VmHWM")


def round_peak(preset: str, workers: int, offload: bool, global_batch: int, seq_len: int, device: str = "cpu",
               overrides: dict | None = None) -> tuple[int, int]:
    """(peak growth in bytes over one round of a fresh trainer on `device`, parameter count).

    Meant to run in a process of its own (`fresh_process_peaks`); `overrides` go to the
    run config.
    """
    device = torch.device(device)
    before = start_span(device)
    trainer = simulator(preset, METHOD, workers, global_batch, seq_len, inner_steps=1, steps=1,
                        **{"offload_workers": offload, "micro_batch": 1, "device": str(device),
                           **(overrides or {})})
    trainer.train_round(0, 1)
    return peak(device) - before, trainer.num_params


def in_fresh_processes(calls: list[tuple[Callable[..., Any], tuple]], env: dict[str, str] | None = None) -> list[Any]:
    """`fn(*args)` for each (fn, args) of `calls`, each in a new process, one after another, so
    no peak or loaded state carries over; `env` is added to the processes' environment."""
    context = multiprocessing.get_context("spawn")
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})  # spawned processes read the environment when they start
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
            return [pool.submit(fn, *args).result() for fn, args in calls]
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def fresh_process_peaks(configs: list[tuple]) -> list[tuple[int, int]]:
    """`round_peak(*config)` for each config, each in a new process, one at a time."""
    return in_fresh_processes([(round_peak, config) for config in configs])


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del repeats  # a peak is a high-water mark, not a noisy time
    setting = QUICK if quick else FULL
    table = Table(f"Memory: peak growth over one round ({METHOD}), with and without idle-worker offload",
                  ["preset", "R", "peak, no offload", "peak, offload", "offload ÷ no offload",
                   "growth per added worker ÷ 12·P"])
    batch, seq_len = setting["global_batch"], setting["seq_len"]
    for preset, workers in setting["presets"].items():
        configs = [(preset, r, offload, batch, seq_len, device) for r in workers for offload in (False, True)]
        peaks = iter(fresh_process_peaks(configs))
        first = None
        for r in workers:
            (plain, params), (offloaded, _) = next(peaks), next(peaks)
            first = first or (r, plain)
            slope = "—" if r == first[0] else ratio((plain - first[1]) / (r - first[0]) / (WORKER_BYTES_PER_PARAM * params))
            table.add(preset, r, megabytes(plain), megabytes(offloaded), ratio(offloaded / plain), slope)
    table.notes.append(
        f"One round of H = 1 inner step per worker at a global batch of {batch} × {seq_len} tokens, one "
        "sequence per forward pass (gradient accumulation), each "
        "configuration in a fresh process. CPU: peak resident memory (VmHWM) minus the resident memory before "
        "the trainer is built; CUDA: the same with allocated memory. The last column compares the growth from the smallest R, per added "
        "worker, with the pseudo-gradient and AdamW moments a worker keeps (12 bytes per parameter P).")
    yield table
