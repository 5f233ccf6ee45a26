"""Swappable tensors: an explicit state machine per tensor, a fixed pool of aligned host buffers, and the swapper
that moves tensors between those buffers and files.

[Note: swap state machine]
Every swappable tensor (a parameter shard, one sub-group of an optimizer state) is in exactly one ``SwapState``::

    ON_DEVICE --write--> INFLIGHT --wait--> ON_NVME --read--> INFLIGHT --wait--> IN_CPU --release/write--> ...

``ON_DEVICE``: only its home tensor holds it (never swapped yet). ``IN_CPU``: a pool buffer holds valid data.
``ON_NVME``: only the file does. ``INFLIGHT``: a read or a write is in progress and the buffer must not be touched.
Each transition has its own method and any other move raises ``SwapStateError`` (no asserts: they vanish under
``python -O``). A read verifies the per-block checksums recorded when the block was written, so a modified or
truncated file is an error, never silently wrong weights.

[Note: fixed buffer pool]
All swap I/O goes through ``buffer_count`` host buffers of ``buffer_size`` elements, allocated once, aligned to
``IO_ALIGNMENT`` (O_DIRECT) and pinned when a CUDA device is used. Nothing else is allocated per swap, so host
memory for swapping is bounded by the pool; running out is a clear error that names ``buffer_count``.

[Note: pool memory layout]
(The allocation itself is ``zlightning.kernels``' ``aligned_empty``: one aligned-buffer allocator for all host I/O.)
How the pool's pages lie in physical memory decides O_DIRECT speed: every physically contiguous run of pages is one
scatter-gather segment of a request, and devices limit segments per request (virtio here: 254). A 1 MiB block in
scattered 4 KiB pages (what ``torch.empty`` of a large buffer gets) is 256 segments, so requests are split and the
queue drains slowly. Without pinning (CPU-only), a pool of at least one huge page is therefore mapped anonymously,
2 MiB aligned, advised to transparent huge pages and faulted in at once in one sequential pass; a 1 MiB block is then
one or two segments. Measured through the swapper by benchmarks/offload.py (256 MiB, 1 MiB blocks, depth 8, medians
of rotated rounds): write/read 2.3/0.92 GB/s with ``torch.empty`` pages, 4.7/2.1 GB/s with this layout (two runs on
a shared machine; DeepSpeed's aio measured 3.2/1.5 and 2.4/1.0 in them). Pinned pools (CUDA) keep ``cudaHostAlloc`` memory, which is allocated in large
physically contiguous chunks already. Nothing else changes: the pool is still one fixed allocation.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zlightning.kernels._aio import aligned_empty
from zlightning.zero._offload_config import IO_ALIGNMENT, NVMeOffload
from zlightning.zero._swap_io import SwapDirectory, SwapIO, SwapSpaceError, make_swap_io

__all__ = ["AlignedBufferPool", "SwapBuffer", "SwapState", "SwapStateError", "SwapStats", "SwapTensor", "Swapper"]


class SwapState(enum.Enum):
    ON_DEVICE = "on_device"
    IN_CPU = "in_cpu"
    ON_NVME = "on_nvme"
    INFLIGHT = "inflight"


class SwapStateError(RuntimeError):
    """An illegal swap transition (an engine bug or a misuse of the swapper's API)."""


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up so the byte size is a multiple of ``IO_ALIGNMENT``."""
    per = IO_ALIGNMENT // torch.empty(0, dtype=dtype).element_size()
    return -(-numel // per) * per


class SwapBuffer:
    """One slot of the pool: ``nbytes`` aligned host bytes, viewed as whatever dtype a tensor needs."""

    def __init__(self, index: int, raw: torch.Tensor) -> None:
        self.index = index
        self.raw = raw  # uint8 [nbytes], aligned
        self.owner: SwapTensor | None = None

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.raw.view(dtype)[:numel]


class AlignedBufferPool:
    """``count`` aligned host buffers of ``nbytes`` each, allocated once (see [Note: fixed buffer pool])."""

    def __init__(self, count: int, nbytes: int, *, pin: bool) -> None:
        nbytes = -(-nbytes // IO_ALIGNMENT) * IO_ALIGNMENT
        self.nbytes = nbytes
        self.count = count
        aligned = aligned_empty(count * nbytes, torch.uint8, pin=pin)  # see [Note: pool memory layout]
        self._backing = aligned
        self.buffers = [SwapBuffer(i, aligned[i * nbytes : (i + 1) * nbytes]) for i in range(count)]
        self._free = list(reversed(self.buffers))

    @property
    def total_bytes(self) -> int:
        return self._backing.numel()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquire(self, owner: SwapTensor) -> SwapBuffer:
        """A free buffer.

        Raises:
            RuntimeError: every buffer is in use (the caller asks for more than ``buffer_count`` at once).
        """
        if not self._free:
            raise RuntimeError(
                f"all {self.count} swap buffers are in use (wanted one for {owner.name}): raise "
                "NVMeOffload(buffer_count=...)"
            )
        buf = self._free.pop()
        buf.owner = owner
        return buf

    def release(self, buf: SwapBuffer) -> None:
        if buf.owner is None:
            raise SwapStateError(f"swap buffer {buf.index} released twice")
        buf.owner = None
        self._free.append(buf)


@dataclass
class SwapStats:
    """Swap traffic counters (cumulative; ``Swapper.take_stats`` returns and resets the per-step ones)."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0  # wall time spent waiting for reads plus overlapped time they were in flight
    write_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {"bytes_read": float(self.bytes_read), "bytes_written": float(self.bytes_written)}
        out["read_MBps"] = self.bytes_read / self.read_s / 1e6 if self.read_s > 0 else 0.0
        out["write_MBps"] = self.bytes_written / self.write_s / 1e6 if self.write_s > 0 else 0.0
        return out


@dataclass(eq=False)
class SwapTensor:
    """One swappable tensor: its file region, its state and, while in host memory, its buffer."""

    name: str
    path: str
    offset: int  # bytes into the file
    numel: int
    dtype: torch.dtype
    state: SwapState = SwapState.ON_DEVICE
    buffer: SwapBuffer | None = None
    checksums: list[int] = field(default_factory=list)
    _writing: bool = False
    _ticket: Any = None  # the I/O handle's ticket while INFLIGHT

    @property
    def nbytes(self) -> int:
        return aligned_numel(self.numel, self.dtype) * torch.empty(0, dtype=self.dtype).element_size()

    def data(self) -> torch.Tensor:
        """The tensor's values in its buffer (state ``IN_CPU``)."""
        if self.state is not SwapState.IN_CPU or self.buffer is None:
            raise SwapStateError(f"{self.name}: data() needs IN_CPU, state is {self.state.name}")
        return self.buffer.view(self.dtype, self.numel)

    def _expect(self, *states: SwapState) -> None:
        if self.state not in states:
            raise SwapStateError(
                f"{self.name}: illegal swap transition from {self.state.name} (allowed from "
                f"{', '.join(s.name for s in states)})"
            )


class Swapper:
    """Moves ``SwapTensor`` s between the pool and their files; one read and one write handle (see the Notes)."""

    def __init__(self, policy: NVMeOffload, folder: SwapDirectory, direct: bool, *, pin: bool, nbytes: int) -> None:
        self.policy = policy
        self.folder = folder
        self._closed = False
        self.pool = AlignedBufferPool(policy.buffer_count, nbytes, pin=pin)
        self.reader: SwapIO = make_swap_io(policy, direct)
        self.writer: SwapIO = make_swap_io(policy, direct)
        self.stats = SwapStats()
        self._step = SwapStats()
        self._reads: list[SwapTensor] = []
        self._writes: list[SwapTensor] = []
        self._busy_since = {"read": 0.0, "write": 0.0}

    # ---------------------------------------------------------------- transitions
    def stage(self, t: SwapTensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """ON_DEVICE -> IN_CPU: gives ``t`` a buffer (filled from ``values``, else zeros) and returns its view."""
        t._expect(SwapState.ON_DEVICE)
        t.buffer = self.pool.acquire(t)
        t.state = SwapState.IN_CPU
        view = t.buffer.view(t.dtype, aligned_numel(t.numel, t.dtype))
        view.zero_() if values is None else (view[t.numel :].zero_(), view[: t.numel].copy_(values.reshape(-1)))
        return t.data()

    def write(self, t: SwapTensor) -> None:
        """IN_CPU -> INFLIGHT (write). The buffer is released when the write completes (``wait_writes``)."""
        t._expect(SwapState.IN_CPU)
        if t.buffer is None:
            raise SwapStateError(f"{t.name}: IN_CPU without a buffer")
        t.buffer.view(t.dtype, aligned_numel(t.numel, t.dtype))[t.numel :].zero_()
        self._start("write", self._writes)
        t._ticket = self.writer.pwrite(t.buffer.raw[: t.nbytes], t.path, t.offset, t.checksums)
        t.state, t._writing = SwapState.INFLIGHT, True
        self._writes.append(t)

    def read(self, t: SwapTensor) -> None:
        """ON_NVME -> INFLIGHT (read into a pool buffer)."""
        t._expect(SwapState.ON_NVME)
        t.buffer = self.pool.acquire(t)
        try:
            ticket = self.reader.pread(t.buffer.raw[: t.nbytes], t.path, t.offset, t.checksums)
        except BaseException:
            self.pool.release(t.buffer)
            t.buffer = None
            raise
        self._start("read", self._reads)
        t._ticket = ticket
        t.state, t._writing = SwapState.INFLIGHT, False
        self._reads.append(t)

    def release(self, t: SwapTensor) -> None:
        """IN_CPU -> ON_NVME without writing (the file already holds these values)."""
        t._expect(SwapState.IN_CPU)
        if not t.checksums:
            raise SwapStateError(f"{t.name}: released unwritten data (it was never written to its file)")
        self._free(t)
        t.state = SwapState.ON_NVME

    def discard(self, t: SwapTensor) -> None:
        """IN_CPU -> ON_DEVICE for a tensor never written: its buffer goes back and its values are dropped (its
        owner starts it again from its home tensor)."""
        t._expect(SwapState.IN_CPU)
        if t.checksums:
            raise SwapStateError(f"{t.name}: discard() of data that has a file copy (use release())")
        self._free(t)
        t.state = SwapState.ON_DEVICE

    def supersede(self, t: SwapTensor) -> None:
        """ON_NVME -> ON_DEVICE: the file's copy is out of date (its owner changed the tensor in memory)."""
        t._expect(SwapState.ON_NVME)
        t.state, t.checksums = SwapState.ON_DEVICE, []

    def _free(self, t: SwapTensor) -> None:
        if t.buffer is not None:
            self.pool.release(t.buffer)
            t.buffer = None

    # ---------------------------------------------------------------- completion
    def _start(self, kind: str, inflight: list[SwapTensor]) -> None:
        if not inflight:
            self._busy_since[kind] = time.perf_counter()

    def _account(self, kind: str, done: list[SwapTensor], inflight: list[SwapTensor]) -> None:
        """Adds bytes moved, and the time some transfer of this kind was in flight (the union of their intervals,
        ending when completion was observed)."""
        now = time.perf_counter()
        elapsed = now - self._busy_since[kind]
        self._busy_since[kind] = now
        n = sum(t.nbytes for t in done)
        for s in (self.stats, self._step):
            if kind == "read":
                s.bytes_read += n
                s.read_s += elapsed
            else:
                s.bytes_written += n
                s.write_s += elapsed

    def is_reading(self, t: SwapTensor) -> bool:
        return t.state is SwapState.INFLIGHT and not t._writing

    def landed(self, t: SwapTensor) -> bool:
        """``t``'s values are in a pool buffer or their read has completed: bringing it in will not wait on the
        disk (only, at most, on its checksums)."""
        return t.state is SwapState.IN_CPU or (self.is_reading(t) and self.reader.done(t._ticket))

    def wait_read(self, t: SwapTensor) -> None:
        """One INFLIGHT read -> IN_CPU (checksums verified); other reads stay in flight.

        Raises:
            SwapCorruptionError: the file no longer holds what was written (the tensor goes back to ON_NVME).
        """
        if not self.is_reading(t):
            raise SwapStateError(f"{t.name}: wait_read needs a read in flight, state is {t.state.name}")
        self._reads.remove(t)
        try:
            self.reader.finish(t._ticket)
        except BaseException:
            self._free(t)
            t.state, t._ticket = SwapState.ON_NVME, None
            raise
        self._account("read", [t], self._reads)
        t.state, t._ticket = SwapState.IN_CPU, None

    def wait_reads(self) -> None:
        """Every INFLIGHT read -> IN_CPU (checksums verified)."""
        reads, self._reads = self._reads, []
        if not reads:
            return
        try:
            self.reader.wait()
        except BaseException:
            for t in reads:
                self._free(t)
                t.state, t._ticket = SwapState.ON_NVME, None
            raise
        self._account("read", reads, self._reads)
        for t in reads:
            t.state, t._ticket = SwapState.IN_CPU, None

    def reap_writes(self) -> int:
        """Completes the writes that have finished (their buffers return to the pool) without blocking; returns how
        many buffers that freed.

        Raises:
            SwapSpaceError: the disk filled up (ENOSPC) while writing.
        """
        done = [t for t in self._writes if self.writer.done(t._ticket)]
        for t in done:
            self._writes.remove(t)
            try:
                self.writer.finish(t._ticket)
            except OSError as err:
                rest, self._writes = [t, *self._writes], []
                try:
                    self.writer.wait()  # the other writes finish too: their buffers go back to the pool
                except OSError:
                    pass
                self._fail_writes(err, rest)
            self._account("write", [t], self._writes)
            self._free(t)
            t.state, t._ticket = SwapState.ON_NVME, None
        return len(done)

    def wait_writes(self) -> None:
        """Every INFLIGHT write -> ON_NVME (its buffer returns to the pool).

        Raises:
            SwapSpaceError: the disk filled up (ENOSPC) while writing.
        """
        writes, self._writes = self._writes, []
        if not writes:
            return
        try:
            self.writer.wait()
        except OSError as err:
            self._fail_writes(err, writes)
        self._account("write", writes, self._writes)
        for t in writes:
            self._free(t)
            t.state, t._ticket = SwapState.ON_NVME, None

    def _fail_writes(self, err: OSError, writes: list[SwapTensor]) -> None:
        """After a failed write: frees the buffers (the files' contents are unknown) and raises."""
        for t in writes:
            self._free(t)
            t.state, t.checksums, t._ticket = SwapState.ON_NVME, [], None
        if err.errno in (28, 27):  # ENOSPC, EFBIG
            raise SwapSpaceError(
                f"the disk under {self.folder.root} ran out of space while writing swap files "
                f"({err.strerror or err}); {sum(t.nbytes for t in writes):,} bytes were being written. Free space "
                "or choose another NVMeOffload(path=...); restart from the last checkpoint."
            ) from err
        raise err

    def take_stats(self) -> SwapStats:
        out, self._step = self._step, SwapStats()
        return out

    def close(self) -> None:
        """Stops both I/O handles (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.reader.close()
        self.writer.close()
