"""`python -m isoloco.bench [--quick] [--only NAMES] [--repeats N] [--threads N]`

Runs the benchmark tables and prints them as markdown, each with the machine's load
average before and after it (the figures are ratios, but a busy machine still blurs them).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from isoloco import logs
from isoloco.bench import comm, factors, goodput, link, memory, merge_scale, ortho, outer, scale, throughput
from isoloco.trainer import resolve_device

TABLES = {
    "ortho": ortho.tables,
    "outer": outer.tables,
    "throughput": throughput.tables,
    "workers": throughput.scale_tables,
    "comm": comm.tables,
    "memory": memory.tables,
    "scale": scale.tables,
    "factors": factors.tables,
    "link": link.tables,
    "goodput": goodput.tables,
    "merge_scale": merge_scale.tables,
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{os.cpu_count()} CPUs ({cpu_model()}){gpu}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads; Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    parser = argparse.ArgumentParser(prog="python -m isoloco.bench", description=__doc__.splitlines()[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, presets and R values")
    parser.add_argument("--only", default=",".join(TABLES),
                        help=f"comma-separated tables to run, from {', '.join(TABLES)} (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 3; 2 with --quick)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N: where the tables compute "
                             "(the communication table always counts bytes on CPU processes)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); on a shared machine use 1, because "
                             "threads waiting for a busy core make small operations orders of magnitude slower")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in TABLES]
    if unknown:
        parser.error(f"unknown table(s) {', '.join(unknown)}: choose from {', '.join(TABLES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the fresh processes of the memory table
    repeats = args.repeats or (2 if args.quick else 3)
    try:
        device = str(resolve_device(args.device))
    except (ValueError, RuntimeError) as err:  # torch.device rejects a malformed name with a RuntimeError
        parser.error(str(err))
    command = " ".join(["python -m isoloco.bench", *(sys.argv[1:] if argv is None else argv)])
    print(f"# isoloco benchmarks\n\n`{command}`\n\nMachine: {machine()}.", flush=True)
    for name in names:
        load_before, began = os.getloadavg()[0], time.perf_counter()
        for table in TABLES[name](args.quick, repeats, device):
            print("\n" + table.markdown(), flush=True)
        print(f"\n_{name}: load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
              f"{time.perf_counter() - began:.0f} s._", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
