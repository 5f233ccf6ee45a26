"""Smaller stacks for the threads that zlightning starts, or makes torch start.

See [Note: thread stacks count against a data limit]. Everything here is a no-op where it cannot apply (not Linux with
glibc, a default already smaller, a backend other than gloo, ``ZLIGHTNING_THREAD_STACK_MIB=0``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
from collections.abc import Iterator

__all__ = ["small_thread_stacks", "thread_stack_bytes"]

# [Note: thread stacks count against a data limit]
# glibc gives every new thread a stack as large as the soft RLIMIT_STACK, 8 MiB on most systems, mapped private and
# writable up front. The pages are never touched, so resident memory does not see them, but the data segment does:
# RLIMIT_DATA (`ulimit -d`, the cap under which a sharded run must fit what DDP cannot) counts every such mapping.
# Creating a gloo process group starts four or five threads (two `pt_gloo_runloop` workers, `gloo_tcp_loop`, the
# TCPStore's server loop on the store's rank, a client helper), every further group two more, and zlightning adds
# its own watchdog: 40-50 MiB of data segment per rank before a single parameter exists, which on a model of 4 M
# parameters is more than the 12 bytes per parameter such a cap allows for all of training.
#
# None of these threads recurses deeply: gloo's workers run collectives and their completion callbacks, the loops
# wait on sockets, ours poll a store. So while zlightning creates gloo process groups and its own threads, new
# threads get a 2 MiB stack (glibc's default where RLIMIT_STACK is unlimited, and more than Windows gives gloo's
# threads by default), set as the process's default thread attributes (`pthread_setattr_default_np`, which
# std::thread follows, and with it the TCPStore's loop thread) and as Python's `threading.stack_size`, and both are
# put back on leaving. A default already smaller is kept. NCCL groups are left alone: their communicators start
# inside group creation, with threads that search the topology recursively (NCCL 2.27 crashed there on stacks below
# 8 MiB), and the data limit this is for is a host matter. Only on Linux with glibc. The window is short (group
# creation), but any thread another part of the program starts inside it gets the smaller stack too.
# `ZLIGHTNING_THREAD_STACK_MIB` sets the size (0 leaves the system's default).

_DEFAULT_MIB = 2
_ENV = "ZLIGHTNING_THREAD_STACK_MIB"
_ATTR_BYTES = 256  # pthread_attr_t is 56 bytes on x86-64 and 64 on aarch64: room to spare
_lock = threading.RLock()
_depth = 0
_saved: tuple[int, int] | None = None  # (pthread default stack size, Python's threading.stack_size) to restore


def thread_stack_bytes() -> int:
    """The stack size new threads get inside `small_thread_stacks` (0: the system's default is kept)."""
    raw = os.environ.get(_ENV, "").strip()
    if not raw:
        return _DEFAULT_MIB << 20
    try:
        mib = float(raw)
        if not math.isfinite(mib):
            raise ValueError(raw)
    except ValueError:
        raise ValueError(
            f"{_ENV}={raw!r} is not a number: set it to a stack size in MiB, or 0 to keep the default"
        ) from None
    if mib < 0:
        raise ValueError(
            f"{_ENV}={raw!r} is negative: set it to a stack size in MiB, or 0 to keep the default"
        ) from None
    return int(mib * (1 << 20)) // 4096 * 4096


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.pthread_getattr_default_np  # noqa: B018 - glibc 2.18 and later
        libc.pthread_setattr_default_np  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def _pthread_default(libc: ctypes.CDLL, new_size: int | None = None) -> int:
    """The process's default thread stack size; sets it to ``new_size`` first when given. 0 when it cannot."""
    attr = ctypes.create_string_buffer(_ATTR_BYTES)
    if libc.pthread_getattr_default_np(attr) != 0:
        return 0
    try:
        size = ctypes.c_size_t()
        if libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) != 0:
            return 0
        if new_size is not None:
            if libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(new_size)) != 0:
                return 0
            if libc.pthread_setattr_default_np(attr) != 0:
                return 0
        return size.value
    finally:
        libc.pthread_attr_destroy(attr)


@contextlib.contextmanager
def small_thread_stacks(backend: str | None = "gloo") -> Iterator[None]:
    """Threads created inside get a smaller stack; see [Note: thread stacks count against a data limit].

    Args:
        backend: the process-group backend whose threads start inside: only ``"gloo"`` (host) threads get small
            stacks; any other (NCCL sizes its own threads and needs deep stacks) leaves the defaults alone. ``None``:
            the default group's backend, read on entry.

    Re-entrant; the outermost use restores the process's defaults. A no-op without glibc.
    """
    global _depth, _saved
    if backend is None:
        backend = dist_backend()
    target = thread_stack_bytes() if backend == "gloo" else 0
    libc = _libc() if target else None
    with _lock:
        _depth += 1
        try:
            if _depth == 1 and libc is not None:
                old = _pthread_default(libc)
                if old and target < old:  # a default already smaller is kept, for Python's threads too
                    python_old = threading.stack_size()
                    threading.stack_size(target)
                    if _pthread_default(libc, target):
                        _saved = (old, python_old)
                    else:
                        threading.stack_size(python_old)
        except (ValueError, RuntimeError, OverflowError):  # Python's stack size not settable here: change nothing
            _saved = None
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                old, python_old = _saved
                _saved = None
                if libc is not None:
                    _pthread_default(libc, old)
                threading.stack_size(python_old)


def dist_backend() -> str | None:
    """The default process group's backend name, or None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend())
