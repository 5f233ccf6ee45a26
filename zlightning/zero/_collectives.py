"""Stateless collective helpers for the ZeRO-3 engine (one all-gather per group, one reduce-scatter per group).

[Note: streams]
On CUDA the all-gather and the reduce-scatter run on their own streams so they overlap compute on the default
stream: the side stream first waits for the current stream (the input was produced there), the collective is issued
on the side stream, and ``CommHandle.wait`` makes the current stream wait for the side stream before the output is
used. Tensors crossing streams are recorded with ``record_stream`` so the caching allocator does not reuse them early.
On CPU (gloo) there are no streams: ``async_op=True`` already runs the collective on gloo's own threads.

[Note: in-place collectives on the host]
Both collectives work in place on buffers the engine owns: the all-gather reads this rank's shard from its own chunk
of the output, and the reduce-scatter leaves this rank's reduced chunk inside the input (the result is a view of
it). NCCL does this natively (``all_gather_into_tensor`` / ``reduce_scatter_tensor``). gloo's versions of those two
ops copy through temporaries as large as the whole buffer (two of them for the reduce-scatter) and are slower than
gloo's own point-to-point-based primitives; measured on 2 and 4 CPU ranks at 4-16 MB per collective, one
``broadcast`` per rank chunk into the output is 1.3-2.9x faster than ``all_gather_into_tensor`` and one ``reduce``
per chunk to its owner is 1.7-2.3x faster than ``reduce_scatter_tensor``. So on host tensors the all-gather is one
broadcast per rank chunk (issued back to back, waited together; every rank issues them in the same order, as gloo
requires), and the reduce-scatter one ``reduce`` per chunk to its owner, except between two ranks (below).

[Note: the host reduce-scatter between two ranks]
gloo's ``reduce`` receives into a temporary it allocates per call, on gloo's worker threads, so from glibc's
per-thread heaps rather than the engine's pool: two of them (one per worker thread) stay resident after the first
step, a whole unit's worth beside the step's buffers. Between two ranks the reduce-scatter is instead one exchange,
an ``all_to_all_single`` whose splits send the peer its chunk and receive the peer's part of this rank's chunk into
a scratch chunk the engine lends from its pool (``scratch``); once it is done this rank adds the scratch into its
chunk (``CommHandle.combine``; with two addends the sum is the same in either order). gloo's all-to-all moves the
bytes between the engine's buffers directly, on its worker threads, and is a collective like the others (matched by
sequence, so the watchdog still tells diverging ranks apart; plain sends and receives, matched by tag, would pair a
skipped unit's gradient with the next one's). Microbenchmark at 1-4 M elements on 2 ranks: 1.4-1.6 / 9.5-9.8 ms
against 2.4 / 16.3 ms for two ``reduce``s. Through ``Trainer.fit`` on 2 CPU ranks (``benchmarks/memory.py`` models,
20 steps, two alternating runs each on a quiet machine): 24 x Linear(1024) 9.26-9.27 -> 9.10 bytes per parameter of
peak resident growth and 0.310-0.315 -> 0.268-0.272 s per step; 12 x Linear(2048) 9.59 -> 9.42-9.43 and 0.531-0.533
-> 0.477-0.490 s; the benchmark GPT (``benchmarks/zero3.py``) 1.03-1.04x -> 1.01-1.02x DDP's step, peak RSS 1018 ->
1010 MB per rank. With more ranks the exchange would need a scratch chunk per peer (this rank's own chunk sits
between the others, so one all-to-all cannot skip it without a whole unit of output; a version with one receive per
peer into (N - 1) scratch chunks, tried on 4 ranks, was faster but held more), so there each chunk is still one
``reduce`` to its owner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zlightning._watchdog import wait_for

__all__ = ["CommHandle", "CommStreams", "all_gather_into", "reduce_scatter_into"]


class CommStreams:
    """Side streams for all-gather and reduce-scatter on CUDA; ``None`` streams on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.all_gather: torch.cuda.Stream | None = torch.cuda.Stream(device=device)
            self.reduce_scatter: torch.cuda.Stream | None = torch.cuda.Stream(device=device)
        else:
            self.all_gather = None
            self.reduce_scatter = None


@dataclass
class CommHandle:
    """An in-flight collective: wait before reading ``output``."""

    works: list[dist.Work]
    output: torch.Tensor
    stream: torch.cuda.Stream | None = None
    sources: tuple[torch.Tensor, ...] = field(default=())  # inputs kept alive until the collective completes
    combine: Callable[[], object] | None = None
    """This rank's share of the work once the transfers are done (see [Note: the host reduce-scatter between two
    ranks]); runs once, in ``wait``."""

    def wait(self) -> torch.Tensor:
        for work in self.works:  # see [Note: diverging collectives] in zlightning/_watchdog.py
            wait_for(work, sliced=self.output.device.type == "cpu")
        self.works = []
        if self.combine is not None:
            combine, self.combine = self.combine, None
            combine()
        if self.stream is not None:
            torch.cuda.current_stream(self.output.device).wait_stream(self.stream)
            self.stream = None
        self.sources = ()
        return self.output


def _issue(stream: torch.cuda.Stream | None, inputs: tuple[torch.Tensor, ...]) -> torch.cuda.StreamContext | None:
    if stream is None:
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in inputs:
        t.record_stream(stream)
    return torch.cuda.stream(stream)


def _finish(
    works: list[dist.Work | None],
    output: torch.Tensor,
    stream: torch.cuda.Stream | None,
    sources: tuple[torch.Tensor, ...],
    async_op: bool,
) -> CommHandle:
    handle = CommHandle([w for w in works if w is not None], output, stream, sources)  # sync device ops: None
    if not async_op:
        handle.wait()
    return handle


def all_gather_into(
    output: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """All-gathers in place: every rank's chunk ``r`` of ``output`` (``world`` equal chunks, rank-major) already
    holds rank ``r``'s shard on rank ``r``; afterwards every rank holds all of them. See [Note: in-place collectives
    on the host]."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    chunks = output.chunk(world)
    if output.device.type == "cpu":
        works = [dist.broadcast(c, group=group, group_src=r, async_op=True) for r, c in enumerate(chunks)]
        return _finish(works, output, None, (output,), async_op)  # waited through the watchdog when synchronous
    ctx = _issue(stream, (output,))
    if ctx is None:
        works = [dist.all_gather_into_tensor(output, chunks[rank], group=group, async_op=async_op)]
    else:
        with ctx:
            works = [dist.all_gather_into_tensor(output, chunks[rank], group=group, async_op=async_op)]
    return _finish(works, output, stream, (output,), async_op)


def reduce_scatter_into(
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    output: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    scratch: torch.Tensor | None = None,
    peer_half: bool = False,
) -> CommHandle:
    """Sums ``full`` (``world`` equal chunks, rank-major) over ranks; each rank receives its own chunk.

    On host tensors the result is chunk ``rank`` of ``full`` itself (the other chunks are left as scratch) and
    ``output`` is not used; between two ranks ``scratch`` (one chunk, same dtype) receives the peer's part (required
    there), unless ``peer_half``: then only the peer's chunk of ``full`` holds data, the peer's part is received into
    this rank's chunk and the result is the peer's part alone (this rank added its own part elsewhere: see [Note: two
    host ranks reduce without packing their own half] in _param_group.py). On devices the result is written to
    ``output`` (required there). See [Note: in-place collectives on the host] and [Note: the host reduce-scatter
    between two ranks].
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    chunks = full.chunk(world)
    if peer_half and (full.device.type != "cpu" or world != 2):
        raise AssertionError("reduce_scatter_into: peer_half is for two host ranks only")
    if full.device.type == "cpu" and world == 2:
        mine, n = chunks[rank], chunks[rank].numel()
        keep: tuple[torch.Tensor, ...]
        combine: Callable[[], object] | None
        if peer_half:  # the own chunk is free: the peer's part lands there and is the result
            recv, keep, combine = mine, (full,), None
        else:
            if scratch is None or scratch.numel() != n or scratch.dtype != full.dtype:
                raise AssertionError("reduce_scatter_into: a two-rank host reduce-scatter needs a scratch chunk")
            recv, keep, combine = scratch, (full, scratch), lambda: mine.add_(scratch)
        splits = [n, 0] if rank == 1 else [0, n]  # to and from the peer only
        work = dist.all_to_all_single(recv, chunks[1 - rank], splits, splits, group=group, async_op=True)
        handle = CommHandle([work] if work is not None else [], mine, None, keep, combine=combine)
        if not async_op:
            handle.wait()
        return handle
    if full.device.type == "cpu":
        works = [dist.reduce(c, group=group, group_dst=r, async_op=True) for r, c in enumerate(chunks)]
        return _finish(works, chunks[rank], None, (full,), async_op)  # waited through the watchdog when synchronous
    if output is None:
        raise AssertionError("reduce_scatter_into: a device reduce-scatter needs an output tensor")
    ctx = _issue(stream, (output, full))
    if ctx is None:
        works = [dist.reduce_scatter_tensor(output, full, group=group, async_op=async_op)]
    else:
        with ctx:
            works = [dist.reduce_scatter_tensor(output, full, group=group, async_op=async_op)]
    return _finish(works, output, stream, (output, full), async_op)
