"""Simulator throughput: tokens/s of DiLoCo with R simulated workers / tokens/s of a plain loop.

One case of `isoloco.bench.throughput` (`python -m isoloco.bench --only throughput` runs the
table of cases); see that module for how it is measured.

    python benchmarks/throughput.py [--workers 8] [--model small] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from isoloco.bench.throughput import ThroughputCase, throughput_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--model", default="small")
    parser.add_argument("--method", default="diloco")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    case = ThroughputCase(args.model, args.workers, args.global_batch, args.seq_len, args.inner_steps, args.method)
    ratio = throughput_ratio(case, args.repeats)
    print(f"model {case.preset}, {case.method}, R={case.workers}, H={case.inner_steps}, micro-batch "
          f"{case.global_batch // case.workers}x{case.seq_len}, threads {torch.get_num_threads()}, {args.repeats} repeats")
    print(f"throughput ratio (simulator / plain loop): {ratio:.3f}")


if __name__ == "__main__":
    main()
