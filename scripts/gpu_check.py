"""The GPU check: one command that tells whether isoloco runs right and fast on a CUDA GPU.

Prints a markdown table, one row per check, and exits 1 if any check failed:

1. exact orthogonalisation (svd, gram) on the GPU against the CPU, Iso-C of the 178m
   shapes: relative difference at most 1e-4;
2. the fast modes (Newton–Schulz bf16 + RMS scale, Polar Express bf16 + inner scale) against
   exact SVD Iso-C on the 178m / 512m / 1b shapes: speed-up and error (CUDA synchronised);
3. every named method trains the tiny model to a finite loss on the GPU;
4. peak device memory per added worker without and with `offload_workers` (expected about
   12 bytes per parameter, and about 0);
5. a DARE run checkpointed on the CPU and resumed on the GPU ends where the CPU run ends;
6. one round of the 178m model at R = 2 in bf16: tokens/s and model FLOPs utilisation.

`--dry-run` takes every step on the CPU with small shapes (tiny/small models, short
sequences), so the script is known to work before a GPU session spends minutes on it:

    OMP_NUM_THREADS=1 python scripts/gpu_check.py --dry-run
    python scripts/gpu_check.py --out gpu_check.md          # on the GPU machine

Nothing is downloaded: the data is the embedded corpus (prepared into ISOLOCO_CACHE on first
use; prepare it beforehand with the dry run and carry the cache to an offline machine).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from isoloco.bench.memory import WORKER_BYTES_PER_PARAM, fresh_process_peaks
from isoloco.bench.ortho import benchmark_shape
from isoloco.bench.workload import matrix_shapes
from isoloco.config import resolve
from isoloco.methods import METHODS
from isoloco.ortho import IsoSettings, iso_correct
from isoloco.trainer import Trainer

#: bf16 dense peak of an H100/H200 SXM, TFLOP/s (override with --peak-tflops).
PEAK_TFLOPS = 989.0
#: The smallest run every training check builds on.
TINY = {"model": "tiny", "seq_len": 32, "global_batch": 8, "steps": 6, "inner_steps": 3, "workers": 2,
        "eval_every": 6, "eval_batch": 8, "data.val_tokens": 1024, "checkpoint_every": 3, "keep_checkpoints": 2}


@dataclass(frozen=True)
class Setting:
    device: str
    ortho_presets: tuple[str, ...]  # check 2
    exact_preset: str  # check 1
    memory_preset: str  # check 4
    round_model: str  # check 6
    round_seq_len: int
    round_batch: int


FULL = Setting("cuda", ("178m", "512m", "1b"), "178m", "small", "178m", 2048, 16)
DRY = Setting("cpu", ("tiny",), "tiny", "tiny", "tiny", 64, 8)


@dataclass
class Row:
    check: str
    result: str
    ok: bool


def exact_paths(setting: Setting) -> Row:
    worst = 0.0
    for rows, cols in matrix_shapes(setting.exact_preset):
        matrix = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
        for method in ("svd", "gram"):
            on_cpu = iso_correct(matrix, IsoSettings(method))
            on_device = iso_correct(matrix.to(setting.device), IsoSettings(method)).cpu()
            worst = max(worst, ((on_device - on_cpu).norm() / on_cpu.norm()).item())
    return Row(f"exact Iso-C (svd, gram) on {setting.device} vs CPU, {setting.exact_preset} shapes",
               f"largest relative difference {worst:.1e}", worst <= 1e-4)


def fast_modes(setting: Setting) -> list[Row]:
    rows = []
    for preset in setting.ortho_presets:
        for shape in matrix_shapes(preset):
            results = {(r.path, r.scale): r for r in benchmark_shape(*shape, repeats=3, device=setting.device)}
            ns, pe = results["NS bf16", "rms"], results["PolarExp bf16", "inner"]
            rows.append(Row(f"fast Iso-C vs SVD, {preset} {shape[0]}×{shape[1]}",
                            f"NS bf16 + rms: speed-up {1 / ns.time_ratio:.1f}×, error {ns.error:.1e}; "
                            f"PolarExp bf16 + inner: speed-up {1 / pe.time_ratio:.1f}×, error {pe.error:.1e}",
                            math.isfinite(ns.error) and math.isfinite(pe.error)))
    return rows


def train(out: Path, **overrides) -> Trainer:
    trainer = Trainer(resolve(None, {**TINY, **overrides}), out, progress=False)
    out.mkdir(parents=True, exist_ok=True)
    trainer.run()
    return trainer


def every_method(setting: Setting, workdir: Path) -> Row:
    losses = {m: train(workdir / f"method-{m}", method=m, device=setting.device).last_val_loss for m in METHODS}
    bad = sorted(m for m, loss in losses.items() if loss is None or not math.isfinite(loss))
    return Row(f"every method trains the tiny model on {setting.device}",
               f"{len(losses) - len(bad)} of {len(losses)} finite" + (f"; not: {', '.join(bad)}" if bad else ""),
               not bad)


def offload_memory(setting: Setting) -> Row:
    preset, device = setting.memory_preset, setting.device
    configs = [(preset, r, offload, 64, 32, device) for offload in (False, True) for r in (1, 4)]
    (one, params), (four, _), (one_off, _), (four_off, _) = fresh_process_peaks(configs)
    per_worker = [(b - a) / 3 / (WORKER_BYTES_PER_PARAM * params) for a, b in ((one, four), (one_off, four_off))]
    expected_offload = device.startswith("cuda")  # on a CPU run the state is already in host memory
    ok = 0.7 <= per_worker[0] <= 1.5 and (per_worker[1] <= 0.2 if expected_offload else True)
    return Row(f"peak {device} memory per added worker, {preset}, R 1→4",
               f"without offload {per_worker[0]:.2f}×12P, with offload {per_worker[1]:.2f}×12P", ok)


def dare_resume(setting: Setting, workdir: Path) -> Row:
    reference = train(workdir / "dare-cpu", method="dare", device="cpu")
    resumed_dir = workdir / "dare-resumed"
    shutil.copytree(workdir / "dare-cpu", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000006")  # resume from step 3
    resumed = Trainer(resolve(None, {**TINY, "method": "dare", "device": setting.device}), resumed_dir,
                      progress=False)
    resumed.run(resume=True)
    worst = max(((a.cpu() - b).norm() / b.norm()).item()
                for a, b in zip(resumed.global_params, reference.global_params))
    limit = 0.0 if setting.device == "cpu" else 1e-3  # another device computes the rest in its own arithmetic
    return Row(f"DARE checkpointed on the CPU, resumed on {setting.device}",
               f"largest relative difference of θ {worst:.1e} (limit {limit:g})", worst <= limit)


def model_round(setting: Setting, workdir: Path, peak_tflops: float) -> Row:
    trainer = train(workdir / "round", model=setting.round_model, method="isoloco", workers=2, inner_steps=3, steps=6,
                    global_batch=setting.round_batch, seq_len=setting.round_seq_len, micro_batch=2,
                    device=setting.device, checkpoint_every=0)
    lines = (workdir / "round" / "metrics.jsonl").read_text().splitlines()
    tokens_per_s = json.loads(lines[-1])["tokens_per_s"]  # the second round: allocation and kernel choice done
    cfg = trainer.cfg
    shape = trainer.model.config
    flops_per_token = 6 * trainer.num_params + 12 * shape.num_hidden_layers * shape.hidden_size * cfg.seq_len
    mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12)
    utilisation = f", MFU {mfu:.1%} of {peak_tflops:g} TFLOP/s" if setting.device.startswith("cuda") else ""
    return Row(f"one round of {setting.round_model} at R = 2 on {setting.device}"
               + (" (bf16 autocast)" if setting.device.startswith("cuda") else ""),
               f"{tokens_per_s:,.0f} tokens/s{utilisation}", math.isfinite(tokens_per_s) and tokens_per_s > 0)


def timed(name: str, fn: Callable[[], Row | list[Row]]) -> tuple[list[Row], float]:
    """The check's rows and seconds; a check that raises is one failed row quoting the error,
    so one failure does not cost the figures of the others."""
    began = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - reported in the table, and the exit status is 1
        result = Row(name, f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", False)
    return (result if isinstance(result, list) else [result]), time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with small shapes")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's bf16 dense peak, for MFU")
    args = parser.parse_args()
    setting = DRY if args.dry_run else FULL
    if setting.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine with a CUDA build of torch, or use --dry-run")
    device_name = torch.cuda.get_device_name() if setting.device == "cuda" else "CPU (dry run)"
    lines = [f"# isoloco GPU check: {device_name}, torch {torch.__version__}", "",
             "| check | result | ok | seconds |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="isoloco-gpu-check-") as tmp:
        workdir = Path(tmp)
        checks = {
            "exact orthogonalisation": lambda: exact_paths(setting),
            "fast modes": lambda: fast_modes(setting),
            "every method": lambda: every_method(setting, workdir),
            "offload memory": lambda: offload_memory(setting),
            "DARE resume": lambda: dare_resume(setting, workdir),
            "model round": lambda: model_round(setting, workdir, args.peak_tflops),
        }
        for name, check in checks.items():
            rows, seconds = timed(name, check)
            for row in rows:
                failed |= not row.ok
                line = f"| {row.check} | {row.result} | {'yes' if row.ok else '**no**'} | {seconds:.0f} |"
                lines.append(line)
                print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
