"""Swap files on disk: path checks, the per-run swap folder and its cleanup, and the asynchronous I/O handles.

[Note: swap folder lifecycle]
Each rank swaps into ``<path>/zlightning_swap/run-<run id>-rank<r>/`` (the run id is chosen by rank 0 and
broadcast), with an ``owner.json`` naming the host, pid and the process start time. The folder is removed when the
engine closes (normal exit, the strategy's teardown after an exception), at process exit and on SIGTERM. A SIGKILL leaves it behind: the next run on the same path finds folders whose owner is gone (same host,
pid dead or reused by another process) and removes them with a warning, or refuses to start
(``NVMeOffload(stale_files="error")``). Folders owned by live processes or other hosts are never touched.
Swap files hold the run's model and optimizer state, which other local users must not read: ``zlightning_swap`` and
the run folders are created with mode 0o700 and the files with 0o600, whatever the umask, and a ``zlightning_swap``
that belongs to another user is refused (its owner could replace our run folder by one of theirs before we write).

[Note: cleanup at process exit]
"Process exit" has two doors. An interpreter that finalises runs ``atexit`` (``python train.py``, Lightning's
``popen`` ranks, torchrun, and spawned ranks: see `_exit_like_a_forked_rank` in ``strategies/_launch.py``). A
process that ``multiprocessing`` started by ``fork`` or ``forkserver`` (``ZStackZero3Strategy(start_method="fork")``
in a notebook, test harnesses) ends with ``os._exit`` once its target returns: ``atexit`` never runs there, only
``multiprocessing``'s own finalizers, so the cleanup is registered with both (per process: a forked child inherits
neither the parent's finalizers nor, here, its folders). The module after ``fit`` stays sharded with its
optimizer state in the folder, so without the second door every forked run left its whole state on disk until the
next run on the path found it stale. ``_close_all`` closes only folders this process opened: a forked child (a
DataLoader worker) inherits the list and the SIGTERM handler, and must not delete its parent's live state.

[Note: SIGTERM]
The handler is chained, not replacing: when a previous Python handler exists (Lightning installs one that finishes
the step and raises), it is called and the folder is left to the normal exception/teardown path, since training may
go on until then. When the previous disposition is the default (terminate), the folders are removed first and the
signal is re-delivered with the default action, so the exit status still says "killed by SIGTERM".

[Note: I/O engines]
All swap I/O goes through ``zlightning.kernels.DeepSpeedIOEngine``: its native io_uring backend when the kernels are
built, else its thread pool of ``pread``/``pwrite`` (``NVMeOffload(io_engine="portable")`` asks for the pool,
``"kernels"`` insists on the native one). This module adds what swap files need on top: block checksums (computed
beside the transfers, see `KernelSwapIO`), the missing/truncated-file checks, and the swap folders. Both backends take
aligned host tensors, split requests into ``block_size`` chunks and report failures from ``wait()``. O_DIRECT bypasses the page cache (what NVMe offload needs: the cache would otherwise hold the very state
we are moving out of memory); where the file system refuses it, buffered I/O is used after a warning.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import json
import logging
import multiprocessing.util
import os
import shutil
import signal
import socket
import threading
import time
import uuid
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import torch

from zlightning.zero._offload_config import IO_ALIGNMENT, NVMeOffload

log = logging.getLogger(__name__)

__all__ = [
    "SwapCorruptionError",
    "SwapDirectory",
    "SwapIO",
    "SwapPathError",
    "SwapSpaceError",
    "check_swap_path",
    "make_swap_io",
    "new_run_id",
]

SWAP_ROOT = "zlightning_swap"


class SwapPathError(ValueError):
    """The swap path cannot be used (not writable, no O_DIRECT when required, stale files with ``"error"``)."""


class SwapSpaceError(OSError):
    """Not enough free space for the swap files (before training), or the disk filled up while writing."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


class SwapCorruptionError(RuntimeError):
    """A swap file was modified, truncated or removed behind the engine's back: its data is not trusted."""


# ==================================================================== path checks
def _probe_direct(folder: Path) -> str | None:
    """None when O_DIRECT writes work in ``folder``, else the reason they do not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = folder / f".odirect-probe-{uuid.uuid4().hex[:8]}"
    from zlightning.kernels._aio import aligned_empty  # the one aligned host allocator

    view = aligned_empty(IO_ALIGNMENT, torch.uint8)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, _cbuf(view), 0)
        finally:
            os.close(fd)
        return None
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    finally:
        probe.unlink(missing_ok=True)


def check_swap_path(policy: NVMeOffload, needed_bytes: int) -> tuple[Path, bool]:
    """Checks that ``policy``'s path is a writable directory with ``needed_bytes`` free; probes O_DIRECT.

    Args:
        policy: the offload policy (its ``path`` and ``direct_io``).
        needed_bytes: bytes the swap files of every process using this path will take.

    Returns:
        ``(root, direct)``: the absolute swap root and whether O_DIRECT is used.

    Raises:
        SwapPathError: the path is not a writable directory, or ``direct_io="on"`` without O_DIRECT support.
        SwapSpaceError: fewer than ``needed_bytes`` bytes are free there.
    """
    root = policy.resolved_path()
    if policy.path is None:
        warnings.warn(
            f"NVMe offload without a path: swapping to the temporary directory {root}. Pass "
            "NVMeOffload(path='/local/nvme/dir') to put swap files on a fast local drive.",
            stacklevel=3,
        )
    elif not root.exists() and not root.parent.exists():
        # See [Note: the swap path must exist].
        raise SwapPathError(
            f"NVMe offload path {root} does not exist, and neither does its parent folder {root.parent}: a mistyped "
            "path or an unmounted drive would put the swap files on another disk. Mount the drive or fix "
            f"NVMeOffload(path=...); if the path is right, create it first (mkdir -p {root})."
        )
    try:
        root.mkdir(exist_ok=True)
        probe = root / f".write-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"\0" * IO_ALIGNMENT)
        probe.unlink()
    except OSError as err:
        raise SwapPathError(
            f"NVMe offload path {root} is not a writable directory ({type(err).__name__}: {err.strerror or err}). "
            "Pass NVMeOffload(path=...) a directory this process can create files in."
        ) from err
    direct = False
    if policy.direct_io != "off":
        reason = _probe_direct(root)
        direct = reason is None
        if reason is not None and policy.direct_io == "on":
            raise SwapPathError(
                f"NVMe offload path {root} does not support O_DIRECT ({reason}) but NVMeOffload(direct_io='on'). "
                "Use a local ext4/xfs NVMe mount, or direct_io='auto' to fall back to buffered I/O."
            )
        if reason is not None:
            warnings.warn(
                f"NVMe offload path {root} does not support O_DIRECT ({reason}, e.g. tmpfs or overlayfs): using "
                "buffered I/O, which goes through the page cache. Point NVMeOffload(path=...) at a local NVMe "
                "file system for full speed, or set direct_io='off' to silence this.",
                stacklevel=3,
            )
    free = shutil.disk_usage(root).free
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine
        log.info(
            "NVMe offload: swap files go to %s, on %s; %.1f GiB free, %.2f GiB needed%s",
            root,
            describe_filesystem(root),
            free / 2**30,
            needed_bytes / 2**30,
            "" if direct else " (buffered I/O)",
        )
    if needed_bytes > free:
        raise SwapSpaceError(
            f"NVMe offload needs {needed_bytes:,} bytes ({needed_bytes / 2**30:.2f} GiB) of swap files under {root} "
            f"but only {free:,} bytes ({free / 2**30:.2f} GiB) are free there. Free space, choose another "
            "NVMeOffload(path=...), or offload less (offload_params=None)."
        )
    return root, direct


def describe_filesystem(path: Path) -> str:
    """``"ext4 /dev/nvme0n1p1 mounted at /local"``: the file system holding ``path`` (Linux ``/proc/self/mountinfo``;
    ``"an unknown file system"`` elsewhere).

    [Note: the swap path must exist]
    A path such as ``/local/nvme/swap`` names a drive by its mount point. Had the drive not been mounted (or the path
    been mistyped), creating the path with all its parents would put the swap files on whatever disk holds ``/``,
    which may be slow or small, silently. So only the last folder of the path is created, the run refuses a path
    whose parent does not exist, and the file system, device and free space the swap files go to are logged.
    """
    real = str(path.resolve())
    best: tuple[str, str, str] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "an unknown file system"
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mount = fields[4].encode().decode("unicode_escape")  # \040 for spaces
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > len(best[0])):
            best = (mount, tail[0], tail[1])
    if best is None:
        return "an unknown file system"
    mount, fstype, device = best
    return f"{fstype} {device} mounted at {mount}"


# ==================================================================== swap folders
def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: dict[str, Any]) -> bool | None:
    """True/False for an owner on this host; None when it cannot be told (another host)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    recorded = owner.get("start_time")
    return recorded is None or _start_time(pid) in (None, recorded)


class SwapDirectory:
    """This rank's swap folder under one root: created on ``open``, removed on ``close``/exit/SIGTERM."""

    root: Path
    path: Path  # <root>/zlightning_swap/run-<id>-rank<r>
    closed: bool
    pid: int  # the process that opened it (only that one removes it at exit: see [Note: cleanup at process exit])

    def __init__(self, root: Path, run_id: str, rank: int) -> None:
        self.root = root
        self.path = root / SWAP_ROOT / f"run-{run_id}-rank{rank}"
        self.closed = True
        self.pid = -1

    def open(self, stale_files: str) -> None:
        """Handles stale folders of crashed runs, then creates this rank's folder and registers its cleanup.

        Raises:
            SwapPathError: stale folders exist and ``stale_files == "error"``.
        """
        _private_base(self.root / SWAP_ROOT)
        self._handle_stale(stale_files)
        # Created under a temporary name with its owner file, then renamed: another rank scanning for stale folders
        # never sees a run folder without an owner.
        staging = self.path.with_name(f".creating-{self.path.name}")
        staging.mkdir(mode=0o700, exist_ok=False)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid())}
        (staging / "owner.json").write_text(json.dumps(owner))
        os.replace(staging, self.path)
        self.closed = False
        self.pid = os.getpid()
        _register(self)

    def _handle_stale(self, policy: str) -> None:
        base = self.root / SWAP_ROOT
        if not base.is_dir():
            return
        stale = []
        for folder in sorted(base.glob("run-*")):
            try:
                owner = json.loads((folder / "owner.json").read_text())
            except (OSError, ValueError):
                owner = None
            if not isinstance(owner, dict):
                owner = {"host": socket.gethostname(), "pid": -1}  # never finished starting (or not ours): orphaned
            if _owner_alive(owner) is False:
                stale.append(folder)
        if not stale:
            return
        names = ", ".join(str(s) for s in stale[:5]) + (" ..." if len(stale) > 5 else "")
        if policy == "error":
            raise SwapPathError(
                f"stale swap folders of a crashed run (their processes are gone) under {base}: {names}. Remove them, "
                "or use NVMeOffload(stale_files='remove') to delete them automatically."
            )
        warnings.warn(f"removing stale swap folders of a crashed run: {names}", stacklevel=3)
        for folder in stale:
            _remove_tree(folder)

    def file(self, name: str) -> str:
        return str(self.path / name)

    def close(self) -> None:
        """Removes the folder and everything in it (idempotent)."""
        if self.closed:
            return
        self.closed = True
        _unregister(self)
        _remove_tree(self.path)
        try:  # the shared parent goes too once empty (other runs' folders keep it)
            (self.root / SWAP_ROOT).rmdir()
        except OSError:
            pass


def _private_base(base: Path) -> None:
    """Creates ``base`` readable by its owner only, or checks that the existing one belongs to this user.

    Raises:
        SwapPathError: ``base`` belongs to another user. See [Note: swap folder lifecycle].
    """
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = base.stat().st_uid
    except OSError as err:
        raise SwapPathError(
            f"cannot create the swap folder {base} ({type(err).__name__}: {err.strerror or err}). Pass "
            "NVMeOffload(path=...) a directory of your own."
        ) from err
    if owner != os.getuid():
        raise SwapPathError(
            f"the swap folder {base} belongs to another user (uid {owner}, this process runs as uid {os.getuid()}): "
            "swap files hold the model and optimizer state and are not written where another user controls the "
            "folder. Pass NVMeOffload(path=...) a directory of your own."
        )


def _remove_tree(folder: Path) -> None:
    trash = folder.with_name(f".deleting-{folder.name}-{uuid.uuid4().hex[:6]}")
    try:
        os.replace(folder, trash)  # atomic: two ranks cleaning the same stale folder do not collide
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


_LIVE: dict[int, SwapDirectory] = {}
_LOCK = threading.Lock()
_HOOKS_PID = -1  # the process whose exit hooks are installed (a forked child installs its own)
_PREVIOUS_SIGTERM: Any = None


def _register(folder: SwapDirectory) -> None:
    global _HOOKS_PID, _PREVIOUS_SIGTERM
    with _LOCK:
        _LIVE[id(folder)] = folder
        if os.getpid() != _HOOKS_PID:  # see [Note: cleanup at process exit]
            _HOOKS_PID = os.getpid()
            atexit.register(_close_all)
            multiprocessing.util.Finalize(None, _close_all, exitpriority=100)
    # (Re-)install when someone (e.g. Lightning's teardown restoring its originals) replaced the handler.
    if threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            _PREVIOUS_SIGTERM = current
            signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(folder: SwapDirectory) -> None:
    with _LOCK:
        _LIVE.pop(id(folder), None)


def _close_all() -> None:
    """Removes the folders this process opened (see [Note: cleanup at process exit])."""
    me = os.getpid()
    for folder in list(_LIVE.values()):
        if folder.pid == me:
            folder.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # See [Note: SIGTERM].
    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# ==================================================================== I/O engines
def _cbuf(t: torch.Tensor) -> Any:
    """A zero-copy buffer-protocol object over a contiguous CPU tensor's bytes."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


_WEIGHTS: dict[int, torch.Tensor] = {}
_WEIGHTS_LOCK = threading.Lock()
_CHECKSUM_COLUMNS = 512
"""Words per row of the checksum's 2-D view (4 KiB rows; every O_DIRECT block is a whole number of them)."""


def _weights(rows: int) -> torch.Tensor:
    """Cached ``[2, rows + C]`` int64 matrix that turns ``cat(row sums, column sums)`` into ``(plain, weighted)``
    (read-only; shared by the I/O threads). See [Note: checksum cost]."""
    with _WEIGHTS_LOCK:
        w = _WEIGHTS.get(rows)
        if w is None:
            c = _CHECKSUM_COLUMNS
            plain = torch.cat([torch.ones(rows, dtype=torch.int64), torch.zeros(c, dtype=torch.int64)])
            weighted = torch.cat([c * torch.arange(rows, dtype=torch.int64), torch.arange(1, c + 1, dtype=torch.int64)])
            w = _WEIGHTS[rows] = torch.stack([plain, weighted])
    return w


def block_checksum(chunk: torch.Tensor) -> int:
    """A 128-bit Fletcher-style checksum of a host block: the wrapping int64 sum of its 8-byte words ``w_i`` and
    their position-weighted sum ``sum((i + 1) * w_i)`` (any changed word, and any two words swapped, change it).

    [Note: checksum cost]
    The weighted sum is not formed word by word (that needs a full-size temporary and three passes). With the words
    viewed as ``R x C`` (``i = r*C + c``), ``sum((i+1) w_i) = C * sum(r * rowsum_r) + sum((c+1) * colsum_c)``:
    two vectorised reductions over the block (row sums, column sums), then one small matrix-vector product gives
    both sums (the exact same value as the word-by-word formula: integer addition modulo 2**64 is associative).
    About 9 GB/s per thread here for 1 MiB blocks, 2.5x zlib's CRC-32; the small product replaced five tiny tensor
    operations whose overhead was a third of the time. The reductions release the GIL, so checksums run in the I/O
    threads beside the transfers. Blocks whose size is not a multiple of ``8 * C`` bytes use a plain weighted sum
    (one column), and those not a multiple of 8 bytes CRC-32."""
    n = chunk.numel()
    if n % 8:
        return zlib.crc32(_cbuf(chunk))
    words = chunk.view(torch.int64)
    if words.numel() % _CHECKSUM_COLUMNS == 0:
        grid = words.view(-1, _CHECKSUM_COLUMNS)
        sums = torch.cat([grid.sum(1), grid.sum(0)])
        plain, weighted = torch.mv(_weights(grid.shape[0]), sums).tolist()
    else:
        plain = int(words.sum())
        weighted = int((words * torch.arange(1, words.numel() + 1, dtype=torch.int64)).sum())
    return _pack(plain, weighted)


def _pack(plain: int, weighted: int) -> int:
    """One 128-bit checksum from its two sums (each taken modulo 2**64: int64 results may be negative)."""
    return ((plain % 2**64) << 64) | (weighted % 2**64)


_native_checksums: bool | None = None


def block_checksums(raw: torch.Tensor, block_size: int) -> list[int]:
    """`block_checksum` of every ``block_size``-byte block of a contiguous uint8 host tensor (the last block may be
    shorter): in one call of the native ``zlightning::block_checksums`` when the kernels are built (one pass over
    memory, the GIL released for the whole range: see [Note: the checksum in one pass] in
    ``kernels/csrc/checksum.cpp``), else block by block. Both give the same values."""
    global _native_checksums
    if _native_checksums is None:
        from zlightning.kernels import _ext

        _native_checksums = _ext.available()
    n = raw.numel()
    native = 0  # leading bytes handed to the native op: every block but a last one that is not whole words
    if _native_checksums:
        native = n if (n % block_size) % 8 == 0 else n - n % block_size
    pairs = torch.ops.zlightning.block_checksums(raw[:native], block_size).tolist() if native else []
    return [_pack(p, w) for p, w in pairs] + [
        block_checksum(raw[s : s + block_size]) for s in range(native, n, block_size)
    ]


class SwapIO(Protocol):
    """An asynchronous I/O handle over aligned host buffers.

    ``pread``/``pwrite`` submit one request and return its ticket. ``finish(ticket)`` waits for that request only
    (others stay in flight) and raises its error; ``wait`` finishes every request. ``pwrite`` fills ``checksums``
    (one ``block_checksum`` per ``block_size`` block of ``buf``); a read is checked against ``checksums`` when it is
    finished, and ``SwapCorruptionError`` is raised on a mismatch or a short file.
    """

    block_size: int

    def pread(self, buf: torch.Tensor, path: str, offset: int, checksums: list[int]) -> Any: ...

    def pwrite(self, buf: torch.Tensor, path: str, offset: int, checksums: list[int]) -> Any: ...

    def done(self, ticket: Any) -> bool: ...

    def finish(self, ticket: Any) -> None: ...

    def wait(self) -> None: ...

    def forget(self, path: str) -> None: ...

    def close(self) -> None: ...


def _raw(buf: torch.Tensor) -> torch.Tensor:
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise AssertionError(f"swap I/O needs a contiguous host buffer, got {buf.device} {buf.is_contiguous()=}")
    return buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf


def _corrupted(path: str, offset: int, block: int, nbytes: int, actual: int, expected: int) -> SwapCorruptionError:
    return SwapCorruptionError(
        f"swap file {path} is corrupted: block {block} (bytes {offset}..{offset + nbytes}) has checksum "
        f"{actual:#034x}, written as {expected:#034x}. The file was modified outside this process; the run "
        "cannot continue from it: restart from the last checkpoint."
    )


_POLL_S = 1e-4
"""How often ``KernelSwapIO.wait`` polls a read request for completion."""


class _Ticket:
    """One submitted request of a `KernelSwapIO`: the engine's request, the buffer and, for a write, the checksum
    tasks that read the same buffer."""

    def __init__(
        self,
        request: Any,
        write: bool,
        buf: torch.Tensor,
        path: str,
        offset: int,
        checksums: list[int],
        sums: list[Future[None]],
    ) -> None:
        self.request = request
        self.write = write
        self.buf = buf
        self.path = path
        self.offset = offset
        self.checksums = checksums
        self.sums = sums
        self.checks: list[Future[None]] | None = None  # a read's verification tasks, once submitted


class KernelSwapIO:
    """Adapter over ``zlightning.kernels.DeepSpeedIOEngine``; block checksums run on a small thread pool.

    [Note: overlapped read verification]
    Writes are checksummed on the pool while the engine writes the same (unchanging) buffer. Reads cannot be
    verified before they land, but a swap-in is several requests (one per tensor): ``wait`` takes them in
    submission order and hands each one's blocks to the checksum pool the moment that request completes, so
    verifying tensor k overlaps reading tensors k+1..; only the last request's verification is exposed.
    ``finish`` waits for one request (the optimizer's read-ahead keeps later ones in flight) and verifies it on the
    pool too, one task per thread. Every call into the handle first hands the reads that have landed since to the
    pool (``_poll``), so a read is usually verified by the time its consumer asks for it: verifying only when
    ``finish`` was called left the consumer waiting for the whole verification (profiled on 4 blocks of the 2.0 B
    model of ``benchmarks/infinity.py``: as much time waiting for verifications as for the reads themselves).
    """

    def __init__(self, engine: Any, block_size: int, threads: int) -> None:
        self._engine = engine
        self.block_size = block_size
        self._threads = max(1, threads)
        self._sums = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zswap-crc")
        self._open: list[_Ticket] = []  # submitted and not finished, in submission order
        self._unverified: list[_Ticket] = []  # open reads whose verification is not submitted yet

    def _poll(self) -> None:
        """Submits the verification of every read that has landed (see [Note: overlapped read verification])."""
        waiting = []
        for t in self._unverified:
            if not t.request.done():
                waiting.append(t)
            elif not t.request.errors:  # a failed read is reported by finish/wait, never verified
                self._verify_landed(t)
        self._unverified = waiting

    def _verify_landed(self, t: _Ticket) -> list[Future[None]]:
        """The verification tasks of a read that has landed, submitted now unless ``_poll`` already did."""
        if t.checks is None:
            t.checks = self._verification(t)
        return t.checks

    def pread(self, buf: torch.Tensor, path: str, offset: int, checksums: list[int]) -> _Ticket:
        self._poll()
        nbytes = buf.numel() * buf.element_size()
        size = os.path.getsize(path) if os.path.exists(path) else -1
        if size < 0:
            raise SwapCorruptionError(f"swap file {path} is missing (removed outside this process)")
        if size < offset + nbytes:
            raise SwapCorruptionError(
                f"swap file {path} is truncated: {size} bytes, needs {offset + nbytes}. The file was modified outside "
                "this process: restart from the last checkpoint."
            )
        ticket = _Ticket(self._engine.async_pread(_raw(buf), path, offset), False, buf, path, offset, checksums, [])
        self._open.append(ticket)
        self._unverified.append(ticket)
        return ticket

    def pwrite(self, buf: torch.Tensor, path: str, offset: int, checksums: list[int]) -> _Ticket:
        self._poll()
        raw, bs = _raw(buf), self.block_size
        checksums[:] = [0] * -(-raw.numel() // bs)

        def fill(first: int, stop: int) -> None:
            checksums[first:stop] = block_checksums(raw[first * bs : stop * bs], bs)

        request = self._engine.async_pwrite(raw, path, offset)
        sums = [self._sums.submit(fill, first, stop) for first, stop in self._groups(raw.numel())]
        ticket = _Ticket(request, True, buf, path, offset, checksums, sums)
        self._open.append(ticket)
        return ticket

    def _groups(self, nbytes: int) -> list[tuple[int, int]]:
        """The blocks ``[first, stop)`` of an ``nbytes`` buffer in one contiguous run per checksum thread (one task
        each, not one per block: the pool's per-task overhead was a tenth of the checksum time with 1 MiB blocks)."""
        blocks = -(-nbytes // self.block_size)
        per = max(1, -(-blocks // self._threads))
        return [(first, min(first + per, blocks)) for first in range(0, blocks, per)]

    def _verify_request(self, t: _Ticket, first: int, stop: int) -> None:
        bs = self.block_size
        raw = _raw(t.buf)[first * bs : stop * bs]
        for i, actual in enumerate(block_checksums(raw, bs), first):
            if actual != t.checksums[i]:
                nbytes = min(bs, raw.numel() - (i - first) * bs)
                raise _corrupted(t.path, t.offset + i * bs, i, nbytes, actual, t.checksums[i])

    def _verification(self, t: _Ticket) -> list[Future[None]]:
        nbytes = t.buf.numel() * t.buf.element_size()
        return [self._sums.submit(self._verify_request, t, first, stop) for first, stop in self._groups(nbytes)]

    def done(self, ticket: _Ticket) -> bool:
        """Whether ``ticket``'s request (and, for a write, its checksums) completed; never blocks."""
        self._poll()
        return ticket.request.done() and all(f.done() for f in ticket.sums)

    def finish(self, ticket: _Ticket) -> None:
        """Waits for one request and checks it (its read blocks against their checksums).

        Raises:
            OSError: the request failed (``AIOError`` carries the errno).
            SwapCorruptionError: a block read back differs from what was written.
        """
        if ticket not in self._open:
            return
        self._poll()
        self._open.remove(ticket)
        if ticket in self._unverified:
            self._unverified.remove(ticket)
        checks: list[Future[None]] = ticket.checks or []
        try:
            ticket.request._wait()  # this request only (the engine's wait() takes every pending one)
            if ticket.request.errors:
                raise ticket.request.errors[0]
            checks = ticket.sums if ticket.write else self._verify_landed(ticket)
            for f in checks:
                f.result()
        finally:  # no checksum thread may still read the buffer once it goes back to the pool
            for f in ticket.sums + checks:
                f.exception()
            if not self._open:
                self._drain_engine()

    def _drain_engine(self) -> None:
        """Clears the engine's list of pending requests once every ticket was finished (their errors were raised
        by `finish` already)."""
        try:
            self._engine.wait()
        except OSError:
            pass

    def wait(self) -> None:
        """Waits for every request; read blocks are verified as soon as their request lands (see
        [Note: overlapped read verification]). I/O errors are raised before checksum mismatches: a failed read's
        buffer holds garbage that would otherwise be reported as corruption."""
        tickets, self._open, self._unverified = self._open, [], []
        sums = [f for t in tickets for f in t.sums]
        checks: list[Future[None]] = [f for t in tickets if t.checks is not None for f in t.checks]
        try:
            for t in tickets:
                if not t.write and t.checks is None:
                    while not t.request.done():
                        time.sleep(_POLL_S)
                    checks += self._verify_landed(t)
            if tickets:
                self._engine.wait()  # raises AIOError (an OSError with the errno) after every request finished
            for f in sums:
                f.result()
            for f in checks:
                f.result()
        finally:  # on any failure the buffers go back to the pool: no checksum thread may still be reading them
            for f in sums + checks:
                f.exception()

    def forget(self, path: str) -> None:
        pass

    def close(self) -> None:
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - closing after a failure must not raise again
            pass
        self._sums.shutdown(wait=True)
        self._engine.close()


def make_swap_io(policy: NVMeOffload, direct: bool) -> SwapIO:
    """The swap I/O handle over ``zlightning.kernels.DeepSpeedIOEngine`` (see [Note: I/O engines])."""
    from zlightning.kernels import DeepSpeedIOEngine

    backend = {"auto": "auto", "kernels": "native", "portable": "python"}[policy.io_engine]
    try:
        engine = DeepSpeedIOEngine(
            block_size=policy.block_size,
            queue_depth=policy.queue_depth,
            intra_op_parallelism=policy.io_threads,
            o_direct=direct,
            backend=backend,
        )
    except RuntimeError as err:
        raise RuntimeError(f"NVMeOffload(io_engine={policy.io_engine!r}): {err}") from err
    return KernelSwapIO(engine, policy.block_size, policy.io_threads)
