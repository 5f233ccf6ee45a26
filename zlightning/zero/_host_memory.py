"""Host-memory hygiene for sharded training on the CPU: the caching host allocator, or a fixed glibc mmap threshold.

[Note: host memory of a sharded step]
A ZeRO step on the host allocates and frees blocks of a unit's size dozens of times (gathered parameters, gradients,
optimizer temporaries), interleaved with long-lived tensors (gradient shards, optimizer state). The engine keeps its
own step buffers in a pool (``_buffers.py``), but autograd's gradients, the optimizer's temporaries and activations
still come from the process allocator, and glibc's heaps fragment under that pattern: on a 24 x Linear(1024) model
on 2 CPU ranks, resident memory grew from 11 to 16 bytes per parameter over 40 steps while 8.9 were live. Two
remedies, in order of preference:

* the caching host allocator from the native kernels (``ZeroConfig.host_cache``, on by default): large tensors come
  from mmap'd blocks that are reused, never from glibc's heaps; resident memory is flat at the step's peak and large
  blocks are not page-faulted again after the first step (see [Note: why a host caching allocator] in
  ``kernels/csrc/host_cache.cpp``);
* without the native kernels, ``ZeroConfig.host_mmap_threshold`` (e.g. 1 MiB) fixes glibc's mmap threshold so large
  blocks are mapped on allocation and unmapped on free: resident memory is exact, but every large block is
  page-faulted afresh (25-50% slower steps on the CPU benchmarks), so it is opt-in.

Both are process-wide. An explicit ``MALLOC_MMAP_THRESHOLD_`` environment variable from the user wins over the
threshold; other C libraries (musl) and other platforms: the threshold does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

__all__ = ["pin_mmap_threshold", "use_host_cache"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_pinned: int | None = None
_warned = False


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fixes glibc's mmap threshold at ``nbytes`` (see the note). Returns True if the allocator took it."""
    global _pinned
    if _pinned == nbytes:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return False
    _pinned = nbytes
    return True


def use_host_cache() -> bool:
    """Installs the caching host allocator (see the note); warns once and returns False without the native kernels."""
    global _warned
    from zlightning.kernels._host_cache import enable_host_cache

    if enable_host_cache():
        return True
    if not _warned:
        _warned = True
        from zlightning.kernels import _ext

        warnings.warn(
            f"zlightning: the caching host allocator is unavailable ({_ext.status().reason}), so glibc serves the "
            "step's large tensors and resident memory can grow with heap fragmentation. Build the native kernels "
            "(`zlightning kernels --build`), or bound memory at some speed cost with "
            "ZeroConfig(host_mmap_threshold=1 << 20).",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
