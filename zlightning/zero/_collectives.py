"""Stateless collective helpers for the ZeRO-3 engine (one all-gather per group, one reduce-scatter per group).

[Note: streams]
On CUDA the all-gather and the reduce-scatter run on their own streams so they overlap compute on the default
stream: the side stream first waits for the current stream (the input was produced there), the collective is issued
on the side stream, and ``CommHandle.wait`` makes the current stream wait for the side stream before the output is
used. Tensors crossing streams are recorded with ``record_stream`` so the caching allocator does not reuse them early.
On CPU (gloo) there are no streams: ``async_op=True`` already runs the collective on gloo's own threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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

    work: dist.Work | None
    output: torch.Tensor
    stream: torch.cuda.Stream | None = None
    source: torch.Tensor | None = None  # the input, kept alive until the collective completes

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.stream is not None:
            torch.cuda.current_stream(self.output.device).wait_stream(self.stream)
            self.stream = None
        self.source = None
        return self.output


def _issue(stream: torch.cuda.Stream | None, inputs: tuple[torch.Tensor, ...]) -> torch.cuda.StreamContext | None:
    if stream is None:
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in inputs:
        t.record_stream(stream)
    return torch.cuda.stream(stream)


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """All-gathers the equal-sized ``shard`` of every rank into ``output`` (rank-major, ``world * shard.numel()``)."""
    ctx = _issue(stream, (output, shard))
    if ctx is None:
        work = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    else:
        with ctx:
            work = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    handle = CommHandle(work if async_op else None, output, stream, shard)
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """Sums ``full`` (``world * output.numel()``, rank-major) over ranks; each rank receives its own chunk."""
    ctx = _issue(stream, (output, full))
    if ctx is None:
        work = dist.reduce_scatter_single(output, full, group=group, async_op=async_op)
    else:
        with ctx:
            work = dist.reduce_scatter_single(output, full, group=group, async_op=async_op)
    handle = CommHandle(work if async_op else None, output, stream, full)
    if not async_op:
        handle.wait()
    return handle
