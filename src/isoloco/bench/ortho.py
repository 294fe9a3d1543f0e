"""Orthogonalisation: the fast Iso-C paths against exact SVD Iso-C on the presets' matrices.

For every distinct 2-D parameter shape of the paper's presets (178m, 512m, 1b, vocabulary
32k) and of the CPU presets (tiny, small), and every fast path (gram; Newton–Schulz with
Muon's coefficients in fp32 and bf16; Polar Express in bf16; each with the scale
estimators that fit), on a matrix shaped like a pseudo-gradient (`workload.pseudo_gradient`):

* × svd: the path's Iso-C time over exact SVD Iso-C (`iso_correct(M, IsoSettings("svd"))`), both timed in the
  same run, interleaved, median of the repeats;
* error: ‖iso_path(M) − iso_svd(M)‖_F / ‖iso_svd(M)‖_F, the relative error of the update;
* isotropy: max_i |σ_i/mean σ − 1| over the singular values of the path's orthogonal factor
  (0 for an exact factor; Muon's Newton–Schulz plateaus near 0.3);
* scale/exact: the path's scale estimate over the exact mean singular value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import CPU_PRESETS, PAPER_PRESETS, matrix_shapes, pseudo_gradient, vocab_size
from isoloco.newton_schulz import NS_DTYPES

#: (label, ortho method, iteration dtype, scale estimators); exact SVD Iso-C is the reference.
from isoloco.ortho import SCALE_METHODS, IsoSettings, iso_correct, orthogonalize
from isoloco.svd import singular_values
REFERENCE = ("svd", "svd", "float32", ["exact"])
FAST_PATHS = [
    ("gram", "gram", "float32", ["exact"]),
    ("NS fp32", "newton_schulz", "float32", ["rms", "inner"]),
    ("NS bf16", "newton_schulz", "bfloat16", ["rms", "inner"]),
    ("PolarExp bf16", "polar_express", "bfloat16", ["rms", "inner"]),
]
#: The path whose speed the aim is about: the paper's fast mode (isoloco_fast).
FAST_MODE = ("NS bf16", "rms")
#: Matrices with fewer elements get an untimed warm-up call per path (see `benchmark_shape`).
WARMUP_BELOW_ELEMENTS = 2**22


@dataclass(frozen=True)
class PathResult:
    path: str
    scale: str
    seconds: float  # median; only for the console listing of benchmarks/ortho.py
    time_ratio: float  # over exact SVD Iso-C
    error: float
    isotropy: float
    scale_ratio: float


def preset_shapes(quick: bool) -> dict[str, list[tuple[int, int]]]:
    """Shapes per preset; --quick keeps the CPU presets and 178m without its vocabulary
    matrices (the slow ones)."""
    if quick:
        shapes = {preset: matrix_shapes(preset) for preset in CPU_PRESETS}
        shapes["178m"] = [s for s in matrix_shapes("178m") if vocab_size("178m") not in s]
        return shapes
    return {preset: matrix_shapes(preset) for preset in PAPER_PRESETS + CPU_PRESETS}


def isotropy_error(factor: torch.Tensor) -> float:
    sigma = singular_values(factor.double())
    return (sigma / sigma.mean() - 1).abs().max().item()


def benchmark_shape(rows: int, cols: int, repeats: int, device: str = "cpu") -> list[PathResult]:
    """Every path on one pseudo-gradient of this shape, on `device`; the reference comes first."""
    matrix = pseudo_gradient(rows, cols).to(device)
    paths = [(label, ortho, dtype, scale) for label, ortho, dtype, scales in [REFERENCE] + FAST_PATHS
             for scale in scales]
    # A warm-up call absorbs one-off costs (oneDNN generates kernels per shape and dtype:
    # 100x a 64x64 Newton-Schulz); on large matrices those are negligible next to the call,
    # and a warm-up would add a whole repeat to the longest part of the run.
    timings = interleaved({(label, scale): partial(iso_correct, matrix, IsoSettings(ortho, scale, IsoSettings.ns_steps, dtype))
                           for label, ortho, dtype, scale in paths}, repeats,
                          warmup=int(matrix.numel() < WARMUP_BELOW_ELEMENTS))
    reference = timings["svd", "exact"]
    exact_mean = singular_values(matrix.double()).mean().item()
    factors = {(ortho, dtype): orthogonalize(matrix, ortho, IsoSettings.ns_steps, NS_DTYPES[dtype]) for _, ortho, dtype, _ in paths}
    results = []
    for label, ortho, dtype, scale in paths:
        timing, factor = timings[label, scale], factors[ortho, dtype]
        results.append(PathResult(
            path=label,
            scale=scale,
            seconds=timing.median,
            time_ratio=timing.median / reference.median,
            error=((timing.result - reference.result).norm() / reference.result.norm()).item(),
            isotropy=isotropy_error(factor.factor),
            scale_ratio=SCALE_METHODS[scale](matrix, factor).item() / exact_mean,
        ))
    return results


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    """A detailed table per preset (every path on every shape), then a summary of the fast
    mode over all of them."""
    note = (f"Device {device}; median of {repeats} interleaved repeats per path; × svd < 1 is faster than exact "
            "SVD Iso-C. "
            "The test matrix is a rank-16 signal (singular values 50 … 5) plus dense noise.")
    summary = Table("Orthogonalisation: the fast mode (Newton–Schulz bf16, RMS scale) against exact SVD",
                    ["preset", "shape", "NS bf16 rms × svd", "error", "PolarExp bf16 inner × svd", "error",
                     "gram × svd", "NS bf16 faster than SVD"])
    for preset, shapes in preset_shapes(quick).items():
        detail = Table(f"Orthogonalisation on `{preset}`: every Iso-C path against exact SVD",
                       ["shape", "path", "scale", "× svd", "error", "isotropy", "scale/exact"], notes=[note])
        for rows, cols in shapes:
            results = {(r.path, r.scale): r for r in benchmark_shape(rows, cols, repeats, device)}
            for r in results.values():
                detail.add(f"{rows}×{cols}", r.path, r.scale, ratio(r.time_ratio), f"{r.error:.2e}",
                           f"{r.isotropy:.2e}", f"{r.scale_ratio:.4f}")
            fast, polar, gram = results[FAST_MODE], results["PolarExp bf16", "inner"], results["gram", "exact"]
            summary.add(preset, f"{rows}×{cols}", ratio(fast.time_ratio), f"{fast.error:.2e}",
                        ratio(polar.time_ratio), f"{polar.error:.2e}", ratio(gram.time_ratio),
                        "yes" if fast.time_ratio < 1 else "**no**")
        yield detail
    summary.notes.append(note)
    yield summary
