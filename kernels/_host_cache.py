"""The caching host allocator (``kernels/csrc/host_cache.cpp``): large CPU tensors from reused mmap'd blocks.

See [Note: why a host caching allocator] in the C++ source. ``enable_host_cache`` installs it as PyTorch's CPU
allocator for the rest of the process (the ZeRO engine does this when shards live on the host); without the native
library it returns False and nothing changes (glibc's allocator keeps serving every tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from zlightning.kernels import _ext

__all__ = ["HostCacheStats", "disable_host_cache", "empty_host_cache", "enable_host_cache", "host_cache_stats"]

DEFAULT_MIN_BYTES = 128 << 10
"""Tensors of at least this many bytes come from the cache; smaller ones from glibc (128 KiB: glibc's own initial
mmap threshold, below which its heaps serve everything anyway)."""


@dataclass(frozen=True)
class HostCacheStats:
    """Counters of the caching host allocator (all zero when it was never enabled)."""

    enabled: bool
    """Installed as PyTorch's CPU allocator right now."""
    live_bytes: int
    """Bytes of blocks held by tensors."""
    idle_bytes: int
    """Bytes of blocks kept for reuse."""
    peak_live_bytes: int
    """Largest ``live_bytes`` seen."""
    mapped_bytes: int
    """Bytes mapped from the OS (live + idle)."""
    hits: int
    """Requests served from an idle block."""
    misses: int
    """Requests that mapped a new block."""
    shed_bytes: int = 0
    """Bytes of idle blocks whose pages were dropped (kept mapped) to make room for a request of another size; see
    [Note: shedding idle blocks of other sizes] in the C++ source."""


def enable_host_cache(min_bytes: int = DEFAULT_MIN_BYTES) -> bool:
    """Installs the caching allocator for CPU tensors of at least ``min_bytes`` (idempotent).

    Returns:
        True when the cache serves CPU tensors now; False when the native library is not available.

    Raises:
        ValueError: ``min_bytes`` is below one page (4096).
    """
    if min_bytes < 4096:
        raise ValueError(f"enable_host_cache(min_bytes=...) must be >= 4096 bytes, got {min_bytes}")
    if not _ext.available():
        return False
    torch.ops.zlightning.host_cache_enable(int(min_bytes))
    return True


def disable_host_cache() -> bool:
    """Puts the previous CPU allocator back (blocks already handed out still return to the cache). Returns whether
    the cache was installed."""
    return _ext.available() and bool(torch.ops.zlightning.host_cache_disable())


def empty_host_cache() -> int:
    """Returns the idle blocks to the OS; the number of bytes unmapped."""
    return int(torch.ops.zlightning.host_cache_empty()) if _ext.available() else 0


def host_cache_stats() -> HostCacheStats:
    """The allocator's counters (zeros when the native library is not loaded or the cache was never enabled)."""
    values = list(torch.ops.zlightning.host_cache_stats()) if _ext.available() else [0] * 8
    return HostCacheStats(bool(values[0]), *values[1:])
