"""Asynchronous tensor file I/O: `DeepSpeedIOEngine`, the job of DeepSpeed's aio handle, without libaio.

[Note: how a request becomes I/O]
``async_pread(buffer, filename, offset)`` / ``async_pwrite(...)`` move ``buffer``'s bytes to or from
``filename`` at byte ``offset``. The request is split into ``block_size`` blocks; each block is one ``pread``/
``pwrite`` system call, run by a pool of worker threads (``queue_depth * intra_op_parallelism`` of them, capped at
`MAX_THREADS`: that is how many blocks are in flight). ``os.preadv``/``os.pwrite`` release the GIL, so the pool
keeps the device queue full while Python returns to the caller at once. The native backend (``backend="native"``,
the compiled extension's io_uring ring, see ``csrc/aio_uring.cpp``) takes the same block list.

[Note: O_DIRECT and alignment]
O_DIRECT bypasses the page cache (what NVMe offload wants: no double buffering, no eviction of useful pages), but
the kernel then requires the memory address, the file offset and the length of every call to be multiples of the
device's logical block size. We use `ALIGNMENT` (4096, a multiple of every common logical block size). A block
meeting all three goes through an O_DIRECT descriptor; any other block (an unaligned tail, an unaligned tensor)
through a buffered descriptor of the same file, so every request works and aligned ones are fast.
`DeepSpeedIOEngine.new_cpu_locked_tensor` returns aligned (and, with CUDA, pinned) buffers. A filesystem that
refuses O_DIRECT at ``open`` (EINVAL: some tmpfs/overlay/network filesystems) gets buffered I/O with one warning per
filesystem.

[Note: buffer memory]
How a buffer's pages lie in *physical* memory decides how fast O_DIRECT runs on many devices: each run of physically
contiguous pages is one scatter-gather segment, and a device has a segment limit per request (``max_segments`` in
``/sys/block/*/queue``) and a limited descriptor ring. A 1 MiB block in scattered 4 KiB pages is 256 segments: on
this project's virtio disk (``max_segments`` 254) every such request is split, and a few of them use up the
device's descriptors, so most of queue_depth 32 waits in the guest. `new_cpu_locked_tensor` (without CUDA;
with CUDA the buffer is ``cudaHostAlloc``'s pinned memory) therefore maps large buffers itself, 2 MiB aligned,
advises transparent huge pages (a 1 MiB block is then one segment) and faults every page in at allocation in one
sequential pass (so even without huge pages neighbouring pages tend to be physically adjacent: what DeepSpeed's
``mlock`` of a fresh buffer gets).
Measured in one run on this VM (1 GiB, depth 32, GB/s write/read): io_uring 3.28/1.59 on a lazily faulted buffer,
5.12/2.48 on a huge-page one; DeepSpeed's aio 3.31/1.28 on its mlock'ed buffer. Any caller's buffer works; these
are just faster.

[Note: a request is DeepSpeed's return code]
DeepSpeed's ``async_pread``/``async_pwrite`` return an int: 0 once the request is scheduled (-1 when it cannot be),
and its swap code checks it (``assert handle.async_pread(buf, path, 0) == 0``, ``assert 0 == r``). Here they return
the `IORequest` handle, and the handle behaves as that int: it equals 0 (so ``== 0`` holds and ``!= -1`` holds), is
falsy like 0, and converts to 0 (``int(req)``, ``operator.index``); it still offers `IORequest.done` and its fields.
A request that cannot be scheduled raises (`AIOError`, ``ValueError``) instead of returning -1, so ported code that
asserted the 0 keeps working and gets a message instead of a failed assert. ``sync_*`` and ``wait`` return DeepSpeed's
counts (requests completed).

[Note: errors]
Opening the file happens at submit, so a missing file or a permission problem raises there. Errors of the I/O
itself (ENOSPC, EIO, a short read past the end of the file) are recorded per block and raised by `wait` (or the
``sync_*`` call) as `AIOError`, an ``OSError`` carrying ``errno``, the file name, the operation and the byte offset
of the failing block; `wait` first lets every other request finish, so nothing is left in flight after it raises.
An engine closed, garbage-collected or alive at interpreter exit first finishes the requests nobody waited for and
warns (``RuntimeWarning``) with their errors instead of losing them (`_drain_and_close`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ALIGNMENT", "AIOConfig", "AIOError", "DeepSpeedIOEngine", "IORequest"]

ALIGNMENT = 4096
"""Byte alignment of address, file offset and length that O_DIRECT I/O needs. See [Note: O_DIRECT and alignment]."""

HUGE_PAGE = 2 << 20
"""Transparent huge page size (x86-64, arm64 with 4 KiB pages): alignment of large `new_cpu_locked_tensor` buffers."""

MAX_THREADS = 128
"""Upper bound on worker threads of the thread-pool backend, whatever queue_depth * intra_op_parallelism says."""

Op = Literal["read", "write"]


@dataclass(frozen=True)
class AIOConfig:
    """Knobs of a `DeepSpeedIOEngine` (DeepSpeed's ``aio`` config section, same names and defaults)."""

    block_size: int = 1 << 20
    """Bytes per system call; a positive multiple of `ALIGNMENT` (4096)."""
    queue_depth: int = 8
    """Blocks in flight per submitting thread."""
    single_submit: bool = False
    """Native io_uring backend: one ``io_uring_enter`` per block instead of one per request. Thread-pool backend:
    accepted for compatibility, no effect (each block is its own system call there)."""
    overlap_events: bool = False
    """Accepted for compatibility: both backends always overlap completion handling with submission."""
    intra_op_parallelism: int = 1
    """Submitting threads; ``queue_depth * intra_op_parallelism`` blocks are in flight at most."""
    o_direct: bool = True
    """Use O_DIRECT for aligned blocks (see [Note: O_DIRECT and alignment]); False: always the page cache."""
    backend: Literal["auto", "python", "native"] = "auto"
    """``python``: thread pool of pread/pwrite. ``native``: the compiled io_uring backend (error if not built).
    ``auto``: native when the extension is built and io_uring is allowed, else python. (Measured side by side,
    benchmarks/results/kernels.md: native is on par with the thread pool, write 0.98-1.39x and read 0.97-1.11x of
    it in three runs, and costs no Python thread per block, so it is preferred whenever available.)"""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % ALIGNMENT:
            raise ValueError(
                f"AIOConfig.block_size={self.block_size!r}: must be a positive multiple of {ALIGNMENT} bytes "
                f"(O_DIRECT alignment), e.g. 1048576 (1 MiB)."
            )
        for name, hi in (("queue_depth", 4096), ("intra_op_parallelism", 256)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"AIOConfig.{name}={value!r}: must be an integer in [1, {hi}].")
        if self.backend not in ("auto", "python", "native"):
            raise ValueError(f"AIOConfig.backend={self.backend!r}: choose 'auto', 'python' or 'native'.")

    @property
    def in_flight(self) -> int:
        """Blocks in flight at most (the thread-pool size, or the io_uring queue size)."""
        return min(self.queue_depth * self.intra_op_parallelism, MAX_THREADS)


class AIOError(OSError):
    """A failed tensor read or write: ``errno``, ``filename``, plus the operation and the byte offset that failed.

    Attributes:
        op: ``"read"`` or ``"write"``.
        offset: byte offset in the file of the failing block (for a short read: where the file ended).
        request_offset: byte offset of the whole request.
        nbytes: bytes of the whole request.
    """

    def __init__(
        self, err: int, message: str, *, op: Op, filename: str, offset: int, request_offset: int, nbytes: int
    ) -> None:
        super().__init__(err, message, filename)
        self.op = op
        self.offset = offset
        self.request_offset = request_offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        return (
            f"[Errno {self.errno}] {self.op} of {self.nbytes} bytes at offset {self.request_offset} of "
            f"'{self.filename}' failed at offset {self.offset}: {self.strerror}"
        )


class IORequest:
    """Handle of one submitted read or write (returned by ``async_pread``/``async_pwrite``).

    It also stands for DeepSpeed's return code of those calls, 0: see [Note: a request is DeepSpeed's return code].
    """

    op: Op
    filename: str
    offset: int
    nbytes: int
    errors: list[AIOError]

    def __init__(self, op: Op, filename: str, offset: int, nbytes: int) -> None:
        self.op, self.filename, self.offset, self.nbytes = op, filename, offset, nbytes
        self.errors = []
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._remaining = 0
        self._fds: list[int] = []
        self._buffer: torch.Tensor | None = None  # kept alive until the request completes (a temporary would be
        # freed while the I/O still reads or writes its memory)
        self._finalize: Callable[[], None] | None = None  # device copy-back of a read into a staged GPU tensor
        self._native: tuple[_NativeBackend, int] | None = None  # (ring, request id) on the io_uring backend

    def done(self) -> bool:
        """True once every block of the request has completed (successfully or not)."""
        if self._native is not None and not self._event.is_set():
            return self._native[0].done(self._native[1])
        return self._event.is_set()

    def _wait(self) -> None:
        if self._native is not None and not self._event.is_set():
            self._native[0].wait(self)
        self._event.wait()

    def _error(self, err: int, message: str, at: int) -> AIOError:
        return AIOError(
            err, message, op=self.op, filename=self.filename, offset=at, request_offset=self.offset, nbytes=self.nbytes
        )

    def _block_done(self, error: AIOError | None) -> None:
        with self._lock:
            if error is not None:
                self.errors.append(error)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._buffer = None
        self._event.set()

    # DeepSpeed's return code: see [Note: a request is DeepSpeed's return code].
    def __eq__(self, other: object) -> bool:
        if isinstance(other, int):
            return other == 0
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    def __index__(self) -> int:
        return 0

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"IORequest({self.op} {self.nbytes} B at {self.offset} of '{self.filename}', {state})"


Block = tuple[int, int, int, int]
"""One system call: (fd, memory address, length in bytes, file offset)."""


def _byte_view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _run_block(req: IORequest, block: Block) -> None:
    fd, address, length, offset = block
    view, done = _byte_view(address, length), 0
    try:
        while done < length:
            if req.op == "read":
                n = os.preadv(fd, [view[done:]], offset + done)
                if 0 < n < length - done and offset + done + n >= os.fstat(fd).st_size:
                    done, n = done + n, 0  # the file ends inside this block (O_DIRECT cannot re-read unaligned)
                if n == 0:
                    size = os.fstat(fd).st_size
                    raise req._error(
                        _errno.EIO,
                        f"short read: the file has only {size} bytes, the request needs "
                        f"{req.offset + req.nbytes} (got {done} of {length} bytes of this block)",
                        offset + done,
                    )
            else:
                n = os.pwrite(fd, view[done:], offset + done)
                if n == 0:
                    raise req._error(_errno.EIO, "write made no progress", offset + done)
            done += n
    except AIOError as err:
        req._block_done(err)
        return
    except OSError as err:
        req._block_done(req._error(err.errno or _errno.EIO, err.strerror or str(err), offset + done))
        return
    except BaseException as err:  # never lose a block's completion, or wait() hangs
        req._block_done(req._error(_errno.EIO, f"unexpected {type(err).__name__}: {err}", offset + done))
        return
    req._block_done(None)


class _ThreadPoolBackend:
    """Blocks run as blocking pread/pwrite calls on a pool of worker threads. See [Note: how a request becomes I/O]."""

    name = "python-threadpool"

    def __init__(self, config: AIOConfig) -> None:
        self._pool = ThreadPoolExecutor(max_workers=config.in_flight, thread_name_prefix="zl-aio")

    def submit(self, req: IORequest, blocks: list[Block]) -> None:
        for block in blocks:
            self._pool.submit(_run_block, req, block)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_warned_filesystems: set[int] = set()


def _open(path: str, op: Op, direct: bool) -> int:
    flags = (os.O_RDONLY if op == "read" else os.O_WRONLY | os.O_CREAT) | getattr(os, "O_CLOEXEC", 0)
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)  # model and optimizer state: readable by its owner only


def _open_direct(path: str, op: Op) -> int | None:
    """An O_DIRECT descriptor, or None (with one warning per filesystem) when the filesystem refuses O_DIRECT."""
    try:
        return _open(path, op, direct=True)
    except OSError as err:
        if err.errno != _errno.EINVAL:
            raise
    dev = os.stat(os.path.dirname(os.path.abspath(path)) or ".").st_dev
    if dev not in _warned_filesystems:
        _warned_filesystems.add(dev)
        warnings.warn(
            f"DeepSpeedIOEngine: the filesystem of '{path}' does not support O_DIRECT; using buffered "
            "I/O (page cache) for files there. Put swap files on a local ext4/xfs NVMe filesystem for "
            "direct I/O.",
            RuntimeWarning,
            stacklevel=4,
        )
    return None


class _NativeBackend:
    """Blocks go to one io_uring ring (``torch.classes.zlightning.AioRing``, csrc/aio_uring.cpp) whose worker
    thread keeps ``in_flight`` of them queued in the kernel."""

    name = "native-io_uring"

    def __init__(self, config: AIOConfig) -> None:
        self._ring = torch.classes.zlightning.AioRing(config.in_flight, config.single_submit)

    def submit(self, req: IORequest, blocks: list[Block]) -> None:
        req._native = (self, self._ring.submit(req.op == "write", torch.tensor(blocks, dtype=torch.int64)))

    def done(self, rid: int) -> bool:
        return self._ring.done(rid)

    def wait(self, req: IORequest) -> None:
        if req._native is None:
            raise AssertionError("a native wait for a request submitted elsewhere")
        err, at, short = self._ring.wait(req._native[1])
        if err:
            if short >= 0:
                size = os.fstat(req._fds[0]).st_size
                msg = (
                    f"short read: the file has only {size} bytes, the request needs {req.offset + req.nbytes} "
                    f"(got {short} bytes of the block at {at - short})"
                )
            else:
                msg = os.strerror(err)
            req.errors.append(req._error(err, msg, at))
        req._complete()

    def close(self) -> None:
        self._ring = None


def _drain_and_close(
    backend: _ThreadPoolBackend | _NativeBackend, pending: list[IORequest], lock: threading.Lock
) -> None:
    """Finalizer of a `DeepSpeedIOEngine` (``close()``, garbage collection, interpreter exit): finishes every request
    nobody waited for, then stops the backend, and warns about their errors, which have no `wait` left to raise
    them. The io_uring ring's destructor only lets blocks already in the kernel finish, so without this a dropped
    engine lost the queued part of its writes (the file was silently cut short)."""
    with lock:
        reqs = list(pending)
        pending.clear()
    errors: list[AIOError] = []
    for req in reqs:
        req._wait()
        errors.extend(req.errors)
    backend.close()
    if errors:
        warnings.warn(
            f"DeepSpeedIOEngine closed or garbage-collected with {len(errors)} failed block(s) in requests never "
            f"passed to wait(); the first: {errors[0]}. Call wait() (or use the engine as a context manager) to "
            "get them as AIOError.",
            RuntimeWarning,
            stacklevel=2,
        )


def _native_backend(config: AIOConfig) -> _NativeBackend | None:
    from zlightning.kernels import _ext

    return _NativeBackend(config) if _ext.aio_native_available() else None


class DeepSpeedIOEngine:
    """Asynchronous reads and writes of tensors to files at byte offsets (DeepSpeed's ``aio_handle`` API).

    Example::

        eng = DeepSpeedIOEngine(block_size=1 << 20, queue_depth=32)
        buf = eng.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))  # aligned (and pinned)
        eng.async_pwrite(buf, "/nvme/swap/p0.bin", 0)   # returns at once
        ...                                               # compute overlaps the write
        done = eng.wait()                                 # blocks (1 request done); raises AIOError on failure
        eng.sync_pread(buf, "/nvme/swap/p0.bin", 0)

    The buffer must stay alive and unmodified (for writes) or untouched (for reads) until `wait` returns.
    Semantics: writes create the file if missing and never truncate it; reads need ``offset + nbytes`` to lie
    within the file (else a short-read `AIOError`). See [Note: how a request becomes I/O], [Note: O_DIRECT and
    alignment], [Note: buffer memory] and [Note: errors].

    Args:
        block_size: bytes per system call (positive multiple of 4096).
        queue_depth: blocks in flight per submitting thread.
        single_submit: see `AIOConfig.single_submit`.
        overlap_events: see `AIOConfig.overlap_events`.
        intra_op_parallelism: submitting threads (in-flight blocks = queue_depth * intra_op_parallelism).
        o_direct: use O_DIRECT for aligned blocks.
        backend: ``"auto"``, ``"python"`` or ``"native"`` (see `AIOConfig.backend`).

    Raises:
        ValueError: a knob out of range.
    """

    config: AIOConfig
    backend_name: str

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        o_direct: bool = True,
        backend: Literal["auto", "python", "native"] = "auto",
    ) -> None:
        self.config = AIOConfig(
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
            o_direct=o_direct,
            backend=backend,
        )
        native = _native_backend(self.config) if backend != "python" else None
        if backend == "native" and native is None:
            from zlightning.kernels import _ext

            raise RuntimeError(
                f"DeepSpeedIOEngine(backend='native'): the native backend is unavailable "
                f"({_ext.status().reason}). Build it with `zlightning kernels --build` or use backend='python'."
            )
        self._backend = native if native is not None else _ThreadPoolBackend(self.config)
        self.backend_name = self._backend.name
        self._pending: list[IORequest] = []
        self._lock = threading.Lock()
        self._locked: dict[int, torch.Tensor] = {}
        self._closer = weakref.finalize(self, _drain_and_close, self._backend, self._pending, self._lock)

    # ---- DeepSpeed aio_handle getters -------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self.config.block_size

    def get_queue_depth(self) -> int:
        return self.config.queue_depth

    def get_single_submit(self) -> bool:
        return self.config.single_submit

    def get_overlap_events(self) -> bool:
        return self.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.config.intra_op_parallelism

    # ---- submission -------------------------------------------------------------------------------------------
    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> IORequest:
        """Starts reading ``buffer.nbytes`` bytes of ``filename`` at ``file_offset`` into ``buffer``; returns at once.

        Raises:
            AIOError: the file cannot be opened (missing, permissions). I/O errors are raised by `wait`.
            ValueError: ``buffer`` is not contiguous or ``file_offset`` is negative.
        """
        return self._submit("read", buffer, filename, file_offset, pending=True)

    def async_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> IORequest:
        """Starts writing ``buffer``'s bytes to ``filename`` at ``file_offset`` (file created if missing).

        Raises:
            AIOError: the file cannot be opened or created. I/O errors (ENOSPC, EIO) are raised by `wait`.
            ValueError: ``buffer`` is not contiguous or ``file_offset`` is negative.
        """
        return self._submit("write", buffer, filename, file_offset, pending=True)

    def wait(self) -> int:
        """Blocks until every request submitted by ``async_*`` has completed.

        Returns:
            the number of requests completed since the previous `wait`.

        Raises:
            AIOError: the first failed request's error (after all requests finished); its message counts the others.
        """
        with self._lock:  # cleared in place: the finalizer holds this list (see `_drain_and_close`)
            reqs = list(self._pending)
            self._pending.clear()
        for req in reqs:
            req._wait()
        errors = [e for req in reqs for e in req.errors]
        for req in reqs:
            if not req.errors and req._finalize is not None:
                try:
                    req._finalize()
                except AIOError as err:  # a failed validation; the other requests still finish
                    errors.append(err)
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.add_note(
                    f"{len(errors) - 1} more failed block(s): "
                    + "; ".join(str(e) for e in errors[1:4])
                    + (" ..." if len(errors) > 4 else "")
                )
            raise first
        return len(reqs)

    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        """Reads like `async_pread` and waits for this request only. Returns 1 (requests completed).

        Raises:
            AIOError: open or I/O failure, naming file and offset.
        """
        return self._general("read", buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        """Writes like `async_pwrite` and waits for this request only. Returns 1 (requests completed).

        Raises:
            AIOError: open or I/O failure (ENOSPC, EIO), naming file and offset.
        """
        return self._general("write", buffer, filename, False, False, file_offset)

    # ---- DeepSpeed's general forms ---------------------------------------------------------------------------
    def pread(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
    ) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)``.

        ``async_op=True`` works as `async_pread` and returns 0 (finish with `wait`); False as `sync_pread` and returns
        1. ``validate=True`` re-reads the range through the page cache once the read completed and compares it with
        the buffer (a debugging aid: it doubles the I/O).

        Raises:
            AIOError: open or I/O failure, or (``validate``) a byte differing from the file, naming file and offset.
        """
        return self._general("read", buffer, filename, validate, async_op, file_offset)

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
    ) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset)``; see `pread` for the arguments."""
        return self._general("write", buffer, filename, validate, async_op, file_offset)

    def read(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, file_offset: int = 0
    ) -> int:
        """DeepSpeed's synchronous ``read(buffer, filename, validate)``: `pread` without ``async_op``. Returns 1."""
        return self._general("read", buffer, filename, validate, False, file_offset)

    def write(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, file_offset: int = 0
    ) -> int:
        """DeepSpeed's synchronous ``write(buffer, filename, validate)``: `pwrite` without ``async_op``. Returns 1."""
        return self._general("write", buffer, filename, validate, False, file_offset)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked by CUDA or came from this engine's `new_cpu_locked_tensor`."""
        return tensor.device.type == "cpu" and (
            tensor.data_ptr() in self._locked or (torch.cuda.is_available() and tensor.is_pinned())
        )

    @staticmethod
    def get_alignment() -> int:
        """Bytes of alignment (address, file offset, length) a block needs to go through O_DIRECT."""
        return ALIGNMENT

    def pending(self) -> int:
        """Requests submitted by ``async_*`` and not yet collected by `wait`."""
        with self._lock:
            return len(self._pending)

    # ---- buffers ----------------------------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor.dtype``, 4096-byte aligned, pinned when CUDA
        is available: the buffer O_DIRECT and fast host-device copies need. Release with `free_cpu_locked_tensor`."""
        if not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor(num_elem={num_elem!r}): need a non-negative integer.")
        t = aligned_empty(num_elem, example_tensor.dtype, pin=torch.cuda.is_available())
        self._locked[t.data_ptr()] = t
        return t

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        """Releases a tensor from `new_cpu_locked_tensor` (its memory is freed once no other reference remains)."""
        if self._locked.pop(tensor.data_ptr(), None) is None:
            raise ValueError(
                "free_cpu_locked_tensor: this tensor was not allocated by this engine's "
                "new_cpu_locked_tensor (or was already freed)."
            )

    def close(self) -> None:
        """Waits for outstanding I/O (raising its errors) and stops the worker threads. Idempotent."""
        try:
            self.wait()
        finally:
            self._closer()

    def __enter__(self) -> DeepSpeedIOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DeepSpeedIOEngine(block_size={c.block_size}, queue_depth={c.queue_depth}, "
            f"intra_op_parallelism={c.intra_op_parallelism}, o_direct={c.o_direct}, backend={self.backend_name})"
        )

    # ---- internals --------------------------------------------------------------------------------------------
    def _general(
        self,
        op: Op,
        buffer: torch.Tensor,
        filename: str | os.PathLike,
        validate: bool,
        async_op: bool,
        file_offset: int,
    ) -> int:
        req = self._submit(op, buffer, filename, file_offset, pending=async_op, validate=validate)
        if async_op:
            return 0
        req._wait()
        if req.errors:
            raise req.errors[0]
        if req._finalize is not None:
            req._finalize()
        return 1

    def _submit(
        self,
        op: Op,
        buffer: torch.Tensor,
        filename: str | os.PathLike,
        offset: int,
        *,
        pending: bool,
        validate: bool = False,
    ) -> IORequest:
        if self._closer.alive is False:
            raise RuntimeError("DeepSpeedIOEngine: the engine is closed; create a new one.")
        path = os.fspath(filename)
        host = self._host_buffer(op, buffer, path)
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"DeepSpeedIOEngine {op} of '{path}': file_offset={offset!r} must be an integer >= 0.")
        req = IORequest(op, path, offset, host.numel() * host.element_size())
        req._buffer = host
        if host is not buffer:  # a device tensor: staged through host memory

            def copy_back() -> None:
                buffer.copy_(host)

            req._finalize = copy_back if op == "read" else None
        if validate:
            staged = req._finalize

            def check() -> None:
                _validate(req, host)
                if staged is not None:
                    staged()

            req._finalize = check
        self._open_and_plan(req, host)
        if pending:
            with self._lock:
                self._pending.append(req)
        return req

    @staticmethod
    def _host_buffer(op: Op, buffer: torch.Tensor, path: str) -> torch.Tensor:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(
                f"DeepSpeedIOEngine {op} of '{path}': buffer must be a torch.Tensor, got {type(buffer).__name__}."
            )
        if not buffer.is_contiguous():
            raise ValueError(
                f"DeepSpeedIOEngine {op} of '{path}': buffer must be contiguous (call .contiguous() "
                "and keep that tensor alive until wait())."
            )
        if buffer.device.type == "cpu":
            return buffer
        host = aligned_empty(buffer.numel(), buffer.dtype, pin=True).view(buffer.shape)
        if op == "write":
            host.copy_(buffer)
        return host

    def _open_and_plan(self, req: IORequest, host: torch.Tensor) -> None:
        blocks = _plan_blocks(host.data_ptr(), req.nbytes, req.offset, self.config.block_size)
        direct_fd = buffered_fd = None
        try:
            if self.config.o_direct and any(d for d, *_ in blocks):
                direct_fd = _open_direct(req.filename, req.op)
            if direct_fd is None or not all(d for d, *_ in blocks):
                buffered_fd = _open(req.filename, req.op, direct=False)
        except OSError as err:
            for fd in (direct_fd, buffered_fd):
                if fd is not None:
                    os.close(fd)
            raise req._error(err.errno or _errno.EIO, f"cannot open: {err.strerror}", req.offset) from err
        req._fds = [fd for fd in (direct_fd, buffered_fd) if fd is not None]
        calls: list[Block] = []
        for direct, addr, length, off in blocks:
            fd = direct_fd if direct and direct_fd is not None else buffered_fd
            if fd is None:
                raise AssertionError(f"no file descriptor for a {'direct' if direct else 'buffered'} block")
            calls.append((fd, addr, length, off))
        if not calls:
            req._complete()
            return
        req._remaining = len(calls)
        self._backend.submit(req, calls)


def _validate(req: IORequest, host: torch.Tensor, chunk: int = 1 << 24) -> None:
    """Compares ``host`` with the file range of a completed request, read again through the page cache."""
    data = host.reshape(-1).view(torch.uint8)
    fd = os.open(req.filename, os.O_RDONLY)
    try:
        for start in range(0, req.nbytes, chunk):
            want = min(chunk, req.nbytes - start)
            got = os.pread(fd, want, req.offset + start)
            mine = data[start : start + want]
            if len(got) != want:
                raise req._error(
                    _errno.EIO, f"validation: file ends {len(got)} bytes into a {want}-byte range", req.offset + start
                )
            theirs = torch.frombuffer(bytearray(got), dtype=torch.uint8)
            if not torch.equal(mine, theirs):
                first = int((mine != theirs).nonzero()[0])
                raise req._error(
                    _errno.EIO,
                    f"validation: buffer and file differ at byte {start + first} of the request",
                    req.offset + start + first,
                )
    finally:
        os.close(fd)


def _plan_blocks(address: int, nbytes: int, offset: int, block_size: int) -> list[tuple[bool, int, int, int]]:
    """Splits a request into (direct?, address, length, file offset) blocks; see [Note: O_DIRECT and alignment]."""
    blocks = []
    for start in range(0, nbytes, block_size):
        length = min(block_size, nbytes - start)
        a, o = address + start, offset + start
        direct = a % ALIGNMENT == 0 and o % ALIGNMENT == 0 and length % ALIGNMENT == 0
        if not direct and length > ALIGNMENT and a % ALIGNMENT == 0 and o % ALIGNMENT == 0:
            head = length - length % ALIGNMENT  # aligned body direct, unaligned tail buffered
            blocks.append((True, a, head, o))
            blocks.append((False, a + head, length - head, o + head))
            continue
        blocks.append((direct, a, length, o))
    return blocks


def aligned_empty(num_elem: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data pointer is a multiple of `ALIGNMENT` (pinned if ``pin`` and CUDA
    is available). Without CUDA, buffers of `HUGE_PAGE` bytes or more are huge-page backed and prefaulted: see
    [Note: buffer memory]."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = num_elem * itemsize
    if (pin and torch.cuda.is_available()) or nbytes < HUGE_PAGE:
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
        skip = (-raw.data_ptr()) % ALIGNMENT
        return raw[skip : skip + nbytes].view(dtype)
    return _mapped_empty(nbytes).view(dtype)


def _mapped_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory, 2 MiB aligned, advised to transparent huge pages and faulted in at once."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor's storage keeps `mm` alive
    skip = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[skip : skip + nbytes]
    with contextlib.suppress(OSError, AttributeError, ValueError):  # THP compiled out or "never": 4 KiB pages
        mm.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    try:  # one sequential fault pass in the kernel (5.14+)
        mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), skip, nbytes)
    except (OSError, ValueError):
        buf[:: ALIGNMENT // 2].zero_()  # touch every page (mapped memory reads as zeros anyway)
    return buf
