"""Fast Iso-C paths against exact SVD Iso-C on the matrix shapes of the model presets.

A console listing of `isoloco.bench.ortho` (`python -m isoloco.bench --only ortho` prints
the same figures as markdown tables); see that module for what each column means. `time s`
is the median time of the path in this run, for orientation only: compare paths by `× svd`.

    python benchmarks/ortho.py [--quick] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from isoloco.bench.ortho import benchmark_shape, preset_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CPU presets and 178m without its vocabulary matrices")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per path (median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    header = f"{'path':<14} {'scale':<6} {'time s':>8} {'× svd':>7} {'error':>9} {'isotropy':>9} {'scale/exact':>11}"
    for preset, shapes in preset_shapes(args.quick).items():
        for rows, cols in shapes:
            print(f"\n{preset} {rows}x{cols}\n{header}", flush=True)
            for r in benchmark_shape(rows, cols, args.repeats):
                print(f"{r.path:<14} {r.scale:<6} {r.seconds:8.3f} {r.time_ratio:7.2f} {r.error:9.2e} "
                      f"{r.isotropy:9.2e} {r.scale_ratio:11.4f}", flush=True)


if __name__ == "__main__":
    main()
