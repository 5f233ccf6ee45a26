"""Step buffers the engine owns: a pool of storages lent to gathers and gradient reductions, and reused every step.

[Note: why the engine pools its step buffers]
Every step gathers each unit (twice with ``reshard_after_forward``) and reduces each unit's gradients: buffers of a
unit's size, allocated and freed dozens of times per step. On CUDA the caching allocator absorbs that; on the host
each one is a ``malloc``/``free`` of megabytes. glibc serves those from its heaps once its dynamic mmap threshold has
risen past them, where they interleave with long-lived tensors (optimizer state, gradient shards) and fragment: the
process's resident memory grew step after step (to twice the sharded model state after three steps on a 24-block
MLP) even though the live tensors did not. So the engine allocates these buffers once, into this pool, and lends
them out: after the first step no step buffer is allocated again and resident memory stays flat.

A gathered group must keep the *identity* of its buffer storage (autograd saved the full tensors in forward and reads
them again in backward after the group was released and re-gathered; see [Note: storage lifetime and autograd] in
``_param_group.py``). Lending therefore swaps the data pointer of a pool storage into the group's own storage
(``UntypedStorage._swap_data_ptr_``) and swaps it back on release: the group's storage object never changes, its
bytes come from the pool, and nothing is allocated. Without that method (other PyTorch builds) the pool falls back
to resizing the group's storage, which is correct and only loses the reuse.

The pool keeps every storage it ever allocated until it holds more idle bytes than ``idle_limit`` (then it frees the
largest idle ones), so its size settles at the step's peak demand: the prefetch window, the units in use and the
reductions in flight. Where zlightning's caching host allocator serves CPU tensors (``ZeroConfig.host_cache``), the
engine sets that limit to 0: the allocator itself keeps freed blocks mapped for the next request of their size, so
nothing is reallocated from the OS either way, and a block the pool does not hold idle can serve autograd's gradient
of the unit computing (see [Note: the host's backward gathers each unit at its own hook] in ``_state.py``).
"""

from __future__ import annotations

import torch

__all__ = ["StoragePool", "can_swap_storages"]

_ALIGN = 4096  # bytes: sizes are rounded up to whole pages so that near-equal requests share slots


def can_swap_storages() -> bool:
    """True where ``UntypedStorage._swap_data_ptr_`` exists (lending without allocation)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class StoragePool:
    """Untyped storages on one device, lent by size (best fit) and returned for reuse."""

    device: torch.device
    idle_limit: int  # bytes of idle storages kept; beyond it the largest idle ones are freed
    allocated_bytes: int  # all storages the pool owns, idle or lent
    _idle: list[torch.UntypedStorage]  # sorted by size

    def __init__(self, device: torch.device, idle_limit: int) -> None:
        self.device = device
        self.idle_limit = idle_limit
        self.allocated_bytes = 0
        self._idle = []
        self._swap = can_swap_storages()

    @property
    def idle_bytes(self) -> int:
        return sum(s.nbytes() for s in self._idle)

    def acquire(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of at least ``nbytes`` (an idle one when one fits within 1.25x, else a new one)."""
        for i, s in enumerate(self._idle):
            if s.nbytes() >= nbytes:
                if s.nbytes() * 4 <= nbytes * 5:
                    return self._idle.pop(i)
                break
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, device=self.device).untyped_storage()

    def release(self, storage: torch.UntypedStorage) -> None:
        """Returns a storage lent by `acquire`."""
        if storage.nbytes() == 0:
            raise AssertionError("StoragePool.release: the storage's bytes were lent on and not swapped back")
        sizes = [s.nbytes() for s in self._idle]
        pos = next((i for i, n in enumerate(sizes) if n >= storage.nbytes()), len(sizes))
        self._idle.insert(pos, storage)
        idle = sum(sizes) + storage.nbytes()
        while idle > self.idle_limit and self._idle:
            freed = self._idle.pop()
            idle -= freed.nbytes()
            self.allocated_bytes -= freed.nbytes()
            _free_now(freed)

    def lend_into(self, target: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage | None:
        """Gives ``target`` (an empty storage that must keep its identity) at least ``nbytes`` of pool memory.

        Returns:
            The token to pass to `take_back` (None on the resizing fallback).
        """
        if target.nbytes() != 0:
            raise AssertionError(f"StoragePool.lend_into: target holds {target.nbytes()} bytes already")
        if not self._swap:
            target.resize_(nbytes)
            return None
        slot = self.acquire(nbytes)
        target._swap_data_ptr_(slot)  # type: ignore[attr-defined]
        return slot

    def take_back(self, target: torch.UntypedStorage, token: torch.UntypedStorage | None) -> None:
        """Undoes `lend_into`: ``target`` is empty again and the memory back in the pool."""
        if token is None:
            target.resize_(0)
            return
        target._swap_data_ptr_(token)  # type: ignore[attr-defined]
        self.release(token)

    def release_idle(self) -> None:
        """Frees the idle storages now, keeping the idle limit (the pool fills up again at the next step).

        [Note: step buffers between backward and the optimizer step]
        The pool's storages are idle from the end of backward until the next forward, while the optimizer step
        allocates temporaries of another size (shard-sized, against the pool's unit-sized buffers) and, at the first
        step, the optimizer state. Kept by the pool, those buffers stay resident on top of the step's peak (12 MiB of
        a 9.3-byte-per-parameter peak on 24 x Linear(1024) at 2 ranks). Where the caching host allocator serves CPU
        tensors, the engine frees them here instead: they go back to the allocator as idle blocks, which it drops
        from resident memory when the step needs room for other sizes (see [Note: shedding idle blocks of other
        sizes] in ``kernels/csrc/host_cache.cpp``) and hands back to the next forward, still mapped. Without it
        (glibc alone) the pool keeps them, which is what stops glibc's heaps from fragmenting.
        """
        self.allocated_bytes -= self.idle_bytes
        for freed in self._idle:
            _free_now(freed)
        self._idle = []

    def clear(self) -> None:
        """Frees every idle storage (lent ones are freed when returned, as the idle limit is then 0)."""
        self.idle_limit = 0
        self.release_idle()


def _free_now(storage: torch.UntypedStorage) -> None:
    """Returns a storage's bytes to the allocator now, whoever still references the storage object.

    [Note: a freed step buffer is freed now]
    A collective's work object keeps the tensors it ran on until gloo's worker thread drops it, which may be a moment
    after the rank's wait returned. A buffer the pool frees is done with (its collective finished), but while that
    reference lives, dropping the pool's own only delays the free: the allocation that should have taken its bytes
    (autograd's gradient of the next unit) gets a fresh block instead, and the step's peak holds one unit more, on
    some steps and not others. Resizing the storage to 0 bytes frees them at once; a late reference sees an empty
    storage. Host storages only: a device collective's work object may keep its tensors until the collective's
    kernels are done on their stream (NCCL's stash instead of ``record_stream``), which is what keeps the bytes from
    being reused under it.
    """
    if storage.device.type == "cpu" and storage.resizable():
        storage.resize_(0)
