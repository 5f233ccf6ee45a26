"""The engine's offload state: swap folders, path checks, swappers and the parameter offloader, per rank.

[Note: what is offloaded where]
``offload_optimizer=NVMeOffload``: Adam's ``exp_avg`` and ``exp_avg_sq`` (and the fp32 master when the compute
device is not the host) live in files, one per (group, state), stepped in sub-groups of ``buffer_size`` elements
through the pool. On a CPU-only machine the engine's fp32 shard *is* the master (no second copy).
``offload_optimizer=CPUOffload``: the same state in host memory (pinned on CUDA) and the step on the host.
``offload_params=NVMeOffload``: each non-persistent group's shard lives in one file and is read back before its
all-gather (prefetched in the recorded execution order) and dropped after it; the optimizer step reads it, updates
it and writes it back. Persistent (small) groups stay resident.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zlightning.zero._offload_config import CPUOffload, NVMeOffload
from zlightning.zero._swap import Swapper, aligned_numel
from zlightning.zero._swap_io import SwapDirectory, check_swap_path, new_run_id

if TYPE_CHECKING:
    from zlightning.zero._offload_optimizer import OffloadedAdam
    from zlightning.zero._offload_params import ParamOffloader
    from zlightning.zero._param_group import ZeroParamGroup
    from zlightning.zero._state import ZeroState

__all__ = ["ZeroOffload", "close_swap_files"]


def _state_bytes(numel: int, dtype: torch.dtype) -> int:
    return aligned_numel(numel, dtype) * dtype.itemsize


class ZeroOffload:
    """Owns this rank's swap folders and swappers; built by ``ZeroState`` when a policy asks for offload."""

    optimizer_policy: CPUOffload | NVMeOffload | None
    param_policy: NVMeOffload | None
    optimizer_swapper: Swapper | None
    params: ParamOffloader | None
    folders: list[SwapDirectory]
    optimizer: OffloadedAdam | None  # set when an optimizer is attached (it steps the offloaded state)

    def __init__(self, state: ZeroState) -> None:
        cfg = state.config
        self.state = state
        self.optimizer_policy = cfg.offload_optimizer
        self.param_policy = cfg.offload_params
        self.master_on_host = state.device.type != "cpu"
        self.pin = state.device.type == "cuda"
        self.optimizer_swapper = None
        self.params = None
        self.folders = []
        self.optimizer = None
        if self.param_policy is not None and self.param_policy.step_in_backward:
            raise ValueError(
                "offload_params=NVMeOffload(step_in_backward=True): step_in_backward is an optimizer setting; set it "
                "on offload_optimizer (parameter shards then follow the update)"
            )
        self._closed = False
        run_id = self._shared_run_id()
        needs = self._bytes_needed()
        try:
            by_root: dict[str, tuple[SwapDirectory, bool]] = {}
            for which, policy in (("optimizer", self.optimizer_policy), ("params", self.param_policy)):
                if not isinstance(policy, NVMeOffload):
                    continue
                key = str(policy.resolved_path())
                if key not in by_root:
                    total = sum(n for k, n in needs.items() if k == key)
                    root, direct = check_swap_path(policy, self._shared_need(key, total))
                    folder = SwapDirectory(root, run_id, state.rank)
                    folder.open(policy.stale_files)
                    self.folders.append(folder)
                    by_root[key] = (folder, direct)
                folder, direct = by_root[key]
                if which == "optimizer":
                    self.optimizer_swapper = Swapper(
                        policy, folder, direct, pin=self.pin, nbytes=max(self.sub_group_nbytes(), 1)
                    )
                else:
                    from zlightning.zero._offload_params import ParamOffloader

                    self.params = ParamOffloader(state, policy, folder, direct, pin=self.pin)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- sizing
    def sub_group_numel_of(self, group: ZeroParamGroup) -> int:
        """Elements per optimizer sub-group of ``group``, aligned: ``buffer_size``, or its whole shard when that is
        smaller (a sub-group never spans two groups, so larger buffers would only hold untouched pages). 0 without
        NVMe optimizer offload."""
        policy = self.optimizer_policy
        if not isinstance(policy, NVMeOffload):
            return 0
        return aligned_numel(min(policy.buffer_size, max(group.shard_numel, 1)), group.master_dtype)

    def sub_group_nbytes(self) -> int:
        """Bytes of one pool buffer: one state tensor of the largest sub-group, in its group's dtype (see [Note:
        optimizer state in the parameter's dtype] in ``_offload_optimizer.py``)."""
        return max(
            (self.sub_group_numel_of(g) * g.master_dtype.itemsize for g in self.state.groups if g.trainable_at_build),
            default=0,
        )

    def offloaded_param_groups(self) -> list[ZeroParamGroup]:
        return [g for g in self.state.groups if not g.persistent]

    def optimizer_state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "master") if self.master_on_host else ("exp_avg", "exp_avg_sq")

    def _bytes_needed(self) -> dict[str, int]:
        out: dict[str, int] = {}
        opt = self.optimizer_policy
        if isinstance(opt, NVMeOffload):
            per = 0
            for g in self.state.groups:
                if g.trainable_at_build:
                    sub = self.sub_group_numel_of(g)
                    full, rest = divmod(g.shard_numel, sub)
                    per += full * _state_bytes(sub, g.master_dtype) + (
                        _state_bytes(rest, g.master_dtype) if rest else 0
                    )
            key = str(opt.resolved_path())
            out[key] = out.get(key, 0) + per * len(self.optimizer_state_names())
        par = self.param_policy
        if isinstance(par, NVMeOffload):
            key = str(par.resolved_path())
            size = sum(
                aligned_numel(g.shard_numel, g.master_dtype) * g.shard.element_size()
                for g in self.offloaded_param_groups()
            )
            out[key] = out.get(key, 0) + size
        return out

    def _shared_run_id(self) -> str:
        box = [new_run_id() if self.state.rank == 0 else None]
        if self.state.world_size > 1:
            dist.broadcast_object_list(box, src=self.state.global_src, group=self.state.process_group)
        return str(box[0])

    def _shared_need(self, root: str, mine: int) -> int:
        """Bytes all ranks on this host will write under ``root`` (they share its free space)."""
        if self.state.world_size == 1:
            return mine
        everyone: list[tuple[str, str, int] | None] = [None] * self.state.world_size
        dist.all_gather_object(everyone, (socket.gethostname(), root, mine), group=self.state.process_group)
        here = socket.gethostname()
        return sum(n for host, r, n in (e for e in everyone if e is not None) if host == here and r == root)

    # ---------------------------------------------------------------- engine hooks
    def gather_source(self, group: ZeroParamGroup) -> contextlib.AbstractContextManager[torch.Tensor]:
        """What ``group``'s all-gather copies this rank's slice from, for the duration of the copy: its shard, or
        with parameter offload the pool buffer it was read into (see [Note: gathers read from the pool])."""
        if self.params is None:
            return contextlib.nullcontext(group.shard)
        keep = self.optimizer is not None and self.optimizer.updates_in_backward(group)
        return self.params.gather_source(group, keep)

    def landed(self, group: ZeroParamGroup) -> bool:
        """``group`` can be gathered without waiting on the disk (see ``ParamOffloader.landed``)."""
        return self.params is None or self.params.landed(group)

    def after_gather(self, group: ZeroParamGroup) -> None:
        if self.params is None:
            return
        if self.optimizer is not None and self.optimizer.updates_in_backward(group):
            self.params.hold(group)  # its update comes later in this backward: read the shard once
        else:
            self.params.evict(group)

    def prefetch(self, groups: list[ZeroParamGroup]) -> None:
        """Called at every unit of forward and backward with the groups expected next: parameter shards are read
        ahead of their gathers, optimizer state ahead of its step."""
        if self.params is not None:
            self.params.prefetch(groups)
        if self.optimizer is not None:
            self.optimizer.read_ahead()

    def gradient_final(self, group: ZeroParamGroup) -> None:
        """Called by the engine when ``group``'s gradient shard is final for this backward."""
        if self.optimizer is not None:
            self.optimizer.gradient_final(group)

    def check_gradients_unapplied(self, what: str) -> None:
        """Raises when ``what`` (clipping, unscaling) would change gradients already applied in backward.

        Raises:
            RuntimeError: some group was stepped during this backward (``step_in_backward``).
        """
        if self.optimizer is not None and self.optimizer.stepped_in_backward:
            raise RuntimeError(
                f"{what} after backward, but offload_optimizer's step_in_backward=True already applied some "
                "gradients during backward: the update would not see it. Turn step_in_backward off, or do not clip "
                "or scale (DeepSpeedZeroOptimizer_Stage3 keeps the update in step() by itself when it clips or "
                "scales)."
            )

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every shard in memory for the duration (checkpoints, consolidation); written back and dropped after."""
        if self.params is None:
            yield
            return
        with self.params.all_resident():
            yield

    def swap_stats(self) -> dict[str, float]:
        """Bytes moved and bandwidth since the last call (optimizer and parameter swapping together)."""
        total = {"bytes_read": 0.0, "bytes_written": 0.0, "read_s": 0.0, "write_s": 0.0}
        for swapper in self.swappers():
            s = swapper.take_stats()
            total["bytes_read"] += s.bytes_read
            total["bytes_written"] += s.bytes_written
            total["read_s"] += s.read_s
            total["write_s"] += s.write_s
        return {
            "swap_bytes_read": total["bytes_read"],
            "swap_bytes_written": total["bytes_written"],
            "swap_read_MBps": total["bytes_read"] / total["read_s"] / 1e6 if total["read_s"] else 0.0,
            "swap_write_MBps": total["bytes_written"] / total["write_s"] / 1e6 if total["write_s"] else 0.0,
        }

    def swappers(self) -> list[Swapper]:
        out = [self.optimizer_swapper] if self.optimizer_swapper is not None else []
        if self.params is not None:
            out.append(self.params.swapper)
        return out

    def close(self) -> None:
        """Stops I/O and removes this rank's swap folders (idempotent; also runs at exit and on SIGTERM)."""
        if self._closed:
            return
        self._closed = True
        close_swap_files(self.swappers(), self.folders)


def close_swap_files(swappers: list[Swapper], folders: list[SwapDirectory]) -> None:
    """Stops swap I/O and removes the folders. Holds no reference to the engine, so it can be the finalizer that runs
    when an engine (and its module) is garbage collected."""
    for swapper in swappers:
        swapper.close()
    for folder in folders:
        folder.close()
