"""Fast Iso-C paths against exact SVD Iso-C on the matrix shapes of the model presets.

For each shape and each fast path (gram; Newton–Schulz fp32 / bf16; Polar Express bf16; with
the scale estimators that fit) it prints:

* time: the path's time as a multiple of exact SVD Iso-C (`iso_correct(M)`), both timed in the
  same run, interleaved, median of the repeats (a ratio, because these machines are noisy);
* error: ‖iso_path(M) − iso_svd(M)‖_F / ‖iso_svd(M)‖_F, the relative error of the update;
* isotropy: max_i |σ_i/mean σ − 1| over the singular values of the path's orthogonal factor
  (0 for an exact factor; Muon's Newton–Schulz plateaus near 0.3);
* scale: the path's scale estimate divided by the exact mean singular value.

The test matrix imitates a pseudo-gradient: a rank-16 signal with singular values from 50
down to 5 plus dense noise whose singular values lie in about [0, 2].

    python benchmarks/ortho.py [--quick] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from isoloco.ortho import SCALE_METHODS, iso_correct, orthogonalize, singular_values

SHAPES = {
    "178m": [(1024, 1024), (1024, 2688), (2688, 1024), (32000, 1024), (1024, 32000)],
    "512m": [(1536, 1536), (1536, 5440), (5440, 1536), (32000, 1536)],
}
QUICK_SHAPES = {"178m": [(1024, 1024), (1024, 2688), (2688, 1024)]}

# (label, ortho, ns_dtype, scales)
FAST_PATHS = [
    ("gram", "gram", torch.float32, ["exact"]),
    ("NS fp32", "newton_schulz", torch.float32, ["rms", "inner"]),
    ("NS bf16", "newton_schulz", torch.bfloat16, ["rms", "inner"]),
    ("PolarExp bf16", "polar_express", torch.bfloat16, ["rms", "inner"]),
]


def pseudo_gradient(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, 16, generator=g))[0]
    v = torch.linalg.qr(torch.randn(cols, 16, generator=g))[0]
    strengths = torch.logspace(math.log10(50), math.log10(5), 16)
    noise = torch.randn(rows, cols, generator=g) / math.sqrt(max(rows, cols))
    return (u * strengths) @ v.T + noise


def timed(fn) -> tuple[float, torch.Tensor]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def isotropy_error(factor: torch.Tensor) -> float:
    sigma = singular_values(factor.double())
    return (sigma / sigma.mean() - 1).abs().max().item()


def benchmark_shape(rows: int, cols: int, repeats: int) -> list[tuple]:
    matrix = pseudo_gradient(rows, cols)
    paths = [("svd", "svd", torch.float32, "exact")] + [
        (label, ortho, dtype, scale) for label, ortho, dtype, scales in FAST_PATHS for scale in scales
    ]
    times: dict[str, list[float]] = {}
    results: dict[str, torch.Tensor] = {}
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every path
        for label, ortho, dtype, scale in paths:
            seconds, results[label, scale] = timed(lambda: iso_correct(matrix, ortho, scale, 5, dtype))
            times.setdefault((label, scale), []).append(seconds)
    reference = results["svd", "exact"]
    reference_time = statistics.median(times["svd", "exact"])
    exact_mean = singular_values(matrix.double()).mean().item()
    rows_out = []
    for label, ortho, dtype, scale in paths:
        factor = orthogonalize(matrix, ortho, 5, dtype)
        error = ((results[label, scale] - reference).norm() / reference.norm()).item()
        estimate = SCALE_METHODS[scale](matrix, factor).item()
        median = statistics.median(times[label, scale])
        rows_out.append(
            (label, scale, median, median / reference_time, error, isotropy_error(factor.factor), estimate / exact_mean)
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the 178m hidden-size shapes (no vocabulary)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per path (median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    header = f"{'path':<14} {'scale':<6} {'time s':>8} {'× svd':>7} {'error':>9} {'isotropy':>9} {'scale/exact':>11}"
    for preset, shapes in (QUICK_SHAPES if args.quick else SHAPES).items():
        for rows, cols in shapes:
            print(f"\n{preset} {rows}x{cols}\n{header}", flush=True)
            for label, scale, seconds, ratio, error, isotropy, scale_ratio in benchmark_shape(rows, cols, args.repeats):
                print(
                    f"{label:<14} {scale:<6} {seconds:8.3f} {ratio:7.2f} {error:9.2e} {isotropy:9.2e} {scale_ratio:11.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
