"""gloo's collectives alone on a real link: the seconds an all-reduce and an all-gather take to
put the same bytes on each island's link, beside the cost model's seconds for those bytes.

    python -m isoloco.bench.reallink --probe --rates 10 --islands 2

A synchronisation is one of these (float32 and Iso-C: an all-reduce; a compressed sum: an
all-gather of every island's codes) plus the merge's own compute, so where a setting's
synchronisation is slower than the model with its compute taken out, the probe says whether the
collective itself is. The all-gather is timed both as one gloo call and as the engine starts it
(`isoloco.torch_comm.all_gather_blocks`: in pieces of `GLOO_PIECE_BYTES`). Each island runs one process of this module (`python -m
isoloco.bench.linkprobe RANK ISLANDS ADDRESS PORT BYTES REPEATS`, started inside its namespace by
`reallink`); rank 0 prints one JSON line of seconds per collective.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from isoloco.torch_comm import all_gather_blocks

#: The collectives a synchronisation puts on the link between islands, and the engine's all-gather.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather in pieces")


def probe(rank: int, islands: int, address: str, port: int, size: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of `repeats` calls of each collective sized to put `size` bytes on this process's
    link."""
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=islands)
    try:
        # An all-reduce over P puts 2(P−1)/P of its tensor on the link; an all-gather (P−1) blocks.
        reduced = torch.zeros(int(size * islands / (2 * (islands - 1))) // 4, dtype=torch.float32)
        block = torch.zeros(size // (islands - 1), dtype=torch.uint8)
        gathered = torch.empty(block.numel() * islands, dtype=torch.uint8)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # one message
        calls = {"all_reduce": lambda: dist.all_reduce(reduced), "all_gather": lambda: gather(gathered, block),
                 "all_gather in pieces": lambda: all_gather_blocks("probe", block, dist.group.WORLD, islands)[0].wait()}
        seconds: dict[str, list[float]] = {name: [] for name in COLLECTIVES}
        for _ in range(repeats):  # interleaved, so a drift in the link's state spreads over both
            for name in COLLECTIVES:
                dist.barrier()
                began = time.perf_counter()
                calls[name]()
                seconds[name].append(time.perf_counter() - began)
        return seconds
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    rank, islands, address, port, size, repeats = (argv if argv is not None else sys.argv[1:])
    seconds = probe(int(rank), int(islands), address, int(port), int(size), int(repeats))
    if int(rank) == 0:
        print(json.dumps(seconds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
