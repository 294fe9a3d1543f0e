"""The GPU check: one command that tells whether isoloco runs right and fast on a CUDA GPU.

Prints a markdown table, one row per check with its figure and the threshold it is held to,
and exits 1 if any check failed:

1. exact orthogonalisation (svd, gram) on the GPU against the CPU, Iso-C of the 178m shapes;
2. the fast Iso-C paths (Newton–Schulz and Polar Express in bf16, inner-product scale)
   against exact SVD Iso-C on the paper's shapes (178m, 512m): faster, and within an error
   bound (CUDA synchronised);
3. every named method trains the tiny model to a finite loss on the GPU;
4. peak device memory per added worker without and with `offload_workers` (pinned host
   memory, the next worker's state prefetched on a side stream);
5. a DARE run checkpointed on the CPU and resumed on the GPU ends where the CPU run ends;
6. one round of the 178m model at R = 2 in bf16: model FLOPs utilisation above a floor;
7. a K = 32 TIES merge of offloaded deltas (fetched from host memory one at a time) on the
   178m shapes: peak device memory within a bound counted in deltas;
8. `deterministic=true`: two runs, each in a fresh process, give the same bits;
9. two GPUs as one island (NCCL) train what one GPU trains (skipped, saying so, with one GPU);
10. an overlapped int8 synchronisation (τ = 1) whose stages run on a side stream trains what
    the CPU trains; over NCCL, two islands of one GPU train what one process trains (skipped,
    saying so, with one GPU);
11. offloaded workers with an overlapped int8 synchronisation and error feedback (residuals in
    pinned host memory, copied to the GPU for the merge and back) train what workers kept on
    the GPU train, bit for bit;
12. low rank and top-k (`merge.compress`, int8 with error feedback, overlapped) on the GPU
    train what the CPU trains, low rank also with offloaded workers (its factors made on the GPU);
13. the torchtitan recipe (`isoloco.torchtitan`, needs the torchtitan extra): a torchft
    lighthouse and 2 replica groups of torchtitan's debug model, each one `torchrun` with half
    the GPUs (FSDP inside a group over NCCL), IsoLoCo's outer step: both groups end
    bit-identical and every matrix's first outer update has flat singular values in the
    directions Iso-C keeps (skipped in the dry run: torchtitan does not run on a CPU as
    shipped; tests/test_torchtitan.py covers the CPU with test-only patches).
14. no stage of an overlapped synchronisation stops the host: the stages of Iso-C, of the mean
    and Iso-C under int8 low rank and top-k with error feedback, deltas and residuals offloaded
    to pinned host memory, and of SparseLoCo run under `torch.cuda.set_sync_debug_mode("error")`
    (the finiteness check before the first stage, Iso-C's pure finalize and the landing after
    the last stage may synchronise; on the dry run the stages run on the CPU, where nothing
    synchronises).

`--dry-run` takes every step on the CPU with small shapes (tiny model, short sequences, one
round per method, a smaller batch for the memory check, two gloo processes for checks 9 and
10), so the script is known to work before a GPU session spends minutes on it. Speed and MFU
are held to their thresholds on the GPU only: on the CPU, tiny matrices are timed by call
overhead and there is no bf16 peak to divide by.

    OMP_NUM_THREADS=1 python scripts/gpu_check.py --dry-run
    python scripts/gpu_check.py --out gpu_check.md          # on the GPU machine
    python scripts/gpu_check.py --only fast,merge            # some checks only

Nothing is downloaded: the data is the embedded corpus (prepared into ISOLOCO_CACHE on first
use; prepare it beforehand with the dry run and carry the cache to an offline machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from isoloco import checkpoint as ckpt
from isoloco.bench import scale
from isoloco.bench.memory import WORKER_BYTES_PER_PARAM, fresh_process_peaks, in_fresh_processes
from isoloco.bench.ortho import benchmark_shape
from isoloco.bench.workload import matrix_shapes
from isoloco.config import DEFAULT_PRESET, resolve
from isoloco.methods import METHODS
from isoloco.ortho import IsoSettings, iso_correct
from isoloco.svd import null_rtol
from isoloco.rundir import CHECKPOINT_DIR, METRICS_FILE
from isoloco.trainer import Trainer

#: bf16 dense peak of an H100/H200 SXM, TFLOP/s (override with --peak-tflops).
PEAK_TFLOPS = 989.0
#: The smallest run every training check builds on.
TINY = {"model": "tiny", "seq_len": 32, "global_batch": 8, "steps": 6, "inner_steps": 3, "workers": 2,
        "eval_every": 6, "eval_batch": 8, "data.val_tokens": 1024, "checkpoint_every": 3, "keep_checkpoints": 2}

#: Exact orthogonalisation on the device against the CPU: both are exact, so they differ by
#: float32 rounding only.
EXACT_LIMIT = 1e-4
#: Largest relative error of a fast path's Iso-C update against exact SVD Iso-C. With the
#: inner-product scale (exact for an exact factor) the error is the orthogonalisation's own:
#: docs/benchmarks.md lists 0.29–0.46 for Newton–Schulz on the paper's shapes and 0.09–0.18
#: for Polar Express on the 178m ones, measured on the CPU; a factor of noise scores about 1.
FAST_PATHS = {("NS bf16", "inner"): 0.6, ("PolarExp bf16", "inner"): 0.3}
#: A run resumed on the GPU from a CPU checkpoint against the CPU run: the rest of the run is
#: computed in the GPU's own arithmetic.
RESUME_LIMIT = 1e-3
#: Model FLOPs utilisation a 178m round must reach on the GPU. More than twice what the GPU
#: gives without bf16 tensor cores (fp32 dense peak 67 TFLOP/s, 6.8% of 989), so a run that
#: lost autocast, fell back to the CPU or waits on the host at every step fails it. It has not
#: been calibrated on a GPU yet: raise it to just under what a healthy run measures.
MFU_FLOOR = 0.15
#: Workers whose deltas the merge check fetches, and its bound: TIES streams one parameter's
#: K deltas in two passes with at most 6 deltas of working memory, whatever K; with the
#: fetched delta in flight and the merged result that is 8 deltas.
MERGE_WORKERS = 32
MERGE_BOUND_DELTAS = 8
#: An island of two processes averages its gradients over both, which rounds differently
#: from one process taking the whole batch: within 1e-5 on the CPU (tests/test_distributed.py).
#: On GPUs bf16 autocast carries that difference through the steps; the bound there is the
#: CPU-to-GPU resume check's, not yet calibrated on two GPUs.
ISLAND_LIMITS = {"cpu": 1e-5, "cuda": RESUME_LIMIT}


@dataclass(frozen=True)
class Setting:
    device: str
    ortho_presets: tuple[str, ...]  # check 2
    exact_preset: str  # check 1
    method_steps: int  # check 3
    merge_shapes: tuple[tuple[int, int], ...]  # check 7
    memory_preset: str  # check 4
    memory_batch: int
    round_model: str  # check 6
    round_seq_len: int
    round_batch: int
    timed: bool  # speed (check 2) and MFU (check 6) are held to their thresholds


FULL = Setting("cuda", ("178m", "512m"), "178m", 6, tuple(matrix_shapes("178m")), "small", 64, "178m", 2048,
               16, timed=True)
# The merge check takes one 178m shape on the CPU too: its figure is the resident high-water
# mark there, in which the interpreter's own allocations would swamp a tiny model's deltas.
DRY = Setting("cpu", ("tiny",), "tiny", 3, ((1024, 1024),), "tiny", 16, "tiny", 64, 8, timed=False)


@dataclass
class Row:
    check: str
    result: str  # the figure(s) measured
    threshold: str  # what they are held to
    ok: bool | None  # None: skipped, the reason in `result`


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def exact_paths(setting: Setting) -> Row:
    worst = 0.0
    for rows, cols in matrix_shapes(setting.exact_preset):
        matrix = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
        for method in ("svd", "gram"):
            on_cpu = iso_correct(matrix, IsoSettings(method))
            on_device = iso_correct(matrix.to(setting.device), IsoSettings(method)).cpu()
            worst = max(worst, relative(on_device, on_cpu))
    return Row(f"exact Iso-C (svd, gram) on {setting.device} vs CPU, {setting.exact_preset} shapes",
               f"largest relative difference {worst:.1e}", f"≤ {EXACT_LIMIT:g}", worst <= EXACT_LIMIT)


def fast_modes(setting: Setting) -> list[Row]:
    rows = []
    for preset in setting.ortho_presets:
        for shape in matrix_shapes(preset):
            results = {(r.path, r.scale): r for r in benchmark_shape(*shape, repeats=3, device=setting.device)}
            for (path, scale), bound in FAST_PATHS.items():
                result = results[path, scale]
                fast = result.time_ratio < 1 or not setting.timed
                within = result.error <= bound
                rows.append(Row(f"fast Iso-C {path} + {scale} vs SVD, {preset} {shape[0]}×{shape[1]}",
                                f"speed-up {1 / result.time_ratio:.2f}×, error {result.error:.2e}",
                                f"error ≤ {bound:g}" + (", speed-up > 1×" if setting.timed else
                                                        " (speed not held on the CPU)"),
                                fast and within))
    return rows


def train(out: Path, preset: str | None = None, **overrides) -> Trainer:
    trainer = Trainer(resolve(preset, {**TINY, **overrides}), out, progress=False)
    out.mkdir(parents=True, exist_ok=True)
    trainer.run()
    return trainer


def every_method(setting: Setting, workdir: Path) -> Row:
    # dp trains one model and refuses the workers the others take
    losses = {m: train(workdir / f"method-{m}", method=m, device=setting.device, steps=setting.method_steps,
                       **({"workers": 1} if METHODS[m]["algorithm"] == "dp" else {})).last_val_loss for m in METHODS}
    bad = sorted(m for m, loss in losses.items() if loss is None or not math.isfinite(loss))
    return Row(f"every method trains the tiny model on {setting.device}",
               f"{len(losses) - len(bad)} of {len(losses)} finite" + (f"; not: {', '.join(bad)}" if bad else ""),
               "every validation loss finite", not bad)


def offload_memory(setting: Setting) -> Row:
    # From R = 2: with offload, one worker's moments are prefetched to the GPU while another
    # trains, a constant from the second worker on.
    preset, device = setting.memory_preset, setting.device
    configs = [(preset, r, offload, setting.memory_batch, 32, device) for offload in (False, True) for r in (2, 4)]
    (two, params), (four, _), (two_off, _), (four_off, _) = fresh_process_peaks(configs)
    per_worker = [(b - a) / 2 / (WORKER_BYTES_PER_PARAM * params) for a, b in ((two, four), (two_off, four_off))]
    offloads = device.startswith("cuda")  # on a CPU run the state is already in host memory
    ok = 0.7 <= per_worker[0] <= 1.5 and (per_worker[1] <= 0.2 if offloads else True)
    return Row(f"peak {device} memory per added worker, {preset}, R 2→4",
               f"without offload {per_worker[0]:.2f}×12P, with offload {per_worker[1]:.2f}×12P",
               "without offload 0.7–1.5×12P" + (", with offload ≤ 0.2×12P" if offloads else ""), ok)


def dare_resume(setting: Setting, workdir: Path) -> Row:
    reference = train(workdir / "dare-cpu", method="dare", device="cpu")
    resumed_dir = workdir / "dare-resumed"
    shutil.copytree(workdir / "dare-cpu", resumed_dir)
    shutil.rmtree(resumed_dir / CHECKPOINT_DIR / "step_00000006")  # resume from step 3
    resumed = Trainer(resolve(None, {**TINY, "method": "dare", "device": setting.device}), resumed_dir,
                      progress=False)
    resumed.run(resume=True)
    worst = max(relative(a.cpu(), b) for a, b in zip(resumed.global_params, reference.global_params))
    limit = 0.0 if setting.device == "cpu" else RESUME_LIMIT
    return Row(f"DARE checkpointed on the CPU, resumed on {setting.device}",
               f"largest relative difference of θ {worst:.1e}", f"≤ {limit:g}", worst <= limit)


def flops_per_token(trainer: Trainer) -> float:
    """Training FLOPs per token of the model's matrix products: 6 per parameter for every
    parameter but the input embedding (a lookup, no product), plus attention's scores and
    weighted sums, 12·layers·hidden·sequence (forward and backward)."""
    shape = trainer.model.config
    weights = sum(p.numel() for name, p in trainer.named_params if "embed_tokens" not in name)
    return 6 * weights + 12 * shape.num_hidden_layers * shape.hidden_size * trainer.cfg.seq_len


def model_round(setting: Setting, workdir: Path, peak_tflops: float) -> Row:
    # H = 8 and the fast Iso-C: the outer step is part of a round, as in a run, but small.
    trainer = train(workdir / "round", model=setting.round_model, method="isoloco_fast", workers=2,
                    inner_steps=8, steps=16, global_batch=setting.round_batch, seq_len=setting.round_seq_len,
                    micro_batch=2, device=setting.device, checkpoint_every=0, eval_every=16)
    lines = (workdir / "round" / METRICS_FILE).read_text().splitlines()
    tokens_per_s = json.loads(lines[-1])["tokens_per_s"]  # the second round: allocation and kernel choice done
    mfu = flops_per_token(trainer) * tokens_per_s / (peak_tflops * 1e12)
    floor = MFU_FLOOR if setting.timed else None
    return Row(f"one round of {setting.round_model} at R = 2, H = 8 on {setting.device}"
               + (" (bf16 autocast)" if setting.device.startswith("cuda") else ""),
               f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} of {peak_tflops:g} TFLOP/s (non-embedding FLOPs)",
               f"MFU ≥ {floor:.0%}" if floor else "finite (MFU not held on the CPU)",
               mfu >= floor if floor else math.isfinite(mfu) and mfu > 0)


def merge_memory(setting: Setting) -> Row:
    shapes = setting.merge_shapes
    peaks = [peak for peak, _ in scale.fresh_process_peaks([("ties", shape, MERGE_WORKERS, setting.device)
                                                              for shape in shapes])]
    worst = max(range(len(shapes)), key=peaks.__getitem__)
    return Row(f"TIES merge of K = {MERGE_WORKERS} offloaded deltas on {setting.device}, each shape in a "
               "fresh process", f"peak {peaks[worst]:.1f} deltas ({shapes[worst][0]}×{shapes[worst][1]})",
               f"≤ {MERGE_BOUND_DELTAS} deltas", peaks[worst] <= MERGE_BOUND_DELTAS)


def _deterministic_run(device: str, out: Path) -> None:
    train(out, method="isoloco", device=device, deterministic=True)


def same_bits(check: str, first: Path, second: Path) -> Row:
    """The row of a check that two runs end on the same θ, bit for bit (their last checkpoints)."""
    one, other = (ckpt.load_tensors(ckpt.latest_checkpoint(out / CHECKPOINT_DIR), "global") for out in (first, second))
    differ = sorted(name for name in one if not torch.equal(one[name], other[name]))
    return Row(check, f"{len(differ)} of {len(one)} tensors of θ differ" + (f" (first: {differ[0]})" if differ else ""),
               "bit for bit", not differ)


def deterministic(setting: Setting, workdir: Path) -> Row:
    # Fresh processes: deterministic kernels are switched on process-wide, and a rerun is one.
    runs = [workdir / f"deterministic-{i}" for i in range(2)]
    in_fresh_processes([(_deterministic_run, (setting.device, out)) for out in runs])
    return same_bits(f"deterministic=true on {setting.device}, two runs of the tiny model", *runs)


def launched_pair(setting: Setting, workdir: Path, label: str, extra: dict, island_args: list[str]) -> float:
    """Largest relative difference of θ between a run of the tiny model in this process and on
    two (`isoloco launch --nproc 2`), with `extra` items on both and `island_args` on the two."""
    overrides = {"method": "isoloco", "device": setting.device, **extra}
    alone = train(workdir / f"{label}-alone", DEFAULT_PRESET, **overrides)  # what `isoloco train` resolves
    out = workdir / f"{label}-launched"
    args = [f"{key}={value}" for key, value in {**TINY, **overrides}.items()]
    done = subprocess.run([sys.executable, "-m", "isoloco", "launch", "--nproc", "2", "--", "train", *args,
                           *island_args, "--out", str(out), "--quiet"], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {label} launched run exited {done.returncode}: {last}")
    launched = ckpt.load_tensors(ckpt.latest_checkpoint(out / CHECKPOINT_DIR), "global")
    return max(relative(launched[name], theta.cpu()) for (name, _), theta in zip(alone.named_params,
                                                                                 alone.global_params))


def island(setting: Setting, workdir: Path) -> Row:
    name = f"two {'GPUs' if setting.device == 'cuda' else 'CPU processes'} as one island vs one process"
    if setting.device == "cuda" and torch.cuda.device_count() < 2:
        return Row(name, f"skipped: {torch.cuda.device_count()} GPU visible, two needed", "—", None)
    worst = launched_pair(setting, workdir, "island", {}, ["gpus_per_worker=2"])
    limit = ISLAND_LIMITS[setting.device]
    return Row(name, f"largest relative difference of θ {worst:.1e}", f"≤ {limit:g}", worst <= limit)


#: The overlapped, compressed synchronisation the overlap check runs (τ = 1 of H = 3).
OVERLAP = {"outer.overlap_steps": 1, "outer.overlap_alpha": 0.5, "merge.quantize": "int8",
           "merge.error_feedback": True}


def overlap(setting: Setting, workdir: Path) -> list[Row]:
    """The synchronisation in flight: its stages on a side stream (one GPU, against the CPU's
    numbers), and over NCCL between two islands of one GPU (against one process), where the
    collectives start from the main thread between inner steps."""
    rows = []
    limit = ISLAND_LIMITS[setting.device]
    if setting.device != "cpu":  # on the CPU (the dry run) it would compare a run with itself
        stream = train(workdir / "overlap-device", method="isoloco", device=setting.device, **OVERLAP)
        cpu = train(workdir / "overlap-cpu", method="isoloco", device="cpu", **OVERLAP)
        worst = max(relative(a.cpu(), b) for a, b in zip(stream.global_params, cpu.global_params))
        rows.append(Row(f"an overlapped int8 synchronisation on {setting.device} (a side stream) vs the CPU",
                        f"largest relative difference of θ {worst:.1e}", f"≤ {limit:g}", worst <= limit))
    name = f"two islands of one {'GPU (NCCL)' if setting.device == 'cuda' else 'CPU process'}, overlapped, vs one process"
    if setting.device == "cuda" and torch.cuda.device_count() < 2:
        return rows + [Row(name, f"skipped: {torch.cuda.device_count()} GPU visible, two needed", "—", None)]
    worst = launched_pair(setting, workdir, "overlap", OVERLAP, [])
    return rows + [Row(name, f"largest relative difference of θ {worst:.1e}", f"≤ {limit:g}", worst <= limit)]


def _overlap_run(device: str, out: Path, offload: bool) -> None:
    train(out, method="isoloco", device=device, deterministic=True, offload_workers=offload, **OVERLAP)


def offloaded_overlap(setting: Setting, workdir: Path) -> Row:
    """Offloading moves state between host and device memory and nothing else: the residuals
    the merge updates must come back to the host, and the side stream's reads of host copies
    must be ordered, so the offloaded run gives the bits of the run that keeps its workers on
    the device (deterministic kernels, each run in a fresh process; on the CPU, the dry run,
    offloading keeps the state where it is)."""
    runs = [workdir / f"overlap-offload-{offload}" for offload in (True, False)]
    in_fresh_processes([(_overlap_run, (setting.device, out, offload)) for out, offload in zip(runs, (True, False))])
    return same_bits(f"offloaded workers, overlapped int8 + error feedback on {setting.device} vs workers kept "
                     "there", *runs)


#: `merge.compress` on the device: PowerSGD's factors and top-k chunks, both int8 with error
#: feedback and overlapped (their stages on the side stream).
STRUCTURED = {
    "low rank": {"merge.compress": "lowrank", "merge.compress_rank": 2},
    "top-k": {"merge.compress": "topk", "merge.compress_density": 0.1, "merge.compress_chunk": 64},
    # Deltas and residuals in pinned host memory, the factors where the merge computes.
    "low rank, offloaded": {"merge.compress": "lowrank", "merge.compress_rank": 2, "offload_workers": True},
}


def structured(setting: Setting, workdir: Path) -> list[Row]:
    """Low rank and top-k on the device against the same runs on the CPU (on the dry run, where
    both would be the CPU, the run alone: a finite loss)."""
    rows = []
    limit = ISLAND_LIMITS["cuda"]
    for label, compress in STRUCTURED.items():
        overrides = {"method": "isoloco", **OVERLAP, **compress}
        run = train(workdir / f"{label}-{setting.device}", device=setting.device, **overrides)
        if setting.device == "cpu":
            loss = run.last_val_loss
            rows.append(Row(f"{label}, overlapped int8 + error feedback on the CPU (dry run: nothing to compare)",
                            f"validation loss {loss:.3f}", "finite", loss is not None and math.isfinite(loss)))
            continue
        cpu = train(workdir / f"{label}-cpu", device="cpu", **overrides)
        worst = max(relative(a.cpu(), b) for a, b in zip(run.global_params, cpu.global_params))
        rows.append(Row(f"{label}, overlapped int8 + error feedback on {setting.device} vs the CPU",
                        f"largest relative difference of θ {worst:.1e}", f"≤ {limit:g}", worst <= limit))
    return rows


def kept_condition_number(matrix: torch.Tensor) -> float:
    """σmax/σmin of `matrix` (in float64) over the directions Iso-C keeps: those above isoloco's
    numerically null threshold (`null_rtol`), which Iso-C leaves null."""
    singular = torch.linalg.svdvals(matrix.double())
    kept = singular[singular > null_rtol(matrix) * singular[0]]
    return (kept[0] / kept[-1]).item()


def torchtitan_recipe(setting: Setting, workdir: Path) -> Row:
    """2 replica groups of the recipe, each a torchrun of half the GPUs (both on the one GPU
    when there is one): FSDP over NCCL inside a group, torchft's all-reduce across groups over
    NCCL (gloo when the groups share a GPU, which NCCL refuses)."""
    import importlib.util

    name = "torchtitan recipe: 2 replica groups, FSDP over NCCL inside each, IsoLoCo"
    if setting.device != "cuda":
        return Row(name, "skipped: torchtitan runs on CUDA only (tests/test_torchtitan.py covers the CPU)", "—", None)
    if importlib.util.find_spec("torchtitan") is None:
        return Row(name, "skipped: the torchtitan extra is not installed (pip install -e '.[torchtitan]')", "—", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU tests' group entry and flags
    import torchtitan_cpu
    from safetensors.torch import load_file

    from isoloco.launch import free_port

    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's per-quorum lines, before torchft loads
    from isoloco.torchft.replica import start_lighthouse

    gpus = torch.cuda.device_count()
    per_group = max(1, gpus // 2)
    devices = [",".join(str(g) for g in range(r * per_group, (r + 1) * per_group)) if gpus > 1 else "0"
               for r in range(2)]
    torchtitan_cpu.prepare_assets(workdir / "titan-assets")
    server, address = start_lighthouse(min_replicas=2)
    try:
        groups = []
        for r in range(2):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices[r], "TORCHFT_LIGHTHOUSE": address,
                   "ISOLOCO_TT_OUT": str(workdir / f"titan-{r}"), "ISOLOCO_TT_RECORD": str(workdir / f"titan-{r}")}
            groups.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_group), "--master-port",
                 str(free_port()), torchtitan_cpu.__file__, *torchtitan_cpu.FLAGS,
                 "--hf-assets-path", str(workdir / "titan-assets" / "tokenizer"), "--dataloader.dataset", "c4_test",
                 "--dataloader.dataset-path", str(workdir / "titan-assets" / "corpus"),
                 "--training.seq-len", "256", "--fault-tolerance.process-group", "nccl" if gpus > 1 else "gloo",
                 "--fault-tolerance.replica-id", str(r), "--dump-folder", str(workdir / f"titan-dump-{r}"),
                 # FSDP2 as such: on the CPU, torchtitan 0.3.0's default spmd_types backend refused a
                 # plain parameter with 2 processes per group (before any isoloco code ran).
                 "--parallelism.spmd-backend", "partial_dtensor"],
                env=env, cwd=workdir, stdout=(workdir / f"titan-{r}.log").open("w"), stderr=subprocess.STDOUT))
        codes = [group.wait() for group in groups]
    finally:
        server.shutdown()
    for r, code in enumerate(codes):
        if code:
            last = ((workdir / f"titan-{r}.log").read_text().strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"replica group {r} exited with status {code}: {last}")
    final = [load_file(workdir / f"titan-{r}.safetensors") for r in range(2)]
    differ = sorted(n for n in final[0] if not torch.equal(final[0][n], final[1][n]))
    first = load_file(workdir / "titan-0-sync0.safetensors")
    matrices = [k.removeprefix("before.") for k, v in first.items() if k.startswith("before.") and v.ndim == 2]
    flat = max(kept_condition_number(first[f"before.{n}"] - first[f"after.{n}"]) for n in matrices)
    return Row(f"{name} ({per_group} GPU{'s' if per_group > 1 else ''} per group)",
               f"{len(differ)} of {len(final[0])} tensors of θ differ between the groups; first update's "
               f"largest σmax/σmin (non-null directions) {flat:.5f}", "bit for bit; ≤ 1.001",
               not differ and flat <= 1.001)


#: Check 14's merges: rule and the merge keys of each, on 4 workers' deltas of a wide and a tall
#: matrix and a vector.
SYNC_FREE = {"Iso-C": ("iso_c", {}),
             "mean, int8 low rank + error feedback, offloaded": (
                 "mean", {"quantize": "int8", "error_feedback": True, "compress": "lowrank", "compress_rank": 2}),
             "Iso-C, int8 low rank + error feedback, offloaded": (
                 "iso_c", {"quantize": "int8", "error_feedback": True, "compress": "lowrank", "compress_rank": 2}),
             "mean, int8 top-k + error feedback, offloaded": (
                 "mean", {"quantize": "int8", "error_feedback": True, "compress": "topk",
                          "compress_density": 0.2, "compress_chunk": 64})}
SYNC_FREE_SHAPES = {"wide.weight": (48, 160), "tall.weight": (120, 24), "norm.weight": (24,)}


@contextmanager
def host_waits(mode: str, device: str) -> Iterator[None]:
    """CUDA's sync debug mode for the block ("error": a synchronising call raises); nothing on the CPU."""
    if device != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def sync_free_stages(setting: Setting) -> list[Row]:
    """Each merge's stages under CUDA's sync debug mode "error" (check 14)."""
    from isoloco.comm import LocalCommunicator
    from isoloco.merge import Merger
    from isoloco.merge_config import MergeConfig
    from isoloco.sync.handles import Sync, run_to_end
    from isoloco.sync.sparseloco import Tiling, sparseloco_mean

    device, workers = setting.device, 4
    generator = torch.Generator().manual_seed(0)
    stored = {name: [torch.randn(shape, generator=generator) for _ in range(workers)]
              for name, shape in SYNC_FREE_SHAPES.items()}

    def placed(offloaded: bool) -> dict[str, list[torch.Tensor]]:
        return {name: [t.pin_memory() if offloaded and device == "cuda" else t.to(device) for t in tensors]
                for name, tensors in stored.items()}

    def stages(sync: Sync) -> dict[str, torch.Tensor]:
        with host_waits("error", device):
            for _ in range(sync.stages):
                next(sync.steps)
        return run_to_end(sync.steps)  # the landing, which the host waits for anyway

    rows = []
    where = "the CPU (dry run: nothing synchronises)" if device == "cpu" else device
    for label, (rule, keys) in SYNC_FREE.items():
        offloaded = "offloaded" in label
        merger = Merger(MergeConfig(rule=rule, **keys), LocalCommunicator(workers), seed=0)
        if merger._rule.finalize is not None:  # a pure step on merged matrices, allowed to wait
            finalize = merger._rule.finalize

            def waiting(merged, knobs, finalize=finalize):
                with host_waits("default", device):
                    return finalize(merged, knobs)

            merger._rule = dataclasses.replace(merger._rule, finalize=waiting)
        deltas, residuals = placed(offloaded), placed(offloaded) if keys.get("error_feedback") else None
        fetch = (lambda t: t.to(device, non_blocking=True)) if offloaded and device == "cuda" else None
        # The finiteness check, one sync per bucket, runs in `start`, before the first stage.
        merged = stages(merger.start(deltas, 0, fetch=fetch, residuals=residuals))
        ok = set(merged) == set(SYNC_FREE_SHAPES) and all(bool(torch.isfinite(t).all()) for t in merged.values())
        rows.append(Row(f"{label}: stages on {where}", "no stage synchronised" if ok else "a merge was not finite",
                        'torch.cuda.set_sync_debug_mode("error") raises nothing', ok))
    accumulators = placed(False)
    steps = sparseloco_mean(LocalCommunicator(workers), placed(False), accumulators, Tiling(8, 4), 0.95)
    merged = stages(Sync(steps, 1))
    ok = all(bool(torch.isfinite(t).all()) for t in merged.values())
    rows.append(Row(f"SparseLoCo: its stage on {where}", "no stage synchronised" if ok else "a merge was not finite",
                    'torch.cuda.set_sync_debug_mode("error") raises nothing', ok))
    return rows


def timed(name: str, fn: Callable[[], Row | list[Row]]) -> tuple[list[Row], float]:
    """The check's rows and seconds; a check that raises is one failed row quoting the error,
    so one failure does not cost the figures of the others."""
    began = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - reported in the table, and the exit status is 1
        result = Row(name, f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", "—",
                     False)
    return (result if isinstance(result, list) else [result]), time.perf_counter() - began


CHECKS: dict[str, Callable[[Setting, Path, float], Row | list[Row]]] = {
    "exact": lambda setting, workdir, peak: exact_paths(setting),
    "fast": lambda setting, workdir, peak: fast_modes(setting),
    "methods": lambda setting, workdir, peak: every_method(setting, workdir),
    "offload": lambda setting, workdir, peak: offload_memory(setting),
    "resume": lambda setting, workdir, peak: dare_resume(setting, workdir),
    "round": model_round,
    "merge": lambda setting, workdir, peak: merge_memory(setting),
    "deterministic": lambda setting, workdir, peak: deterministic(setting, workdir),
    "island": lambda setting, workdir, peak: island(setting, workdir),
    "overlap": lambda setting, workdir, peak: overlap(setting, workdir),
    "offloaded_overlap": lambda setting, workdir, peak: offloaded_overlap(setting, workdir),
    "structured": lambda setting, workdir, peak: structured(setting, workdir),
    "torchtitan": lambda setting, workdir, peak: torchtitan_recipe(setting, workdir),
    "sync_free": lambda setting, workdir, peak: sync_free_stages(setting),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with small shapes")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's bf16 dense peak, for MFU")
    parser.add_argument("--only", default=",".join(CHECKS),
                        help=f"comma-separated checks to run, from {', '.join(CHECKS)} (default: all)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown or not names:
        parser.error(f"--only {args.only!r} names no check or an unknown one: choose from {', '.join(CHECKS)}")
    setting = DRY if args.dry_run else FULL
    if setting.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine with a CUDA build of torch, or use --dry-run")
    device_name = torch.cuda.get_device_name() if setting.device == "cuda" else "CPU (dry run)"
    lines = [f"# isoloco GPU check: {device_name}, torch {torch.__version__}", "",
             "| check | result | threshold | ok | seconds |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="isoloco-gpu-check-") as tmp:
        for name in names:
            rows, seconds = timed(name, lambda: CHECKS[name](setting, Path(tmp), args.peak_tflops))
            for row in rows:
                failed |= row.ok is False
                verdict = "skipped" if row.ok is None else "yes" if row.ok else "**no**"
                line = f"| {row.check} | {row.result} | {row.threshold} | {verdict} | {seconds:.0f} |"
                lines.append(line)
                print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
