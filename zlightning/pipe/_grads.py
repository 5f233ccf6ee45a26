"""Gradient work at the end of a batch: tied-weight all-reduce, data-parallel all-reduce, and ZeRO-1 (optimizer state
of each parameter on one data-parallel rank). The global norm, clipping and fp16 unscaling are
``zlightning/_gradnorm.py``'s, shared with the ZeRO engine and tensor parallelism.

[Note: ZeRO-1 by parameter ownership]
Each data-parallel rank of a stage owns a subset of the stage's parameters, balanced by element count (largest
first, to the least-loaded rank). Before the optimizer step the gradients of parameters owned elsewhere are set to
None, so the user's own optimizer (any ``torch.optim`` class, any param groups) skips them and never allocates their
state; after the step each parameter is broadcast from its owner. Optimizer state therefore shrinks by about ``dp``
without wrapping or re-implementing the optimizer. The granularity is a whole parameter, not a flat slice: with a
few very large parameters the balance is coarser than DeepSpeed's flat partitions (recorded in ``imbalance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Zero1Sharding", "allreduce_mean", "allreduce_sum"]


def _bucketed(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType, divide: int
) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=op, group=group)
        if divide > 1:
            flat /= divide
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_sum(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """In-place sum over ``group`` (one flat message per dtype)."""
    if group is not None and grads:
        _bucketed(grads, group, dist.ReduceOp.SUM, 1)


def allreduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup | None, size: int) -> None:
    """In-place mean over ``group`` of ``size`` ranks."""
    if group is not None and size > 1 and grads:
        _bucketed(grads, group, dist.ReduceOp.SUM, size)


@dataclass
class Zero1Sharding:
    """Which data-parallel rank steps which parameter; see [Note: ZeRO-1 by parameter ownership]."""

    params: list[nn.Parameter]
    owner: list[int]
    """Data-parallel rank owning each parameter."""
    dp_rank: int
    group_ranks: list[int]
    """Global rank of each data-parallel rank of this stage."""
    group: dist.ProcessGroup | None

    @staticmethod
    def plan(
        params: list[nn.Parameter], dp: int, dp_rank: int, group_ranks: list[int], group: dist.ProcessGroup | None
    ) -> Zero1Sharding:
        load = [0] * dp
        owner = [0] * len(params)
        for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
            r = min(range(dp), key=lambda d: (load[d], d))
            owner[i] = r
            load[r] += params[i].numel()
        return Zero1Sharding(params, owner, dp_rank, group_ranks, group)

    @property
    def imbalance(self) -> float:
        """Largest owned element count over the mean (1.0 is perfect)."""
        loads = [0] * len(self.group_ranks)
        for p, o in zip(self.params, self.owner):
            loads[o] += p.numel()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def drop_foreign_grads(self) -> None:
        for p, o in zip(self.params, self.owner):
            if o != self.dp_rank:
                p.grad = None

    @torch.no_grad()
    def broadcast_from_owners(self) -> None:
        if self.group is None or len(self.group_ranks) == 1:
            return
        for p, o in zip(self.params, self.owner):
            dist.broadcast(p.data, src=self.group_ranks[o], group=self.group)
