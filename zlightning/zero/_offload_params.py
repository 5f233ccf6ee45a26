"""Parameter offload to NVMe: each non-persistent group's shard lives in a file between uses.

[Note: parameter shards on disk]
A group's shard tensor keeps its identity (the optimizer and the modules hold views of it, the pieces), but its
storage is shrunk to 0 bytes while the shard is on disk, exactly like the gathered buffer between uses. Before the
group's all-gather the shard is read (through a pool buffer, checksums verified) and the storage regrown; after the
all-gather it is dropped again (no write: it did not change). The optimizer step is the only writer: it makes the
shard resident, updates it and writes it back. Reads are issued ahead of need in the recorded execution order
(``prefetch``), limited by the free pool buffers, one buffer being kept for on-demand reads; a group used out of
order is read on demand (slower, correct). Waiting for a shard waits for its own read only: prefetches of later
groups stay in flight. When the optimizer will step a group during this backward (``step_in_backward``), the shard
read for the group's backward all-gather is *held* (kept resident) until that update, so it is read once.

[Note: gathers read from the pool]
A gather only copies the shard into the gathered buffer (this rank's slice of it). So a shard that is read for a
gather and dropped right after is not made resident at all: the gather copies out of the pool buffer the read landed
in, and the buffer goes back to the pool. Making it resident first cost a second copy of every shard on every
gather, into memory freshly faulted in (about 60 ms per 134 MB shard on the 0.2 B-parameter benchmark, for every
unit of forward and of backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zlightning.zero._offload_config import NVMeOffload
from zlightning.zero._swap import Swapper, SwapState, SwapTensor, aligned_numel
from zlightning.zero._swap_io import SwapDirectory

if TYPE_CHECKING:
    from zlightning.zero._param_group import ZeroParamGroup
    from zlightning.zero._state import ZeroState

__all__ = ["ParamOffloader"]


class ParamOffloader:
    """Keeps non-persistent group shards on disk and brings them back for gathers and optimizer steps."""

    swapper: Swapper
    files: dict[int, SwapTensor]  # id(group) -> its shard's swap tensor
    resident: set[int]  # id(group) of shards currently in memory

    def __init__(
        self, state: ZeroState, policy: NVMeOffload, folder: SwapDirectory, direct: bool, *, pin: bool
    ) -> None:
        groups = [g for g in state.groups if not g.persistent]
        largest = max(
            (aligned_numel(g.shard_numel, g.master_dtype) * g.shard.element_size() for g in groups), default=0
        )
        limit = aligned_numel(policy.buffer_size, torch.float32) * 4
        if largest > limit:
            big = max(groups, key=lambda g: g.shard_numel)
            names = ", ".join(p.fqn for p in big.params[:3])
            raise ValueError(
                f"offload_params: a parameter group's shard ({big.shard_numel:,} elements: {names}...) is larger than "
                f"NVMeOffload.buffer_size={policy.buffer_size:,} elements; every unit's shard must fit one buffer. "
                "Raise buffer_size or use smaller units (ZeroConfig.unit_modules)."
            )
        if policy.buffer_count < 2:
            raise ValueError("offload_params needs NVMeOffload(buffer_count >= 2) (one for prefetch, one on demand)")
        self.state = state
        self.swapper = Swapper(policy, folder, direct, pin=pin, nbytes=max(largest, 4096))
        self.files = {}
        self.resident = set()
        self._dirty: set[int] = set()
        self._held: dict[int, ZeroParamGroup] = {}  # resident until the optimizer's update (see the Note)
        for i, g in enumerate(state.groups):
            if g.persistent:
                continue
            t = SwapTensor(
                f"param group {i} shard", folder.file(f"param_group{i}.swp"), 0, g.shard_numel, g.master_dtype
            )
            self.files[id(g)] = t
            g.fill_pending_values()  # meta-built shards get values only now ([Note: initial values straight to disk])
            self.swapper.stage(t, g.shard.detach())
            self.swapper.write(t)
            self.swapper.wait_writes()
            self._drop(g)

    def manages(self, group: ZeroParamGroup) -> bool:
        return id(group) in self.files

    # ---------------------------------------------------------------- residency
    def _drop(self, group: ZeroParamGroup) -> None:
        group.shard.untyped_storage().resize_(0)
        self.resident.discard(id(group))

    def ensure(self, group: ZeroParamGroup) -> None:
        """Makes ``group``'s shard resident (waiting for its prefetch, or reading it now)."""
        key = id(group)
        if key not in self.files or key in self.resident:
            return
        t = self.files[key]
        self._into_pool(t)
        storage = group.shard.untyped_storage()
        storage.resize_(group.shard_numel * group.shard.element_size())
        with torch.no_grad():
            group.shard.copy_(t.data())
        self.swapper.release(t)
        self.resident.add(key)

    @contextlib.contextmanager
    def gather_source(self, group: ZeroParamGroup, keep: bool) -> Iterator[torch.Tensor]:
        """The values an all-gather copies this rank's slice from. A shard on disk that nothing keeps (``keep``: its
        update comes later in this backward) is not made resident: the gather copies straight out of the pool
        buffer its read landed in, which goes back to the pool afterwards ([Note: gathers read from the pool])."""
        key = id(group)
        if keep or key not in self.files or key in self.resident:
            self.ensure(group)
            yield group.shard
            return
        t = self.files[key]
        self._into_pool(t)
        try:
            yield t.data()
        finally:
            self.swapper.release(t)

    def _into_pool(self, t: SwapTensor) -> None:
        """``t`` in a pool buffer: its prefetch waited for, or read now. Waits for this read only: later prefetches
        stay in flight."""
        if t.state is SwapState.ON_NVME:
            self._make_room()
            self.swapper.read(t)
        if self.swapper.is_reading(t):
            self.swapper.wait_read(t)

    def _make_room(self) -> None:
        """Frees a pool buffer for a read on demand: finished writes first, then unconsumed prefetches, and only
        then waits for the writes still in flight (with ``buffer_count`` commits in flight every buffer is a write's,
        and how many are still in flight depends on the disk's speed)."""
        if self.swapper.pool.free_count == 0:
            self.swapper.reap_writes()
        if self.swapper.pool.free_count == 0:
            self._reclaim()
        if self.swapper.pool.free_count == 0:
            self.swapper.wait_writes()

    def _reclaim(self) -> None:
        """Returns buffers of prefetched shards nobody consumed (the execution order changed) to the pool."""
        self.swapper.wait_reads()
        for t in self.files.values():
            if t.state is SwapState.IN_CPU:
                self.swapper.release(t)

    def evict(self, group: ZeroParamGroup) -> None:
        """Drops an unchanged resident shard (after its all-gather) unless it is held."""
        key = id(group)
        if key in self.files and key in self.resident and key not in self._dirty and key not in self._held:
            self._drop(group)

    def landed(self, group: ZeroParamGroup) -> bool:
        """``group``'s shard can be gathered without waiting on the disk (resident, not offloaded, or read)."""
        key = id(group)
        return key not in self.files or key in self.resident or self.swapper.landed(self.files[key])

    def hold(self, group: ZeroParamGroup) -> None:
        """Keeps a resident shard in memory for an update that comes soon (`evict` leaves it alone)."""
        if id(group) in self.files and id(group) in self.resident:
            self._held[id(group)] = group

    def drop_held(self) -> None:
        """Drops held shards that were not updated after all (no gradient this step)."""
        held, self._held = self._held, {}
        for group in held.values():
            self.evict(group)

    def prefetch(self, upcoming: list[ZeroParamGroup]) -> None:
        """Issues reads for upcoming groups in order while pool buffers are free (one stays free)."""
        for g in upcoming:
            if self.swapper.pool.free_count <= 1:
                return
            t = self.files.get(id(g))
            if g.status.value != "sharded":  # gathered (or gathering) already: its shard is not needed again yet
                continue
            if t is not None and id(g) not in self.resident and t.state is SwapState.ON_NVME:
                self.swapper.read(t)

    # ---------------------------------------------------------------- writers
    def mark_dirty(self, group: ZeroParamGroup) -> None:
        """The shard is about to change (optimizer step, checkpoint load): it must be written before dropping."""
        if id(group) in self.files:
            self.ensure(group)
            self._dirty.add(id(group))

    def commit(self, group: ZeroParamGroup, *, wait: bool = False) -> None:
        """Writes a changed shard back (asynchronously unless ``wait``) and drops it from memory."""
        key = id(group)
        self._held.pop(key, None)
        if key not in self._dirty:
            self.evict(group)
            return
        self.swapper.reap_writes()
        if self.swapper.pool.free_count == 0:
            self.swapper.wait_writes()  # an earlier commit's buffer is free again
        t = self.files[key]
        self.swapper.supersede(t)  # the in-memory shard is now the only current copy
        self.swapper.stage(t, group.shard.detach())
        self.swapper.write(t)
        self._dirty.discard(key)
        self._drop(group)
        if wait:
            self.swapper.wait_writes()

    def flush(self) -> None:
        self.swapper.wait_writes()

    @contextlib.contextmanager
    def all_resident(self) -> Iterator[None]:
        """Every offloaded shard resident and considered changed; written back and dropped on exit."""
        groups = [g for g in self.state.groups if id(g) in self.files]
        for g in groups:
            self.mark_dirty(g)
        try:
            yield
        finally:
            for g in groups:
                self.commit(g)
            self.flush()
