"""The merge's collectives over torch.distributed, and the slow link they may be held to.

`TorchCommunicator` is the `Communicator` of one process of a multi-process run: across
islands it talks to its peer group only, inside its island over the fast link (see
`isoloco.layout` for who is where). `EmulatedLink` holds each cross-island collective's
result back until a slow link would have delivered it (`dist.emulate_link`), charging the
one cost model of `isoloco.sync.cost`. `collective` marks torch.distributed calls so that
a failure says what it was doing and counts as a possible lost peer.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from isoloco.comm import Communicator, nbytes
from isoloco.errors import CollectiveError, first_line
from isoloco.layout import ProcessLayout
from isoloco.sync.cost import Link, wire_bytes
from isoloco.sync.handles import Pending


class EmulatedLink:
    """A slow link between islands, emulated on one machine: a collective's result is held
    back until the link, busy with the collectives before it, would have delivered it, after
    the seconds the cost model charges it (`isoloco.sync.cost.Link.collective_seconds`)."""

    def __init__(self, gbps: float, latency_ms: float) -> None:
        self.link = Link(bandwidth=gbps * 1e9 / 8, latency=latency_ms / 1000)
        self._free_at = 0.0

    def deliver_at(self, kind: str, wire: float, processes: int) -> float:
        """When a collective of `kind` over `processes` putting `wire` bytes on the link,
        started now, is delivered."""
        begins = max(time.perf_counter(), self._free_at)
        self._free_at = begins + self.link.collective_seconds(kind, wire, processes)
        return self._free_at


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Mark the torch.distributed calls inside as one collective, so a failure says what it
    was doing and is recognised as a possible lost peer (see `process_group`)."""
    try:
        yield
    except RuntimeError as err:  # backend errors (gloo, NCCL, store) are RuntimeErrors
        if isinstance(err, CollectiveError):
            raise
        raise CollectiveError(f"{what} failed: {first_line(err)}") from err


def assign_owners(costs: list[float], processes: int) -> list[int]:
    """Owner process of each job: largest jobs first, each to the least loaded process.

    Deterministic (ties go to the lower index), so every process computes the same plan.
    """
    load = [0.0] * processes
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: -costs[j]):
        owner = min(range(processes), key=lambda p: load[p])
        owners[job] = owner
        load[owner] += costs[job]
    return owners


def _orthogonalisation_cost(tensor: torch.Tensor) -> float:
    """Relative cost of an SVD / Newton–Schulz of `tensor`: m·n·min(m, n) for a matrix."""
    return tensor.numel() * (min(tensor.shape) if tensor.ndim == 2 else 1)


class TorchCommunicator(Communicator):
    """The merge collectives of one process over torch.distributed.

    Only the merge crosses islands, so its cross-island traffic is split among the island's
    G processes (the hierarchical pattern of HSDP's replica groups): process j of every
    island exchanges slice j of each tensor with its peer group, then the island all-gathers
    the G results over its fast link. HSDP needs a reduce-scatter inside the island first;
    here the island's processes are data-parallel replicas holding the same deltas, so each
    already has the island's sum and takes its slice without communicating. Each island
    thereby sends one copy of what it merges across islands (sums: one model; gathers: its
    workers' factors), not G copies.

    `shard_map` spreads pure per-tensor work (Iso-C's orthogonalisations) over the island's
    processes and broadcasts each result from its owner inside the island; across islands
    each island computes its own, so no result crosses the slow link.
    """

    def __init__(self, layout: ProcessLayout, peers: dist.ProcessGroup | None,
                 island: dist.ProcessGroup | None, link: EmulatedLink | None = None) -> None:
        """`peers`: this process's peer group (None with one island). `island`: its island's
        group, over whose fast link the cross-island traffic is split; None sends every
        tensor whole across islands from each process (G = 1, or how isoloco merged islands
        of G > 1 before the split: the communication benchmark's "before")."""
        super().__init__()
        self._layout = layout
        self._peers = peers
        self._island = island
        self._link = link  # an emulated slow link between islands, or None
        # Slice `_slot` of `_slices` is this process's share of the cross-island traffic.
        self._slices = layout.group_size if island is not None else 1
        self._slot = layout.island_rank if island is not None else 0

    @property
    def num_workers(self) -> int:
        return self._layout.workers

    @property
    def local_worker_ids(self) -> list[int]:
        return self._layout.local_worker_ids

    @property
    def islands(self) -> int:
        return self._layout.islands if self._peers is not None else 1

    @property
    def island(self) -> int:
        return self._layout.island if self._peers is not None else 0

    @property
    def island_slices(self) -> tuple[int, int]:
        return self._slices, self._slot

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._start_sum(tensor).wait()

    def _gather_across_processes(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._start_gather(tensors).wait()

    def _start_sum(self, tensor: torch.Tensor) -> Pending[torch.Tensor]:
        if self._peers is None:
            return Pending.done(tensor)
        part = self._slice(tensor)
        ready_at = self._cross("all_reduce", nbytes(part))
        work = _post("merge all-reduce", [part], lambda: dist.all_reduce(part, group=self._peers, async_op=True))
        return Pending([work], lambda: self._joined(part, tensor.numel()).view_as(tensor), ready_at)

    def sum_in_order_async(self, build: Callable[[torch.Tensor | None], torch.Tensor | None],
                           zeros: Callable[[], torch.Tensor], started: Callable[[int], bool]) -> Pending[torch.Tensor]:
        if self._peers is None:
            return super().sum_in_order_async(build, zeros, started)
        # Islands hold consecutive workers, so the running sum passes from island to island:
        # each receives it, adds its own workers' terms one after another and sends it on; the
        # last broadcasts the total. An island's processes hold the same workers, so each
        # carries its slice of the running sum, as `_start_sum` does. It all runs at the wait:
        # an island can add nothing before the islands ahead of it have.
        template = zeros()
        self._count(template)
        width = self._slice_width(template.numel())
        ready_at = self._cross("chain_sum", width * template.element_size())
        islands, workers = self._layout.islands, self.local_worker_ids
        receives = self.island > 0 and started(workers[0])
        sends = self.island < islands - 1 and started(workers[-1] + 1)

        def finish() -> torch.Tensor:
            onto = None
            if receives:
                running = template.new_empty(width)
                with collective("in-order sum receive"):
                    dist.recv(running, src=dist.get_global_rank(self._peers, self.island - 1), group=self._peers)
                onto = template  # zeros, but for this process's slice
                begin = min(self._slot * width, template.numel())
                end = min(begin + width, template.numel())
                onto[begin:end] = running[:end - begin]
            total = build(onto)
            part = self._slice(total if total is not None else template)
            sent = _post("in-order sum send", [part], lambda: dist.isend(
                part, dst=dist.get_global_rank(self._peers, self.island + 1), group=self._peers)) if sends else None
            # The total lands beside the running sum, which may still be on its way.
            landed = part if self.island == islands - 1 else torch.empty_like(part)
            with collective("in-order sum broadcast"):
                dist.broadcast(landed, src=dist.get_global_rank(self._peers, islands - 1), group=self._peers)
            if sent is not None:
                sent.wait()
            return self._joined(landed, template.numel()).view_as(template)

        return Pending([], finish, ready_at)

    def _start_gather(self, tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        if self._peers is None:
            return Pending.done(list(tensors))
        local = torch.stack(tensors)
        part = self._slice(local)
        ready_at = self._cross("all_gather", nbytes(part))
        work, blocks = all_gather_blocks("merge all-gather", part, self._peers, self._layout.islands)

        def finish() -> list[torch.Tensor]:
            # Island i's block holds its workers' tensors, so the rows come in global worker order.
            gathered = self._joined(blocks, local.numel())
            return list(gathered.reshape(-1, *local.shape[1:]).unbind(0))

        return Pending([work], finish, ready_at)

    def exchange(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Pending[list[torch.Tensor]]:
        received = torch.empty(sum(receive_sizes), dtype=send.dtype, device=send.device)
        ready_at = self._cross("all_to_all", nbytes(send) - send_sizes[self.island] * send.element_size(),
                               handed=nbytes(send))
        work = _post("compressed-sum all-to-all", [send, received],
                     lambda: dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self._peers,
                                                    async_op=True))
        return Pending([work], lambda: list(torch.split(received, receive_sizes)), ready_at)

    def gather_peers(self, blob: torch.Tensor) -> Pending[list[torch.Tensor]]:
        ready_at = self._cross("all_gather", nbytes(blob))
        work, blocks = all_gather_blocks("compressed-sum all-gather", blob, self._peers, self._layout.islands)
        return Pending([work], lambda: _blocks(blocks), ready_at)

    def join_island(self, part: torch.Tensor) -> Pending[list[torch.Tensor]]:
        if self._slices == 1:
            return Pending.done([part])
        work, slots = self._gather_in_island(part)
        return Pending([work], lambda: _blocks(slots))

    def _slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of `tensor` flattened (equal slices, the last zero-padded), so
        that the island's all-gather can join them."""
        flat = tensor.reshape(-1)
        width = self._slice_width(flat.numel())
        if self._slices > 1:
            flat = torch.nn.functional.pad(flat, (0, width * self._slices - flat.numel()))
        return flat[self._slot * width:(self._slot + 1) * width]

    def _slice_width(self, numel: int) -> int:
        """The elements of each process's slice of a tensor of `numel` (the last zero-padded)."""
        return -(-numel // self._slices)

    def _joined(self, exchanged: torch.Tensor, numel: int) -> torch.Tensor:
        """The island's slices of a cross-island result joined over its fast link: shape
        (..., numel), the leading dimensions being those the exchange added."""
        if self._slices == 1:
            return exchanged
        work, slots = self._gather_in_island(exchanged)
        work.wait()
        # Slot j holds slice j of every row: each row's slices side by side, in slot order.
        return slots.movedim(0, -2).reshape(*exchanged.shape[:-1], -1)[..., :numel]

    def _gather_in_island(self, part: torch.Tensor) -> tuple[_Labelled, torch.Tensor]:
        """Count and start the island's all-gather of each process's `part` (`all_gather_blocks`)."""
        self.record("in_island", nbytes(part), wire_bytes("all_gather", nbytes(part), self._slices))
        return all_gather_blocks("island all-gather", part, self._island, self._slices)

    def _cross(self, kind: str, size: int, handed: int | None = None) -> float:
        """Count one collective of `kind` across islands sending `size` bytes (`handed` given
        to it, by default `size`); returns when an emulated slow link delivers it (0: no
        emulation)."""
        wire = wire_bytes(kind, size, self._layout.islands)
        self.record("cross_island", size if handed is None else handed, wire)
        return self._link.deliver_at(kind, wire, self._layout.islands) if self._link is not None else 0.0

    def shard_map_async(self, fn: Callable[[torch.Tensor], torch.Tensor],
                        tensors: list[torch.Tensor]) -> Pending[list[torch.Tensor]]:
        # Shared out inside the island only, over its fast link: across islands every island
        # computes its own, so no result crosses the slow link. An island of one process has
        # nobody to share with.
        if self._island is None:
            return Pending.done([fn(tensor) for tensor in tensors])
        ranks = self._layout.island_ranks(self._layout.island)
        owners = [ranks[owner] for owner in assign_owners([_orthogonalisation_cost(t) for t in tensors], len(ranks))]
        results, handed = [], 0
        for owner, tensor in zip(owners, tensors):
            if owner == self._layout.rank:
                result = fn(tensor)
                assert result.shape == tensor.shape and result.dtype == tensor.dtype, \
                    "shard_map needs a shape-keeping fn"
                results.append(result.contiguous())
                handed += nbytes(result)
            else:
                results.append(torch.empty_like(tensor))
        # Every process joins every broadcast; the owner sends its results to the others.
        self.record("in_island", handed, wire_bytes("broadcast", handed, len(ranks)), calls=len(results))
        works = [_post("broadcast of orthogonalised matrices", [result],
                       lambda result=result, owner=owner: dist.broadcast(result, src=owner, group=self._island,
                                                                         async_op=True))
                 for owner, result in zip(owners, results)]
        return Pending(works, lambda: results)


class _Labelled:
    """A torch.distributed `Work` whose failure says which collective it was (`collective`),
    holding the tensors the collective reads and writes until its wait.

    On a GPU, `InFlight` runs a synchronisation's stages on a side stream, and a stage may hand
    a collective a tensor the main stream allocated (or the other way round). Each tensor is
    marked in use by the stream that posts the collective (`record_stream`), so that once freed
    its memory goes to no other stream before that one has passed its wait for the collective,
    and it is held here so that it is not freed before the wait.
    """

    def __init__(self, work: Any, what: str, tensors: list[torch.Tensor]) -> None:
        self._work, self._what, self._tensors = work, what, tensors
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))

    def wait(self) -> None:
        with collective(self._what):
            self._work.wait()
        self._tensors = []


def _post(what: str, tensors: list[torch.Tensor], start: Callable[[], Any]) -> _Labelled:
    """Start an async collective (`start()` returns its `Work`) on `tensors`, labelled `what`."""
    with collective(what):
        return _Labelled(start(), what, tensors)


#: The most bytes of a member's block that one gloo all-gather carries. gloo sends a block as one
#: message, and on a real slow TCP link a block of megabytes crossed slower than an all-reduce of
#: the same bytes, where pieces of this size, all started at once, crossed at the all-reduce's
#: rate (docs/benchmarks.md, "gloo's collectives alone"). NCCL's all-gathers are left whole.
GLOO_PIECE_BYTES = 1 << 16
#: Pieces one all-gather is cut into at most, so a large block is not thousands of calls.
_MAX_PIECES = 256


class _AllOf:
    """The `Work`s of one collective posted in pieces, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def all_gather_blocks(what: str, part: torch.Tensor, group: dist.ProcessGroup, members: int,
                      piece_bytes: int = GLOO_PIECE_BYTES) -> tuple[_Labelled, torch.Tensor]:
    """Start an all-gather of every member's `part` into one tensor, without a list of blocks
    to join afterwards; returns its handle and the result, shaped (members, *part.shape) once
    the handle is waited for. Over gloo the block goes in pieces of at most `piece_bytes`."""
    flat = part.contiguous().view(-1)
    gathered = flat.new_empty(members * flat.numel())
    piece = max(piece_bytes // flat.element_size(), -(-flat.numel() // _MAX_PIECES), 1)
    if dist.get_backend(group) != "gloo" or flat.numel() <= piece:
        # torch 2.13 renamed all_gather_into_tensor, which then warns; torch >= 2.9 is supported.
        start = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = _post(what, [flat, gathered], lambda: start(gathered, flat, group=group, async_op=True))
        return work, gathered.view(members, *part.shape)
    rows = gathered.view(members, -1)

    def start_pieces() -> _AllOf:
        # Each piece lands straight in its columns of every member's row.
        return _AllOf([dist.all_gather(list(rows[:, begin:begin + piece].unbind(0)), flat[begin:begin + piece],
                                       group=group, async_op=True)
                       for begin in range(0, flat.numel(), piece)])

    return _post(what, [flat, gathered], start_pieces), gathered.view(members, *part.shape)


#: Bytes a gathered block must start on to be read as any wider dtype (a uint8 blob's float32
#: scales are viewed in place).
_BLOCK_ALIGNMENT = 16


def _blocks(gathered: torch.Tensor) -> list[torch.Tensor]:
    """The blocks of an `all_gather_blocks` result, in member order: views of it where every block
    starts aligned, copies where a block's size leaves the next one's start unaligned (empty
    blocks too: their views start one element apart)."""
    blocks = list(gathered.unbind(0))
    if all(block.storage_offset() * block.element_size() % _BLOCK_ALIGNMENT == 0 for block in blocks):
        return blocks
    return [block.clone() for block in blocks]
