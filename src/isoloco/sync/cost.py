"""The one cost model of collectives: bytes each process puts on a link, and seconds on a link.

Every count in isoloco (the metrics' `wire_bytes_*`, the link benchmark's predictions, the
planning tables) comes from here, and so does every second: a collective takes its wire bytes
at the link's bandwidth plus one latency per latency-bound step (`Link.collective_seconds`).
The emulated slow link (`dist.emulate_link`) holds each collective back that long, and the
planning tables (`isoloco.bench.planning`) and the link benchmark (`isoloco.bench.link`) plan
with the same seconds. Collectives are the usual ring / pairwise algorithms over P processes:

* all-reduce of an n-byte tensor: a reduce-scatter then an all-gather, 2(P−1)/P·n sent per
  process in 2(P−1) latency-bound steps;
* all-gather of n-byte blocks: each process's block to each of the P − 1 others, (P−1)·n, in
  P − 1 steps;
* all-to-all: what a process sends to the others (its own chunk stays), in P − 1 steps;
* broadcast of n bytes: the source sends it to each of the P − 1 receivers (counted there);
* a sum in worker order (``chain_sum``, `Communicator.sum_in_order_async`): each of P − 1
  processes sends the whole running sum to the next, one after another, and the last
  broadcasts the total: on average the all-reduce's 2(P−1)/P·n per process in 2(P−1) steps,
  but the sends are not pipelined, so the bytes on its path are P times a process's share.
"""

from __future__ import annotations

import dataclasses

KINDS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "chain_sum")


def wire_bytes(kind: str, size: float, processes: int) -> float:
    """Bytes one process puts on the link in one collective of `kind` over `processes`:
    `size` is the all-reduced tensor, one all-gather block, the bytes an all-to-all sends to
    the others, or the broadcast tensor."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(KINDS)}")
    if processes <= 1:
        return 0.0
    if kind in ("all_reduce", "chain_sum"):
        return 2 * (processes - 1) / processes * size
    if kind == "all_to_all":
        return float(size)
    return (processes - 1) * size


def latency_steps(kind: str, processes: int) -> int:
    """Latency-bound steps of one collective of `kind` over `processes` (see the module docstring)."""
    if processes <= 1:
        return 0
    return 2 * (processes - 1) if kind in ("all_reduce", "chain_sum") else processes - 1


#: Bytes a TCP stream over IPv4 and Ethernet (MTU 1500) puts on a link per byte it carries: each
#: 1,448-byte segment leaves as a 1,514-byte frame, and the other direction's acknowledgements (a
#: 66-byte frame per two segments) share the link, since a collective sends both ways. Real links
#: charge it (`isoloco.bench.reallink` measures it); the emulated link charges what is sent alone.
TCP_FRAMING = (1514 + 66 / 2) / 1448


@dataclasses.dataclass(frozen=True)
class Link:
    """A link of `bandwidth` bytes/s per member and `latency` seconds per message; `framing`
    bytes cross it per byte a collective sends (1: none; a real TCP link: `TCP_FRAMING`)."""

    bandwidth: float
    latency: float
    framing: float = 1.0

    def collective_seconds(self, kind: str, wire: float, processes: int, calls: int = 1) -> float:
        """Seconds of `calls` collectives of `kind` over `processes` members that put `wire`
        bytes in all on this member's link: the bytes at the bandwidth, and a latency per
        latency-bound step of each call."""
        on_path = wire * processes if kind == "chain_sum" else wire
        return on_path * self.framing / self.bandwidth + calls * latency_steps(kind, processes) * self.latency

    def seconds(self, kind: str, size: float, processes: int, messages: int = 1) -> float:
        """Seconds of `messages` collectives of `kind` moving `size` bytes in all over
        `processes` members (for an all-gather, `size` is the gathered result)."""
        block = size / processes if kind == "all_gather" else size
        return self.collective_seconds(kind, wire_bytes(kind, block, processes), processes, messages)
