"""Stateless tensor-parallel collectives as autograd Functions (forward op, and its adjoint in backward).

| Function            | forward                         | backward                       |
|---------------------|---------------------------------|--------------------------------|
| ``copy_to_tp``      | identity                        | all-reduce(sum) over TP        |
| ``reduce_from_tp``  | all-reduce(sum) over TP         | identity                       |
| ``gather_from_tp``  | all-gather on the last dim      | keep this rank's slice         |
| ``scatter_to_tp``   | keep this rank's last-dim slice | all-gather on the last dim     |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["copy_to_tp", "gather_from_tp", "reduce_from_tp", "scatter_to_tp"]


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice_last(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[-1] % world != 0:
        raise ValueError(f"tensor parallel: last dim {x.shape[-1]} is not divisible by the TP size {world}")
    return x.chunk(world, dim=-1)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _own_slice_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _own_slice_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_gather_last(grad, ctx.group), None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Identity forward; all-reduces the gradient (entry of a column-parallel layer)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-reduces partial sums forward; identity backward (exit of a row-parallel layer)."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Concatenates the ranks' last-dim shards forward; keeps this rank's slice of the gradient backward."""
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Keeps this rank's last-dim slice forward; all-gathers the gradient backward."""
    return _ScatterToTP.apply(x, group)
